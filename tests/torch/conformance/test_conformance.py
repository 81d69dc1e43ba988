"""torch's own distributed test suite on the allreduce backend: the committed lists, and a slice of the suite.

The whole suite (every test Gloo passes, at 2 and 3 ranks) runs in its own CI step, ``make test-conformance``
(``run.py check``): a few minutes, too long for ``make test``. Here a slice of it, one or two tests of each kind of
operation, shows the runner and the backend work together, and the committed lists are checked to fit the
installed torch.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch.testing._internal.distributed import __file__ as _distributed_dir

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run  # noqa: E402 (the runner beside this file, not a package)

SUITE = Path(_distributed_dir).parent / "distributed_test.py"

# One or two tests of each kind of operation the backend offers, all passed by Gloo.
SLICE = [
    "test_all_reduce_sum",
    "test_all_reduce_max",
    "test_all_reduce_sum_async",
    "test_all_reduce_sum_complex",
    "test_broadcast",
    "test_all_gather",
    "test_all_gather_coalesced_with_empty",
    "test_reduce_sum",
    "test_gather",
    "test_scatter",
    "test_barrier_full_group",
    "test_send_recv",
    "test_irecv",
    "test_destroy_group",
    "test_DistributedDataParallelCPU",
]


def _suite_tests() -> set[str]:
    return set(re.findall(r"^\s+def (test_\w+)\(", SUITE.read_text(), flags=re.MULTILINE))


def test_the_gloo_list_was_made_with_the_installed_torch() -> None:
    import json

    assert json.loads(run.GLOO_PASSES.read_text())["torch"] == torch.__version__, (
        f"{run.GLOO_PASSES.name} was made with another torch: run `run.py refresh` and review expected_failures.yaml"
    )


def test_every_listed_test_is_in_torchs_suite() -> None:
    listed = {name for names in run.gloo_passes().values() for name in names} | set(run.expected_failures())
    assert listed - _suite_tests() == set()


def test_gloo_passes_are_listed_for_both_world_sizes() -> None:
    passes = run.gloo_passes()
    assert set(passes) == set(run.WORLD_SIZES)
    assert all(passes[ws] for ws in run.WORLD_SIZES)


def test_every_expected_failure_is_a_gloo_pass_with_its_reason() -> None:
    passes = run.gloo_passes()
    for name, expected in run.expected_failures().items():
        assert expected.outcome in ("failed", "skipped"), name
        assert expected.lifted in ("", "passed", "failed"), name
        assert expected.lifted == "" or expected.outcome == "skipped", f"{name}: only a skipped test is lifted"
        assert len(expected.reason) > 20, f"{name}: say why it cannot pass"
        for world_size in expected.world_sizes:
            assert name in passes[world_size], f"{name} at {world_size} ranks: Gloo does not pass it either"


def test_the_slice_is_of_tests_allreduce_is_held_to() -> None:
    expected = run.expected_failures()
    for world_size, passes in run.gloo_passes().items():
        assert set(SLICE) <= set(passes), world_size
    assert not set(SLICE) & set(expected)


@pytest.mark.slow
def test_a_slice_of_torchs_suite_passes_on_allreduce(tmp_path: Path) -> None:
    # At 2 ranks: the slice shows the runner and the backend work together; every listed test at 2 and 3 ranks is
    # the conformance step's (make test-conformance, which CI runs after make test).
    world_size = 2
    pytest.importorskip("expecttest", reason="torch's test harness needs the expecttest package (the test extra)")
    done = subprocess.run(
        [
            *(sys.executable, HERE / "run.py", "run", "--backend", "allreduce", "--world-size", str(world_size)),
            *("--jobs", "1", "--out", tmp_path, *SLICE),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    outcomes = {o.test: o.outcome for o in run._read(tmp_path / f"allreduce-ws{world_size}.jsonl")}
    assert outcomes == dict.fromkeys(SLICE, "passed"), done.stdout
