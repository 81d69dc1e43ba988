"""The per-event core of :mod:`allreduce.sim._event`, compiled with numba (the optional ``fast`` extra).

The same model and events as ``_Run``: one queue of events ordered by (time, counter) (sim/_kernel_heap.py: a
heap, and first-in first-out lanes for the deliveries and starts due a fixed time after the instant that
schedules them, which pop in the same order), events due within _EVENT_RTOL of the earliest processed
together, then one re-solve of the max-min fair rates, replayed lazily from the changed links outwards where
they can have changed (sim/_kernel_levels.py), not over the whole component of transfers sharing links with
them as ``_Run`` does. Flows and links are arrays, not
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
from allreduce.sim._kernel_ahead import look_ahead
from allreduce.sim._kernel_heap import (
    DELIVER,
    DRAIN,
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
from allreduce.sim._kernel_levels import alone_unlinked, resolve_alone, resolve_fill, resolve_solo, solve_scratch

__all__ = ["DONE", "KERNEL_ENV", "MORE", "UNKNOWN", "Queue", "available", "make_work", "run_kernel", "whole"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

# The same tolerances as the per-event core (sim/_event.py) and sim/_fair.py.
_EVENT_RTOL = 1e-12
_LEVEL_RTOL = 1e-9
# How many deliveries between two calls of the progress callback (as the per-event core).
_PROGRESS_EVERY = 4096

# What _advance returns: the run is over; the queue needs room; a progress report is due; more transfers drain at
# once than blocks were made for (a broken bound: the run stops rather than write past them); a streamed layout
# must lay out more steps.
_DONE, _GROW, _REPORT, _FULL, _MORE = 0, 1, 2, 3, 4
# A streamed slot's successor that is not laid out yet.
_UNKNOWN = -2
# Where the earliest event is: not looked for since the queue last changed.
_UNSEEN = -3


@inline
def _ends_unknown(x: int, send_slot: Any, recv_slot: Any, pending: Any, succ: Any, masks: Any) -> bool:  # noqa: PLR0917
    """Whether delivering transfer ``x`` ends a slot whose successor is not laid out yet."""
    xi = x & masks[0]
    send, recv = send_slot[xi], recv_slot[xi]
    if send == recv:
        si = send & masks[1]
        return bool(pending[si] == 2 and succ[si] == _UNKNOWN)
    si, ri = send & masks[1], recv & masks[1]
    return bool((pending[si] == 1 and succ[si] == _UNKNOWN) or (pending[ri] == 1 and succ[ri] == _UNKNOWN))


@inline
def _mark(link: int, stamp: int, changed_mark: Any, changed: Any, num_changed: int) -> int:
    """Add ``link`` to this instant's changed links (once); returns how many there are."""
    if changed_mark[link] == stamp:
        return num_changed
    changed_mark[link] = stamp
    changed[num_changed] = link
    return num_changed + 1


@inline
def _link(block: int, lists: Any, tail: Any, node_prev: Any, block_pair: Any, pair_ptr: Any, pair_link: Any) -> None:  # noqa: PLR0917
    """Append block ``block``'s nodes (one per link of its path, ``node_x``/``node_w`` written) to its links'
    lists; a list held by it alone (``head`` -2 - block, resolve_solo) holds it as its one node."""
    head, _, _, node_next, shift = lists
    p = block_pair[block]
    for h in range(pair_ptr[p + 1] - pair_ptr[p]):
        link = pair_link[pair_ptr[p] + h]
        node = (block << shift) + h
        node_next[node] = -1
        if head[link] < 0:
            head[link] = node
            node_prev[node] = -1
        else:
            node_prev[node] = tail[link]
            node_next[tail[link]] = node
        tail[link] = node


@inline
def _deliver_later(  # noqa: PLR0917
    x: int, p: int, now: float, counter: int, size: int, extra: Any, pair_lane: Any, pair_latency: Any, queues: Any
) -> int:
    """Queue transfer ``x``'s delivery, its pair ``p``'s latency (and its extra delay) after ``now``: on its
    pair's lane where it has one and no extra delay, else on the heap; returns the heap's size."""
    heap_t, heap_k, lane_t, lane_k, lane_pos = queues
    lane = pair_lane[p] if extra.size == 0 or extra[x] == 0 else -1
    if lane >= 0:
        lane_push(lane_t, lane_k, lane_pos, lane, now + pair_latency[p], counter, x * 4 + DELIVER)
        return size
    latency = pair_latency[p] + extra[x] if extra.size > 0 else pair_latency[p]
    grown: int = push(heap_t, heap_k, size, now + latency, counter, x * 4 + DELIVER, 0)
    return grown


@njit
def _advance(route: Any, program: Any, out: Any, work: Any, queue: Any, state: Any, ahead_on: Any) -> int:  # noqa: PLR0917
    """Run instants until the queue is empty (returns _DONE), it may not have room for the next instant's
    events (_GROW: the caller grows it and calls again), a progress report is due (_REPORT) or, on a streamed
    layout, a slot is about to end whose rank's next slot is not laid out yet (_MORE: the caller lays out more
    steps and calls again; the instant resumes where it stopped). ``route``: pair per transfer, pair_ptr,
    pair_link, pair_weight, link capacity; ``program``: fraction of the buffer per transfer, bytes in the
    buffer, latency per pair, extra delay per transfer (none: empty), its send and receive slots, per slot its
    first and stop member positions, slot_member, slot_rank, per rank its stop slot and delay, then the
    streamed layout's (:func:`streamed`; empty where the layout is whole); ``out``: the arrays a run fills in;
    ``work``: the run's state (:func:`_work`); ``queue``: the heap's times and keys, the lanes' times, keys and
    positions, the lane of each pair's deliveries and each rank's starts (sim/_kernel_heap.py); ``state``: the
    counts carried from call to call (_SIZE ...)."""
    pair, pair_ptr, pair_link, pair_weight, _ = route
    heap_t, heap_k, lane_t, lane_k, lane_pos, pair_lane, rank_lane = queue
    queues = (heap_t, heap_k, lane_t, lane_k, lane_pos)
    lane_mask = lane_t.shape[1] - 1
    fraction, size_bytes, pair_latency, extra, send_slot, recv_slot, slot_m0, slot_m1, slot_member = program[:9]
    slot_rank, rank_stop_slot, delay, masks, succ, pred, parent, slot_step, step_open, clock = program[9:]
    # A streamed layout keeps transfers, slots and members in ring buffers (indexed by id & mask), numbers slots
    # step by step, and names each slot's successor (succ: -1 none, _UNKNOWN not laid out yet).
    streamed = succ.size > 0
    tmask, smask, mmask, stmask = masks[0], masks[1], masks[2], masks[3]
    slot_start, slot_end, slot_last, trigger, start_s, drained_s, delivered_s, rank_end, slowest, bottleneck = out
    pending, ready, holder, blocks, lists, node_prev, per_link, per_flow, solver, stats = work
    rate, left, since, version, free, block_pair = blocks
    head, node_x, node_w, node_next, shift = lists
    tail, changed, changed_mark, capacity = per_link
    started, members, sort_stack = per_flow
    net = (block_pair, pair_ptr, pair_link, capacity, head, node_x, node_w, node_next, shift, rate)
    ahead = (
        send_slot,
        recv_slot,
        delivered_s,
        pending,
        slot_end,
        succ,
        slot_m0,
        slot_m1,
        slot_member,
        ready,
        slot_start,
        start_s,
        slot_rank,
        rank_stop_slot,
        masks,
    )
    ahead_route = (pair_ptr, pair_link, pair_weight, tail)
    blocks_i, new_rate, play_list = solver[3], solver[4], solver[5]
    size, counter, delivered, stamp, num_free = state[0], state[1], state[2], state[3], state[4]
    next_report, need = state[5], state[6]
    # An instant a _MORE interrupted resumes with its changed links and started transfers.
    resume = state[7] == 1
    num_changed = state[8]
    num_started = state[9]

    # Where the earliest event is (sim/_kernel_heap.earliest; _UNSEEN: not looked for since the queue changed).
    source = _UNSEEN
    while True:
        if resume:
            now = clock[0]
            resume = False
            state[7] = 0
        else:
            if source == _UNSEEN:
                source = earliest(heap_t, heap_k, size, lane_t, lane_k, lane_pos)
            if source == -2 or size + need > heap_t.size or delivered >= next_report:
                break
            now = heap_t[0] if source < 0 else lane_t[source, lane_pos[2 * source] & lane_mask]
        horizon = now * (1 + _EVENT_RTOL)
        while True:
            if source == _UNSEEN:
                source = earliest(heap_t, heap_k, size, lane_t, lane_k, lane_pos)
            if source == -2:
                break
            if source < 0:
                if heap_t[0] > horizon:
                    break
                item, ver = heap_k[1], heap_k[2]
            else:
                i = lane_pos[2 * source] & lane_mask
                if lane_t[source, i] > horizon:
                    break
                item, ver = lane_k[source, 2 * i + 1], 0
            kind = item & 3
            what = item >> 2
            if streamed and kind == DELIVER and _ends_unknown(what, send_slot, recv_slot, pending, succ, masks):
                clock[0] = now
                state[0], state[1], state[2], state[3], state[4] = size, counter, delivered, stamp, num_free
                state[7], state[8], state[9] = 1, num_changed, num_started
                return _MORE
            if source < 0:
                size = pop(heap_t, heap_k, size)
            else:
                lane_pos[2 * source] += 1
                if ahead_on is not None:  # noqa: SIM102 (numba prunes a lone `is None` test: None compiles it out)
                    if kind == DELIVER:
                        look_ahead(source, lane_k, lane_pos, ahead, pair, ahead_route)
            source = _UNSEEN
            if kind == START:
                slot = what
                si = slot & smask
                slot_start[si] = now
                for m in range(slot_m0[si], slot_m1[si]):
                    x = slot_member[m & mmask]
                    xi = x & tmask
                    ready[xi] += 1
                    if ready[xi] != 2:
                        continue
                    trigger[xi] = slot
                    start_s[xi] = now
                    p = pair[xi]
                    nbytes = fraction[xi] * size_bytes
                    if nbytes <= 0 or pair_ptr[p + 1] == pair_ptr[p]:
                        drained_s[xi] = now
                        size = _deliver_later(x, p, now, counter, size, extra, pair_lane, pair_latency, queues)
                        counter += 1
                        continue
                    if num_free == 0:
                        return _FULL
                    num_free -= 1
                    block = free[num_free]
                    holder[xi] = block
                    block_pair[block] = p
                    left[block] = nbytes
                    since[block] = now
                    rate[block] = 0.0
                    # Linked into its links' lists at the end of the instant (_link), unless it is alone there.
                    for h in range(pair_ptr[p + 1] - pair_ptr[p]):
                        e = pair_ptr[p] + h
                        link = pair_link[e]
                        node = (block << shift) + h
                        node_x[node] = x
                        node_w[node] = pair_weight[e]
                        if head[link] <= -2:  # a transfer alone there so far: now in the list
                            _link(-2 - head[link], lists, tail, node_prev, block_pair, pair_ptr, pair_link)
                        num_changed = _mark(link, stamp, changed_mark, changed, num_changed)
                    started[num_started] = block
                    num_started += 1
            elif kind == DELIVER:
                x = what
                xi = x & tmask
                delivered_s[xi] = now
                delivered += 1
                send, recv = send_slot[xi], recv_slot[xi]
                if streamed:
                    step_open[slot_step[send & smask] & stmask] -= 1
                for slot in (send, recv):
                    if slot == recv and send == recv:
                        break
                    si = slot & smask
                    pending[si] -= 2 if send == recv else 1
                    if pending[si] != 0:
                        continue
                    slot_end[si] = now
                    slot_last[si] = x
                    rank = slot_rank[si]
                    after = now + delay[rank]
                    if streamed:
                        # The critical path's link: the slot before the one whose start let x begin.
                        parent[si] = pred[trigger[xi] & smask]
                        step_open[slot_step[si] & stmask] -= 1
                        following = succ[si]
                    else:
                        following = slot + 1 if slot + 1 < rank_stop_slot[rank] else -1
                    if following >= 0:
                        if rank_lane[rank] >= 0:
                            lane_push(lane_t, lane_k, lane_pos, rank_lane[rank], after, counter, following * 4 + START)
                        else:
                            size = push(heap_t, heap_k, size, after, counter, following * 4 + START, 0)
                        counter += 1
                    else:
                        rank_end[rank] = after
            elif ver == version[what]:
                block = what
                x = node_x[block << shift]
                xi = x & tmask
                drained_s[xi] = now
                rate[block] = 0.0
                left[block] = 0.0
                p = block_pair[block]  # pair[xi], from the block (in the cache) rather than the transfer
                holder[xi] = -1
                if head[pair_link[pair_ptr[p]]] == -2 - block:
                    # Alone on its links (resolve_solo): they are empty now, and no other rate changes.
                    for h in range(pair_ptr[p + 1] - pair_ptr[p]):
                        head[pair_link[pair_ptr[p] + h]] = -1
                else:
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
                size = _deliver_later(x, p, now, counter, size, extra, pair_lane, pair_latency, queues)
                counter += 1
        if not num_changed:
            continue

        # One re-solve for every transfer that came and went at this instant: the blocks in play, the ones
        # whose rate changed listed in transfer order (the order their drain events are pushed in).
        if num_started == 1 and alone_unlinked(started[0], changed, num_changed, net):
            num = resolve_solo(started[0], changed, num_changed, net, solver)
        else:
            for i in range(num_started):
                _link(started[i], lists, tail, node_prev, block_pair, pair_ptr, pair_link)
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
            xi = x & tmask
            block = holder[xi]
            r = new_rate[block]
            old = rate[block]
            left[block] -= old * (now - since[block])
            since[block] = now
            rate[block] = r
            if r < slowest[xi]:
                # Rates within _LEVEL_RTOL are one level: rounding must not move the bottleneck named.
                if r < slowest[xi] * (1 - _LEVEL_RTOL):
                    bottleneck[xi] = blocks_i[2, block]
                slowest[xi] = r
            when = now + max(left[block], 0.0) / r
            version[block] += 1
            size = push(heap_t, heap_k, size, when, counter, block * 4 + DRAIN, version[block])
            counter += 1
        num_changed = 0
        num_started = 0
        stamp += 1
        source = _UNSEEN

    state[0], state[1], state[2], state[3], state[4] = size, counter, delivered, stamp, num_free
    state[8], state[9] = 0, 0
    if earliest(heap_t, heap_k, size, lane_t, lane_k, lane_pos) == -2:
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
        run.slot_ptr[:-1],
        run.slot_ptr[1:],
        run.slot_member,
        run.slot_rank,
        run.rank_stop_slot,
        np.asarray(run.delay, dtype=np.float64),
        *whole(),
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
    pending = np.diff(run.slot_ptr).astype(np.int32)  # transfers per slot not delivered yet
    work = make_work(run.link_capacity, run.pair_len, in_flight, (pending, len(run.t)), stats)
    # Each rank with steps begins its first at its start; the rest end where they start.
    first, stop = run.rank_first_slot, run.rank_stop_slot
    start_at = np.asarray(run.start_at, dtype=np.float64)
    active = np.flatnonzero(first < stop)
    idle = first >= stop
    run.rank_end[idle] = start_at[idle]
    queue = Queue(
        run.schedule.world_size,
        in_flight,
        start_at[active],
        first[active].astype(np.int64),
        progress,
        constants=(program[2], program[11]),
    )
    while queue.step(route, program, out, work, len(run.t)) != _DONE:
        pass
    _check_full(queue, run.schedule.name, in_flight)
    counters = work[8][-1]
    stats[3], stats[4] = counters[3], counters[4]
    run.kernel_stats = stats
    found = dense >= 0
    dense[found] = run.used_links[dense[found]]


def whole() -> tuple[Any, ...]:
    """The streamed layout's part of ``program`` for a whole layout: no masks, nothing streamed."""
    none = np.zeros(0, dtype=np.int64)
    return (np.full(4, -1, dtype=np.int64), none, none, none, np.zeros(0, dtype=np.int32), none, np.zeros(1))


# What a streamed run's driver (sim/_stream.py) reads of the kernel's statuses and marks.
DONE, MORE, UNKNOWN = _DONE, _MORE, _UNKNOWN


class Queue:
    """The event queue of one run and the counts the kernel carries from call to call."""

    def __init__(
        self,
        world_size: int,
        in_flight: int,
        start_at: FloatArray,
        first_slot: IntArray,
        progress: Callable[[float], None] | None,
        *,
        constants: tuple[FloatArray, FloatArray],
        look_ahead: bool = False,
    ) -> None:
        """``constants``: the latency per pair and the delay per rank (what the lanes are made for); ``look_ahead``:
        the kernel prefetches for the deliveries behind each one (sim/_kernel_ahead.py; for streamed layouts, whose
        buffers outgrow the caches: on a whole layout it gained nothing measured and compiling it costs a third
        more time)."""
        # None compiles the kernel without the look-ahead (numba prunes the branch on an argument that is None).
        self.ahead_on = np.zeros(1) if look_ahead else None
        # Room for what one instant can add: a start per rank, and per transfer in flight its drain or delivery
        # and a new drain event (the old one goes stale).
        self.need = world_size + 2 * in_flight + 1
        self.times, self.keys = seeded(start_at, first_slot * 4 + START, 2 * self.need)
        # A lane holds at most a start per rank (a rank's next step starts once its step before ended) and a
        # delivery per transfer in flight.
        self.lanes = lanes(*constants, world_size + in_flight + 1)
        self.progress = progress
        self.every = _PROGRESS_EVERY if progress is not None else 0
        # size, counter, delivered, stamp, free blocks, deliveries at the next report, room an instant needs,
        # an instant interrupted (_MORE), its changed links and started transfers so far
        count = start_at.size
        self.state = np.array([count, count, 0, 1, in_flight, self.every or 2**62, self.need, 0, 0, 0], dtype=np.int64)
        self.status = _GROW

    def step(self, route: Any, program: Any, out: Any, work: Any, total: int) -> int:
        """One call of the kernel, then what its status asks for (room, a report); returns the status."""
        queue = (self.times, self.keys, *self.lanes)
        self.status = status = _advance(route, program, out, work, queue, self.state, self.ahead_on)
        state = self.state
        while self.every and state[2] >= state[5]:
            assert self.progress is not None
            self.progress(int(state[5]) / max(total, 1))
            state[5] += self.every
        if status == _GROW:
            self.times, self.keys = grow(self.times, self.keys, int(state[0]), int(self.need))
        if status == _FULL:
            return _DONE
        return int(status)


def _check_full(queue: Queue, name: str, in_flight: int) -> None:
    if queue.status == _FULL:
        raise RuntimeError(f"{name}: more than {in_flight} transfers in flight at once")


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


def link_records(capacity: FloatArray) -> tuple[Any, ...]:
    """Per link its list's head and tail, the instant that last changed it, its capacity (a copy of
    ``capacity``) and the re-solve's rows (sim/_kernel_levels.py: 4 int, 3 float), as views of one record of 128
    bytes a link, aligned to cache lines: the first line holds what a transfer starting or draining reads and
    writes of each link on its path, and what a re-solve of a transfer alone on its links reads (the level and
    the group that filled it); the second the rest of the re-solve's rows. One line a link where separate
    arrays took six: at 16,384 ranks the links' arrays outgrow the caches."""
    num_links = capacity.size
    raw = np.empty(num_links * 128 + 64, dtype=np.uint8)
    at = -raw.ctypes.data % 64
    ints = raw[at : at + num_links * 128].view(np.int64).reshape(num_links, 16)
    floats = ints.view(np.float64)
    ints[:, :3] = -1  # head, tail; the changed mark (instants are numbered from 1)
    floats[:, 3] = capacity
    # Columns 4-6: the float rows (level, room, demand); 7-10: the int rows (filled first: in the first line).
    return ints[:, 0], ints[:, 1], ints[:, 2], floats[:, 3], (ints[:, 7:11].T, floats[:, 4:7].T)


def make_work(
    capacity: FloatArray, pair_len: IntArray, in_flight: int, per_transfer: tuple[Any, int], stats: Any
) -> tuple[Any, ...]:
    """The arrays the kernel keeps its state in, all made here (the compiled code allocates nothing) but the
    per-slot count of transfers not delivered yet and the room for transfers (``per_transfer``); ``capacity``:
    per link."""
    pending, transfers = per_transfer
    num_links = capacity.size
    head, tail, changed_mark, link_capacity, rows = link_records(np.asarray(capacity, dtype=np.float64))
    hops = max(int(pair_len.max()) if pair_len.size else 1, 1)
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
        np.zeros(blocks, dtype=np.int64),  # the pair of the transfer draining in it
    )
    lists = (
        head,
        np.empty(nodes, dtype=np.int64),  # node_x
        np.empty(nodes),  # node_w
        np.empty(nodes, dtype=np.int64),  # node_next
        shift,
    )
    per_link = (
        tail,
        np.empty(num_links, dtype=np.int64),  # changed: the links changed at this instant
        changed_mark,  # the instant that last changed the link
        link_capacity,
    )
    per_flow = (
        np.empty(blocks, dtype=np.int64),  # started: blocks that began draining at this instant
        np.empty(blocks, dtype=np.int64),  # members: transfers whose rate changed
        np.empty(128, dtype=np.int64),  # sort_stack: the parts a sort of those transfers has waiting
    )
    return (
        pending,
        np.zeros(transfers, dtype=np.int8),  # ready: how many of a transfer's two slots have begun
        np.full(transfers, -1, dtype=np.int32),  # holder: the block of a draining transfer
        block_state,
        lists,
        np.empty(nodes, dtype=np.int64),  # node_prev
        per_link,
        per_flow,
        solve_scratch(num_links, blocks, hops, rows),
        stats,
    )
