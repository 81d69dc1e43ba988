"""Goodput under failures: the rates against the Llama 3 report, the checkpoint intervals and the waste against
their closed forms, and the closed forms against a failure-by-failure replay of a simulated month."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from allreduce.plan._goodput import (
    LLAMA3_RATES,
    Checkpointing,
    FailureRates,
    Fleet,
    Network,
    checkpoint_bytes,
    daly_interval,
    elastic_goodput,
    expected_lost_s,
    fleet_of,
    goodput_table,
    restart_goodput,
    simulate_elastic,
    simulate_restarts,
    young_interval,
)
from allreduce.topology import parse_topology

MONTH_S = 30 * 86400.0


def test_the_llama3_rates_give_back_419_failures_in_54_days_on_16384_gpus() -> None:
    fleet = Fleet(16_384, gpus_per_host=8)
    failures = sum(fleet.failures_per_h(LLAMA3_RATES).values()) * 54 * 24
    assert failures == pytest.approx(419, rel=1e-12)


def test_the_job_failure_rate_is_the_sum_over_its_parts() -> None:
    rates = FailureRates(1e-5, 2e-5, 3e-6, 4e-7, 5e-4, 6e-6)
    fleet = Fleet(64, gpus_per_host=4, nics=32, cables=100, switches=3)
    want = 64 * 1e-5 + 16 * 2e-5 + 32 * 3e-6 + 100 * 4e-7 + 3 * 5e-4 + 64 * 6e-6
    assert fleet.mtbf_s(rates) == pytest.approx(3600 / want, rel=1e-12)


def test_the_mean_time_between_failures_falls_as_one_over_the_gpus() -> None:
    small, large = Fleet(1024).mtbf_s(LLAMA3_RATES), Fleet(131_072).mtbf_s(LLAMA3_RATES)
    assert small / large == pytest.approx(128, rel=1e-12)


def test_young_interval_is_the_square_root_of_twice_write_times_mtbf() -> None:
    assert young_interval(50.0, 10_000.0) == pytest.approx(1000.0)


@given(
    write_s=st.floats(1.0, 600.0),
    mtbf_s=st.floats(3600.0, 1e7),
)
def test_daly_interval_tends_to_young_when_the_write_is_short(write_s: float, mtbf_s: float) -> None:
    x = write_s / (2 * mtbf_s)
    ratio = daly_interval(write_s, mtbf_s) / young_interval(write_s, mtbf_s)
    # Daly = Young (1 + sqrt(x)/3 + x/9) - write: within the first correction term of Young
    assert abs(ratio - 1) <= math.sqrt(x) / 3 + x / 9 + write_s / young_interval(write_s, mtbf_s) + 1e-12


@given(
    write_s=st.floats(1.0, 600.0),
    restart_s=st.floats(0.0, 1800.0),
    mtbf_s=st.floats(1800.0, 1e6),
)
def test_daly_interval_is_within_a_hair_of_the_best_interval(write_s: float, restart_s: float, mtbf_s: float) -> None:
    best = daly_interval(write_s, mtbf_s)
    at_best = restart_goodput(best, write_s, restart_s, mtbf_s)
    for factor in (0.5, 0.8, 1.25, 2.0):
        assert at_best >= restart_goodput(best * factor, write_s, restart_s, mtbf_s) - 1e-9


def test_a_job_that_never_fails_loses_only_the_checkpoint_writes() -> None:
    assert restart_goodput(900.0, 100.0, 600.0, math.inf) == pytest.approx(0.9)


@pytest.mark.parametrize(("write_s", "restart_s", "mtbf_s"), [(10.0, 60.0, 1e6), (1.0, 5.0, 1e7)])
def test_rare_failures_waste_what_the_first_order_model_says(write_s: float, restart_s: float, mtbf_s: float) -> None:
    # waste = write/interval + (interval + write)/(2 M) + restart/M, to first order in 1/M
    interval = young_interval(write_s, mtbf_s)
    waste = 1 - restart_goodput(interval, write_s, restart_s, mtbf_s)
    first_order = write_s / interval + (interval + write_s) / (2 * mtbf_s) + restart_s / mtbf_s
    assert waste == pytest.approx(first_order, rel=0.02)


@pytest.mark.parametrize(
    ("write_s", "restart_s", "mtbf_s"),
    [(57.0, 600.0, 11_135.0), (300.0, 1800.0, 3600.0), (20.0, 120.0, 178_000.0)],
)
def test_a_simulated_month_of_restarts_agrees_with_daly(write_s: float, restart_s: float, mtbf_s: float) -> None:
    interval = daly_interval(write_s, mtbf_s)
    want = restart_goodput(interval, write_s, restart_s, mtbf_s)
    got, stderr = simulate_restarts(interval, write_s, restart_s, mtbf_s, horizon_s=MONTH_S, seed=7)
    assert abs(got - want) <= 3 * stderr + 1e-3, (got, want, stderr)


@pytest.mark.parametrize(("step_s", "recovery_s", "mtbf_s"), [(10.0, 30.0, 11_135.0), (60.0, 300.0, 1400.0)])
def test_a_simulated_month_of_elastic_recoveries_agrees_with_the_closed_form(
    step_s: float, recovery_s: float, mtbf_s: float
) -> None:
    want = elastic_goodput(step_s, recovery_s, mtbf_s)
    got, stderr = simulate_elastic(step_s, recovery_s, mtbf_s, horizon_s=MONTH_S, seed=11)
    assert abs(got - want) <= 3 * stderr + 1e-3, (got, want, stderr)


def test_spares_beat_restarts_and_a_30_s_elastic_recovery_beats_both_at_16384_gpus() -> None:
    ckpt = Checkpointing(write_s=checkpoint_bytes(405e9) / 100e9, elastic_recovery_s=30.0)
    rows = {r.policy: r.goodput for r in goodput_table(Fleet(16_384), LLAMA3_RATES, ckpt, step_s=10.0)}
    assert rows["restart"] < rows["spares"] < rows["elastic"] < 1


def test_an_elastic_job_runs_at_the_capacity_left_while_hosts_are_repaired() -> None:
    ckpt = Checkpointing(write_s=60.0, elastic_recovery_s=0.0, repair_s=3600.0)
    fleet = Fleet(16, gpus_per_host=8)
    rates = FailureRates(0.0, 0.1, 0.0, 0.0, 0.0, 0.0)  # each host fails every 10 h; 2 hosts: 0.2 per hour
    elastic = next(r for r in goodput_table(fleet, rates, ckpt, step_s=1e-6) if r.policy == "elastic")
    # Little's law: 0.2 hosts out on average, each 8 of 16 GPUs
    assert elastic.goodput == pytest.approx(1 - 0.2 * 8 / 16, rel=1e-4)


def test_a_software_failure_takes_no_host_out_of_an_elastic_job() -> None:
    ckpt = Checkpointing(write_s=60.0, elastic_recovery_s=0.0, repair_s=3600.0)
    fleet = Fleet(16, gpus_per_host=8)
    software = FailureRates(0.0, 0.0, 0.0, 0.0, 0.0, 0.01)  # 16 GPUs' processes: 0.16 failures per hour
    elastic = next(r for r in goodput_table(fleet, software, ckpt, step_s=1e-6) if r.policy == "elastic")
    assert elastic.goodput == pytest.approx(1.0, rel=1e-4)  # every GPU stays: only the (empty) pauses cost


def test_a_negative_failure_rate_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="host_per_h"):
        FailureRates(1e-5, -1.0, 0.0, 0.0, 0.0, 0.0)


def test_a_replacement_wait_longer_than_the_restart_is_refused() -> None:
    with pytest.raises(ValueError, match="replace_s"):
        Checkpointing(write_s=10.0, elastic_recovery_s=30.0, restart_s=60.0, replace_s=120.0)


@pytest.mark.parametrize("k", [4, 8, 16])
def test_a_fat_trees_network_has_its_closed_form_cables_and_switches(k: int) -> None:
    # k^3/4 hosts, each with one cable to its edge switch, and as many cables between each two tiers above;
    # k^2/2 edge and k^2/2 aggregation switches and k^2/4 core switches
    network = Network.of(parse_topology(f"fat-tree:k={k}"))
    assert (network.gpus, network.cables, network.switches) == (k**3 // 4, 3 * k**3 // 4, 5 * k**2 // 4)


def test_a_job_counts_the_networks_parts_in_proportion_to_its_gpus() -> None:
    fleet = fleet_of(Network(gpus=1024, cables=3072, switches=320), 256, 8)
    assert (fleet.hosts, fleet.counts()["cable"], fleet.switches) == (32, 768, 80)


@pytest.mark.parametrize(("segment_s", "mtbf_s"), [(600.0, 11_135.0), (3600.0, 1400.0), (1e-3, 1e6)])
def test_the_work_a_failure_loses_is_the_mean_of_where_it_struck_in_the_segment(
    segment_s: float, mtbf_s: float
) -> None:
    # E[X | X < T] for X ~ Exp(mean M), integrated numerically
    xs = np.linspace(0.0, segment_s, 200_001)
    density = np.exp(-xs / mtbf_s)
    want = float(np.trapezoid(xs * density, xs) / np.trapezoid(density, xs))
    assert expected_lost_s(segment_s, mtbf_s) == pytest.approx(want, rel=1e-6)
    assert expected_lost_s(segment_s, mtbf_s) <= segment_s / 2  # later in the segment is less likely


def test_each_policys_row_carries_the_work_a_failure_loses() -> None:
    ckpt = Checkpointing(write_s=60.0, elastic_recovery_s=30.0, interval_s=1200.0)
    rows = {r.policy: r for r in goodput_table(Fleet(16_384), LLAMA3_RATES, ckpt, step_s=10.0)}
    mtbf = Fleet(16_384).mtbf_s(LLAMA3_RATES)
    assert rows["restart"].lost_s == pytest.approx(expected_lost_s(1260.0, mtbf))
    assert rows["elastic"].lost_s == pytest.approx(expected_lost_s(10.0, mtbf))
