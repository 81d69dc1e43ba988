"""The compiled event core's queue and sort (sim/_kernel_heap.py) against the references they replace: the
event queue against heapq, the sort against sorted(). Without numba the same functions run as plain Python, so
these hold for the fallback too."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.sim._kernel_heap import DRAIN, START, grow, pop, push, seeded, sort_ids


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
