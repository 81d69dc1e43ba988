"""Small plans (one with failures and a measured backward) and a small tail result, computed once, for the
report's tests."""

from __future__ import annotations

from typing import Any

import pytest

from allreduce.plan import Compute, FailureSettings, MeasuredBackward, PlanRequest, model_from_params, plan
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
def measured_plan_document() -> dict[str, Any]:
    """A plan driven by a measured backward (four tensors, the last registered ready first), with failures and
    what-ifs."""
    measured = MeasuredBackward(
        "measured: four tensors",
        tensor_params=(2_000_000, 3_000_000, 500_000, 4_000_000),
        ready_fraction=(0.95, 0.6, 0.3, 0.05),
        forward_s=0.01,
        backward_s=0.02,
        optimizer_s=0.002,
        flops=1e12,
    )
    request = PlanRequest(
        model=measured.model("four-tensors"),
        gpus=16,
        topology="fat-tree:k=4",
        compute=Compute(measured.compute_s, backward_fraction=measured.backward_share),
        bucket_cap_bytes=5 * 2**20,
        measured=measured,
    )
    # what-ifs without the loss rows (a tail per bucket size): the recovery policies' rows are the ones read here
    return plan(request, loss_probability=0.0, failures=FailureSettings()).to_json()


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
