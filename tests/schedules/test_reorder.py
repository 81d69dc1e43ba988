"""Ring orders: the relabelled ring is a verified all-reduce along its order, the search avoids slow links, and
the α–β time is the closed form."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.schedules import Verb, best_ring_order, ordered_ring, ring_bottleneck, ring_time_s

N = 8
FAST = 1e9


def _rates(n: int, slow: dict[tuple[int, int], float]) -> np.ndarray:
    rates = np.full((n, n), FAST)
    for (src, dst), rate in slow.items():
        rates[src, dst] = rate
    return rates


def test_a_relabelled_ring_sends_only_along_its_order() -> None:
    order = (0, 2, 1, 3, 5, 4, 7, 6)
    schedule = ordered_ring(order)
    for position, rank in enumerate(order):
        peers = {op.peer for op in schedule.program(rank) if op.verb is Verb.SEND}
        assert peers == {order[(position + 1) % N]}


def test_an_order_that_is_not_a_permutation_is_refused() -> None:
    with pytest.raises(ValueError, match=r"each rank 0\.\.3 once"):
        ordered_ring((0, 1, 1, 3))


def test_the_best_order_avoids_the_slow_link_and_keeps_rank_0_first() -> None:
    rates = _rates(N, {(3, 4): 0.1 * FAST})
    order = best_ring_order(rates, 1 << 20).order
    assert order[0] == 0
    assert sorted(order) == list(range(N))
    assert ring_bottleneck(order, rates) == FAST


def test_two_slow_links_are_both_avoided() -> None:
    rates = _rates(N, {(3, 4): 0.1 * FAST, (6, 7): 0.2 * FAST})
    assert ring_bottleneck(best_ring_order(rates, 1 << 20).order, rates) == FAST


@settings(max_examples=30, deadline=None)
@given(st.integers(10, 24), st.data())
def test_above_nine_ranks_the_local_search_never_makes_the_bottleneck_worse(n: int, data: st.DataObject) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    rates = rng.uniform(0.05, 1.0, size=(n, n)) * FAST
    start = tuple(rng.permutation(n).tolist())
    chosen = best_ring_order(rates, 1 << 20, current=start).order
    assert chosen[0] == start[0]
    assert ring_bottleneck(chosen, rates) >= ring_bottleneck(start, rates)


def test_a_slow_link_every_ring_must_use_stays() -> None:
    """Rank 1 is slow to everyone: no order avoids it, and the search leaves the ring as it is."""
    rates = np.full((N, N), FAST)
    rates[1, :] = 0.1 * FAST
    assert best_ring_order(rates, 1 << 20).order == tuple(range(N))


def test_ring_time_is_the_alpha_beta_formula() -> None:
    rates = _rates(N, {(3, 4): 0.25 * FAST})
    alpha, size = 20e-6, 64 << 20
    expected = 2 * (N - 1) * alpha + 2 * (N - 1) / N * size / (0.25 * FAST)
    assert ring_time_s(tuple(range(N)), rates, size, alpha) == pytest.approx(expected, rel=1e-12)
