"""Scripts run unchanged under torchrun (whose own store holds MASTER_PORT), under `allreduce run`, and by hand."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from allreduce.runtime.launcher._spawn import reserve_port

SCRIPT = textwrap.dedent(
    """
    import sys

    import numpy as np
    import allreduce

    for call in range(2):  # two groups in a row: their rendezvous must not collide
        with allreduce.init() as group:
            x = np.arange(6, dtype=np.int64) * (group.rank + 1) + call
            group.all_reduce(x)
            # one write per line: both ranks share the launcher's pipe (writes under PIPE_BUF are atomic)
            sys.stdout.write(f"result {call} rank {group.rank} of {group.world_size}: {x.tolist()}\\n")
            sys.stdout.flush()
    """
)


def _expected(call: int, world_size: int) -> list[int]:
    return [i * sum(range(1, world_size + 1)) + call * world_size for i in range(6)]


def _check(stdout: str, world_size: int) -> None:
    for call in range(2):
        lines = [line for line in stdout.splitlines() if f"result {call} rank" in line]
        assert len(lines) == world_size, stdout
        for line in lines:
            assert line.endswith(str(_expected(call, world_size))), line


@pytest.mark.slow
def test_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    _check(out.stdout, 2)


@pytest.mark.slow
def test_allreduce_run(tmp_path: Path, run_allreduce: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = run_allreduce("run", "-n", "3", "--", sys.executable, str(script))
    assert out.returncode == 0, out.stderr[-3000:]
    _check(out.stdout, 3)


TORCH_SCRIPT = textwrap.dedent(
    """
    import sys

    import torch
    import torch.distributed as dist

    import allreduce.torch  # registers the "allreduce" backend

    # torch's own store binds MASTER_PORT on rank 0 (the port the launcher reserved for the job).
    dist.init_process_group(sys.argv[1], init_method="env://")
    x = torch.arange(4, dtype=torch.int64) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    sys.stdout.write(f"{sys.argv[1]} rank {dist.get_rank()}: {x.tolist()}\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "allreduce"])
def test_a_torch_backend_under_allreduce_run(
    tmp_path: Path, run_allreduce: Callable[..., subprocess.CompletedProcess[str]], backend: str
) -> None:
    script = tmp_path / "torch_job.py"
    script.write_text(TORCH_SCRIPT)
    out = run_allreduce("run", "-n", "2", "--", sys.executable, str(script), backend)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(out.stdout.splitlines()) == [f"[rank {r}] {backend} rank {r}: [0, 3, 6, 9]" for r in range(2)]


@pytest.mark.slow
def test_the_allreduce_torch_backend_with_variables_set_by_hand(tmp_path: Path) -> None:
    script = tmp_path / "torch_job.py"
    script.write_text(TORCH_SCRIPT)
    with reserve_port() as reservation:  # held while the ranks run, so no one else takes the port
        port = reservation.getsockname()[1]
        ranks = [
            subprocess.Popen(
                [sys.executable, str(script), "allreduce"],
                env={
                    **os.environ,
                    "RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                },
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        outputs = [rank.communicate(timeout=240) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], [err[-3000:] for _, err in outputs]
    assert [out.strip() for out, _ in outputs] == [f"allreduce rank {r}: [0, 3, 6, 9]" for r in range(2)]


@pytest.mark.slow
def test_a_job_token_reaches_every_rank_and_a_given_one_is_kept(
    tmp_path: Path, run_allreduce: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    script = tmp_path / "token.py"
    script.write_text("import os\nprint(os.environ['ALLREDUCE_TOKEN'])\n")
    command = ("run", "-n", "2", "--", sys.executable, str(script))
    env = {k: v for k, v in os.environ.items() if k != "ALLREDUCE_TOKEN"}
    fresh = run_allreduce(*command, env=env, timeout_s=120)
    assert fresh.returncode == 0, fresh.stderr
    tokens = {line.split()[-1] for line in fresh.stdout.splitlines()}
    assert len(tokens) == 1
    assert len(tokens.pop()) >= 32  # 128 random bits, hex
    given = run_allreduce(*command, env={**env, "ALLREDUCE_TOKEN": "ours"}, timeout_s=120)
    assert given.returncode == 0, given.stderr
    assert sorted(given.stdout.splitlines()) == ["[rank 0] ours", "[rank 1] ours"]
