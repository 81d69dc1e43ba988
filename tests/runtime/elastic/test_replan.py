"""Re-planning around a slow link: the rule (hysteresis, no flapping, the probe) and the speedup it predicts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.runtime.elastic._replan import (
    MeasuredRate,
    Replanner,
    ReplanRule,
    busy_interval_s,
    sender_rates,
    slow_links,
)
from allreduce.runtime.elastic._replan_probe import probe_pair_bytes
from allreduce.runtime.tcp._tcpinfo import JIFFY_S

N = 8
FAST = 1e9
ALPHA = 20e-6
SIZE = 64 << 20


def _ring_rates(order: tuple[int, ...], slow: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """What one window of a ring in ``order`` measures: its links' rates, ``slow`` ones at their own rate."""
    edges = [(order[i], order[(i + 1) % len(order)]) for i in range(len(order))]
    return {e: slow.get(e, FAST) for e in edges}


def test_one_slow_window_changes_nothing_and_the_second_reorders_with_the_predicted_speedup() -> None:
    planner = Replanner(N, ReplanRule(window_calls=100, confirm_windows=2))
    slow = {(3, 4): 0.1 * FAST}
    assert planner.observe(_ring_rates(planner.order, slow), size_bytes=SIZE, alpha_s=ALPHA) is None
    decision = planner.observe(_ring_rates(planner.order, slow), size_bytes=SIZE, alpha_s=ALPHA)
    assert decision is not None
    before = 2 * (N - 1) * ALPHA + 2 * (N - 1) / N * SIZE / (0.1 * FAST)
    after = 2 * (N - 1) * ALPHA + 2 * (N - 1) / N * SIZE / FAST
    assert decision.predicted_speedup == pytest.approx(before / after, rel=1e-12)
    assert decision.reason.startswith("link 3->4 at 10% of the others' median for 200 calls: ring reordered 0,")
    assert (3, 4) not in {(decision.order[i], decision.order[(i + 1) % N]) for i in range(N)}


def test_a_slow_link_moving_around_resets_the_confirmation() -> None:
    planner = Replanner(N, ReplanRule(confirm_windows=2))
    assert planner.observe(_ring_rates(planner.order, {(3, 4): 1e8}), size_bytes=SIZE, alpha_s=ALPHA) is None
    assert planner.observe(_ring_rates(planner.order, {(5, 6): 1e8}), size_bytes=SIZE, alpha_s=ALPHA) is None


def test_after_the_probe_windows_the_original_order_is_tried_again_and_kept_if_healed() -> None:
    planner = Replanner(N, ReplanRule(confirm_windows=1, probe_windows=3))
    assert planner.observe(_ring_rates(planner.order, {(3, 4): 1e8}), size_bytes=SIZE, alpha_s=ALPHA) is not None
    for _ in range(2):
        assert planner.observe(_ring_rates(planner.order, {}), size_bytes=SIZE, alpha_s=ALPHA) is None
    probe = planner.observe(_ring_rates(planner.order, {}), size_bytes=SIZE, alpha_s=ALPHA)
    assert probe is not None
    assert probe.order == tuple(range(N))
    assert planner.observe(_ring_rates(planner.order, {}), size_bytes=SIZE, alpha_s=ALPHA) is None  # healed
    assert planner.order == tuple(range(N))


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_noise_within_the_slow_ratio_never_changes_the_order(seed: int) -> None:
    """Links whose rates wander within a factor 1/slow_ratio of each other are never slow: 0 changes in 500
    windows (the benchmark runs 10,000 collectives)."""
    rng = np.random.default_rng(seed)
    planner = Replanner(N, ReplanRule(slow_ratio=0.5, confirm_windows=1))
    for _ in range(500):
        rates = {e: FAST * rng.uniform(0.51, 1.0) for e in _ring_rates(planner.order, {})}
        assert planner.observe(rates, size_bytes=SIZE, alpha_s=ALPHA) is None


def test_two_links_alone_are_never_slow() -> None:
    assert slow_links({(0, 1): 1.0, (1, 0): 100.0}, 0.5) == frozenset()


def _table(counters: dict[tuple[int, int], tuple[float, float]], n: int = 4) -> np.ndarray:
    """A gathered counter table: row src, columns 2·dst and 2·dst + 1 (bytes acknowledged, network-limited s)."""
    table = np.full((n, 2 * n), np.nan)
    for (src, dst), (acked, busy) in counters.items():
        table[src, 2 * dst : 2 * dst + 2] = acked, busy
    return table


def test_sender_rates_are_the_bytes_over_the_network_limited_time_of_each_data_link() -> None:
    before = _table({(0, 1): (0, 0.0), (1, 2): (0, 0.0), (2, 3): (0, 0.0), (3, 0): (0, 0.0)})
    after = _table({(0, 1): (8e6, 0.4), (1, 2): (8e6, 4.0), (2, 3): (8e6, 0.0), (3, 0): (1e3, 0.0)})
    rates = sender_rates(before, after)
    assert rates[(0, 1)] == pytest.approx(2e7)
    assert rates[(1, 2)] == pytest.approx(2e6)  # the slow one
    assert rates[(2, 3)] == pytest.approx(8e6 / JIFFY_S)  # never seen busy: at least a jiffy's worth
    assert (3, 0) not in rates  # a kilobyte of control frames is not a data link
    assert len(rates) == 3  # pairs without counters (NaN) are not rated


def test_a_link_never_seen_busy_may_be_any_rate_above_its_bytes_over_nine_jiffies() -> None:
    before = _table({(0, 1): (0, 0.0)})
    rate = sender_rates(before, _table({(0, 1): (8e6, 0.0)}))[(0, 1)]
    assert isinstance(rate, MeasuredRate)
    assert rate.low == pytest.approx(8e6 / (9 * JIFFY_S))  # z = 3: a count of 0 allows z² jiffies
    assert rate.high == float("inf")


def test_the_busy_interval_holds_the_true_time_of_jiffy_counted_periods() -> None:
    """The kernel counts a busy period as the jiffies that ticked in it: over 2,000 windows of 1-300 periods of
    0.1-10 ms at random phases, the true busy time lies in the interval of its count in at least 99.5% of them
    (z = 3 covers 99.7% of a normal count; the variance bound is an upper bound)."""
    rng = np.random.default_rng(39)
    inside = 0
    for _ in range(2000):
        durations = rng.uniform(1e-4, 1e-2, rng.integers(1, 301))
        starts = rng.uniform(0, JIFFY_S, durations.size)
        counted = (np.floor((starts + durations) / JIFFY_S) - np.floor(starts / JIFFY_S)) * JIFFY_S
        low, high = busy_interval_s(float(counted.sum()))
        inside += low <= durations.sum() <= high
    assert inside >= 1990


def test_a_link_is_slow_only_when_its_highest_rate_is_below_the_others_lowest() -> None:
    others = {(1, 2): MeasuredRate(1e8, 5e7, 2e8), (2, 3): MeasuredRate(1e8, 5e7, 2e8)}
    barely = {**others, (0, 1): MeasuredRate(1e7, 5e6, 1.3e7)}  # estimate a tenth, but could be a quarter
    assert slow_links(barely, 0.25) == frozenset()
    clearly = {**others, (0, 1): MeasuredRate(1e7, 5e6, 1.2e7)}
    assert slow_links(clearly, 0.25) == {(0, 1)}


def _counted(rates: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """``rates`` as the kernel's counters give them: each within +-20%."""
    return {link: MeasuredRate(rate, 0.8 * rate, 1.2 * rate) for link, rate in rates.items()}


def _first_change(planner: Replanner, slow: dict[tuple[int, int], float]) -> tuple[int, ...]:
    for _ in range(planner.rule.confirm_windows):
        decision = planner.observe(_counted(_ring_rates(planner.order, slow)), size_bytes=SIZE, alpha_s=ALPHA)
    assert decision is not None
    return decision.order


def _unmeasured_edge(order: tuple[int, ...]) -> tuple[int, int]:
    identity_edges = _ring_rates(tuple(range(N)), {})
    return next(e for e in ((order[i], order[(i + 1) % N]) for i in range(N)) if e not in identity_edges)


def test_a_pair_the_new_order_uses_first_and_the_kernel_reads_slow_is_re_planned_after_one_window() -> None:
    planner = Replanner(N, ReplanRule(confirm_windows=2))
    order = _first_change(planner, {(3, 4): 1e7})
    hidden = _unmeasured_edge(order)
    second = planner.observe(_counted(_ring_rates(order, {hidden: 1e7})), size_bytes=SIZE, alpha_s=ALPHA)
    assert second is not None
    edges = set(_ring_rates(second.order, {}))
    assert hidden not in edges
    assert (3, 4) not in edges  # the first slow link is remembered


def test_a_receivers_record_of_a_new_pair_is_confirmed_like_any_other() -> None:
    planner = Replanner(N, ReplanRule(confirm_windows=2))
    order = _first_change(planner, {(3, 4): 1e7})
    hidden = _unmeasured_edge(order)
    assert planner.observe(_ring_rates(order, {hidden: 1e7}), size_bytes=SIZE, alpha_s=ALPHA) is None
    assert planner.observe(_ring_rates(order, {hidden: 1e7}), size_bytes=SIZE, alpha_s=ALPHA) is not None


def _pairs(slow: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """What the all-pairs probe measures: every ordered pair, ``slow`` ones at their own rate, within +-20%."""
    return _counted({(a, b): slow.get((a, b), FAST) for a in range(N) for b in range(N) if a != b})


def test_a_confirmed_slow_link_runs_the_probe_once_and_the_new_order_avoids_every_slow_pair_it_found() -> None:
    hidden = {(3, 4): 0.1 * FAST, (0, 2): 0.05 * FAST, (5, 7): 0.1 * FAST, (7, 1): 0.1 * FAST, (2, 6): 0.08 * FAST}
    asked: list[int] = []

    def probe(pair_bytes: int) -> dict[tuple[int, int], float]:
        asked.append(pair_bytes)
        return _pairs(hidden)

    planner = Replanner(N, ReplanRule(confirm_windows=2))
    for _ in range(2):
        decision = planner.observe(_counted(_ring_rates(planner.order, hidden)), size_bytes=SIZE, alpha_s=ALPHA,
                                   probe=probe)  # fmt: skip
    assert decision is not None
    assert len(asked) == 1
    assert not set(_ring_rates(decision.order, {})) & set(hidden)
    assert "probed 56 pairs with " in decision.reason
    assert "5 (0->2, 2->6, 3->4, 5->7, 7->1) slow: ring reordered " in decision.reason
    for _ in range(5):  # the new ring is healthy: nothing to confirm, nothing to probe
        rates = _counted(_ring_rates(planner.order, hidden))
        assert planner.observe(rates, size_bytes=SIZE, alpha_s=ALPHA, probe=probe) is None
    assert len(asked) == 1


def test_a_healthy_group_never_runs_the_probe() -> None:
    def probe(pair_bytes: int) -> dict[tuple[int, int], float]:
        raise AssertionError(f"probed with {pair_bytes} bytes a pair on a healthy group")

    rng = np.random.default_rng(39)
    planner = Replanner(N, ReplanRule(confirm_windows=2))
    for _ in range(500):
        rates = {e: MeasuredRate(r, 0.5 * r, 2 * r) for e in _ring_rates(planner.order, {})
                 for r in [FAST * rng.uniform(0.3, 1.0)]}  # fmt: skip
        assert planner.observe(rates, size_bytes=SIZE, alpha_s=ALPHA, probe=probe) is None


def test_a_confirmed_slow_link_that_the_probe_reads_fast_stays_slow_and_is_routed_around() -> None:
    """The probe is short, and read ring hops that the windows had confirmed on a slow cable 2-10 times faster than
    they were: its reading replaces a confirmed slow link's only where it is slower."""
    planner = Replanner(N, ReplanRule(confirm_windows=1))
    decision = planner.observe(_counted(_ring_rates(planner.order, {(3, 4): 1e7})), size_bytes=SIZE, alpha_s=ALPHA,
                               probe=lambda pair_bytes: _pairs({}))  # fmt: skip
    assert decision is not None
    assert (3, 4) not in set(_ring_rates(decision.order, {}))
    assert "probed 56 pairs with 11 MiB each: 1 (3->4) slow (1 read faster by the probe, slow as confirmed): " in (
        decision.reason
    )


def test_a_probe_after_which_no_schedule_is_faster_keeps_the_order_and_says_so() -> None:
    """64 bytes a call: the steps' latency is all a call costs, and no order gains 1.25x on it."""
    planner = Replanner(N, ReplanRule(confirm_windows=1))
    decision = planner.observe(_counted(_ring_rates(planner.order, {(3, 4): 1e7})), size_bytes=64, alpha_s=ALPHA,
                               probe=lambda pair_bytes: _pairs({(3, 4): 1e7}))  # fmt: skip
    assert decision is None
    assert planner.order == tuple(range(N))
    assert planner.probes == ["link 3->4 at 1% of the others' median for 50 calls; probed 56 pairs with 11 MiB each: "
                              "1 (3->4) slow: schedule kept (no schedule predicted 1.25x faster)"]  # fmt: skip


@pytest.mark.parametrize("slow_Bps", [1e5, 2.5e6, 3e7])
def test_the_probe_is_sized_so_that_a_pair_at_a_tenth_of_the_others_is_resolved_slow(slow_Bps: float) -> None:
    """A pair as slow as the confirmed link, and others 10 times faster, counted exactly by the kernel: the interval
    rule names it slow among 56 pairs (above 32 MiB/s the probe is capped and too short: the parametrization
    stops below)."""
    pair_bytes = probe_pair_bytes(slow_Bps)
    rates = {}
    for link, rate in [((0, 1), slow_Bps)] + [((1, d), 10 * slow_Bps) for d in range(2, 8)]:
        busy = pair_bytes / rate
        shortest, longest = busy_interval_s(busy)
        rates[link] = MeasuredRate(rate, pair_bytes / longest, pair_bytes / shortest)
    assert slow_links(rates, 0.25) == {(0, 1)}


def test_a_slow_cable_under_most_of_the_ring_is_named_by_the_gap_below_the_others() -> None:
    """Five of eight ring links behind one slow cable: the median is one of them, so only the gap names them (the
    windows of an emulated Clos, senders' counters, MB/s)."""
    read = [(1.75, 1.56, 1.97), (1.82, 1.62, 2.05), (1.86, 1.65, 2.1), (1.88, 1.67, 2.12), (2.09, 1.84, 2.38),
            (114.87, 45.95, 287.18), (143.59, 51.97, 396.75), (1148.72, 105.31, 12530.62)]  # fmt: skip
    rates = {(i, (i + 1) % N): MeasuredRate(*(1e6 * r for r in rate)) for i, rate in enumerate(read)}
    assert slow_links(rates, 0.25) == {(i, i + 1) for i in range(5)}


def test_a_slow_cable_under_six_of_eight_hops_is_named_by_the_gap_below_the_two_others() -> None:
    """Six of eight ring links behind one slow cable (a twentieth): two links above the gap, and the kernel's
    counts say how fast they certainly were (a window of an emulated Clos at load 14, senders' counters, MB/s)."""
    read = [(0.88, 0.81, 0.95), (0.90, 0.83, 0.98), (0.92, 0.84, 1.00), (0.92, 0.84, 1.00), (0.93, 0.85, 1.01),
            (0.95, 0.87, 1.04), (60.46, 30.77, 118.78), (127.64, 48.75, 334.15)]  # fmt: skip
    rates = {(i, (i + 1) % N): MeasuredRate(*(1e6 * r for r in rate)) for i, rate in enumerate(read)}
    assert slow_links(rates, 0.25) == {(i, i + 1) for i in range(6)}


def test_a_kernel_count_above_seven_slow_links_names_them() -> None:
    rates = {(i, (i + 1) % N): MeasuredRate(1e6, 0.9e6, 1.1e6) for i in range(N - 1)}
    rates[(N - 1, 0)] = MeasuredRate(1.2e8, 5e7, math.inf)  # never seen busy: its lowest rate is what it reached
    assert slow_links(rates, 0.25) == {(i, i + 1) for i in range(N - 1)}


def test_two_receivers_records_far_above_the_others_are_no_gap() -> None:
    """A receiver that never waited for a link's data times it at any rate: two such links are not "the others"."""
    rates = {(i, (i + 1) % N): 1e6 for i in range(N - 2)} | {(N - 2, N - 1): 1e9, (N - 1, 0): 1e9}
    assert slow_links(rates, 0.25) == frozenset()


def test_a_healthy_window_with_one_link_above_the_rest_has_no_gap() -> None:
    """The healthy ring's window whose top link stood furthest above the others (emulated Clos, load 17): its
    lowest rate is 1.7 times below the others' highest, nowhere near a quarter."""
    read = [(30.88, 19.07, 50.0), (32.14, 19.59, 52.72), (34.03, 20.45, 56.61), (35.64, 21.1, 60.21),
            (38.02, 22.13, 65.31), (38.29, 22.29, 65.78), (38.84, 22.61, 66.72), (88.36, 39.32, 198.58)]  # fmt: skip
    rates = {(i, (i + 1) % N): MeasuredRate(*(1e6 * r for r in rate)) for i, rate in enumerate(read)}
    assert slow_links(rates, 0.25) == frozenset()


def test_a_healthy_windows_spread_has_no_gap() -> None:
    """The bottom of a healthy ring's window on the emulated Clos (links sharing a spine uplink) beside links that
    never waited: less than four times apart once the intervals are taken, so nothing is slow."""
    read = [(19.8, 13.39, 29.29), (23.58, 15.35, 36.24), (25.73, 16.43, 40.29), (27.15, 17.16, 42.96),
            (29.36, 18.13, 47.54), (229.69, 65.34, 807.48), (382.81, 79.9, 1834.17),
            (1148.44, 127.6, math.inf)]  # fmt: skip
    rates = {(i, (i + 1) % N): MeasuredRate(*(1e6 * r for r in rate)) for i, rate in enumerate(read)}
    assert slow_links(rates, 0.25) == frozenset()


def _slow_port(rank: int, rate: float) -> dict[tuple[int, int], float]:
    """Every link into and out of ``rank`` at ``rate``: its port is slow, not a cable."""
    return {(a, b): rate for a in range(N) for b in range(N) if a != b and rank in (a, b)}


def _schedule_rates(planner: Replanner, slow: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """What one window of the schedule ``planner`` runs measures: each link it uses, ``slow`` ones at their rate."""
    schedule = planner.schedule
    if schedule is None:
        return _ring_rates(planner.order, slow)
    used = set(zip(schedule.streams.src.tolist(), schedule.streams.peer.tolist(), strict=True))
    return {link: slow.get(link, FAST) for link in used}


def test_a_rank_whose_ring_links_are_both_slow_is_put_where_a_tree_moves_the_fewest_bytes() -> None:
    planner = Replanner(N, ReplanRule(confirm_windows=2))
    slow = _slow_port(3, 0.1 * FAST)
    assert planner.observe(_ring_rates(planner.order, slow), size_bytes=SIZE, alpha_s=ALPHA) is None
    decision = planner.observe(_ring_rates(planner.order, slow), size_bytes=SIZE, alpha_s=ALPHA)
    assert decision is not None
    assert "tree" in decision.algorithm
    assert decision.reason.startswith("rank 3: all 2 of its links measured slow, the fastest at 10% of the others'")
    assert " with rank 3 " in decision.reason
    # the port bounds any schedule: the buffer through it once each way, against 2(N-1)/N times in a ring
    assert 1.25 <= decision.predicted_speedup <= 2 * (N - 1) / N
    assert f"predicted {decision.predicted_speedup:.1f}x faster" in decision.reason


def test_once_around_a_slow_rank_the_schedule_stays() -> None:
    planner = Replanner(N, ReplanRule(confirm_windows=1))
    slow = _slow_port(3, 0.1 * FAST)
    assert planner.observe(_ring_rates(planner.order, slow), size_bytes=SIZE, alpha_s=ALPHA) is not None
    chosen = (planner.algorithm, planner.order, planner.chunks)
    for _ in range(10):  # the tree's windows read rank 3's links slow: the same choice, no change
        assert planner.observe(_schedule_rates(planner, slow), size_bytes=SIZE, alpha_s=ALPHA) is None
    assert (planner.algorithm, planner.order, planner.chunks) == chosen


def test_the_probe_names_a_slow_port_from_all_of_its_pairs() -> None:
    planner = Replanner(N, ReplanRule(confirm_windows=1))
    slow = _slow_port(6, 0.05 * FAST)
    decision = planner.observe(_counted(_ring_rates(planner.order, slow)), size_bytes=SIZE, alpha_s=ALPHA,
                               probe=lambda pair_bytes: _pairs(slow))  # fmt: skip
    assert decision is not None
    assert decision.reason.startswith("rank 6: all 14 of its links measured slow")
    assert "probed 56 pairs with " in decision.reason
    assert "tree" in decision.algorithm


def test_a_slow_cable_is_still_routed_around_by_a_ring_order() -> None:
    planner = Replanner(N, ReplanRule(confirm_windows=1))
    decision = planner.observe(_ring_rates(planner.order, {(3, 4): 0.1 * FAST}), size_bytes=SIZE, alpha_s=ALPHA)
    assert decision is not None
    assert decision.algorithm == "ring"
    assert decision.reason.startswith("link 3->4 at 10% ")
