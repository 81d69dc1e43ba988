"""A small plan and a small tail result, computed once, for the report's tests."""

from __future__ import annotations

from typing import Any

import pytest

from allreduce.plan import Compute, PlanRequest, model_from_params, plan
from allreduce.schedules import all_reduce
from allreduce.sim import LossModel, TailConfig, simulate_tail
from allreduce.topology import parse_topology


@pytest.fixture(scope="session")
def plan_document() -> dict[str, Any]:
    request = PlanRequest(
        model=model_from_params(5e7), gpus=16, topology="fat-tree:k=4", compute=Compute(0.02), algorithm="auto"
    )
    return plan(request).to_json()


@pytest.fixture(scope="session")
def tail_document() -> dict[str, Any]:
    """``allreduce tail --json``'s document, built from the library as the command builds it."""
    topology = parse_topology("fat-tree:k=4")
    config = TailConfig(samples=300, seed=1, loss=LossModel(1e-5, fabric="tcp", rto_s=4e-3))
    results = [
        simulate_tail(all_reduce(name, 16), topology, size_bytes=16 * 2**20, config=config)
        for name in ("ring", "halving_doubling")
    ]
    return {
        "topology": topology.name,
        "ranks": 16,
        "size_bytes": 16 * 2**20,
        "samples": 300,
        "seed": 1,
        "algorithms": [r.to_json() for r in results],
        "skipped": [],
    }
