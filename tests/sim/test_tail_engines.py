"""Which engine computes each Monte Carlo sample: the event engine against closed forms and against the fast
engine where that one is certified exact; what engine="auto" re-runs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from allreduce.schedules import all_reduce
from allreduce.sim import (
    SAMPLE_EVENT,
    SAMPLE_FAST,
    SAMPLE_FAST_UNCERTIFIED,
    Distribution,
    Faults,
    LinkDown,
    LossModel,
    TailConfig,
    simulate,
    simulate_tail,
)
from allreduce.sim._event import match_transfers
from allreduce.sim._rerun import rerun_cost_s
from allreduce.topology import fat_tree, switch


@pytest.mark.slow
def test_event_engine_grows_the_ring_by_the_timeout_once_per_lost_transfer() -> None:
    # As the fast engine's closed-form test: one lossy link, one packet per transfer, every loss a timeout on
    # the critical path; here every sample is run by the event engine.
    n, mtu, rto = 8, 4096, 1e-3
    topology = switch(n)
    loss = LossModel(links=(("gpu0->switch0", 0.05),), fabric="roce", mtu_bytes=mtu, rto_s=rto)
    config = TailConfig(samples=150, seed=11, loss=loss, engine="event")
    result = simulate_tail(all_reduce("ring", n), topology, size_bytes=float(mtu * n), config=config)
    resend_s = mtu / topology.link_bandwidth_Bps[0]
    assert result.engine_counts() == {"fast": 0, "fast ~": 0, "event": 150}
    assert result.timeouts.max() >= 2
    np.testing.assert_allclose(
        result.step_s - result.baseline_s, result.timeouts * (rto + resend_s), rtol=1e-9, atol=1e-15
    )


def test_event_engine_delays_the_barrier_by_the_latest_arrival() -> None:
    # A zero-byte ring is a chain of barriers: each sample ends its noise-free time after the latest arrival.
    n = 8
    config = TailConfig(samples=50, seed=2, rank_jitter=Distribution.exponential(1e-3), engine="event")
    result = simulate_tail(all_reduce("ring", n), switch(n), size_bytes=0.0, config=config)
    np.testing.assert_allclose(result.step_s, result.baseline_s + (result.step_s - result.collective_s), rtol=1e-12)
    assert result.collective_s == pytest.approx(np.full(50, result.baseline_s), rel=1e-9)
    assert result.engine == "sensitivity"
    assert np.all(result.sample_engine == SAMPLE_EVENT)


@pytest.mark.parametrize("noise", ["loss+jitter", "jitter"])
@pytest.mark.slow
def test_event_engine_equals_the_certified_fast_engine_sample_by_sample(noise: str) -> None:
    # A ring with linear placement on a fat-tree: no link is ever shared, so no timing changes a rate and the
    # fast engine's recurrence is exact under any noise. (TCP as RFC 6298 has it: the linux stack's agreement
    # delays start the ranks with a blame the event engine re-derives differently in 1-2 samples of 30.)
    config = TailConfig(
        samples=30,
        seed=4,
        loss=LossModel(3e-4, "tcp", rto_s=1e-3, tcp="rfc6298") if noise == "loss+jitter" else LossModel(),
        link_jitter=Distribution.exponential(2e-6) if noise == "loss+jitter" else None,
        rank_jitter=Distribution.lognormal(20e-6, 200e-6),
        stragglers=((6, 40e-6),),
    )
    faults = Faults(slow_ranks=((3, 5e-6),))
    schedule, topology = all_reduce("ring", 16), fat_tree(4)
    fast = simulate_tail(schedule, topology, size_bytes=2**22, config=config, faults=faults)
    event = simulate_tail(
        schedule, topology, size_bytes=2**22, config=dataclasses.replace(config, engine="event"), faults=faults
    )
    assert fast.exact
    assert np.all(fast.sample_engine == SAMPLE_FAST)
    assert np.all(event.sample_engine == SAMPLE_EVENT)
    if noise == "loss+jitter":
        assert fast.lost_transfers.sum() > 0
    np.testing.assert_allclose(event.step_s, fast.step_s, rtol=1e-9)
    np.testing.assert_array_equal(event.culprit, fast.culprit)
    np.testing.assert_allclose(event.culprit_delay_s, fast.culprit_delay_s, atol=1e-9)


@pytest.mark.slow
def test_auto_reruns_every_sample_when_the_noise_free_run_is_not_certified() -> None:
    # Halving-doubling with random placement on an ECMP fat-tree: flows collide, the fast engine is not exact.
    schedule, topology = all_reduce("halving_doubling", 16), fat_tree(4)
    config = TailConfig(samples=40, seed=1, loss=LossModel(2e-6, "roce", rto_s=1e-3))
    auto = simulate_tail(schedule, topology, size_bytes=2**22, config=config, placement="random", seed=3)
    fast = simulate_tail(
        schedule,
        topology,
        size_bytes=2**22,
        config=dataclasses.replace(config, engine="fast"),
        placement="random",
        seed=3,
    )
    assert not fast.exact
    assert fast.engine_counts() == {"fast": 0, "fast ~": 40, "event": 0}
    assert auto.exact
    assert auto.engine_counts() == {"fast": 0, "fast ~": 0, "event": 40}
    assert not np.allclose(auto.step_s, fast.step_s, rtol=1e-6)
    # The noise-free time each compares with is its own engine's.
    kwargs = {"size_bytes": 2**22, "placement": "random", "seed": 3}
    assert auto.baseline_s == pytest.approx(simulate(schedule, topology, engine="event", **kwargs).seconds, rel=1e-12)
    assert fast.baseline_s == pytest.approx(simulate(schedule, topology, engine="fast", **kwargs).seconds, rel=1e-12)


def test_auto_reruns_only_lossy_samples_when_the_noise_free_run_is_certified_by_lockstep() -> None:
    # Halving-doubling on one switch runs in lockstep: the noise-free run is exact, a lossy sample is not.
    n = 8
    schedule = all_reduce("halving_doubling", n)
    loss = LossModel(1e-5, "roce", rto_s=1e-3)
    result = simulate_tail(
        schedule, switch(n), size_bytes=2**20, config=TailConfig(samples=60, seed=5, loss=loss, engine="auto")
    )
    lossy = result.lost_transfers > 0
    assert 0 < lossy.sum() < 60
    np.testing.assert_array_equal(result.sample_engine, np.where(lossy, SAMPLE_EVENT, SAMPLE_FAST))
    assert np.all(result.step_s[~lossy] == result.baseline_s)


def test_auto_leaves_samples_beyond_the_exact_budget_to_the_fast_engine() -> None:
    schedule = all_reduce("halving_doubling", 16)
    samples = 20
    budget = rerun_cost_s(len(match_transfers(schedule)), samples) * 0.99
    config = TailConfig(samples=samples, seed=1, rank_jitter=Distribution.exponential(1e-6))
    kwargs = {"size_bytes": 2**22, "config": config, "placement": "random", "seed": 3}
    result = simulate_tail(schedule, fat_tree(4), exact_budget_s=budget, **kwargs)  # type: ignore[arg-type]
    assert result.engine_counts() == {"fast": 0, "fast ~": samples, "event": 0}
    assert np.all(result.sample_engine == SAMPLE_FAST_UNCERTIFIED)


def test_auto_reruns_every_sample_within_the_exact_budget() -> None:
    schedule = all_reduce("halving_doubling", 16)
    samples = 20
    budget = rerun_cost_s(len(match_transfers(schedule)), samples)
    config = TailConfig(samples=samples, seed=1, rank_jitter=Distribution.exponential(1e-6))
    kwargs = {"size_bytes": 2**22, "config": config, "placement": "random", "seed": 3}
    result = simulate_tail(schedule, fat_tree(4), exact_budget_s=budget, **kwargs)  # type: ignore[arg-type]
    assert result.engine_counts() == {"fast": 0, "fast ~": 0, "event": samples}
    assert result.exact


def test_a_negative_exact_budget_is_named() -> None:
    with pytest.raises(ValueError, match="exact_budget_s"):
        simulate_tail(all_reduce("ring", 4), switch(4), size_bytes=2**20, config=TailConfig(), exact_budget_s=-1.0)


def test_event_engine_refuses_timed_faults() -> None:
    down = LinkDown("gpu2<->switch0", 50e-6, duration_s=1e-3)
    with pytest.raises(ValueError, match="timed faults"):
        TailConfig(samples=2, timed_faults=(down,), engine="event")


def test_unknown_engine_is_named() -> None:
    with pytest.raises(ValueError, match="'exact'"):
        TailConfig(engine="exact")
