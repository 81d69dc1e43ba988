"""The per-event core of :mod:`allreduce.sim._event`, compiled with numba (the optional ``fast`` extra).

The same model, events and formulas as ``_Run``: one queue of events ordered by (time, counter)
(sim/_kernel_heap.py), events due within _EVENT_RTOL of the earliest processed together, then one re-solve of
the max-min fair rates of the transfers connected to a changed link, less those whose rate cannot have changed
(sim/_kernel_fluid.py: the threshold of ``_Run._threshold``, progressive filling with running sums for a few
transfers as ``_Run._fill_python``, level by level as ``sim/_fair.fill_dense`` for more). Flows and links are
arrays, not objects: the draining transfers on a link are an intrusive linked list in insertion order (the
order of ``_Run``'s dicts), and a transfer whose rate changed has its drain event moved. Summation orders follow
the Python core's, so results agree with it bit for bit where the tests check them (to 1e-9).

:func:`available` (sim/_jit.py) says whether the kernel can run: numba is importable and the environment
variable ``ALLREDUCE_SIM_KERNEL`` is not ``numpy`` (which forces the pure numpy/Python cores).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.sim._jit import KERNEL_ENV, available, njit, numba
from allreduce.sim._kernel_fluid import fill_dense, fill_small, number_path, sort_ids, summable_links, threshold
from allreduce.sim._kernel_heap import DELIVER, DRAIN, START, grow, pop, push

__all__ = ["KERNEL_ENV", "available", "run_kernel"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

# The same tolerances as the per-event core (sim/_event.py) and sim/_fair.py.
_EVENT_RTOL = 1e-12
_LEVEL_RTOL = 1e-9
# Components with more draining transfers than this are filled level by level with fresh sums (as
# sim/_fair.fill_dense), smaller ones with running sums (as _Run._fill_python): the per-event core's split.
_DENSE_MIN_FLOWS = 16

# How many deliveries between two calls of the progress callback (as the per-event core).
_PROGRESS_EVERY = 4096

_progress = threading.local()  # the progress callback of the run in this thread


def _report(fraction: float) -> None:
    callback = getattr(_progress, "callback", None)
    if callback is not None:
        callback(fraction)


@njit
def _mark(link: int, stamp: int, changed_mark: Any, changed: Any, num_changed: int) -> int:
    """Add ``link`` to this instant's changed links (once); returns how many there are."""
    if changed_mark[link] == stamp:
        return num_changed
    changed_mark[link] = stamp
    changed[num_changed] = link
    return num_changed + 1


@njit
def _events(route: Any, program: Any, out: Any, stats: Any, report_every: int, summable: Any) -> None:  # noqa: PLR0917
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
    shift = 0  # a block's nodes are 2^shift >= hops apart: a node's block is a shift away, not a division
    while (1 << shift) < hops:
        shift += 1
    stride = 1 << shift

    pending = (slot_ptr[1:] - slot_ptr[:-1]).astype(np.int32)
    ready = np.zeros(num_transfers, dtype=np.int8)
    holder = np.full(num_transfers, -1, dtype=np.int32)  # the block of a draining transfer

    # A draining transfer holds a block: its state (below) and hops nodes, one per link of its path, each in
    # its link's list of nodes in insertion order. Per transfer only the block is kept: a run holds millions.
    blocks = 64
    rate = np.zeros(blocks)
    left = np.zeros(blocks)  # bytes still to drain at time since
    since = np.zeros(blocks)
    version = np.zeros(blocks, dtype=np.int64)  # its drain events of older versions are stale
    comp_pos = np.zeros(blocks, dtype=np.int32)  # 1 + its place among the component's transfers
    node_x = np.empty(blocks * stride, dtype=np.int64)
    node_w = np.empty(blocks * stride)
    node_prev = np.empty(blocks * stride, dtype=np.int64)
    node_next = np.empty(blocks * stride, dtype=np.int64)
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
    small_place = np.zeros(num_links, dtype=np.int64)
    small_links = np.empty(small, dtype=np.int64)
    small_demand = np.empty(small)
    small_count = np.empty(small, dtype=np.int64)
    small_tight = np.empty(small, dtype=np.bool_)
    small_rated = np.empty(small, dtype=np.bool_)

    heap = (np.empty(1024), np.empty(1024, dtype=np.int64), np.empty(1024, dtype=np.int64), np.zeros(1024, np.int64))
    size = 0
    delivered = 0
    counter = 0
    for rank in range(rank_first_slot.size):
        if rank_first_slot[rank] < rank_stop_slot[rank]:
            if size == heap[0].size:
                heap = grow(heap, size, 1)
            size = push(heap, size, start_at[rank], counter, rank_first_slot[rank] * 4 + START, 0)
            counter += 1
        else:
            rank_end[rank] = start_at[rank]

    while size:
        now = heap[0][0]
        horizon = now * (1 + _EVENT_RTOL)
        while size and heap[0][0] <= horizon:
            kind = heap[2][0] & 3
            what = heap[2][0] >> 2
            ver = heap[3][0]
            size = pop(heap, size)
            if kind == START:
                slot = what
                slot_start[slot] = now
                if size + slot_ptr[slot + 1] - slot_ptr[slot] > heap[0].size:
                    heap = grow(heap, size, slot_ptr[slot + 1] - slot_ptr[slot])
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
                        size = push(heap, size, now + latency[x], counter, x * 4 + DELIVER, 0)
                        counter += 1
                        continue
                    if num_free == 0:
                        grown = 2 * blocks
                        rate = np.concatenate((rate, np.zeros(blocks)))
                        left = np.concatenate((left, np.zeros(blocks)))
                        since = np.concatenate((since, np.zeros(blocks)))
                        version = np.concatenate((version, np.zeros(blocks, dtype=np.int64)))
                        comp_pos = np.concatenate((comp_pos, np.zeros(blocks, dtype=np.int32)))
                        node_x = np.concatenate((node_x, np.empty(blocks * stride, dtype=np.int64)))
                        node_w = np.concatenate((node_w, np.empty(blocks * stride)))
                        node_prev = np.concatenate((node_prev, np.empty(blocks * stride, dtype=np.int64)))
                        node_next = np.concatenate((node_next, np.empty(blocks * stride, dtype=np.int64)))
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
                    left[block] = nbytes[x]
                    since[block] = now
                    rate[block] = 0.0
                    for h in range(pair_ptr[p + 1] - pair_ptr[p]):
                        e = pair_ptr[p] + h
                        link = pair_link[e]
                        node = (block << shift) + h
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
            elif kind == DELIVER:
                x = what
                delivered_s[x] = now
                delivered += 1
                if report_every and delivered % report_every == 0:
                    with numba.objmode():
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
                        if size == heap[0].size:
                            heap = grow(heap, size, 1)
                        size = push(heap, size, after, counter, (slot + 1) * 4 + START, 0)
                        counter += 1
                    else:
                        rank_end[rank] = after
            elif ver == version[what]:
                block = what
                x = node_x[block << shift]
                drained_s[x] = now
                drained_rate = min(drained_rate, rate[block])
                rate[block] = 0.0
                left[block] = 0.0
                p = pair[x]
                holder[x] = -1
                for h in range(pair_ptr[p + 1] - pair_ptr[p]):
                    link = pair_link[pair_ptr[p] + h]
                    node = (block << shift) + h
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
                if size == heap[0].size:
                    heap = grow(heap, size, 1)
                size = push(heap, size, now + latency[x], counter, x * 4 + DELIVER, 0)
                counter += 1
        if not num_changed:
            continue

        # One re-solve for every transfer that came and went at this instant.
        lists = (head, node_x, node_w, node_next, shift)
        theta = threshold(started, num_started, drained_rate, route, lists, rate, stamp, (seen, old_r, old_w))
        # The component: transfers connected to a changed link through shared links, less those below theta
        # (they keep their rate and only take capacity).
        num = 0
        num_comp_links = 0
        top = 0
        visited = 0
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
                visited += 1
                block = node >> shift
                r = rate[block]
                if 0.0 < r < theta:
                    room_left -= node_w[node] * r
                elif comp_pos[block] == 0:
                    x = node_x[node]
                    members[num] = x
                    num += 1
                    comp_pos[block] = 1
                    before = num_comp_links
                    num_comp_links = number_path(pair[x], route, local, comp_links, num_comp_links)
                    for j in range(before, num_comp_links):
                        stack[top] = comp_links[j]
                        top += 1
                node = node_next[node]
            room[link] = room_left
        sort_ids(members, num)
        chosen = members
        for i in range(num):
            comp_pos[holder[chosen[i]]] = i + 1
            new_rate[i] = np.inf
            new_bottleneck[i] = -1
        stats[0] += 1
        stats[1] += num
        stats[4] += visited
        if num > _DENSE_MIN_FLOWS:
            stats[2] += 1
            comp = (comp_links, num_comp_links, local)
            stats[3] += fill_dense(chosen, num, comp, route, room, (new_rate, new_bottleneck), summable)
        elif num:
            scratch = (small_links, small_demand, small_count, small_tight, small_rated, small_place)
            fill_small(chosen, num, route, room, lists, comp_pos, (new_rate, new_bottleneck), scratch)
        for j in range(num_comp_links):
            local[comp_links[j]] = -1
        if size + num > heap[0].size:
            heap = grow(heap, size, num)
        for i in range(num):
            x = chosen[i]
            block = holder[x]
            comp_pos[block] = 0
            r = new_rate[i]
            old = rate[block]
            if r == old:
                continue
            left[block] -= old * (now - since[block])
            since[block] = now
            rate[block] = r
            if r < slowest[x]:
                # Rates within _LEVEL_RTOL are one level: rounding must not move the bottleneck named.
                if r < slowest[x] * (1 - _LEVEL_RTOL):
                    bottleneck[x] = new_bottleneck[i]
                slowest[x] = r
            when = now + max(left[block], 0.0) / r
            version[block] += 1
            size = push(heap, size, when, counter, block * 4 + DRAIN, version[block])
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
    # Rate solves, transfers re-solved, dense fills, their levels, link-list nodes the component searches visited.
    stats = np.zeros(5, dtype=np.int64)
    _progress.callback = progress
    try:
        _run_events(run, slowest, dense, stats, 0 if progress is None else _PROGRESS_EVERY)
    finally:
        _progress.callback = None
    run.kernel_stats = stats
    found = dense >= 0
    dense[found] = run.used_links[dense[found]]


def _run_events(run: Any, slowest: FloatArray, dense: IntArray, stats: IntArray, report_every: int) -> None:
    # As the layout holds them (32-bit where it can): a conversion would copy arrays of millions of entries.
    route = (run.pair, run.pair_ptr, run.pair_link, run.pair_weight, run.link_capacity)
    program = (
        run.nbytes,
        np.asarray(run.latency, dtype=np.float64),
        run.send_slot,
        run.recv_slot,
        run.slot_ptr,
        run.slot_member,
        run.slot_rank,
        run.rank_first_slot,
        run.rank_stop_slot,
        np.asarray(run.start_at, dtype=np.float64),
        np.asarray(run.delay, dtype=np.float64),
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
    summable = summable_links(run.pair_link, run.pair_weight, run.link_capacity.size)
    _events(route, program, out, stats, report_every, summable)
