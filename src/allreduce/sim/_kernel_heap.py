"""The compiled event core's queue (sim/_kernel.py): a binary heap of events ordered by (time, counter).

The counter is the order of scheduling, so events due at one instant come out in the order they were pushed
and a run is deterministic (the per-event Python core's ``heapq`` of tuples does the same). An event is its
time (one array) and three integers (another, three entries an event: its counter, an item ``what * 4 + kind``
and a version), moved with a hole rather than swapped. When a transfer's rate changes it gets a new drain event
and the old one goes stale (its version is no longer the transfer's): popped, it does nothing, but like the
per-event core's it still opens an instant when it is the earliest, which keeps results bit for bit the same.

Beside the heap, :func:`lanes`: an event due a fixed time after the instant that schedules it (a delivery, its
pair's latency after its drain; a start, its rank's delay after its step before ended) goes to that constant's
lane, a ring in which such events are in (time, counter) order already; :func:`earliest` finds the first event
among the heap's and the lanes' heads.

The compiled functions allocate nothing (sim/_jit.py): the run makes room before an instant
(:func:`grow`, numpy) for every event the instant can push. :func:`sort_ids` puts the transfers whose rates
changed at an instant in order, the order their drain events are pushed in.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.sim._jit import inline

__all__ = [
    "DELIVER",
    "DRAIN",
    "START",
    "earliest",
    "grow",
    "lane_push",
    "lanes",
    "pop",
    "push",
    "seeded",
    "sort_ids",
]

# At most this many lanes (:func:`lanes`): the earliest event is looked for among their heads and the heap's.
MAX_LANES = 8

START = 0  # a rank begins its next step (what: the slot)
DELIVER = 1  # a transfer's last byte arrived (what: the transfer)
DRAIN = 2  # a transfer's last byte left (what: the block the transfer drains in)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def seeded(times: FloatArray, items: IntArray, capacity: int) -> tuple[FloatArray, IntArray]:
    """A queue of room ``capacity`` holding events at ``times`` with ``items``, counters 0, 1, ... in that
    order, version 0: sorted by (time, counter), which is a heap."""
    order = np.lexsort((np.arange(times.size), times))
    heap_times = np.empty(max(capacity, times.size))
    heap_keys = np.zeros(3 * heap_times.size, dtype=np.int64)
    heap_times[: times.size] = times[order]
    heap_keys[0 : 3 * times.size : 3] = order
    heap_keys[1 : 3 * times.size : 3] = items[order]
    return heap_times, heap_keys


def grow(times: FloatArray, keys: IntArray, size: int, extra: int) -> tuple[FloatArray, IntArray]:
    """The queue's arrays with room for ``extra`` more events past ``size``."""
    capacity = max(2 * times.size, size + extra)
    new_times = np.empty(capacity)
    new_keys = np.zeros(3 * capacity, dtype=np.int64)
    new_times[:size] = times[:size]
    new_keys[: 3 * size] = keys[: 3 * size]
    return new_times, new_keys


@inline
def push(times: Any, keys: Any, size: int, time_s: float, counter: int, item: int, version: int) -> int:  # noqa: PLR0917
    """Add an event (the caller made room); returns the new size."""
    i = size
    while i > 0:
        parent = (i - 1) >> 1
        if times[parent] < time_s or (times[parent] == time_s and keys[3 * parent] < counter):
            break
        times[i] = times[parent]
        keys[3 * i] = keys[3 * parent]
        keys[3 * i + 1] = keys[3 * parent + 1]
        keys[3 * i + 2] = keys[3 * parent + 2]
        i = parent
    times[i] = time_s
    keys[3 * i] = counter
    keys[3 * i + 1] = item
    keys[3 * i + 2] = version
    return size + 1


@inline
def pop(times: Any, keys: Any, size: int) -> int:
    """Remove the first event (the caller read it); returns the new size."""
    size -= 1
    time_s = times[size]
    counter, item, version = keys[3 * size], keys[3 * size + 1], keys[3 * size + 2]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        right = child + 1
        if right < size and (
            times[right] < times[child] or (times[right] == times[child] and keys[3 * right] < keys[3 * child])
        ):
            child = right
        if times[child] > time_s or (times[child] == time_s and keys[3 * child] > counter):
            break
        times[i] = times[child]
        keys[3 * i] = keys[3 * child]
        keys[3 * i + 1] = keys[3 * child + 1]
        keys[3 * i + 2] = keys[3 * child + 2]
        i = child
    times[i] = time_s
    keys[3 * i] = counter
    keys[3 * i + 1] = item
    keys[3 * i + 2] = version
    return size


def lanes(
    pair_latency: FloatArray, delay: FloatArray, capacity: int
) -> tuple[FloatArray, IntArray, IntArray, IntArray, IntArray]:
    """The queue's lanes: first-in first-out rings beside the heap for the events due a fixed time after the
    instant that schedules them (a delivery: its pair's latency after its drain; a start: its rank's delay
    after the end of its step before). The instants' times never decrease, so such events, pushed in counter
    order, are in (time, counter) order in their lane: the earliest event of the queue is the least of the
    heap's first and the lanes' heads, popped in the same order as from one heap, at a fraction of the cost.
    One lane per distinct latency or delay, the MAX_LANES most common (the rest go to the heap; all do where
    any is negative or not finite: the times could then decrease). Returns the lanes' times and their
    (counter, item) pairs (a row per lane of ``capacity`` entries, a power of two), their first and next
    positions, and the lane of each pair's deliveries and of each rank's starts (-1: the heap)."""
    pair_lane = np.full(pair_latency.size, -1, dtype=np.int64)
    rank_lane = np.full(delay.size, -1, dtype=np.int64)
    constants = np.concatenate([pair_latency, delay])
    count = 0
    if constants.size and np.all(np.isfinite(constants)) and np.all(constants >= 0):
        values, inverse, counts = np.unique(constants, return_inverse=True, return_counts=True)
        kept = np.argsort(-counts, kind="stable")[:MAX_LANES]
        lane_of = np.full(values.size, -1, dtype=np.int64)
        lane_of[kept] = np.arange(kept.size)
        pair_lane[:] = lane_of[inverse[: pair_latency.size]]
        rank_lane[:] = lane_of[inverse[pair_latency.size :]]
        count = kept.size
    room = 1
    while room < capacity:
        room *= 2
    return (
        np.zeros((count, room)),
        np.zeros((count, 2 * room), dtype=np.int64),
        np.zeros(2 * count, dtype=np.int64),
        pair_lane,
        rank_lane,
    )


@inline
def lane_push(lane_t: Any, lane_k: Any, pos: Any, lane: int, time_s: float, counter: int, item: int) -> None:  # noqa: PLR0917
    """Add an event to the end of lane ``lane`` (its time not below any there; room for it)."""
    i = pos[2 * lane + 1] & (lane_t.shape[1] - 1)
    lane_t[lane, i] = time_s
    lane_k[lane, 2 * i] = counter
    lane_k[lane, 2 * i + 1] = item
    pos[2 * lane + 1] += 1


@inline
def earliest(times: Any, keys: Any, size: int, lane_t: Any, lane_k: Any, pos: Any) -> int:  # noqa: PLR0917
    """Where the earliest event is, by (time, counter): -1 the heap's first, a lane's number its head, -2 the
    queue is empty."""
    best = -2
    time_s = 0.0
    counter = 0
    if size:
        best = -1
        time_s = times[0]
        counter = keys[0]
    mask = lane_t.shape[1] - 1
    for lane in range(pos.size >> 1):
        head = pos[2 * lane]
        if head == pos[2 * lane + 1]:
            continue
        i = head & mask
        t = lane_t[lane, i]
        if best == -2 or t < time_s or (t == time_s and lane_k[lane, 2 * i] < counter):
            best = lane
            time_s = t
            counter = lane_k[lane, 2 * i]
    return best


@inline
def sort_ids(ids: Any, count: int, stack: Any) -> None:
    """Sort the distinct ``ids[:count]`` in place: a quicksort (median of three; the larger part waits on
    ``stack``, at least 128 entries, while the smaller is sorted, so it holds at most log2(count) parts) down
    to parts of 16, sorted by insertion."""
    lo, hi = 0, count - 1
    top = 0
    while True:
        if hi - lo < 16:
            for i in range(lo + 1, hi + 1):
                x = ids[i]
                k = i - 1
                while k >= lo and ids[k] > x:
                    ids[k + 1] = ids[k]
                    k -= 1
                ids[k + 1] = x
            if top == 0:
                return
            top -= 2
            lo, hi = stack[top], stack[top + 1]
            continue
        a, b, c = ids[lo], ids[(lo + hi) >> 1], ids[hi]
        pivot = max(min(a, b), min(max(a, b), c))
        i, j = lo, hi
        while i <= j:
            while ids[i] < pivot:
                i += 1
            while ids[j] > pivot:
                j -= 1
            if i <= j:
                ids[i], ids[j] = ids[j], ids[i]
                i += 1
                j -= 1
        if j - lo < hi - i:
            stack[top], stack[top + 1] = i, hi
            hi = j
        else:
            stack[top], stack[top + 1] = lo, j
            lo = i
        top += 2
