"""The compiled event core's lazy re-solve (sim/_kernel_levels.py) against a full progressive filling
(sim/_fair.fill_dense) of every draining transfer, after each change of a random sequence of transfers starting
and draining. Without numba the same functions run as plain Python, so these hold for the fallback too."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.sim._fair import fill_dense
from allreduce.sim._kernel_levels import resolve, resolve_alone, resolve_fill, solve_scratch

WEIGHTS = (1.0, 0.5, 0.25, 1 / 3)
HOPS = 4
SHIFT = 2  # 2^SHIFT >= HOPS nodes a block


class Links:
    """Transfers draining over links as the compiled core keeps them: per link a list of nodes (one per hop of
    each transfer crossing it), in the order the transfers started; a block per transfer, its rate."""

    def __init__(self, paths: list[list[int]], weights: list[list[float]], capacity: list[float]) -> None:
        self.paths, self.weights = paths, weights
        self.capacity = np.asarray(capacity)
        num_links, blocks = len(capacity), len(paths)
        self.pair_ptr = np.concatenate([[0], np.cumsum([len(p) for p in paths])]).astype(np.int64)
        self.pair_link = np.asarray([x for p in paths for x in p], dtype=np.int64)
        self.head = np.full(num_links, -1, dtype=np.int64)
        self.node_x = np.zeros(blocks << SHIFT, dtype=np.int64)
        self.node_w = np.zeros(blocks << SHIFT)
        self.node_next = np.full(blocks << SHIFT, -1, dtype=np.int64)
        self.rate = np.zeros(blocks)
        self.draining: list[int] = []
        self.scratch = solve_scratch(num_links, blocks, HOPS)
        self.stamp = 0

    def net(self) -> tuple[Any, ...]:
        # Transfer x is block x and pair x; pairs are 32-bit as the layout holds them (the kernel's own types: one
        # compiled re-solve for both).
        pair = np.arange(len(self.paths), dtype=np.int32)
        return (
            pair,
            self.pair_ptr,
            self.pair_link,
            self.capacity,
            self.head,
            self.node_x,
            self.node_w,
            self.node_next,
            SHIFT,
            self.rate,
        )

    def _relink(self) -> None:
        """Rebuild every link's list from the draining transfers in start order (a list loses a drained
        transfer's nodes and keeps the rest in order, as the core's doubly linked lists do)."""
        self.head.fill(-1)
        tail = {}
        for x in self.draining:
            for h, link in enumerate(self.paths[x]):
                node = (x << SHIFT) + h
                self.node_x[node] = x
                self.node_w[node] = self.weights[x][h]
                self.node_next[node] = -1
                if link in tail:
                    self.node_next[tail[link]] = node
                else:
                    self.head[link] = node
                tail[link] = node

    def change(self, start: list[int], drain: list[int]) -> None:
        """Transfers ``drain`` stop draining and ``start`` begin, then one re-solve."""
        started, links = self.prepare(start, drain)
        num = resolve(started, started.size, links, links.size, self.stamp, self.net(), self.scratch)
        self.take(num)

    def prepare(self, start: list[int], drain: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The lists changed as ``change`` changes them; returns the blocks started and the links changed."""
        changed = sorted({link for x in start + drain for link in self.paths[x]})
        for x in drain:
            self.draining.remove(x)
            self.rate[x] = 0.0
        for x in start:
            self.draining.append(x)
            self.rate[x] = 0.0
        self._relink()
        self.stamp += 1
        return np.asarray(start, dtype=np.int64), np.asarray(changed, dtype=np.int64)

    def take(self, num: int) -> None:
        """The rates of the ``num`` blocks the re-solve put in play."""
        new_rate, play_list = self.scratch[4], self.scratch[5]
        for block in play_list[:num]:
            self.rate[block] = new_rate[block]

    def full(self) -> np.ndarray:
        """Every draining transfer's rate by a full progressive filling."""
        flows = self.draining
        entry_flow = np.repeat(np.arange(len(flows)), [len(self.paths[x]) for x in flows])
        link = np.asarray([lk for x in flows for lk in self.paths[x]], dtype=np.int64)
        weight = np.asarray([w for x in flows for w in self.weights[x]])
        rate, _, _ = fill_dense(len(flows), entry_flow, link, weight, self.capacity.copy())
        return rate


# Transfers on links, and the changes made to them: per change, the transfers that start and those that drain.
History = tuple[Links, list[tuple[list[int], list[int]]]]


@st.composite
def histories(draw: st.DrawFn) -> History:
    num_links = draw(st.integers(1, 10))
    num_flows = draw(st.integers(1, 30))
    paths = [
        draw(st.lists(st.integers(0, num_links - 1), min_size=1, max_size=min(HOPS, num_links), unique=True))
        for _ in range(num_flows)
    ]
    weights = [[draw(st.sampled_from(WEIGHTS)) for _ in path] for path in paths]
    # Capacities with ties (levels that fill together) and an infinitely fast link.
    capacity = [draw(st.sampled_from([1.0, 2.0, 3.0, 7.5, np.inf])) for _ in range(num_links)]
    order = draw(st.permutations(range(num_flows)))
    steps: list[tuple[list[int], list[int]]] = []
    waiting, draining = list(order), []
    while waiting or draining:
        start = waiting[: draw(st.integers(0, 3))]
        waiting = waiting[len(start) :]
        drain = [x for x in draining if draw(st.booleans())] if draining else []
        if not start and not drain:
            drain = draining[:1] if draining else []
            start = waiting[:1] if not drain else []
            waiting = waiting[len(start) :]
        draining = [x for x in draining if x not in drain] + start
        steps.append((start, drain))
    return Links(paths, weights, capacity), steps


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(histories())
def test_the_lazy_re_solve_gives_the_full_filling_after_every_change(case: History) -> None:
    links, steps = case
    for start, drain in steps:
        links.change(start, drain)
        np.testing.assert_allclose(links.rate[links.draining], links.full(), rtol=1e-9)


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(histories())
def test_the_shortcut_for_unshared_links_sets_what_the_filling_sets(case: History) -> None:
    # Where no changed link is shared, resolve_alone must leave what resolve_fill leaves, bit for bit: the rate
    # and bottleneck of the transfer in play, every changed link's fill level, the count of level groups.
    links, steps = case
    for start, drain in steps:
        started, changed = links.prepare(start, drain)
        shortcut = tuple(np.copy(a) for a in links.scratch)
        num = resolve_alone(started, started.size, changed, changed.size, links.net(), shortcut)
        full = resolve_fill(started, started.size, changed, changed.size, links.stamp, links.net(), links.scratch)
        if num >= 0:
            assert num == full
            play = links.scratch[5][:full]
            assert np.array_equal(shortcut[4][play], links.scratch[4][play])
            assert np.array_equal(shortcut[3][2, play], links.scratch[3][2, play])
            assert np.array_equal(shortcut[1][0, changed], links.scratch[1][0, changed])
            assert shortcut[10][3] == links.scratch[10][3]
        links.take(full)


def test_a_transfer_alone_on_its_links_takes_the_shortcut() -> None:
    # Its rate is its narrowest link's capacity over its weight, that link its bottleneck; a shared link is
    # left to the filling (-1).
    links = Links([[0, 1], [1]], [[1.0, 0.5], [1.0]], [3.0, 1.0])
    started, changed = links.prepare([0], [])
    assert resolve_alone(started, 1, changed, changed.size, links.net(), links.scratch) == 1
    assert links.scratch[4][0] == 2.0
    assert links.scratch[3][2, 0] == 1
    links.take(1)
    started, changed = links.prepare([1], [])
    assert resolve_alone(started, 1, changed, changed.size, links.net(), links.scratch) == -1
