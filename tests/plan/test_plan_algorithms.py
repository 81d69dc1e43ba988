"""The planner takes its algorithms from the registry: built-ins, naive, and user algorithms by spec."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from pathlib import Path

import pytest

from allreduce.plan import Compute, PlanRequest, make_executor, model_from_params, plan_step, run_case, run_sweep
from allreduce.schedules import Collective, algorithms, register_algorithm

ROOT = Path(__file__).resolve().parents[2]
MY_RING = str(ROOT / "examples" / "algorithms" / "my_ring.py") + ":bidirectional_ring"
CASE = {"params": 2e7, "compute_ms": 20, "topology": "fat-tree:k=4", "gpus": 16}


def _request(algorithm: str) -> PlanRequest:
    return PlanRequest(
        model=model_from_params(2e7), gpus=16, topology="fat-tree:k=4", compute=Compute(0.02), algorithm=algorithm
    )


def test_naive_is_a_registered_algorithm_to_plan_with() -> None:
    assert {r.algorithm for r in plan_step(_request("naive")).runs} == {"naive"}


def test_an_unregistered_name_lists_the_registry() -> None:
    known = r"--algorithm: unknown all-reduce algorithm 'nope'; choose one of ring,.*naive"
    with pytest.raises(ValueError, match=known):
        _request("nope")


def test_a_sweep_case_names_a_user_algorithm_by_spec() -> None:
    row = run_case({**CASE, "algorithm": MY_RING})
    assert row["error"] == ""
    assert row["algorithms"] == "bidirectional_ring"


@pytest.mark.slow
def test_a_spec_is_loaded_in_the_pool_worker_that_runs_the_case(tmp_path: Path) -> None:
    executor = make_executor("local", workers=1)
    try:
        summary = run_sweep([{**CASE, "algorithm": MY_RING}], tmp_path / "out.csv", executor)
    finally:
        executor.shutdown()
    assert (summary.ran, summary.failed) == (1, 0)
    assert "bidirectional_ring" in (tmp_path / "out.csv").read_text()


@pytest.mark.slow
def test_auto_chooses_a_users_automatic_algorithm_per_size_as_it_chooses_any_other() -> None:
    # A user algorithm registered for auto (the bidirectional ring of examples/, both directions of every link
    # busy) is one more candidate: at each bucket size the plan takes the fastest of every automatic algorithm. On
    # a physical ring of 16 GPUs it beats the one-way ring (8 MiB: 0.19 against 0.35 ms in the simulator).
    spec = importlib.util.spec_from_file_location("my_ring", ROOT / "examples" / "algorithms" / "my_ring.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    register_algorithm(Collective.ALL_REDUCE, "my_bidirectional_ring", module.bidirectional_ring, automatic=True)
    request = PlanRequest(
        model=model_from_params(30 * 2**20), gpus=16, topology="ring:16", compute=Compute(0.01),
        bucket_cap_bytes=8 * 2**20, first_bucket_bytes=2**20,
    )  # fmt: skip
    chosen = plan_step(request).runs
    per_algorithm = {}
    for name in algorithms(automatic=True):
        with contextlib.suppress(ValueError):  # an algorithm that does not apply to 16 GPUs here
            per_algorithm[name] = plan_step(dataclasses.replace(request, algorithm=name)).runs
    assert "my_bidirectional_ring" in per_algorithm
    for i, run in enumerate(chosen):
        best = min(per_algorithm, key=lambda name: per_algorithm[name][i].seconds)
        assert (run.algorithm, run.seconds) == (best, per_algorithm[best][i].seconds), run.size_bytes
    assert "my_bidirectional_ring" in {run.algorithm for run in chosen}
