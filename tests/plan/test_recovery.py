"""Elastic recovery: the model that moves a measured kill to a job's size against its closed form; the pause
goodput uses, modelled or given (the real kill is measured end to end in tests/cli/test_plan_goodput.py)."""

from __future__ import annotations

import pytest

from allreduce.plan import (
    LLAMA3_RATES,
    RUNTIME_LEASE_S,
    RUNTIME_TIMEOUT_S,
    STORE_REQUEST_S,
    FailureSettings,
    Fleet,
    RecoveryMeasurement,
    RecoveryModel,
    agreement_requests,
    elastic_goodput,
    goodput_plan,
    measure_recovery,
)
from allreduce.runtime import silent_detection_s

MEASURED = RecoveryMeasurement(ranks=4, transport="shm", detection_s=0.02, resume_s=0.3, source="a test's")


@pytest.mark.parametrize("gpus", [8, 1024, 16_384])
def test_the_modelled_recovery_is_its_closed_form(gpus: int) -> None:
    failures = Fleet(gpus).failures_per_h(LLAMA3_RATES)
    got = RecoveryModel(MEASURED, timeout_s=100.0, lease_s=10.0).at(gpus, failures)
    store_s = STORE_REQUEST_S * ((11 * gpus + 3) - (11 * 4 + 3))
    exit_s = 0.02 + 0.3 + store_s
    # the lease, less half a beat period (2 s), plus half the store's sweep (0.5 s) and half the survivors' check (1 s)
    silent_s = (10.0 - 2.0 / 2 + 0.5 / 2 + 1.0 / 2) + 0.3 + store_s
    silent = sum(failures[k] for k in ("host", "nic", "cable", "switch")) / sum(failures.values())
    assert got.store_s == pytest.approx(store_s)
    assert got.exit_s == pytest.approx(exit_s)
    assert got.silent_s == pytest.approx(silent_s)
    assert got.silent_share == pytest.approx(silent)
    assert got.seconds == pytest.approx((1 - silent) * exit_s + silent * silent_s)


def test_the_agreement_grows_as_the_ranks() -> None:
    small, large = agreement_requests(8_192), agreement_requests(16_384)
    assert large / small == pytest.approx(2.0, rel=1e-3)


def test_without_the_heartbeat_a_silent_failure_costs_two_timeouts() -> None:
    model = RecoveryModel(MEASURED, timeout_s=10.0, lease_s=0.0)
    assert model.at(4, {"host": 1.0}).seconds == pytest.approx(2 * 10.0 + 0.3)


def test_a_process_exit_costs_the_measured_detection_whatever_the_lease() -> None:
    for lease_s in (0.0, 10.0):
        model = RecoveryModel(MEASURED, timeout_s=10.0, lease_s=lease_s)
        assert model.at(4, {"gpu": 1.0}).seconds == pytest.approx(0.02 + 0.3)


def test_with_the_heartbeat_a_silent_failure_costs_the_leases_detection() -> None:
    model = RecoveryModel(MEASURED, timeout_s=300.0, lease_s=10.0)
    assert model.at(4, {"host": 1.0}).seconds == pytest.approx(silent_detection_s(10.0)[0] + 0.3)


def test_a_lease_longer_than_two_timeouts_leaves_the_timeouts_to_find_a_silent_rank() -> None:
    model = RecoveryModel(MEASURED, timeout_s=100.0, lease_s=3600.0)
    recovery = model.at(4, {"host": 1.0})
    assert recovery.seconds == pytest.approx(2 * 100.0 + 0.3)
    assert "two 100 s timeouts" in recovery.describe()[1]


@pytest.mark.parametrize("lease_s", [1.0, 3.0, 10.0, 600.0])
def test_the_mean_detection_lies_between_the_mechanisms_best_and_worst(lease_s: float) -> None:
    mean, worst = silent_detection_s(lease_s)
    assert lease_s * (1 - 1 / 5) < mean < worst  # at best the last beat left a period before the silence
    assert worst == pytest.approx(lease_s + min(0.5, lease_s / 4) + 1.0)


def test_a_lease_outside_the_runtimes_bounds_is_refused() -> None:
    with pytest.raises(ValueError, match="lease must be 0"):
        RecoveryModel(MEASURED, lease_s=0.5)


def test_the_default_is_the_runtimes_timeout_and_its_kill_benchmark() -> None:
    recovery = FailureSettings().elastic_recovery(1024, Fleet(1024).failures_per_h(LLAMA3_RATES))
    assert recovery.basis == "stored"
    assert recovery.timeout_s == RUNTIME_TIMEOUT_S == 300.0  # allreduce.init's default
    assert recovery.lease_s == RUNTIME_LEASE_S == 10.0
    assert "bench_elastic.py" in recovery.source


def test_the_elastic_policy_pauses_as_the_model_says_or_as_given() -> None:
    modelled = goodput_plan(FailureSettings(), gpus=1024, parameters=7e9, step_s=1.0)
    elastic = modelled.row("elastic")
    assert elastic.restart_s == modelled.recovery.seconds
    assert elastic.goodput <= elastic_goodput(1.0, modelled.recovery.seconds, modelled.mtbf_s)
    given = goodput_plan(FailureSettings(elastic_recovery_s=12.0), gpus=1024, parameters=7e9, step_s=1.0)
    assert (given.row("elastic").restart_s, given.recovery.basis) == (12.0, "given")
    assert given.to_json()["elastic_recovery"] == {"seconds": 12.0, "basis": "given", "source": "--elastic-recovery-s"}


def test_measuring_a_group_too_small_to_lose_a_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="ranks must be in"):
        measure_recovery(ranks=2)
