"""The compiled event core's parts (sim/_kernel_fluid.py, sim/_kernel_heap.py) against the references they
replace: the dense fill against sim/_fair.fill_dense bit for bit, the event queue against heapq. Without numba
the same functions run as plain Python, so these hold for the fallback too."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.sim._fair import fill_dense as reference_fill
from allreduce.sim._kernel_fluid import dense_scratch, fill_dense, sort_ids, summable_links
from allreduce.sim._kernel_heap import DRAIN, START, grow, pop, push, seeded

WEIGHTS = (1.0, 0.5, 0.25, 1 / 3, 0.125, 0.7)
Incidence = tuple[list[list[int]], list[list[float]], list[float]]
# One room for every example, as a run reuses it from fill to fill: what one fill leaves must not reach the next.
SCRATCH = dense_scratch(40, 200, 12)
# The same with the min segment tree from the first level: the fill a large component ends in.
TREE_SCRATCH = dense_scratch(40, 200, 12, scan=0)


@st.composite
def incidences(draw: st.DrawFn) -> Incidence:
    num_links = draw(st.integers(1, 12))
    num_flows = draw(st.integers(1, 40))
    paths = [
        draw(st.lists(st.integers(0, num_links - 1), min_size=1, max_size=min(5, num_links), unique=True))
        for _ in range(num_flows)
    ]
    dyadic = draw(st.booleans())
    choices = WEIGHTS[:3] if dyadic else WEIGHTS
    weights = [[draw(st.sampled_from(choices)) for _ in path] for path in paths]
    # Capacities with ties (levels that fill together) and a room a little below zero, as rounding leaves one.
    room = [draw(st.sampled_from([1.0, 2.0, 3.0, 1.0 + 1e-12, 7.5, -1e-18])) for _ in range(num_links)]
    return paths, weights, room


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(incidences(), st.booleans())
def test_the_dense_fill_equals_fill_dense_bit_for_bit(case: Incidence, tree: bool) -> None:
    paths, weights, room_list = case
    num_flows, num_links = len(paths), len(room_list)
    pair_ptr = np.concatenate([[0], np.cumsum([len(p) for p in paths])]).astype(np.int64)
    pair_link = np.asarray([x for p in paths for x in p], dtype=np.int64)
    pair_weight = np.asarray([w for ws in weights for w in ws])
    capacity = np.full(num_links, 1.0)
    room = np.asarray(room_list)
    route = (np.arange(num_flows, dtype=np.int32), pair_ptr, pair_link, pair_weight, capacity)
    # The component's links numbered in an order other than the entries' (the fill must not depend on it).
    comp_links = np.arange(num_links - 1, -1, -1, dtype=np.int64)
    local = np.empty(num_links, dtype=np.int64)
    local[comp_links] = np.arange(num_links)
    new_rate = np.full(num_flows, np.inf)
    new_bottleneck = np.full(num_flows, -1, dtype=np.int64)
    members = np.arange(num_flows, dtype=np.int64)
    fill_dense(
        members,
        num_flows,
        (comp_links, num_links, local),
        route,
        room,
        (new_rate, new_bottleneck),
        summable_links(pair_link, pair_weight, num_links),
        TREE_SCRATCH if tree else SCRATCH,
    )
    entry_flow = np.repeat(np.arange(num_flows, dtype=np.int64), np.diff(pair_ptr))
    rate, bottleneck, _ = reference_fill(num_flows, entry_flow, pair_link, pair_weight, room)
    np.testing.assert_array_equal(new_rate, rate)
    np.testing.assert_array_equal(new_bottleneck, bottleneck)


def test_only_dyadic_weights_at_most_one_are_summable_in_any_order() -> None:
    link = np.asarray([0, 0, 1, 1, 2, 3], dtype=np.int64)
    weight = np.asarray([1.0, 0.25, 0.5, 1 / 3, 1.0, 2.0])
    assert summable_links(link, weight, 5).tolist() == [True, False, True, False, True]


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(0, 5))), st.lists(st.integers(0, 5), max_size=6))
def test_the_event_queue_pops_in_time_then_counter_order(ops: list[int | None], first: list[int]) -> None:
    # The queue starts with ``first`` (seeded), then None pops and a number pushes an event at that time:
    # against heapq of (time, counter, item, version).
    times, keys = seeded(np.asarray(first, dtype=np.float64), np.arange(len(first), dtype=np.int64), 2)
    size = counter = len(first)
    reference = [(float(t), i, i, 0) for i, t in enumerate(first)]
    heapq.heapify(reference)
    popped, expected = [], []
    for op in ops:
        if op is None:
            if not reference:
                assert size == 0
                continue
            expected.append(heapq.heappop(reference))
            popped.append((float(times[0]), int(keys[0]), int(keys[1]), int(keys[2])))
            size = pop(times, keys, size)
            continue
        if size == times.size:
            times, keys = grow(times, keys, size, 1)
        event = (float(op), counter, counter * 4 + (DRAIN if op % 2 else START), counter % 3)
        size = push(times, keys, size, *event)
        heapq.heappush(reference, event)
        counter += 1
    assert popped == expected
    assert size == len(reference)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-(2**40), 2**40), max_size=120))
def test_distinct_ids_sort_in_place(ids: list[int]) -> None:
    # A quicksort down to parts of 16, then insertion; the parts waiting fit the 128-entry stack.
    distinct = list(dict.fromkeys(ids))
    array = np.asarray([*distinct, 7], dtype=np.int64)
    sort_ids(array, len(distinct), np.empty(128, dtype=np.int64))
    assert array.tolist() == [*sorted(distinct), 7]


@pytest.mark.parametrize("count", [33, 1000, 100_000])
def test_many_ids_sort_in_place(count: int) -> None:
    # Large parts (a component of thousands of transfers), in shuffled, sorted and reversed order.
    stack = np.empty(128, dtype=np.int64)
    for array in (np.random.default_rng(count).permutation(count), np.arange(count), np.arange(count)[::-1].copy()):
        sort_ids(array, count, stack)
        assert np.array_equal(array, np.arange(count))
