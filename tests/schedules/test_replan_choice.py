"""Choosing a schedule from measured link rates: the best ring order against every order and closed forms, the
cost model on a rate per pair against the α–β model and the ring's formula, the slow-rank rule, and the schedule
chosen around a slow rank against the bound its port sets."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.schedules import (
    CostModel,
    algorithms,
    best_ring_order,
    best_schedule,
    link_time_s,
    make_schedule,
    ordered_ring,
    predict_seconds,
    ring_time_s,
    slow_ranks,
)

FAST = 1e9
ALPHA = 20e-6
SIZE = 1 << 20


def _rates(n: int, slow: dict[tuple[int, int], float]) -> np.ndarray:
    rates = np.full((n, n), FAST)
    for link, rate in slow.items():
        rates[link] = rate
    return rates


def _slow_port(n: int, rank: int, rate: float) -> np.ndarray:
    rates = np.full((n, n), FAST)
    rates[rank, :] = rates[:, rank] = rate
    return rates


def test_three_slow_pairs_of_four_ranks_leave_one_ring_at_the_fast_rate() -> None:
    """1->2, 1->3 and 3->2 slow: of the six rings of four ranks from 0, only 0,2,3,1 uses none of them."""
    rates = _rates(4, {(1, 2): 1e6, (1, 3): 1e6, (3, 2): 1e6})
    chosen = best_ring_order(rates, SIZE, latency_s=ALPHA)
    assert chosen.order == (0, 2, 3, 1)
    assert chosen.seconds == pytest.approx(2 * 3 * ALPHA + 2 * 3 / 4 * SIZE / FAST, rel=1e-12)


def test_when_every_ring_uses_a_slow_pair_the_slowest_is_avoided_and_the_cost_is_the_next() -> None:
    """Four ranks, every pair but 0<->1 and 2<->3 at 2e8 and 0->2 at 1e7: the best ring runs at 2e8."""
    rates = np.full((4, 4), 2e8)
    rates[0, 1] = rates[1, 0] = rates[2, 3] = rates[3, 2] = FAST
    rates[0, 2] = 1e7
    chosen = best_ring_order(rates, SIZE)
    assert (0, 2) not in {(chosen.order[i], chosen.order[(i + 1) % 4]) for i in range(4)}
    assert chosen.seconds == pytest.approx(2 * 3 / 4 * SIZE / 2e8, rel=1e-12)


def test_the_current_order_is_kept_when_no_order_is_faster() -> None:
    current = (0, 3, 1, 2, 4)
    assert best_ring_order(np.full((5, 5), FAST), SIZE, current=current).order == current


@settings(max_examples=25, deadline=None)
@given(st.integers(4, 7), st.integers(0, 2**32 - 1))
def test_the_chosen_order_costs_no_more_than_any_other_order(n: int, seed: int) -> None:
    rates = np.random.default_rng(seed).choice([1e6, 5e6, 2e7, 1e8, 1e9], size=(n, n))
    chosen = best_ring_order(rates, SIZE, latency_s=ALPHA)
    assert sorted(chosen.order) == list(range(n))
    assert chosen.order[0] == 0
    assert chosen.seconds == pytest.approx(ring_time_s(chosen.order, rates, SIZE, ALPHA), rel=1e-12)
    every = [ring_time_s((0, *rest), rates, SIZE, ALPHA) for rest in itertools.permutations(range(1, n))]
    assert chosen.seconds <= min(every) * (1 + 1e-12)


@pytest.mark.parametrize("n", [4, 7, 8])
def test_with_every_rate_equal_the_link_model_is_the_cost_model(n: int) -> None:
    for name in algorithms():
        schedule = make_schedule("all_reduce", name, n, group_size=2 if n % 2 == 0 else 7)
        expected = predict_seconds(schedule, SIZE, CostModel(ALPHA, FAST))
        assert link_time_s(schedule, SIZE, np.full((n, n), FAST), latency_s=ALPHA) == pytest.approx(expected), name


@settings(max_examples=20, deadline=None)
@given(st.integers(3, 9), st.integers(0, 2**32 - 1))
def test_on_a_ring_the_link_model_is_the_ring_formula(n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    rates = rng.uniform(1e6, 1e9, size=(n, n))
    order = tuple(rng.permutation(n).tolist())
    expected = ring_time_s(order, rates, SIZE, ALPHA)
    assert link_time_s(ordered_ring(order), SIZE, rates, latency_s=ALPHA) == pytest.approx(expected, rel=1e-9)


def test_a_rank_whose_every_link_is_slow_is_named() -> None:
    ring = {(i, (i + 1) % 8): FAST for i in range(8)}
    ring[(2, 3)] = ring[(3, 4)] = 0.1 * FAST
    assert slow_ranks(ring, 0.25) == (3,)


def test_a_slow_cable_names_no_rank() -> None:
    ring = {(i, (i + 1) % 8): FAST for i in range(8)}
    ring[(2, 3)] = 0.1 * FAST
    assert slow_ranks(ring, 0.25) == ()


def test_a_rank_measured_to_one_peer_only_is_not_named() -> None:
    """Both directions between 0 and 1 slow, 1 measured with 0 alone: the pair may be a cable, not a port."""
    rates = {(0, 1): 1e7, (1, 0): 1e7, (0, 2): 1e7, (2, 0): 1e7, (2, 3): FAST, (3, 2): FAST, (3, 4): FAST}
    assert slow_ranks(rates, 0.25) == (0,)  # 0's links to two peers are all slow; 1's one peer is not enough


def test_of_two_slow_ranks_the_slowest_comes_first() -> None:
    rates = {**{(i, j): FAST for i in range(6) for j in range(6) if i != j}}
    for peer in range(6):
        if peer != 4:
            rates[(4, peer)] = rates[(peer, 4)] = 0.2 * FAST
        if peer != 1:
            rates[(1, peer)] = rates[(peer, 1)] = 0.05 * FAST
    rates[(1, 4)] = rates[(4, 1)] = 0.05 * FAST
    assert slow_ranks(rates, 0.25) == (1, 4)


@pytest.mark.parametrize("n", [4, 6, 8])
def test_around_a_slow_port_a_tree_is_chosen_within_the_bound_the_port_sets(n: int) -> None:
    """A rank at a tenth on every link: a ring moves 2(N-1)/N of the buffer through it each way, any all-reduce at
    least the buffer (it must send its part and receive the result): the choice lies between."""
    slow_rate = 0.1 * FAST
    rates = _slow_port(n, n - 1, slow_rate)
    chosen = best_schedule(rates, SIZE, latency_s=ALPHA, slow=(n - 1,))
    ring = best_schedule(rates, SIZE, latency_s=ALPHA)
    assert ring.algorithm == "ring"
    assert "tree" in chosen.algorithm
    assert SIZE / slow_rate <= chosen.seconds < ring.seconds / 1.3
    assert ring.seconds == pytest.approx(2 * (n - 1) * ALPHA + 2 * (n - 1) / n * SIZE / slow_rate, rel=1e-12)
    assert link_time_s(chosen.schedule(), SIZE, rates, latency_s=ALPHA) == pytest.approx(chosen.seconds)


def test_the_slow_rank_sits_where_the_chosen_schedule_moves_the_fewest_bytes() -> None:
    rates = _slow_port(8, 5, 0.1 * FAST)
    chosen = best_schedule(rates, SIZE, latency_s=ALPHA, slow=(5,))
    schedule = chosen.schedule()
    moved = [sum(op.block_stop - op.block_start for op in schedule.program(r)) for r in range(8)]
    assert moved[5] == min(moved)
    assert moved[5] < max(moved)


def test_without_a_slow_rank_the_choice_is_the_ring() -> None:
    assert best_schedule(np.full((6, 6), FAST), SIZE).algorithm == "ring"
