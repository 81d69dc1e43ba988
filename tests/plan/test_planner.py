"""The planner against the simulator: the issue's accuracy cases, computed by hand from ``simulate``."""

from __future__ import annotations

import dataclasses

import pytest

from allreduce.plan import Compute, PlanRequest, model_from_params, plan, plan_step, scaling_counts
from allreduce.schedules import algorithms, all_reduce
from allreduce.sim import simulate
from allreduce.topology import parse_topology

FABRIC = "fat-tree:k=4"  # 16 GPUs
MiB = 2**20


def request(params: float, compute_s: float, **changes: object) -> PlanRequest:
    base = PlanRequest(
        model=model_from_params(params),
        gpus=16,
        topology=FABRIC,
        compute=Compute(compute_s),
        algorithm="ring",
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def sim_seconds(size_bytes: int, *, gpus: int = 16, topology: str = FABRIC, algorithm: str = "ring") -> float:
    return simulate(all_reduce(algorithm, gpus), parse_topology(topology), size_bytes=size_bytes).seconds


def test_compute_zero_and_one_bucket_equals_one_simulated_all_reduce() -> None:
    # 4 Mi bf16 elements = 8 MiB, one bucket when the first bucket and the cap hold it all.
    req = request(4 * MiB, 0.0, first_bucket_bytes=64 * MiB, bucket_cap_bytes=64 * MiB)
    result = plan_step(req)
    assert result.step.bucket_bytes == (8 * MiB,)
    assert result.step.step_s == pytest.approx(sim_seconds(8 * MiB), rel=1e-9, abs=0)


def test_without_overlap_the_step_is_compute_plus_the_simulated_all_reduces() -> None:
    req = request(20 * MiB, 0.25, compute=Compute(0.25, overlap=False))
    result = plan_step(req)
    by_hand = 0.25 + sum(sim_seconds(b) for b in result.step.bucket_bytes)
    assert result.step.step_s == pytest.approx(by_hand, rel=1e-9, abs=0)


def test_full_overlap_on_a_fast_network_leaves_the_last_buckets_all_reduce() -> None:
    # Compute 100x the whole all-reduce: every bucket but the last is done before the next is ready.
    req = request(20 * MiB, 1.0, compute=Compute(1.0, backward_fraction=1.0))
    buckets = req.bucket_bytes
    total_comm = sum(sim_seconds(b) for b in buckets)
    compute_s = 100 * total_comm
    req = dataclasses.replace(req, compute=Compute(compute_s, backward_fraction=1.0))
    result = plan_step(req)
    assert result.step.step_s == pytest.approx(compute_s + sim_seconds(buckets[-1]), rel=1e-9, abs=0)


@pytest.mark.slow
def test_auto_takes_the_fastest_simulated_algorithm_per_bucket_size() -> None:
    req = request(20 * MiB, 0.0, algorithm="auto")
    result = plan_step(req)
    for run in result.runs:
        fastest = min(sim_seconds(run.size_bytes, algorithm=name) for name in ("ring", "double_binary_tree"))
        assert run.seconds <= fastest * (1 + 1e-12)


def test_ring_scaling_on_one_switch_is_monotone() -> None:
    # On a single switch the ring's bandwidth term 2(N-1)/N·S/B barely moves with N while its latency term
    # 2(N-1)·α grows linearly: the step time never falls as GPUs double, the efficiency never rises.
    req = dataclasses.replace(request(1e9, 0.1), gpus=128, topology="switch:128")
    result = plan(req, what_ifs=False, curve=False)
    steps = [row.step.step_s for row in result.scaling]
    assert [row.gpus for row in result.scaling] == [8, 16, 32, 64, 128]
    assert steps == sorted(steps)
    efficiencies = [row.efficiency for row in result.scaling]
    assert efficiencies == sorted(efficiencies, reverse=True)
    assert efficiencies[0] == 1.0


def test_ring_scaling_is_the_closed_form_latency_linear_bandwidth_constant() -> None:
    # Compute 0, no overlap, one 32-byte bucket on one switch: the step is the ring all-reduce,
    # 2(N-1)·α + 2(N-1)/N·S/B with α the two-hop path latency and B the host link bandwidth.
    req = dataclasses.replace(request(16, 0.0, compute=Compute(0.0, overlap=False)), gpus=64, topology="switch:64")
    topology = parse_topology("switch:64")
    alpha = 2 * float(topology.link_latency_s[0])
    bandwidth = float(topology.link_bandwidth_Bps[0])
    result = plan(req, what_ifs=False, curve=False)
    for row in result.scaling:
        n = row.gpus
        assert row.step.step_s == pytest.approx(2 * (n - 1) * alpha + 2 * (n - 1) / n * 32 / bandwidth, rel=1e-9)


def test_scaling_counts_double_from_8_and_end_at_the_request() -> None:
    assert scaling_counts(1024) == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert scaling_counts(100) == [8, 16, 32, 64, 100]
    assert scaling_counts(4) == [4]


@pytest.mark.slow
def test_the_what_if_table_changes_one_thing_per_row() -> None:
    result = plan(request(50 * MiB, 0.05), curve=False)
    changes = [w.change for w in result.what_ifs]
    assert any(c.startswith("algorithm ") for c in changes)
    assert "bucket cap 5 MiB" in changes
    assert "bucket cap 100 MiB" in changes
    assert "leaf uplinks at 2:1" in changes
    assert "leaf uplinks at 4:1" in changes
    assert "random placement" in changes
    assert any(c.endswith("at 10%") for c in changes)
    assert "one GPU 10% slower" in changes
    assert "fp32 gradients" in changes
    rows = {w.change: w for w in result.what_ifs}
    base = result.base.step
    assert rows["fp32 gradients"].step is not None
    assert rows["fp32 gradients"].step.comm_s > base.comm_s
    assert rows["leaf uplinks at 4:1"].step is not None
    assert rows["leaf uplinks at 4:1"].step.comm_s >= rows["leaf uplinks at 2:1"].step.comm_s  # type: ignore[union-attr]
    straggler = rows["one GPU 10% slower"].step
    assert straggler is not None
    assert straggler.waiting_s == pytest.approx(0.1 * base.compute_s, rel=1e-9)


def test_oversubscription_is_refused_where_there_is_no_uplink() -> None:
    result = plan(dataclasses.replace(request(10 * MiB, 0.05), topology="switch:16"), curve=False)
    row = next(w for w in result.what_ifs if w.change == "leaf uplinks at 2:1")
    assert row.step is None
    assert "no switch tier" in row.note


def test_too_many_gpus_for_the_topology_is_an_error_naming_both() -> None:
    with pytest.raises(ValueError, match=r"--gpus 32: .* has only 16 GPUs"):
        plan_step(dataclasses.replace(request(1e6, 0.1), gpus=32))


@pytest.mark.slow
def test_to_json_carries_the_split_and_the_tables() -> None:
    data = plan(request(50 * MiB, 0.05)).to_json()
    assert data["kind"] == "plan"
    assert set(data["base"]) >= {"step_s", "compute_s", "waiting_s", "exposed_comm_s", "sizes"}
    assert data["scaling"][-1]["gpus"] == 16
    assert data["busbw_curve"]
    assert data["links"]


@pytest.mark.parametrize("engine", ["fast", "auto"])
@pytest.mark.slow
def test_auto_with_size_bounds_chooses_what_simulating_every_algorithm_chooses(engine: str) -> None:
    # Several bucket sizes, so smaller sizes' times bound the larger ones' (the fast engine's pruning).
    req = request(60 * MiB, 0.01, algorithm="auto", engine=engine, bucket_cap_bytes=8 * MiB, first_bucket_bytes=MiB)
    chosen = plan_step(req)
    assert len(chosen.runs) >= 3
    per_algorithm = {}
    for name in algorithms(automatic=True):
        try:
            per_algorithm[name] = plan_step(dataclasses.replace(req, algorithm=name)).runs
        except ValueError:
            continue
    for i, run in enumerate(chosen.runs):
        best = min(per_algorithm, key=lambda name: per_algorithm[name][i].seconds)
        assert run.seconds == per_algorithm[best][i].seconds, run.size_bytes
        assert run.algorithm == best, run.size_bytes


@pytest.mark.slow
def test_a_plan_with_what_ifs_makes_the_per_size_choice_a_step_alone_makes() -> None:
    # With what-ifs the plan simulates every candidate at every base size first; the choice must not change.
    req = request(60 * MiB, 0.01, algorithm="auto", bucket_cap_bytes=8 * MiB, first_bucket_bytes=MiB)
    alone = plan_step(req).runs
    planned = plan(req, scaling=False, curve=False, loss_probability=0).base.runs
    assert [(r.size_bytes, r.algorithm, r.seconds) for r in planned] == [
        (r.size_bytes, r.algorithm, r.seconds) for r in alone
    ]


def test_a_scaling_row_too_small_for_the_bases_groups_takes_autos_choice() -> None:
    # hierarchical on servers of 8: a row of 8 GPUs is one server, no groups to form; the row runs what auto runs
    req = request(5e7, 0.02, gpus=32, topology="rail:nodes=4,gpus=8", algorithm="hierarchical")
    rows = plan(req, what_ifs=False, curve=False).scaling
    assert rows[0].gpus == 8
    alone = plan_step(dataclasses.replace(req, gpus=8, algorithm="auto"))
    assert rows[0].algorithm == "/".join(sorted({r.algorithm for r in alone.runs}))
    assert rows[0].step.step_s == alone.step.step_s
    assert rows[-1].algorithm == "hierarchical"
