"""Monte Carlo of the tail against closed forms and against the deterministic simulator."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.schedules import all_reduce
from allreduce.sim import (
    Distribution,
    Faults,
    LinkDegrade,
    LinkDown,
    LinkFlap,
    LossModel,
    TailConfig,
    simulate,
    simulate_tail,
    transfer_loss_probability,
)
from allreduce.topology import fat_tree, switch

# Deviations accepted, in standard errors (fixed seeds: a run always passes or always fails).
Z = 4.0
# A loss probability so small that no packet is lost in any test, but which makes the Monte Carlo step every
# transfer (the "stepping" method) instead of using the max-plus sensitivity.
NEGLIGIBLE_LOSS = 1e-15


def _stepping(config: TailConfig) -> TailConfig:
    return TailConfig(
        samples=config.samples,
        seed=config.seed,
        loss=LossModel(NEGLIGIBLE_LOSS),
        rank_jitter=config.rank_jitter,
        stragglers=config.stragglers,
    )


def test_barrier_of_exponential_arrivals_has_mean_h_n_over_lambda() -> None:
    n, rate = 8, 1000.0  # λ = 1/ms
    topology = switch(n)
    schedule = all_reduce("ring", n)
    config = TailConfig(samples=20_000, seed=3, rank_jitter=Distribution.exponential(1 / rate))
    result = simulate_tail(schedule, topology, size_bytes=0.0, config=config)
    waited = result.step_s - result.baseline_s
    harmonic = sum(1 / i for i in range(1, n + 1))
    assert result.engine == "sensitivity"
    assert abs(waited.mean() - harmonic / rate) < Z * waited.std() / math.sqrt(waited.size)


@pytest.mark.parametrize("p", [0.5, 0.9, 0.99])
def test_barrier_of_exponential_arrivals_has_the_closed_form_quantile(p: float) -> None:
    n, rate, k = 8, 1000.0, 20_000
    config = TailConfig(samples=k, seed=4, rank_jitter=Distribution.exponential(1 / rate))
    result = simulate_tail(all_reduce("ring", n), switch(n), size_bytes=0.0, config=config)
    quantile = -math.log(1 - p ** (1 / n)) / rate
    # The fraction of samples below the true quantile is Binomial(k, p) / k.
    below = float(np.mean(result.step_s - result.baseline_s < quantile))
    assert abs(below - p) < Z * math.sqrt(p * (1 - p) / k)


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling", "hierarchical", "double_binary_tree"])
@pytest.mark.slow
def test_stepping_and_sensitivity_agree_sample_by_sample(algorithm: str) -> None:
    topology = fat_tree(4)
    schedule = all_reduce(algorithm, 16, group_size=4) if algorithm == "hierarchical" else all_reduce(algorithm, 16)
    config = TailConfig(
        samples=64,
        seed=7,
        rank_jitter=Distribution.lognormal(20e-6, 200e-6),
        stragglers=((5, 30e-6),),
    )
    faults = Faults(slow_ranks=((3, 5e-6),))
    fast = simulate_tail(schedule, topology, size_bytes=2**22, config=config, faults=faults)
    stepped = simulate_tail(schedule, topology, size_bytes=2**22, config=_stepping(config), faults=faults)
    assert (fast.engine, stepped.engine) == ("sensitivity", "stepping")
    np.testing.assert_allclose(stepped.step_s, fast.step_s, rtol=1e-12)


@settings(max_examples=12)
@given(
    algorithm=st.sampled_from(["ring", "halving_doubling", "recursive_doubling", "double_binary_tree", "direct"]),
    world_size=st.sampled_from([4, 8, 16]),
    placement=st.sampled_from(["linear", "random"]),
    stepping=st.booleans(),
    engine=st.sampled_from(["fast", "auto"]),
)
@pytest.mark.slow
def test_noise_free_runs_equal_the_deterministic_simulator(
    *, algorithm: str, world_size: int, placement: str, stepping: bool, engine: str
) -> None:
    # engine="fast": the fast engine's result; "auto": simulate's exact one (the fast engine's where it is
    # certified, else the event engine's), as every noise-free sample of a small group is re-run with it.
    topology = fat_tree(4)
    schedule = all_reduce(algorithm, world_size)
    config = dataclasses.replace(_stepping(TailConfig(samples=2)) if stepping else TailConfig(samples=2), engine=engine)
    result = simulate_tail(schedule, topology, size_bytes=2**24, config=config, placement=placement, seed=2)
    expected = simulate(schedule, topology, size_bytes=2**24, placement=placement, seed=2, engine=engine)
    np.testing.assert_allclose(result.step_s, expected.seconds, rtol=1e-9)
    assert result.baseline_s == pytest.approx(expected.seconds, rel=1e-12)
    assert result.exact == (engine == "auto" or expected.exact)


def test_ring_grows_by_the_timeout_once_per_lost_transfer_on_the_critical_path() -> None:
    # One lossy link, rank 0's uplink; one packet per transfer, so every loss is a tail loss: a timeout (and a
    # resent packet lost again is one more). All are on rank 0 -> rank 1's transfers, one after the other, so
    # each is on the critical path.
    n, mtu, rto = 8, 4096, 1e-3
    topology = switch(n)
    loss = LossModel(links=(("gpu0->switch0", 0.02),), fabric="roce", mtu_bytes=mtu, rto_s=rto)
    result = simulate_tail(
        all_reduce("ring", n),
        topology,
        size_bytes=float(mtu * n),
        config=TailConfig(samples=2000, seed=11, loss=loss),
    )
    resend_s = mtu / topology.link_bandwidth_Bps[0]
    assert result.lost_transfers.max() >= 2
    assert np.all(result.timeouts >= result.lost_transfers)
    assert np.any(result.timeouts > result.lost_transfers)
    np.testing.assert_allclose(
        result.step_s - result.baseline_s, result.timeouts * (rto + resend_s), rtol=1e-9, atol=1e-15
    )


def test_frequency_of_a_step_with_a_loss_matches_the_closed_form() -> None:
    n, p, mtu, size = 8, 2e-5, 4096, 2**20
    topology = switch(n)
    schedule = all_reduce("ring", n)
    k = 4000
    result = simulate_tail(
        schedule,
        topology,
        size_bytes=float(size),
        config=TailConfig(samples=k, seed=12, loss=LossModel(p, "roce", mtu_bytes=mtu, rto_s=1e-3)),
    )
    # Every packet crosses two links (up to the switch, down to the peer); 2(N-1) steps of N transfers.
    per_packet = 1 - (1 - p) ** 2
    transfers = 2 * (n - 1) * n
    packets = transfers * math.ceil(size / n / mtu)
    expected = transfer_loss_probability(packets * mtu, per_packet, mtu)
    assert 0.1 < expected < 0.9
    observed = result.loss_frequency()
    assert abs(observed - expected) < Z * math.sqrt(expected * (1 - expected) / k)


def test_a_straggler_is_named_in_every_sample() -> None:
    config = TailConfig(samples=50, seed=1, rank_jitter=Distribution.uniform(0, 1e-6), stragglers=((6, 1e-3),))
    result = simulate_tail(all_reduce("ring", 16), fat_tree(4), size_bytes=2**22, config=config)
    (top,) = result.attribution(1)
    assert (top.kind, top.name, top.fraction) == ("rank", "rank 6", 1.0)
    assert top.mean_delay_s == pytest.approx(1e-3, rel=1e-3)


def test_the_lossy_link_is_named() -> None:
    loss = LossModel(links=(("gpu3->edge1", 0.05),), fabric="tcp", rto_s=5e-3)
    result = simulate_tail(
        all_reduce("ring", 16), fat_tree(4), size_bytes=2**20, config=TailConfig(samples=100, seed=2, loss=loss)
    )
    (top,) = result.attribution(1)
    assert (top.kind, top.name) == ("link", "gpu3->edge1")
    assert top.fraction == pytest.approx(result.loss_frequency())


def test_a_link_down_with_no_other_path_makes_transfers_wait_for_it() -> None:
    n = 8
    down = LinkDown("gpu2<->switch0", 50e-6, duration_s=2e-3)
    result = simulate_tail(
        all_reduce("ring", n), switch(n), size_bytes=2**20, config=TailConfig(samples=1, timed_faults=(down,))
    )
    assert result.baseline_s < down.start_s + down.duration_s
    assert result.step_s[0] > down.start_s + down.duration_s
    assert result.attribution(1)[0].name in ("gpu2->switch0", "switch0->gpu2")


def test_a_link_down_on_a_fat_tree_reroutes_and_costs_at_most_its_duration() -> None:
    down = LinkDown("edge0<->agg0", 0.0, duration_s=1.0)
    schedule = all_reduce("ring", 16)
    healthy = simulate(schedule, fat_tree(4), size_bytes=2**22, engine="fast")
    result = simulate_tail(
        schedule, fat_tree(4), size_bytes=2**22, config=TailConfig(samples=1, timed_faults=(down,)), routing="spray"
    )
    rerouted = simulate(
        schedule, fat_tree(4), size_bytes=2**22, engine="fast", routing="spray", faults=Faults(failed=(down.link,))
    )
    assert result.step_s[0] == pytest.approx(rerouted.seconds, rel=1e-9)
    assert result.step_s[0] < healthy.seconds + down.duration_s


def test_same_seed_same_samples_other_seed_other_samples() -> None:
    def run(seed: int) -> np.ndarray:
        config = TailConfig(samples=20, seed=seed, loss=LossModel(1e-4), link_jitter=Distribution.exponential(1e-6))
        return simulate_tail(all_reduce("ring", 8), switch(8), size_bytes=2**20, config=config).step_s

    np.testing.assert_array_equal(run(1), run(1))
    assert not np.array_equal(run(1), run(2))


@pytest.mark.slow
def test_ecmp_seeds_spread_the_samples_over_path_assignments() -> None:
    config = TailConfig(samples=32, ecmp_seeds=8)
    result = simulate_tail(
        all_reduce("ring", 16), fat_tree(4), size_bytes=2**24, config=config, placement="random", seed=1
    )
    assert len(np.unique(np.round(result.step_s, 12))) > 1


def test_percentiles_and_json_shape() -> None:
    config = TailConfig(samples=200, seed=1, rank_jitter=Distribution.exponential(1e-4))
    result = simulate_tail(all_reduce("ring", 8), switch(8), size_bytes=2**20, config=config)
    p = result.percentiles()
    assert p["p50"] <= p["p90"] <= p["p99"] <= p["p99.9"] <= p["max"]
    data = result.to_json()
    assert data["samples"] == 200
    assert data["engine"] == "sensitivity"
    assert set(data["step_s"]) == {"p50", "p90", "p99", "p99.9", "max", "mean"}
    assert data["attribution"][0]["kind"] == "rank"


def test_unknown_link_in_a_loss_model_is_named() -> None:
    loss = LossModel(links=(("gpu99->switch0", 0.1),))
    with pytest.raises(ValueError, match="gpu99"):
        simulate_tail(all_reduce("ring", 8), switch(8), size_bytes=2**20, config=TailConfig(samples=2, loss=loss))


def test_attribution_by_kind_lists_only_that_kind() -> None:
    loss = LossModel(links=(("gpu3->edge1", 0.05),), fabric="tcp", rto_s=5e-3)
    config = TailConfig(samples=100, seed=2, loss=loss, rank_jitter=Distribution.exponential(2e-3))
    result = simulate_tail(all_reduce("ring", 16), fat_tree(4), size_bytes=2**20, config=config)
    assert {c.kind for c in result.attribution(20, "rank")} == {"rank"}
    assert [c.name for c in result.attribution(20, "link")] == ["gpu3->edge1"]


def test_a_link_degraded_from_time_zero_equals_the_static_fault() -> None:
    schedule = all_reduce("ring", 16)
    degraded = LinkDegrade("gpu5->edge2", 0.0, factor=0.1)
    result = simulate_tail(
        schedule, fat_tree(4), size_bytes=2**22, config=TailConfig(samples=1, timed_faults=(degraded,))
    )
    static = simulate(
        schedule, fat_tree(4), size_bytes=2**22, engine="fast", faults=Faults(degraded=(("gpu5->edge2", 0.1),))
    )
    assert result.step_s[0] == pytest.approx(static.seconds, rel=1e-9)
    assert result.attribution(1)[0].name == "gpu5->edge2"


def test_a_flapping_link_without_another_path_delays_the_step() -> None:
    flap = LinkFlap("gpu1<->switch0", 0.0, period_s=200e-6, duty=0.5)
    schedule = all_reduce("ring", 8)
    result = simulate_tail(schedule, switch(8), size_bytes=2**22, config=TailConfig(samples=1, timed_faults=(flap,)))
    assert result.step_s[0] > result.baseline_s
    assert result.attribution(1)[0].name in ("gpu1->switch0", "switch0->gpu1")
