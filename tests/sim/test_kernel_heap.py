"""The compiled event core's queue and sort (sim/_kernel_heap.py) against the references they replace: the
event queue against heapq, the sort against sorted(). Without numba the same functions run as plain Python, so
these hold for the fallback too."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.sim._kernel_heap import (
    DRAIN,
    MAX_LANES,
    START,
    earliest,
    grow,
    lane_push,
    lanes,
    pop,
    push,
    seeded,
    sort_ids,
)


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


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(st.none(), st.tuples(st.integers(0, 4), st.booleans()))),
    st.lists(st.integers(0, 5), max_size=6),
)
def test_the_lanes_and_the_heap_pop_as_one_heap(ops: list[tuple[int, bool] | None], first: list[int]) -> None:
    # As the kernel schedules: at the time of the event popped last, an event a constant later (0, 0.5, 1.5 or
    # 2.5: a lane each; 4: the heap) or at a time of its own (False: the heap); against heapq of
    # (time, counter, item).
    constants = np.asarray([0.0, 0.5, 1.5, 2.5, 0.25])
    lane_t, lane_k, pos, pair_lane, _ = lanes(constants, np.zeros(0), len(ops) + 1)
    pair_lane[4] = -1
    times, keys = seeded(np.asarray(first, dtype=np.float64), np.arange(len(first), dtype=np.int64), 2)
    size = counter = len(first)
    reference = [(float(t), i, i) for i, t in enumerate(first)]
    heapq.heapify(reference)
    now = 0.0
    popped, expected = [], []
    for op in ops:
        if op is None:
            source = earliest(times, keys, size, lane_t, lane_k, pos)
            if not reference:
                assert source == -2
                continue
            expected.append(heapq.heappop(reference))
            if source < 0:
                popped.append((float(times[0]), int(keys[0]), int(keys[1])))
                size = pop(times, keys, size)
            else:
                i = pos[2 * source] % lane_t.shape[1]
                popped.append((float(lane_t[source, i]), int(lane_k[source, 2 * i]), int(lane_k[source, 2 * i + 1])))
                pos[2 * source] += 1
            now = popped[-1][0]
            continue
        which, fixed = op
        time_s = now + constants[which] if fixed else now + 0.75 * which
        if fixed and pair_lane[which] >= 0:
            lane_push(lane_t, lane_k, pos, int(pair_lane[which]), time_s, counter, counter)
        else:
            if size == times.size:
                times, keys = grow(times, keys, size, 1)
            size = push(times, keys, size, time_s, counter, counter, 0)
        heapq.heappush(reference, (time_s, counter, counter))
        counter += 1
    assert popped == expected


def test_a_lane_per_constant_the_most_common_first() -> None:
    # Ten distinct latencies and delays: the eight most common get lanes (ties: the smaller first), the rest the
    # heap.
    latency = np.asarray([1.0, 2.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 9.0])
    delay = np.asarray([0.0, 0.0, 0.0, 2.0, 8.0, 8.0])
    lane_t, _, pos, pair_lane, rank_lane = lanes(latency, delay, 5)
    assert lane_t.shape == (MAX_LANES, 8)
    assert pos.size == 2 * MAX_LANES
    assert rank_lane.tolist() == [0, 0, 0, 1, 2, 2]  # 0.0 (three ranks), 2.0 (two pairs, a rank), 8.0
    assert pair_lane.tolist() == [3, 1, 1, 4, 5, 6, 7, -1, -1]


def test_no_lanes_where_a_constant_is_negative() -> None:
    # A negative delay could put an event before the instant that scheduled it: lanes would no longer be in order.
    lane_t, _, pos, pair_lane, rank_lane = lanes(np.asarray([1.0, 2.0]), np.asarray([0.0, -1.0]), 4)
    assert lane_t.shape[0] == pos.size == 0
    assert np.all(pair_lane == -1)
    assert np.all(rank_lane == -1)
