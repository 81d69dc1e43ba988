"""The planner takes its algorithms from the registry: built-ins, naive, and user algorithms by spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from allreduce.plan import Compute, PlanRequest, make_executor, model_from_params, plan_step, run_case, run_sweep

MY_RING = str(Path(__file__).resolve().parents[2] / "examples" / "algorithms" / "my_ring.py") + ":bidirectional_ring"
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
