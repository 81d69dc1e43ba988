"""The per-event core of :mod:`allreduce.sim._event`, compiled with numba (the optional ``fast`` extra).

The same model, events and formulas as ``_Run``: one heap of (time, counter, event), events due within
_EVENT_RTOL of the earliest processed together, then one re-solve of the max-min fair rates of the transfers
connected to a changed link (less those whose rate cannot have changed: the threshold of ``_Run._threshold``),
by progressive filling — over the component's own links as ``_Run._fill_python`` does for a few transfers, a
level at a time with fresh sums as ``sim/_fair.fill_dense`` does for more. Flows and links are arrays, not
objects: the draining transfers on a link are an intrusive linked list in insertion order (the order of
``_Run``'s dicts), a transfer whose rate changed gets a new drain event and its old one goes stale (a version
per transfer). Summation orders follow the Python core's, so results agree with it to rounding.

:func:`available` says whether the kernel can run: numba is importable and the environment variable
``ALLREDUCE_SIM_KERNEL`` is not ``numpy`` (which forces the pure numpy/Python cores, so tests can compare).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt


def _load_numba() -> Any:
    try:
        import numba
    except ImportError:  # the fast extra is not installed: the numpy cores run
        return None
    return numba


_numba: Any = _load_numba()

__all__ = ["KERNEL_ENV", "available", "run_kernel"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

# Set to "numpy" to run the pure numpy/Python cores even where numba is installed.
KERNEL_ENV = "ALLREDUCE_SIM_KERNEL"

# The same tolerances as the per-event core (sim/_event.py) and sim/_fair.py.
_EVENT_RTOL = 1e-12
_LEVEL_RTOL = 1e-9
# Components with more draining transfers than this are filled level by level with fresh sums (as
# sim/_fair.fill_dense), smaller ones with running sums (as _Run._fill_python): the per-event core's split.
_DENSE_MIN_FLOWS = 16

# How many deliveries between two calls of the progress callback (as the per-event core).
_PROGRESS_EVERY = 4096

_START = 0
_DELIVER = 1
_DRAIN = 2


_progress = threading.local()  # the progress callback of the run in this thread


def _report(fraction: float) -> None:
    callback = getattr(_progress, "callback", None)
    if callback is not None:
        callback(fraction)


def available() -> bool:
    """Whether the compiled kernel runs: numba is installed and not switched off by ALLREDUCE_SIM_KERNEL."""
    return _numba is not None and os.environ.get(KERNEL_ENV, "").strip().lower() != "numpy"


def _njit(function: Callable[..., Any]) -> Callable[..., Any]:
    if _numba is None:
        return function
    compiled: Callable[..., Any] = _numba.njit(cache=True)(function)
    return compiled


# -- the event heap: rows (time, counter, kind, what, version), ordered by (time, counter) ---------------------
@_njit
def _reserve(heap: Any, size: int, extra: int) -> Any:
    if size + extra <= heap.shape[0]:
        return heap
    grown = np.empty((max(2 * heap.shape[0], size + extra), 5))
    grown[:size] = heap[:size]
    return grown


@_njit
def _before(heap: Any, i: int, j: int) -> bool:
    return bool(heap[i, 0] < heap[j, 0] or (heap[i, 0] == heap[j, 0] and heap[i, 1] < heap[j, 1]))


@_njit
def _push(heap: Any, size: int, time_s: float, counter: int, kind: int, what: int, version: int) -> int:  # noqa: PLR0917
    i = size
    heap[i, 0] = time_s
    heap[i, 1] = counter
    heap[i, 2] = kind
    heap[i, 3] = what
    heap[i, 4] = version
    while i > 0:
        parent = (i - 1) >> 1
        if not _before(heap, i, parent):
            break
        for c in range(5):
            heap[i, c], heap[parent, c] = heap[parent, c], heap[i, c]
        i = parent
    return size + 1


@_njit
def _pop(heap: Any, size: int) -> int:
    """Remove the first row (the caller read it); returns the new size."""
    size -= 1
    for c in range(5):
        heap[0, c] = heap[size, c]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and _before(heap, child + 1, child):
            child += 1
        if not _before(heap, child, i):
            break
        for c in range(5):
            heap[i, c], heap[child, c] = heap[child, c], heap[i, c]
        i = child
    return size


@_njit
def _mark(link: int, stamp: int, changed_mark: Any, changed: Any, num_changed: int) -> int:
    """Add ``link`` to this instant's changed links (once); returns how many there are."""
    if changed_mark[link] == stamp:
        return num_changed
    changed_mark[link] = stamp
    changed[num_changed] = link
    return num_changed + 1


@_njit
def _number_path(p: int, route: Any, local: Any, comp_links: Any, count: int) -> int:
    """Number the links of pair ``p``'s path not numbered yet (``local``), in path order, from ``count`` on;
    returns how many are numbered."""
    _, pair_ptr, pair_link, _, _ = route
    for e in range(pair_ptr[p], pair_ptr[p + 1]):
        link = pair_link[e]
        if local[link] < 0:
            local[link] = count
            comp_links[count] = link
            count += 1
    return count


# -- the fluid: rates of a changed component -------------------------------------------------------------------
@_njit
def _sort_pairs(key: Any, second: Any, count: int) -> None:
    """Sort ``key[:count]`` (ties by ``second``), moving ``second`` along: insertion sort for the few flows
    a link usually carries, a stable sort beyond."""
    if count > 32:
        by_second = np.argsort(second[:count], kind="mergesort")
        order = by_second[np.argsort(key[:count][by_second], kind="mergesort")]
        key[:count] = key[:count][order]
        second[:count] = second[:count][order]
        return
    for i in range(1, count):
        k, v = key[i], second[i]
        j = i - 1
        while j >= 0 and (key[j] > k or (key[j] == k and second[j] > v)):
            key[j + 1] = key[j]
            second[j + 1] = second[j]
            j -= 1
        key[j + 1] = k
        second[j + 1] = v


@_njit
def _threshold(  # noqa: PLR0917 (numba has no keyword-only parameters)
    started: Any, num_started: int, drained_rate: float, route: Any, lists: Any, rate: Any, stamp: int, scratch: Any
) -> float:
    """A rate below which no transfer's max-min fair rate can have changed (``_Run._threshold``)."""
    pair, pair_ptr, pair_link, _, capacity = route
    head, node_x, node_w, node_next = lists
    seen, old_r, old_w = scratch
    theta = drained_rate
    for i in range(num_started):
        p = pair[started[i]]
        for e in range(pair_ptr[p], pair_ptr[p + 1]):
            link = pair_link[e]
            if seen[link] == stamp:
                continue
            seen[link] = stamp
            rising = 0.0
            count = 0
            node = head[link]
            while node >= 0:
                r = rate[node_x[node]]
                if r == 0.0:
                    rising += node_w[node]
                else:
                    old_r[count] = r
                    old_w[count] = node_w[node]
                    count += 1
                node = node_next[node]
            room = capacity[link]
            for j in range(count):
                rising += old_w[j]
            _sort_pairs(old_r, old_w, count)  # in (rate, weight) order, as Python sorts the tuples
            for j in range(count):
                r = old_r[j]
                if room <= r * rising:
                    break
                room -= old_w[j] * r
                rising -= old_w[j]
            theta = min(theta, room / rising)
    return theta * (1 - 4 * _LEVEL_RTOL)


@_njit
def _fill_small(  # noqa: PLR0917 (numba has no keyword-only parameters)
    members: Any, num: int, route: Any, room: Any, lists: Any, comp_pos: Any, new: Any, scratch: Any
) -> None:
    """Progressive filling with running sums over the component's links (``_Run._fill_python``)."""
    links, demand, count, tight, rated = scratch
    pair, pair_ptr, pair_link, pair_weight, _ = route
    num_links = 0
    for i in range(num):
        p = pair[members[i]]
        for e in range(pair_ptr[p], pair_ptr[p + 1]):
            link = pair_link[e]
            k = 0
            while k < num_links and links[k] != link:
                k += 1
            if k == num_links:
                links[k] = link
                demand[k] = 0.0
                count[k] = 0
                num_links += 1
            demand[k] += pair_weight[e]
            count[k] += 1
    rated[:num] = False
    head, node_x, _, node_next = lists
    new_rate, new_bottleneck = new
    while True:
        fill = np.inf
        any_left = False
        for k in range(num_links):
            if count[k] > 0:
                any_left = True
                fill = min(fill, room[links[k]] / demand[k])
        if not any_left or not np.isfinite(fill):
            break
        limit = fill * (1 + _LEVEL_RTOL)
        for k in range(num_links):
            tight[k] = count[k] > 0 and room[links[k]] / demand[k] <= limit
        for k in range(num_links):
            if not tight[k]:
                continue
            node = head[links[k]]
            while node >= 0:
                x = node_x[node]
                node = node_next[node]
                pos = comp_pos[x] - 1
                if pos < 0 or rated[pos]:
                    continue
                rated[pos] = True
                new_rate[pos] = fill
                p = pair[x]
                first = -1
                for e in range(pair_ptr[p], pair_ptr[p + 1]):
                    lk = pair_link[e]
                    j = 0
                    while links[j] != lk:
                        j += 1
                    if first < 0 and tight[j]:
                        first = lk
                    room[lk] = max(room[lk] - pair_weight[e] * fill, 0.0)
                    demand[j] -= pair_weight[e]
                    count[j] -= 1
                new_bottleneck[pos] = first


@_njit
def _fill_dense(  # noqa: PLR0917 (numba has no keyword-only parameters)
    members: Any, num: int, comp: Any, route: Any, room: Any, new: Any
) -> int:
    """Progressive filling a level at a time with fresh sums (``sim/_fair.fill_dense``), over the component's
    links (``local`` numbers them)."""
    pair, pair_ptr, pair_link, pair_weight, _ = route
    num_entries = 0
    for i in range(num):
        p = pair[members[i]]
        num_entries += pair_ptr[p + 1] - pair_ptr[p]
    comp_links, num_links, local = comp
    new_rate, new_bottleneck = new
    flow = np.empty(num_entries, dtype=np.int64)
    link = np.empty(num_entries, dtype=np.int64)
    weight = np.empty(num_entries)
    k = 0
    for i in range(num):
        p = pair[members[i]]
        for e in range(pair_ptr[p], pair_ptr[p + 1]):
            flow[k] = i
            link[k] = local[pair_link[e]]
            weight[k] = pair_weight[e]
            k += 1
    remaining = np.empty(num_links)
    for j in range(num_links):
        remaining[j] = room[comp_links[j]]
    demand = np.zeros(num_links)
    level = np.empty(num_links)
    taken = np.zeros(num_links)
    frozen = np.zeros(num, dtype=np.bool_)
    left = num_entries
    levels = 0
    while left:
        levels += 1
        demand[:] = 0.0
        for e in range(left):
            demand[link[e]] += weight[e]
        fill = np.inf
        for j in range(num_links):
            level[j] = remaining[j] / demand[j] if demand[j] > 0 else np.inf
            fill = min(fill, level[j])
        if not np.isfinite(fill):
            break
        limit = fill * (1 + _LEVEL_RTOL)
        previous = -1
        for e in range(left):
            if level[link[e]] <= limit:
                f = flow[e]
                new_rate[f] = fill
                if f != previous:
                    new_bottleneck[f] = comp_links[link[e]]
                    previous = f
                frozen[f] = True
        taken[:] = 0.0
        kept = 0
        for e in range(left):
            if frozen[flow[e]]:
                taken[link[e]] += weight[e] * fill
            else:
                flow[kept] = flow[e]
                link[kept] = link[e]
                weight[kept] = weight[e]
                kept += 1
        for j in range(num_links):
            remaining[j] = max(remaining[j] - taken[j], 0.0)
        left = kept
    return levels


@_njit
def _events(route: Any, program: Any, out: Any, stats: Any, report_every: int) -> None:
    """Run to the end: ``route`` (pair per transfer, pair_ptr, pair_link, pair_weight, link capacity),
    ``program`` (bytes and latency per transfer, its send and receive slots; slot_ptr, slot_member, slot_rank;
    per rank its first and stop slots, start and delay) and ``out`` (the arrays a run fills in)."""
    pair, pair_ptr, pair_link, pair_weight, capacity = route
    nbytes, latency, send_slot, recv_slot, slot_ptr, slot_member, slot_rank = program[:7]
    rank_first_slot, rank_stop_slot, start_at, delay = program[7:]
    slot_start, slot_end, slot_last, trigger, start_s, drained_s, delivered_s, rank_end, slowest, bottleneck = out
    num_transfers = nbytes.size
    num_links = capacity.size
    hops = 1
    for p in range(pair_ptr.size - 1):
        hops = max(hops, pair_ptr[p + 1] - pair_ptr[p])

    pending = slot_ptr[1:] - slot_ptr[:-1]
    ready = np.zeros(num_transfers, dtype=np.int8)
    rate = np.zeros(num_transfers)
    left = np.zeros(num_transfers)
    since = np.zeros(num_transfers)
    version = np.zeros(num_transfers, dtype=np.int64)
    holder = np.full(num_transfers, -1, dtype=np.int64)  # the node block of a draining transfer
    comp_pos = np.zeros(num_transfers, dtype=np.int32)  # 1 + its place among the component's transfers

    # Draining transfers' links: node block b holds hops nodes; per link a list of nodes in insertion order.
    blocks = 64
    node_x = np.empty(blocks * hops, dtype=np.int64)
    node_w = np.empty(blocks * hops)
    node_prev = np.empty(blocks * hops, dtype=np.int64)
    node_next = np.empty(blocks * hops, dtype=np.int64)
    free = np.arange(blocks - 1, -1, -1).astype(np.int64)
    num_free = blocks
    head = np.full(num_links, -1, dtype=np.int64)
    tail = np.full(num_links, -1, dtype=np.int64)

    changed = np.empty(num_links, dtype=np.int64)
    changed_mark = np.zeros(num_links, dtype=np.int64)
    num_changed = 0
    started = np.empty(blocks, dtype=np.int64)
    num_started = 0
    drained_rate = np.inf
    seen = np.zeros(num_links, dtype=np.int64)
    stamp = 1  # this instant's mark in changed_mark and seen
    room = np.empty(num_links)
    local = np.full(num_links, -1, dtype=np.int64)
    comp_links = np.empty(num_links, dtype=np.int64)
    stack = np.empty(num_links, dtype=np.int64)
    members = np.empty(blocks, dtype=np.int64)
    new_rate = np.empty(blocks)
    new_bottleneck = np.empty(blocks, dtype=np.int64)
    old_r = np.empty(blocks)
    old_w = np.empty(blocks)

    small = (_DENSE_MIN_FLOWS + 1) * hops
    small_links = np.empty(small, dtype=np.int64)
    small_demand = np.empty(small)
    small_count = np.empty(small, dtype=np.int64)
    small_tight = np.empty(small, dtype=np.bool_)
    small_rated = np.empty(small, dtype=np.bool_)

    heap = np.empty((1024, 5))
    size = 0
    delivered = 0
    counter = 0
    for rank in range(rank_first_slot.size):
        if rank_first_slot[rank] < rank_stop_slot[rank]:
            heap = _reserve(heap, size, 1)
            size = _push(heap, size, start_at[rank], counter, _START, rank_first_slot[rank], 0)
            counter += 1
        else:
            rank_end[rank] = start_at[rank]

    while size:
        now = heap[0, 0]
        horizon = now * (1 + _EVENT_RTOL)
        while size and heap[0, 0] <= horizon:
            kind = int(heap[0, 2])
            what = int(heap[0, 3])
            ver = int(heap[0, 4])
            size = _pop(heap, size)
            if kind == _START:
                slot = what
                slot_start[slot] = now
                heap = _reserve(heap, size, slot_ptr[slot + 1] - slot_ptr[slot])
                for m in range(slot_ptr[slot], slot_ptr[slot + 1]):
                    x = slot_member[m]
                    ready[x] += 1
                    if ready[x] != 2:
                        continue
                    trigger[x] = slot
                    start_s[x] = now
                    p = pair[x]
                    if nbytes[x] <= 0 or pair_ptr[p + 1] == pair_ptr[p]:
                        drained_s[x] = now
                        size = _push(heap, size, now + latency[x], counter, _DELIVER, x, 0)
                        counter += 1
                        continue
                    left[x] = nbytes[x]
                    since[x] = now
                    rate[x] = 0.0
                    if num_free == 0:
                        grown = 2 * blocks
                        node_x = np.concatenate((node_x, np.empty(blocks * hops, dtype=np.int64)))
                        node_w = np.concatenate((node_w, np.empty(blocks * hops)))
                        node_prev = np.concatenate((node_prev, np.empty(blocks * hops, dtype=np.int64)))
                        node_next = np.concatenate((node_next, np.empty(blocks * hops, dtype=np.int64)))
                        free = np.concatenate((np.arange(grown - 1, blocks - 1, -1).astype(np.int64), free))
                        num_free = blocks
                        blocks = grown
                        started = np.concatenate((started, np.empty(blocks - started.size, dtype=np.int64)))
                        members = np.empty(blocks, dtype=np.int64)
                        new_rate = np.empty(blocks)
                        new_bottleneck = np.empty(blocks, dtype=np.int64)
                        old_r = np.empty(blocks)
                        old_w = np.empty(blocks)
                    num_free -= 1
                    block = free[num_free]
                    holder[x] = block
                    for h in range(pair_ptr[p + 1] - pair_ptr[p]):
                        e = pair_ptr[p] + h
                        link = pair_link[e]
                        node = block * hops + h
                        node_x[node] = x
                        node_w[node] = pair_weight[e]
                        node_next[node] = -1
                        node_prev[node] = tail[link]
                        if tail[link] >= 0:
                            node_next[tail[link]] = node
                        else:
                            head[link] = node
                        tail[link] = node
                        num_changed = _mark(link, stamp, changed_mark, changed, num_changed)
                    started[num_started] = x
                    num_started += 1
            elif kind == _DELIVER:
                x = what
                delivered_s[x] = now
                delivered += 1
                if report_every and delivered % report_every == 0:
                    with _numba.objmode():
                        _report(delivered / num_transfers)
                send, recv = send_slot[x], recv_slot[x]
                for slot in (send, recv):
                    if slot == recv and send == recv:
                        break
                    pending[slot] -= 2 if send == recv else 1
                    if pending[slot] != 0:
                        continue
                    slot_end[slot] = now
                    slot_last[slot] = x
                    rank = slot_rank[slot]
                    after = now + delay[rank]
                    if slot + 1 < rank_stop_slot[rank]:
                        heap = _reserve(heap, size, 1)
                        size = _push(heap, size, after, counter, _START, slot + 1, 0)
                        counter += 1
                    else:
                        rank_end[rank] = after
            elif ver == version[what]:
                x = what
                drained_s[x] = now
                drained_rate = min(drained_rate, rate[x])
                rate[x] = 0.0
                left[x] = 0.0
                p = pair[x]
                block = holder[x]
                holder[x] = -1
                for h in range(pair_ptr[p + 1] - pair_ptr[p]):
                    link = pair_link[pair_ptr[p] + h]
                    node = block * hops + h
                    before, after_node = node_prev[node], node_next[node]
                    if before >= 0:
                        node_next[before] = after_node
                    else:
                        head[link] = after_node
                    if after_node >= 0:
                        node_prev[after_node] = before
                    else:
                        tail[link] = before
                    num_changed = _mark(link, stamp, changed_mark, changed, num_changed)
                free[num_free] = block
                num_free += 1
                heap = _reserve(heap, size, 1)
                size = _push(heap, size, now + latency[x], counter, _DELIVER, x, 0)
                counter += 1
        if not num_changed:
            continue

        # One re-solve for every transfer that came and went at this instant.
        lists = (head, node_x, node_w, node_next)
        theta = _threshold(started, num_started, drained_rate, route, lists, rate, stamp, (seen, old_r, old_w))
        # The component: transfers connected to a changed link through shared links, less those below theta
        # (they keep their rate and only take capacity).
        num = 0
        num_comp_links = 0
        top = 0
        for i in range(num_changed):
            link = changed[i]
            local[link] = num_comp_links
            comp_links[num_comp_links] = link
            num_comp_links += 1
            stack[top] = link
            top += 1
        while top:
            top -= 1
            link = stack[top]
            room_left = capacity[link]
            node = head[link]
            while node >= 0:
                x = node_x[node]
                r = rate[x]
                if 0.0 < r < theta:
                    room_left -= node_w[node] * r
                elif comp_pos[x] == 0:
                    members[num] = x
                    num += 1
                    comp_pos[x] = 1
                    before = num_comp_links
                    num_comp_links = _number_path(pair[x], route, local, comp_links, num_comp_links)
                    for j in range(before, num_comp_links):
                        stack[top] = comp_links[j]
                        top += 1
                node = node_next[node]
            room[link] = room_left
        if num > 32:
            members[:num] = np.sort(members[:num])
        else:
            for i in range(1, num):
                x = members[i]
                j = i - 1
                while j >= 0 and members[j] > x:
                    members[j + 1] = members[j]
                    j -= 1
                members[j + 1] = x
        chosen = members
        for i in range(num):
            comp_pos[chosen[i]] = i + 1
            new_rate[i] = np.inf
            new_bottleneck[i] = -1
        stats[0] += 1
        stats[1] += num
        if num > _DENSE_MIN_FLOWS:
            # The dense fill numbers the component's links in the order their transfers (sorted) reach them.
            for j in range(num_comp_links):
                local[comp_links[j]] = -1
            num_comp_links = 0
            for i in range(num):
                num_comp_links = _number_path(pair[chosen[i]], route, local, comp_links, num_comp_links)
            stats[2] += 1
            comp = (comp_links, num_comp_links, local)
            stats[3] += _fill_dense(chosen, num, comp, route, room, (new_rate, new_bottleneck))
        elif num:
            scratch = (small_links, small_demand, small_count, small_tight, small_rated)
            _fill_small(chosen, num, route, room, lists, comp_pos, (new_rate, new_bottleneck), scratch)
        for j in range(num_comp_links):
            local[comp_links[j]] = -1
        heap = _reserve(heap, size, num)
        for i in range(num):
            x = chosen[i]
            comp_pos[x] = 0
            r = new_rate[i]
            old = rate[x]
            if r == old:
                continue
            left[x] -= old * (now - since[x])
            since[x] = now
            rate[x] = r
            version[x] += 1
            if r < slowest[x]:
                # Rates within _LEVEL_RTOL are one level: rounding must not move the bottleneck named.
                if r < slowest[x] * (1 - _LEVEL_RTOL):
                    bottleneck[x] = new_bottleneck[i]
                slowest[x] = r
            size = _push(heap, size, now + max(left[x], 0.0) / r, counter, _DRAIN, x, version[x])
            counter += 1
        num_changed = 0
        num_started = 0
        drained_rate = np.inf
        stamp += 1


def run_kernel(run: Any, progress: Callable[[float], None] | None = None) -> None:
    """Run a :class:`allreduce.sim._layout.Layout` to the end with the compiled kernel, filling in its arrays
    (``slowest_rate`` and ``bottleneck`` as ``_Run.run`` leaves them). ``progress`` (if given) is called with
    the fraction of transfers delivered, every _PROGRESS_EVERY deliveries."""
    # The kernel writes the slowest rates and the bottlenecks (dense link numbers, then mapped) in place.
    slowest = run.slowest_rate
    slowest.fill(np.inf)
    dense = run.bottleneck
    dense.fill(-1)
    stats = np.zeros(4, dtype=np.int64)
    _progress.callback = progress
    try:
        _run_events(run, slowest, dense, stats, 0 if progress is None else _PROGRESS_EVERY)
    finally:
        _progress.callback = None
    run.kernel_stats = stats
    found = dense >= 0
    dense[found] = run.used_links[dense[found]]


def _run_events(run: Any, slowest: FloatArray, dense: IntArray, stats: IntArray, report_every: int) -> None:
    def ints(a: Any) -> IntArray:
        return np.asarray(a, dtype=np.int64)

    def floats(a: Any) -> FloatArray:
        return np.asarray(a, dtype=np.float64)

    route = (
        ints(run.pair),
        ints(run.pair_ptr),
        ints(run.pair_link),
        floats(run.pair_weight),
        floats(run.link_capacity),
    )
    program = (
        floats(run.nbytes),
        floats(run.latency),
        ints(run.send_slot),
        ints(run.recv_slot),
        ints(run.slot_ptr),
        ints(run.slot_member),
        ints(run.slot_rank),
        ints(run.rank_first_slot),
        ints(run.rank_stop_slot),
        floats(run.start_at),
        floats(run.delay),
    )
    out = (
        run.slot_start,
        run.slot_end,
        run.slot_last,
        run.trigger,
        run.start_s,
        run.drained_s,
        run.delivered_s,
        run.rank_end,
        slowest,
        dense,
    )
    _events(route, program, out, stats, report_every)
