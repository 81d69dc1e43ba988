"""The planner's random parts: compute drawn from a distribution, and the packet-loss what-if rows."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest

from allreduce.plan import (
    Compute,
    PlanRequest,
    compute_quantiles,
    model_from_params,
    plan,
    plan_step,
    step_seconds,
    step_time,
)
from allreduce.plan._planner import _Simulator
from allreduce.schedules import all_reduce
from allreduce.sim import Distribution, LossModel, TailConfig, parse_distribution, simulate_tail
from allreduce.topology import parse_topology

FABRIC = "fat-tree:k=4"  # 16 GPUs
MiB = 2**20


def request(params: float, compute_s: float, **changes: object) -> PlanRequest:
    base = PlanRequest(
        model=model_from_params(params), gpus=16, topology=FABRIC, compute=Compute(compute_s), algorithm="ring"
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("compute", [Compute(0.1), Compute(0.1, overlap=False), Compute(0.05, accumulation_steps=3)])
def test_step_seconds_is_step_time_row_by_row(compute: Compute) -> None:
    rng = np.random.default_rng(7)
    buckets = (MiB, 25 * MiB, 25 * MiB, 3 * MiB)
    draws = rng.exponential(0.02, size=(50, len(buckets)))
    many = step_seconds(buckets, draws, compute)
    for row, value in zip(draws, many, strict=True):
        assert value == pytest.approx(step_time(buckets, row, compute).step_s, rel=1e-12, abs=0)


def test_a_constant_compute_distribution_has_the_base_step_at_every_quantile() -> None:
    step = plan_step(request(20 * MiB, 0.1))
    quantiles = compute_quantiles(step, Distribution.constant(0.1), gpus=16)
    assert quantiles.p50.step_s == pytest.approx(step.step.step_s, rel=1e-12)
    assert quantiles.p99.step_s == pytest.approx(step.step.step_s, rel=1e-12)
    assert quantiles.p99.waiting_s == 0.0


def test_the_p_quantile_without_overlap_is_the_slowest_of_n_gpus_plus_the_all_reduces() -> None:
    # The max of n iid draws is below x with probability F(x)^n, so its p-quantile is F^-1(p^(1/n)); without
    # overlap the step is that plus every all-reduce.
    median_s, p99_s = 0.3, 0.4
    distribution = parse_distribution(f"lognormal:median={median_s},p99={p99_s}")
    step = plan_step(request(20 * MiB, median_s, compute=Compute(median_s, overlap=False)))
    sigma = math.log(p99_s / median_s) / NormalDist().inv_cdf(0.99)
    comm_s = sum(step.step.bucket_s)
    for gpus in (1, 16, 131_072):
        quantiles = compute_quantiles(step, distribution, gpus=gpus)
        for p, got in ((0.5, quantiles.p50), (0.99, quantiles.p99)):
            slowest_s = median_s * math.exp(sigma * NormalDist().inv_cdf(p ** (1 / gpus)))
            assert got.step_s == pytest.approx(slowest_s + comm_s, rel=1e-9), (gpus, p)
            assert got.compute_s + got.waiting_s == pytest.approx(slowest_s, rel=1e-9)


def test_an_empirical_compute_distribution_takes_its_measured_quantile(tmp_path: Path) -> None:
    steps = tmp_path / "steps.csv"
    values_ms = list(range(200, 300))  # 100 measured steps of 200..299 ms
    steps.write_text("seconds\n" + "".join(f"{v / 1e3}\n" for v in values_ms))
    distribution = parse_distribution(f"empirical:{steps}")
    step = plan_step(request(20 * MiB, 0.25, compute=Compute(0.25, overlap=False)))
    quantiles = compute_quantiles(step, distribution, gpus=1)
    comm_s = sum(step.step.bucket_s)
    # Draws are uniform over the values: the p-quantile is the value at index floor(p * count).
    assert quantiles.p50.step_s == pytest.approx(0.250 + comm_s, rel=1e-12)
    assert quantiles.p99.step_s == pytest.approx(0.299 + comm_s, rel=1e-12)


def test_accumulation_samples_the_slowest_sum_and_a_constant_gives_it_exactly() -> None:
    step = plan_step(request(20 * MiB, 0.1, compute=Compute(0.1, accumulation_steps=4)))
    quantiles = compute_quantiles(step, Distribution.constant(0.1), gpus=16)
    assert quantiles.p99.step_s == pytest.approx(step.step.step_s, rel=1e-12)
    assert "draws of the sum of 4" in quantiles.method


def test_the_slowest_gpu_grows_with_the_gpu_count_in_the_scaling_table() -> None:
    distribution = parse_distribution("lognormal:median=50ms,p99=80ms")
    changed = request(20 * MiB, 0.05, compute_distribution=distribution)
    result = plan(changed, what_ifs=False, curve=False)
    p99s = [row.quantiles.p99.step_s for row in result.scaling if row.quantiles]
    assert len(p99s) == len(result.scaling)
    assert p99s == sorted(p99s)
    assert result.quantiles is not None
    assert result.quantiles.p99.step_s == p99s[-1]
    assert result.to_json()["base"]["p99_step_s"] == p99s[-1]


@pytest.mark.slow
def test_the_loss_rows_name_their_fabric_and_carry_p50_and_p99() -> None:
    result = plan(request(50 * MiB, 0.05), curve=False)
    loss_rows = [w for w in result.what_ifs if w.change.startswith("loss ")]
    assert [w.change for w in loss_rows] == [
        "loss 1e-06, RoCE timeout 4.295 s",
        "loss 1e-06, TCP (linux stack) RTO 200 ms",
        "loss 1e-06, TCP (linux stack) RTO 4 ms",
    ]
    base_s = result.base.step.step_s
    for row in loss_rows:
        assert row.quantiles is not None
        assert row.step is row.quantiles.p50
        assert base_s <= row.quantiles.p50.step_s <= row.quantiles.p99.step_s
    assert not any("packet-loss model" in note for note in result.notes)
    assert any(note.startswith("loss rows: p50") for note in result.notes)


@pytest.mark.slow
def test_a_loss_too_rare_to_draw_leaves_the_step_as_it_is() -> None:
    result = plan(request(50 * MiB, 0.05), scaling=False, curve=False, loss_probability=1e-18)
    for row in (w for w in result.what_ifs if w.quantiles):
        assert row.quantiles is not None
        assert row.quantiles.p50.step_s == pytest.approx(result.base.step.step_s, rel=1e-12)
        assert row.quantiles.p99.step_s == pytest.approx(result.base.step.step_s, rel=1e-12)


@pytest.mark.slow
def test_a_timeout_that_fires_adds_at_least_one_rto_to_the_steps_that_see_it() -> None:
    # 1e-4 per packet: most 25 MiB ring all-reduces on 16 GPUs lose a packet somewhere; under TCP with a 200 ms
    # minimum RTO a tail loss costs >= 200 ms, far above the base step.
    result = plan(request(100 * MiB, 0.05), scaling=False, curve=False, loss_probability=1e-4)
    row = next(w for w in result.what_ifs if w.change == "loss 0.0001, TCP (linux stack) RTO 200 ms")
    assert row.quantiles is not None
    assert row.quantiles.p99.step_s >= result.base.step.step_s + 0.2


@pytest.mark.slow
def test_loss_zero_leaves_the_rows_out() -> None:
    result = plan(request(20 * MiB, 0.05), scaling=False, curve=False, loss_probability=0.0)
    assert not any(w.change.startswith("loss ") for w in result.what_ifs)
    assert not any(note.startswith("loss rows") for note in result.notes)


def test_a_loss_probability_outside_0_1_is_refused() -> None:
    with pytest.raises(ValueError, match=r"--loss must be a probability in \[0, 1\), got 1.5"):
        plan(request(20 * MiB, 0.05), loss_probability=1.5)


@pytest.mark.parametrize("name", ["double_binary_tree", "halving_doubling"])
def test_a_tail_the_plan_runs_on_the_fast_engine_is_the_auto_tail_without_re_runs(name: str) -> None:
    # Where the plan's engine is the fast one, its tails re-run no sample on the event engine: the same as
    # engine "auto" with no budget for re-runs, sample for sample (and its noise is not recorded for them).
    sim = _Simulator()
    changed = request(20 * MiB, 0.1, engine="fast")
    config = TailConfig(samples=40, seed=3, loss=LossModel(1e-4, fabric="tcp"), attribution=False)
    got = sim.tail(changed, name, 16, 4 * MiB, config)
    expected = simulate_tail(
        all_reduce(name, 16), parse_topology(FABRIC), size_bytes=4 * MiB, config=config, exact_budget_s=0.0
    )
    assert got.lost_transfers.sum() > 0
    assert not got.exact  # samples "auto" would re-run with a budget
    for field in ("step_s", "collective_s", "lost_transfers", "timeouts", "sample_engine"):
        np.testing.assert_array_equal(getattr(got, field), getattr(expected, field), err_msg=field)
    assert (got.baseline_s, got.exact) == (expected.baseline_s, expected.exact)
