"""The compiled event core's queue (sim/_kernel.py): a binary heap of events ordered by (time, counter).

The counter is the order of scheduling, so events due at one instant come out in the order they were pushed
and a run is deterministic (the per-event Python core's ``heapq`` of tuples does the same). An event is four
parallel arrays' entries — its time, its counter, an item ``what * 4 + kind`` and a version — moved with a
hole rather than swapped. When a transfer's rate changes it gets a new drain event and the old one goes stale
(its version is no longer the transfer's): popped, it does nothing, but like the per-event core's it still
opens an instant when it is the earliest, which keeps results bit for bit the same.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from allreduce.sim._jit import njit

__all__ = ["DELIVER", "DRAIN", "START", "grow", "pop", "push"]

START = 0  # a rank begins its next step (what: the slot)
DELIVER = 1  # a transfer's last byte arrived (what: the transfer)
DRAIN = 2  # a transfer's last byte left (what: the block the transfer drains in)


@njit
def grow(heap: Any, size: int, extra: int) -> Any:
    """``heap`` (times, counters, items, versions) with room for ``extra`` more events past ``size``."""
    times, counters, items, versions = heap
    capacity = max(2 * times.size, size + extra)
    new_times = np.empty(capacity)
    new_counters = np.empty(capacity, dtype=np.int64)
    new_items = np.empty(capacity, dtype=np.int64)
    new_versions = np.empty(capacity, dtype=np.int64)
    new_times[:size] = times[:size]
    new_counters[:size] = counters[:size]
    new_items[:size] = items[:size]
    new_versions[:size] = versions[:size]
    return new_times, new_counters, new_items, new_versions


@njit
def _put(heap: Any, i: int, event: Any) -> None:
    """Write ``event`` (time, counter, item, version) at place ``i``."""
    times, counters, items, versions = heap
    times[i], counters[i], items[i], versions[i] = event


@njit
def _get(heap: Any, i: int) -> Any:
    times, counters, items, versions = heap
    return times[i], counters[i], items[i], versions[i]


@njit
def push(heap: Any, size: int, time_s: float, counter: int, item: int, version: int) -> int:  # noqa: PLR0917
    """Add an event (the caller made room: :func:`grow`); returns the new size."""
    times, counters, _, _ = heap
    i = size
    while i > 0:
        parent = (i - 1) >> 1
        if times[parent] < time_s or (times[parent] == time_s and counters[parent] < counter):
            break
        _put(heap, i, _get(heap, parent))
        i = parent
    _put(heap, i, (time_s, counter, item, version))
    return size + 1


@njit
def pop(heap: Any, size: int) -> int:
    """Remove the first event (the caller read it); returns the new size."""
    times, counters, _, _ = heap
    size -= 1
    last = _get(heap, size)
    time_s, counter = last[0], last[1]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        right = child + 1
        if right < size and (
            times[right] < times[child] or (times[right] == times[child] and counters[right] < counters[child])
        ):
            child = right
        if times[child] > time_s or (times[child] == time_s and counters[child] > counter):
            break
        _put(heap, i, _get(heap, child))
        i = child
    _put(heap, i, last)
    return size
