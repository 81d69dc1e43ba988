"""The per-event core of :mod:`allreduce.sim._event`, compiled with numba (the optional ``fast`` extra).

The same model and events as ``_Run``: one queue of events ordered by (time, counter) (sim/_kernel_heap.py),
events due within _EVENT_RTOL of the earliest processed together, then one re-solve of the max-min fair rates,
replayed lazily from the changed links outwards where they can have changed (sim/_kernel_levels.py), not over
the whole component of transfers sharing links with them as ``_Run`` does. Flows and links are arrays, not
objects: the draining transfers on a link are an intrusive linked list in insertion order (the order of
``_Run``'s dicts), and a transfer whose rate changed has its drain event moved. The rates are the same max-min
fair rates as ``_Run``'s, to rounding (sums in other orders): results agree with it to 1e-9 relative, except
where rounding-sized changes move a run by more (benchmarks/bench_engines.py --against --rtol).

The compiled code allocates nothing and takes no references (sim/_jit.py): :func:`run_kernel` makes every
array up front, sized by the most transfers that can be in flight at once (each rank's largest step), and
calls :func:`_advance` until the run is over, growing the queue and reporting progress between calls.

:func:`available` (sim/_jit.py) says whether the kernel can run: numba is importable and the environment
variable ``ALLREDUCE_SIM_KERNEL`` is not ``numpy`` (which forces the pure numpy/Python cores).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.sim._jit import KERNEL_ENV, available, inline, njit
from allreduce.sim._kernel_heap import DELIVER, DRAIN, START, grow, pop, push, seeded, sort_ids
from allreduce.sim._kernel_levels import resolve_alone, resolve_fill, solve_scratch

__all__ = ["KERNEL_ENV", "available", "run_kernel"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

# The same tolerances as the per-event core (sim/_event.py) and sim/_fair.py.
_EVENT_RTOL = 1e-12
_LEVEL_RTOL = 1e-9
# How many deliveries between two calls of the progress callback (as the per-event core).
_PROGRESS_EVERY = 4096

# What _advance returns: the run is over; the queue needs room; a progress report is due; more transfers drain at
# once than blocks were made for (a broken bound: the run stops rather than write past them).
_DONE, _GROW, _REPORT, _FULL = 0, 1, 2, 3


@inline
def _mark(link: int, stamp: int, changed_mark: Any, changed: Any, num_changed: int) -> int:
    """Add ``link`` to this instant's changed links (once); returns how many there are."""
    if changed_mark[link] == stamp:
        return num_changed
    changed_mark[link] = stamp
    changed[num_changed] = link
    return num_changed + 1


@njit
def _advance(route: Any, program: Any, out: Any, work: Any, heap_t: Any, heap_k: Any, state: Any) -> int:  # noqa: PLR0917
    """Run instants until the queue is empty (returns _DONE), it may not have room for the next instant's
    events (_GROW: the caller grows it and calls again) or a progress report is due (_REPORT). ``route``:
    pair per transfer, pair_ptr, pair_link, pair_weight, link capacity; ``program``: fraction of the buffer
    per transfer, bytes in the buffer, latency per pair, extra delay per transfer (none: empty), its send
    and receive slots, slot_ptr, slot_member, slot_rank, per rank its stop slot and delay; ``out``: the
    arrays a run fills in; ``work``: the run's state (:func:`_work`); ``state``: the counts carried from call
    to call (_SIZE ...)."""
    pair, pair_ptr, pair_link, pair_weight, capacity = route
    fraction, size_bytes, pair_latency, extra, send_slot, recv_slot, slot_ptr, slot_member, slot_rank = program[:9]
    rank_stop_slot, delay = program[9:]
    has_extra = extra.size > 0
    slot_start, slot_end, slot_last, trigger, start_s, drained_s, delivered_s, rank_end, slowest, bottleneck = out
    pending, ready, holder, blocks, lists, node_prev, per_link, per_flow, solver, stats = work
    rate, left, since, version, free = blocks
    head, node_x, node_w, node_next, shift = lists
    tail, changed, changed_mark = per_link
    started, members, sort_stack = per_flow
    net = (pair, pair_ptr, pair_link, capacity, head, node_x, node_w, node_next, shift, rate)
    blocks_i, new_rate, play_list = solver[3], solver[4], solver[5]
    size, counter, delivered, stamp, num_free = state[0], state[1], state[2], state[3], state[4]
    next_report, need = state[5], state[6]
    num_changed = 0
    num_started = 0

    while size:
        if size + need > heap_t.size or delivered >= next_report:
            break
        now = heap_t[0]
        horizon = now * (1 + _EVENT_RTOL)
        while size and heap_t[0] <= horizon:
            kind = heap_k[1] & 3
            what = heap_k[1] >> 2
            ver = heap_k[2]
            size = pop(heap_t, heap_k, size)
            if kind == START:
                slot = what
                slot_start[slot] = now
                for m in range(slot_ptr[slot], slot_ptr[slot + 1]):
                    x = slot_member[m]
                    ready[x] += 1
                    if ready[x] != 2:
                        continue
                    trigger[x] = slot
                    start_s[x] = now
                    p = pair[x]
                    nbytes = fraction[x] * size_bytes
                    if nbytes <= 0 or pair_ptr[p + 1] == pair_ptr[p]:
                        drained_s[x] = now
                        latency = pair_latency[p] + extra[x] if has_extra else pair_latency[p]
                        size = push(heap_t, heap_k, size, now + latency, counter, x * 4 + DELIVER, 0)
                        counter += 1
                        continue
                    if num_free == 0:
                        return _FULL
                    num_free -= 1
                    block = free[num_free]
                    holder[x] = block
                    left[block] = nbytes
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
                    started[num_started] = block
                    num_started += 1
            elif kind == DELIVER:
                x = what
                delivered_s[x] = now
                delivered += 1
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
                        size = push(heap_t, heap_k, size, after, counter, (slot + 1) * 4 + START, 0)
                        counter += 1
                    else:
                        rank_end[rank] = after
            elif ver == version[what]:
                block = what
                x = node_x[block << shift]
                drained_s[x] = now
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
                latency = pair_latency[p] + extra[x] if has_extra else pair_latency[p]
                size = push(heap_t, heap_k, size, now + latency, counter, x * 4 + DELIVER, 0)
                counter += 1
        if not num_changed:
            continue

        # One re-solve for every transfer that came and went at this instant: the blocks in play, the ones
        # whose rate changed listed in transfer order (the order their drain events are pushed in).
        num = resolve_alone(started, num_started, changed, num_changed, net, solver)
        if num < 0:
            num = resolve_fill(started, num_started, changed, num_changed, stamp, net, solver)
        num_moved = 0
        for k in range(num):
            block = play_list[k]
            if new_rate[block] != rate[block]:
                members[num_moved] = node_x[block << shift]
                num_moved += 1
        sort_ids(members, num_moved, sort_stack)
        stats[0] += 1
        stats[1] += num
        stats[2] += num_moved
        for i in range(num_moved):
            x = members[i]
            block = holder[x]
            r = new_rate[block]
            old = rate[block]
            left[block] -= old * (now - since[block])
            since[block] = now
            rate[block] = r
            if r < slowest[x]:
                # Rates within _LEVEL_RTOL are one level: rounding must not move the bottleneck named.
                if r < slowest[x] * (1 - _LEVEL_RTOL):
                    bottleneck[x] = blocks_i[2, block]
                slowest[x] = r
            when = now + max(left[block], 0.0) / r
            version[block] += 1
            size = push(heap_t, heap_k, size, when, counter, block * 4 + DRAIN, version[block])
            counter += 1
        num_changed = 0
        num_started = 0
        stamp += 1

    state[0], state[1], state[2], state[3], state[4] = size, counter, delivered, stamp, num_free
    if not size:
        return _DONE
    return _REPORT if delivered >= next_report else _GROW


def run_kernel(run: Any, progress: Callable[[float], None] | None = None) -> None:
    """Run a :class:`allreduce.sim._layout.Layout` to the end with the compiled kernel, filling in its arrays
    (``slowest_rate`` and ``bottleneck`` as ``_Run.run`` leaves them). ``progress`` (if given) is called with
    the fraction of transfers delivered, every _PROGRESS_EVERY deliveries."""
    # The kernel writes the slowest rates and the bottlenecks (dense link numbers, then mapped) in place.
    slowest = run.slowest_rate
    slowest.fill(np.inf)
    dense = run.bottleneck
    dense.fill(-1)
    # Rate solves, transfers in play, rates changed, level groups filled, link-list nodes visited.
    stats = np.zeros(5, dtype=np.int64)
    route = (run.pair, run.pair_ptr, run.pair_link, run.pair_weight, run.link_capacity)
    # As the layout holds them (32-bit where it can): a conversion would copy arrays of millions of entries.
    program = (
        np.asarray(run.t.fraction, dtype=np.float64),
        float(run.size_bytes),
        np.asarray(run.pair_latency, dtype=np.float64),
        np.zeros(0) if run.extra_s is None else np.asarray(run.extra_s, dtype=np.float64),
        run.send_slot,
        run.recv_slot,
        run.slot_ptr,
        run.slot_member,
        run.slot_rank,
        run.rank_stop_slot,
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
    in_flight = _in_flight_bound(run)
    work = _work(run, in_flight, stats)
    # Each rank with steps begins its first at its start; the rest end where they start.
    first, stop = run.rank_first_slot, run.rank_stop_slot
    start_at = np.asarray(run.start_at, dtype=np.float64)
    active = np.flatnonzero(first < stop)
    idle = first >= stop
    run.rank_end[idle] = start_at[idle]
    # Room for what one instant can add: a start per rank, and per transfer in flight its drain or delivery
    # and a new drain event (the old one goes stale).
    need = run.schedule.world_size + 2 * in_flight + 1
    heap_t, heap_k = seeded(start_at[active], first[active].astype(np.int64) * 4 + START, 2 * need)
    every = _PROGRESS_EVERY if progress is not None else 0
    # size, counter, delivered, stamp, free blocks, deliveries at the next report, room an instant needs
    state = np.array([active.size, active.size, 0, 1, in_flight, every or 2**62, need], dtype=np.int64)
    total = len(run.t)
    while True:
        status = _advance(route, program, out, work, heap_t, heap_k, state)
        while every and state[2] >= state[5]:
            assert progress is not None
            progress(int(state[5]) / total)
            state[5] += every
        if status == _DONE:
            break
        if status == _FULL:
            raise RuntimeError(f"{run.schedule.name}: more than {in_flight} transfers in flight at once")
        if status == _GROW:
            heap_t, heap_k = grow(heap_t, heap_k, int(state[0]), int(need))
    counters = work[8][-1]
    stats[3], stats[4] = counters[3], counters[4]
    run.kernel_stats = stats
    found = dense >= 0
    dense[found] = run.used_links[dense[found]]


def _in_flight_bound(run: Any) -> int:
    """At most how many transfers are in flight (started, not delivered) at once: each is in the step its
    sender is in, which lasts until all of that step's transfers are delivered, so at most each rank's largest
    step's transfers."""
    sizes = np.diff(run.slot_ptr)
    first, stop = run.rank_first_slot, run.rank_stop_slot
    active = first < stop
    if not active.any():
        return 1
    largest = np.maximum.reduceat(sizes, first[active])
    # reduceat runs each rank's slots up to the next active rank's first: exactly its own (ranks' slots are
    # consecutive, and a rank without steps has none).
    return int(min(int(largest.sum()), len(run.t))) + 1


def _work(run: Any, in_flight: int, stats: Any) -> tuple[Any, ...]:
    """The arrays the kernel keeps its state in, all made here (the compiled code allocates nothing)."""
    num_links = run.link_capacity.size
    hops = max(int(run.pair_len.max()) if run.pair_len.size else 1, 1)
    shift = 0  # a block's nodes are 2^shift >= hops apart: a node's block is a shift away, not a division
    while (1 << shift) < hops:
        shift += 1
    blocks = in_flight
    nodes = blocks << shift
    # A draining transfer holds a block: its state and hops nodes, one per link of its path, each in its link's
    # list of nodes in insertion order. Per transfer only the block is kept: a run holds millions.
    block_state = (
        np.zeros(blocks),  # rate
        np.zeros(blocks),  # left: bytes still to drain at time since
        np.zeros(blocks),  # since
        np.zeros(blocks, dtype=np.int64),  # version: drain events of older versions are stale
        np.arange(blocks - 1, -1, -1, dtype=np.int64),  # free blocks, the next at the end
    )
    lists = (
        np.full(num_links, -1, dtype=np.int64),  # head
        np.empty(nodes, dtype=np.int64),  # node_x
        np.empty(nodes),  # node_w
        np.empty(nodes, dtype=np.int64),  # node_next
        shift,
    )
    per_link = (
        np.full(num_links, -1, dtype=np.int64),  # tail
        np.empty(num_links, dtype=np.int64),  # changed: the links changed at this instant
        np.zeros(num_links, dtype=np.int64),  # changed_mark: the instant that last changed the link
    )
    per_flow = (
        np.empty(blocks, dtype=np.int64),  # started: blocks that began draining at this instant
        np.empty(blocks, dtype=np.int64),  # members: transfers whose rate changed
        np.empty(128, dtype=np.int64),  # sort_stack: the parts a sort of those transfers has waiting
    )
    return (
        np.diff(run.slot_ptr).astype(np.int32),  # pending: transfers per slot not delivered yet
        np.zeros(len(run.t), dtype=np.int8),  # ready: how many of a transfer's two slots have begun
        np.full(len(run.t), -1, dtype=np.int32),  # holder: the block of a draining transfer
        block_state,
        lists,
        np.empty(nodes, dtype=np.int64),  # node_prev
        per_link,
        per_flow,
        solve_scratch(num_links, blocks, hops),
        stats,
    )
