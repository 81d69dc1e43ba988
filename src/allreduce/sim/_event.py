"""The event-driven engine: per-rank programs, flows that share links max-min fairly as they come and go.

The model, stated once:

- every rank runs its program's steps in order; a step's transfers are concurrent; a transfer starts when both
  its sender and its receiver have begun that step (the k-th send from a to b meets the k-th receive at b from
  a), so a slow link or a slow rank delays exactly what depends on it;
- a started transfer drains its bytes at its max-min fair rate among all transfers draining at that moment —
  rates are recomputed whenever a transfer starts or finishes draining — and is delivered its path latency
  after its last byte left;
- a rank's step ends when its last transfer of the step is delivered; a slow rank then waits its delay before
  its next step (the same ``rank_seconds`` the fast engine feeds the shared recurrence).

The engine core is one heap of (time, counter, event) — the counter makes equal-time events pop in the order
they were pushed, so runs are deterministic — plus the fluid drain of the active transfers between events.
Events due at the same instant are processed together and the rates re-solved once, and only for the
transfers connected to a changed link through shared links: max-min fair rates decompose over the connected
components of the transfer-link incidence. Within a component, progressive filling runs exactly as before the
change up to the lowest old rate of a transfer that drained and up to the level at which a link on a new
transfer's path fills: the transfers frozen below that level keep their rates and only take capacity, so only
the rest is re-solved, on the capacity they leave, found by a search from the changed links that does not pass
through the frozen ones. That is exact in mathematics, not bit for bit (summation order differs). A transfer
whose rate changed gets a new drain event; its old one goes stale (a version counter). The core is plain
Python over sets and dicts, since each event touches a handful of transfers; ``docs/design.md`` ("The event
engine's incremental re-solve") has the measurements behind these choices.

:func:`run_core` runs this per-event core compiled (:mod:`allreduce.sim._kernel`, numba: the ``fast`` extra)
where numba is installed; without it, the windowed core (:mod:`allreduce.sim._window`: many transfers per
numpy pass, exact by lookahead) wherever every transfer has a latency. This Python per-event core is the
reference both are tested against, the fallback without lookahead, and what the tail's re-runs use without
numba. The event engine
checks the fast engine (see :mod:`allreduce.sim._fast` for where and why the two differ), and engine="auto"
uses it where the fast engine cannot certify its result.

The critical path is found by walking back from the rank that finished last: the transfer that ended its last
step, the rank whose arrival started that transfer, that rank's previous step, and so on to time zero.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.schedules import Schedule
from allreduce.sim._fair import fill_dense
from allreduce.sim._jit import ready as kernel_ready
from allreduce.sim._layout import ChainRecords, Layout, Problem, Transfers, match_transfers
from allreduce.sim._result import CriticalStep, PhaseResult, SimResult
from allreduce.sim._routing import Router
from allreduce.sim._summary import summarize_bottlenecks
from allreduce.sim._window import WindowRun

__all__ = ["STREAM_TRANSFERS", "Transfers", "match_transfers", "run_core", "run_event"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

_START = 0  # a rank begins its next step
_DELIVER = 1  # a transfer's last byte arrived
_DRAIN = 2  # a transfer's last byte left (stale unless its version is current: its rate changed since)
# How many deliveries between two calls of run()'s progress callback.
_PROGRESS_EVERY = 4096
# Events within this relative distance of the current time are processed with it.
_EVENT_RTOL = 1e-12
# Components with more draining transfers than this are re-solved with numpy (sim/_fair.py), smaller ones
# over dicts: below it numpy's fixed cost per call loses.
_NUMPY_MIN_FLOWS = 16
# Links whose fill levels agree to this relative tolerance saturate together (as in sim/_fair.py).
_LEVEL_RTOL = 1e-9
# Schedules of more transfers than this run on a streamed layout where numba is installed (sim/_stream.py): a whole
# layout holds about 136 bytes a transfer.
STREAM_TRANSFERS = 1 << 22


class _Run(Layout):
    """One event-driven simulation: the state that changes as time advances.

    ``local = False`` re-solves the rates of every draining transfer at every change, not only those of the
    changed transfers' component (the reference the local re-solve is tested against); components of more than
    ``numpy_min_flows`` transfers are solved with numpy, smaller ones over dicts. Both are read while it runs."""

    local = True
    numpy_min_flows = _NUMPY_MIN_FLOWS

    def _prepare(self) -> None:
        t = self.t
        link_capacity = self.link_capacity
        self.slot_members = self.slot_member.tolist()

        # The fluid core works on plain Python lists: each event touches a handful of transfers and links,
        # where a numpy call's fixed cost would dominate.
        self._pending = np.diff(self.slot_ptr).tolist()
        self._slot_ptr = self.slot_ptr.tolist()
        self._ready_ends = [0] * len(t)
        pair_ptr = self.pair_ptr.tolist()
        pair_link_list = self.pair_link.tolist()
        pair_weight_list = self.pair_weight.tolist()
        pair_entries = [
            (tuple(pair_link_list[a:b]), tuple(pair_weight_list[a:b])) for a, b in itertools.pairwise(pair_ptr)
        ]
        self._path = [pair_entries[p] for p in self.pair.tolist()]  # (links, weights) per transfer
        self._bytes = self.nbytes.tolist()
        self._latency = self.latency.tolist()
        self._delay = np.asarray(self.delay, dtype=np.float64).tolist()
        self._send_slot = self.send_slot.tolist()
        self._recv_slot = self.recv_slot.tolist()
        self._slot_rank = self.slot_rank.tolist()
        self._rank_stop_slot = self.rank_stop_slot.tolist()
        self._capacity = link_capacity.tolist()
        self._capacity_array = link_capacity
        self._link_flows: list[dict[int, float]] = [{} for _ in range(len(self._capacity))]  # transfer: weight
        self._rate = [0.0] * len(t)
        self._left = [0.0] * len(t)  # bytes still to drain at time _since
        self._since = [0.0] * len(t)
        self._version = [0] * len(t)  # drain events of older versions are stale
        self._slowest = [math.inf] * len(t)
        self._bottleneck = [-1] * len(t)  # dense link

        self.heap: list[tuple[float, int, int, int, int]] = []
        self.counter = 0
        self.now = 0.0
        self._draining = 0
        self._changed: set[int] = set()  # links whose set of draining transfers changed at this instant
        self._started: list[int] = []  # transfers that started draining at this instant
        self._drained_rate = math.inf  # lowest rate of the transfers that drained at this instant
        self.solves = 0  # rate solves (one per instant at which some transfer started or drained)
        self.solved_flows = 0  # transfers re-solved, summed over solves
        self.active_flows = 0  # transfers draining, summed over solves

    def push(self, time_s: float, kind: int, what: int, version: int = 0) -> None:
        heapq.heappush(self.heap, (time_s, self.counter, kind, what, version))
        self.counter += 1

    # -- events ---------------------------------------------------------------------------------------
    def begin_slot(self, slot: int) -> None:
        self.slot_start[slot] = self.now
        ready = self._ready_ends
        for x in self.slot_members[self._slot_ptr[slot] : self._slot_ptr[slot + 1]]:
            ready[x] += 1
            if ready[x] == 2:
                self.trigger[x] = slot
                self.start_transfer(x)

    def start_transfer(self, x: int) -> None:
        self.start_s[x] = self.now
        links = self._path[x][0]
        if self._bytes[x] <= 0 or not links:
            self.drained_s[x] = self.now
            self.push(self.now + self._latency[x], _DELIVER, x)
            return
        self._left[x] = self._bytes[x]
        self._since[x] = self.now
        self._rate[x] = 0.0
        self._draining += 1
        for link, weight in zip(links, self._path[x][1], strict=True):
            self._link_flows[link][x] = weight
        self._changed.update(links)
        self._started.append(x)

    def drain(self, x: int) -> None:
        self.drained_s[x] = self.now
        self._drained_rate = min(self._drained_rate, self._rate[x])
        self._rate[x] = 0.0
        self._left[x] = 0.0
        links = self._path[x][0]
        self._draining -= 1
        for link in links:
            del self._link_flows[link][x]
        self._changed.update(links)
        self.push(self.now + self._latency[x], _DELIVER, x)

    def deliver(self, x: int) -> None:
        self.delivered_s[x] = self.now
        send, recv = self._send_slot[x], self._recv_slot[x]
        if send == recv:
            self._pending[send] -= 2
            if self._pending[send] == 0:
                self.end_slot(send, x)
            return
        for slot in (send, recv):
            self._pending[slot] -= 1
            if self._pending[slot] == 0:
                self.end_slot(slot, x)

    def end_slot(self, slot: int, last: int) -> None:
        self.slot_end[slot] = self.now
        self.slot_last[slot] = last
        rank = self._slot_rank[slot]
        after = self.now + self._delay[rank]
        if slot + 1 < self._rank_stop_slot[rank]:
            self.push(after, _START, slot + 1)
        else:
            self.rank_end[rank] = after

    # -- fluid drain ----------------------------------------------------------------------------------
    def _threshold(self) -> float:
        """A rate below which no transfer's max-min fair rate can have changed at this instant.

        Progressive filling raises all rates together and freezes a transfer when a link on its path fills.
        Up to the lowest old rate of a transfer that drained, and up to the level at which a link on a new
        transfer's path fills (the transfers already there frozen at their old rates, the new ones rising),
        the filling runs exactly as it did before the change: so every transfer whose old rate is below both
        keeps it. Lowered by a few _LEVEL_RTOL so that links filling "together" stay together."""
        theta = self._drained_rate
        flows_of = self._link_flows
        rate = self._rate
        capacity = self._capacity
        path = self._path
        seen: set[int] = set()
        for x in self._started:
            for link in path[x][0]:
                if link in seen:
                    continue
                seen.add(link)
                rising = 0.0  # weight of the new transfers
                old: list[tuple[float, float]] = []
                for f, weight in flows_of[link].items():
                    r = rate[f]
                    if r == 0.0:
                        rising += weight
                    else:
                        old.append((r, weight))
                room = capacity[link]
                for _, weight in old:
                    rising += weight
                old.sort()
                for r, weight in old:  # the old transfers freeze in rate order; the rest rise together
                    if room <= r * rising:
                        break
                    room -= weight * r
                    rising -= weight
                level = room / rising
                theta = min(theta, level)
        return theta * (1 - 4 * _LEVEL_RTOL)

    def _component(self, theta: float) -> tuple[list[int], set[int], dict[int, float]]:
        """The draining transfers whose rate may have changed, and per link they cross its capacity left by
        the transfers whose rate cannot have (rate below ``theta``, see _threshold).

        Those are the transfers connected to a changed link through shared links, not counting the ones
        below ``theta`` (they keep their rate, so only take capacity): max-min fair rates decompose over the
        connected components of the transfer-link incidence, so only this component's rates can change."""
        flows_of = self._link_flows
        path = self._path
        rate = self._rate
        # local=False: every link that carries a transfer, and theta is 0: the plain full re-solve.
        seen_links = set(self._changed) if self.local else {link for link, flows in enumerate(flows_of) if flows}
        stack = list(seen_links)
        members: set[int] = set()
        capacity = self._capacity
        room: dict[int, float] = {}
        while stack:
            link = stack.pop()
            left = capacity[link]
            for x, weight in flows_of[link].items():
                r = rate[x]
                if 0.0 < r < theta:
                    left -= weight * r
                elif x not in members:
                    members.add(x)
                    for lk in path[x][0]:
                        if lk not in seen_links:
                            seen_links.add(lk)
                            stack.append(lk)
            room[link] = left
        return sorted(members), members, room

    def solve_rates(self) -> None:
        """Re-solve the max-min fair rates of the changed component by progressive filling, and reschedule
        the drains whose rate changed."""
        theta = self._threshold() if self.local else 0.0
        flows, members, room = self._component(theta)
        self._changed.clear()
        self._started.clear()
        self._drained_rate = math.inf
        self.solves += 1
        self.solved_flows += len(flows)
        self.active_flows += self._draining
        if not flows:
            return
        if len(flows) > self.numpy_min_flows:
            new_rate, new_bottleneck = self._fill_numpy(flows, room)
        else:
            new_rate, new_bottleneck = self._fill_python(flows, members, room)
        now = self.now
        for x in flows:
            rate = new_rate[x]
            old = self._rate[x]
            if rate == old:
                continue
            self._left[x] -= old * (now - self._since[x])
            self._since[x] = now
            self._rate[x] = rate
            self._version[x] += 1
            if rate < self._slowest[x]:
                # Rates within _LEVEL_RTOL are one level: rounding must not move the bottleneck named.
                if rate < self._slowest[x] * (1 - _LEVEL_RTOL):
                    self._bottleneck[x] = new_bottleneck[x]
                self._slowest[x] = rate
            self.push(now + max(self._left[x], 0.0) / rate, _DRAIN, x, self._version[x])

    def _fill_python(
        self, flows: list[int], members: set[int], room: dict[int, float]
    ) -> tuple[dict[int, float], dict[int, int]]:
        """Progressive filling of a small component over dicts: rate and bottleneck link per transfer."""
        path = self._path
        demand: dict[int, float] = {}
        count: dict[int, int] = {}  # unfrozen transfers per link that has some
        for x in flows:
            for link, weight in zip(*path[x], strict=True):
                if link in count:
                    demand[link] += weight
                    count[link] += 1
                else:
                    demand[link] = weight
                    count[link] = 1
        new_rate: dict[int, float] = {}
        new_bottleneck: dict[int, int] = {}
        flows_of = self._link_flows
        while count:
            fill = min(room[link] / demand[link] for link in count)
            if not math.isfinite(fill):
                break
            limit = fill * (1 + _LEVEL_RTOL)
            tight = {link for link in count if room[link] / demand[link] <= limit}
            for link in tight:
                for x in flows_of[link]:
                    if x in new_rate or x not in members:
                        continue
                    xlinks, xweights = path[x]
                    new_rate[x] = fill
                    # The first saturated link on its path: the one the report names.
                    new_bottleneck[x] = next(lk for lk in xlinks if lk in tight)
                    for lk, weight in zip(xlinks, xweights, strict=True):
                        room[lk] = max(room[lk] - weight * fill, 0.0)
                        demand[lk] -= weight
                        count[lk] -= 1
                        if count[lk] == 0:
                            del count[lk]
        for x in flows:
            new_rate.setdefault(x, math.inf)  # only infinitely fast links left: as fill_dense does
        return new_rate, new_bottleneck

    def _fill_numpy(self, flows: list[int], room: dict[int, float]) -> tuple[dict[int, float], dict[int, int]]:
        """The same, vectorised (sim/_fair.py), for a large component: many links per level."""
        ids = np.asarray(flows, dtype=np.int64)
        pair = self.pair[ids]
        lens = self.pair_len[pair]
        ptr = np.concatenate([[0], np.cumsum(lens)])
        entries = np.repeat(self.pair_ptr[pair] - ptr[:-1], lens) + np.arange(int(ptr[-1]))
        flow = np.repeat(np.arange(ids.size, dtype=np.int64), lens)
        capacity = self._capacity_array.copy()
        capacity[np.fromiter(room.keys(), np.int64, len(room))] = np.fromiter(room.values(), np.float64, len(room))
        rate, bottleneck, _ = fill_dense(ids.size, flow, self.pair_link[entries], self.pair_weight[entries], capacity)
        return dict(zip(flows, rate.tolist(), strict=True)), dict(zip(flows, bottleneck.tolist(), strict=True))

    def run(self, progress: Callable[[float], None] | None = None) -> None:
        """Run to the end; ``progress`` (if given) is called with the fraction of transfers delivered, every
        _PROGRESS_EVERY deliveries."""
        total = max(len(self.t), 1)
        delivered = 0
        for rank in range(self.schedule.world_size):
            if self.rank_first_slot[rank] < self.rank_stop_slot[rank]:
                self.push(float(self.start_at[rank]), _START, int(self.rank_first_slot[rank]))
            else:
                self.rank_end[rank] = self.start_at[rank]
        heap = self.heap
        version = self._version
        while heap:
            self.now = heap[0][0]
            horizon = self.now * (1 + _EVENT_RTOL)
            # Everything due at this instant, then one re-solve for all the transfers that came and went.
            while heap and heap[0][0] <= horizon:
                _, _, kind, what, ver = heapq.heappop(heap)
                if kind == _START:
                    self.begin_slot(what)
                elif kind == _DELIVER:
                    self.deliver(what)
                    delivered += 1
                    if progress is not None and delivered % _PROGRESS_EVERY == 0:
                        progress(delivered / total)
                elif ver == version[what]:
                    self.drain(what)
            if self._changed:
                self.solve_rates()
        self.slowest_rate = np.asarray(self._slowest, dtype=np.float64)
        dense = np.asarray(self._bottleneck, dtype=np.int64)
        self.bottleneck = np.where(dense >= 0, self.used_links[np.maximum(dense, 0)], -1)


def run_core(
    problem: Problem,
    *,
    start_s: FloatArray | None = None,
    extra_s: FloatArray | None = None,
    progress: Callable[[float], None] | None = None,
    windowed: bool = True,
) -> Layout:
    """Run ``problem`` to the end on the fastest core there is: the compiled per-event core where numba is
    installed (sim/_kernel.py), else (``windowed``) the windowed core where it has lookahead and its passes
    pay, else the per-event core in Python. All three give the same result (to rounding: see docs/design.md).
    ``start_s`` and ``extra_s``: as :class:`Layout` has them."""
    count = len(problem[2])
    if kernel_ready():
        from allreduce.sim._kernel import run_kernel  # numba loads with the first run that needs it

        run = Layout(*problem, start_s=start_s, extra_s=extra_s)
        if count:
            run_kernel(run, progress)
        return run
    if windowed:
        window = WindowRun(*problem, start_s=start_s, extra_s=extra_s)
        if not count or (window.usable and window.run(progress)):
            return window
        # No lookahead, or a run whose passes would cost more than the per-event core's events. The abandoned
        # run's arrays go before the per-event core builds its lists.
        del window
    per_event = _Run(*problem, start_s=start_s, extra_s=extra_s)
    if count:
        per_event.run(progress)
    return per_event


def run_event(
    schedule: Schedule,
    router: Router,
    *,
    size_bytes: float,
    rank_delay_s: FloatArray | None,
    trace_ranks: int,
    progress: Callable[[float], None] | None = None,
    stream: bool | None = None,
) -> SimResult:
    """The event engine's result. ``stream``: run the compiled core on a layout streamed from the schedule
    (sim/_stream.py: memory for the steps under way, not for every transfer); None: where numba is installed
    and the schedule has more than STREAM_TRANSFERS transfers."""
    topology = router.topology
    n = schedule.world_size
    if stream is None:
        stream = kernel_ready() and int(schedule.streams.steps.sum()) > STREAM_TRANSFERS
    if stream:
        from allreduce.sim._stream import StreamRun  # numba loads with the first run that needs it

        streamed = StreamRun(schedule, router, size_bytes, rank_delay_s, trace_ranks=trace_ranks)
        streamed.run(progress)
        rank_end = streamed.rank_end
        routes = streamed.routes
        pair_bytes: npt.NDArray[Any] = streamed.pair_bytes
        pair_len: npt.NDArray[np.integer[Any]] = routes.length
        used_links = routes.used_links
        pair_link, pair_weight = routes.link, routes.weight
        chain = streamed.chain()
        phases = streamed.phase_results()
        steps: IntArray = streamed.steps_with
        trace_start, trace_end = streamed.trace_start, streamed.trace_end
    else:
        transfers = match_transfers(schedule)
        run = run_core((schedule, router, transfers, size_bytes, rank_delay_s), progress=progress)
        rank_end = run.rank_end
        # Per pair (its transfers' bytes summed), not per transfer: no array has one entry per transfer and hop.
        pair_bytes = np.bincount(run.pair, weights=run.t.fraction * run.size_bytes, minlength=run.pair_len.size)
        pair_len = run.pair_len
        used_links = run.used_links
        pair_link = run.pair_link
        pair_weight = run.pair_weight
        chain = _layout_chain(run)
        phases = _phase_results(schedule, run)
        steps = np.flatnonzero(np.bincount(transfers.step))  # the steps with transfers, without sorting them all
        trace_start, trace_end = _trace(run, steps, min(n, trace_ranks))
    seconds = float(rank_end.max()) if n else 0.0

    # Per-link bytes: every rank pair's bytes spread over its route with the route's weights.
    entry_pair = np.repeat(np.arange(pair_len.size), pair_len)
    link_bytes = np.bincount(
        used_links[pair_link], weights=pair_weight * pair_bytes[entry_pair], minlength=topology.num_links
    ).astype(np.float64)

    critical, waited = _critical_path(chain, topology.num_links)
    bottlenecks, count = summarize_bottlenecks(topology, waited, link_bytes, seconds)
    return SimResult(
        name=schedule.name,
        collective=schedule.collective,
        world_size=n,
        size_bytes=float(size_bytes),
        seconds=seconds,
        engine="event",
        topology=topology,
        rank_gpu=router.rank_gpu,
        phases=phases,
        link_bytes=link_bytes,
        critical_path=critical,
        bottlenecks=bottlenecks,
        critical_links=count,
        rank_end_s=rank_end,
        trace_labels=tuple(f"step {s}" for s in steps.tolist()),
        trace_start_s=trace_start,
        trace_end_s=trace_end,
    )


def _trace(run: Layout, steps: IntArray, k: int) -> tuple[FloatArray, FloatArray]:
    """One slice per step of the first ``k`` ranks: when it began and ended."""
    trace_start = np.full((steps.size, k), np.nan)
    trace_end = np.full((steps.size, k), np.nan)
    # The first ranks' slots only: arrays over every slot would be the largest of the run's last allocations.
    shown = np.flatnonzero(run.slot_rank < k)
    row, rank = np.searchsorted(steps, run.slot_step[shown]), run.slot_rank[shown]
    trace_start[row, rank] = run.slot_start[shown]
    trace_end[row, rank] = run.slot_end[shown] + run.delay[rank]
    return trace_start, trace_end


def _layout_chain(run: Layout) -> ChainRecords:
    """The critical path's transfers, walking back from the last rank to finish: the transfer that ended its
    last step, the rank whose arrival started that transfer, that rank's previous step, and so on."""
    picked: list[int] = []
    slots: list[int] = []
    if len(run.t):
        last_rank = int(np.argmax(run.rank_end))
        slot = int(run.rank_stop_slot[last_rank]) - 1
        while slot >= 0:
            x = int(run.slot_last[slot])
            picked.append(x)
            slots.append(slot)
            cause = int(run.trigger[x])
            rank = int(run.slot_rank[cause])
            slot = cause - 1 if cause > run.rank_first_slot[rank] else -1
    xs = np.asarray(picked[::-1], dtype=np.int64)
    t = run.t
    return ChainRecords(
        src=t.src[xs].astype(np.int64),
        dst=t.dst[xs].astype(np.int64),
        step=t.step[xs].astype(np.int64),
        start_s=run.start_s[xs],
        drained_s=run.drained_s[xs],
        delivered_s=run.delivered_s[xs],
        slowest_rate=run.slowest_rate[xs],
        bottleneck=run.bottleneck[xs].astype(np.int64),
        delay_s=np.asarray(run.delay, dtype=np.float64)[run.slot_rank[np.asarray(slots[::-1], dtype=np.int64)]],
    )


def _critical_path(chain: ChainRecords, num_links: int) -> tuple[tuple[CriticalStep, ...], FloatArray]:
    """The critical path's stretches (consecutive steps of one rank pair and bottleneck link merged), and per
    link the seconds the path spent draining through it."""
    waited = np.zeros(num_links)
    steps: list[CriticalStep] = []
    for i in range(chain.src.size):
        drain = float(chain.drained_s[i] - chain.start_s[i])
        delay = float(chain.delay_s[i])
        link = int(chain.bottleneck[i])
        if link >= 0:
            waited[link] += drain
        src, dst, step = int(chain.src[i]), int(chain.dst[i]), int(chain.step[i])
        total = float(chain.delivered_s[i] - chain.start_s[i]) + delay
        latency = float(chain.delivered_s[i] - chain.drained_s[i])
        rate = float(chain.slowest_rate[i])
        prev = steps[-1] if steps else None
        if prev is not None and (prev.src_rank, prev.dst_rank, prev.bottleneck_link) == (src, dst, link):
            steps[-1] = CriticalStep(
                first_step=prev.first_step,
                last_step=step,
                src_rank=src,
                dst_rank=dst,
                seconds=prev.seconds + total,
                transfer_s=prev.transfer_s + drain,
                latency_s=prev.latency_s + latency,
                rank_delay_s=prev.rank_delay_s + delay,
                rate_Bps=min(prev.rate_Bps, rate),
                bottleneck_link=link,
            )
        else:
            steps.append(
                CriticalStep(
                    first_step=step,
                    last_step=step,
                    src_rank=src,
                    dst_rank=dst,
                    seconds=total,
                    transfer_s=drain,
                    latency_s=latency,
                    rank_delay_s=delay,
                    rate_Bps=rate,
                    bottleneck_link=link,
                )
            )
    return tuple(steps), waited


def _phase_results(schedule: Schedule, run: Layout) -> tuple[PhaseResult, ...]:
    t = run.t
    out = []
    for phase in schedule.phases():
        last = phase.first_step + phase.repeat
        in_slots = (run.slot_step >= phase.first_step) & (run.slot_step < last)
        # Transfers are ordered by step (match_transfers): a phase's are one range, and their rates are made
        # for it alone (arrays over every transfer would be the largest of the run's last allocations).
        lo, hi = (int(i) for i in np.searchsorted(t.step, [phase.first_step, last]))
        start_s, drained_s = run.start_s[lo:hi], run.drained_s[lo:hi]
        rates = np.divide(
            t.fraction[lo:hi] * run.size_bytes,
            drained_s - start_s,
            out=np.full(hi - lo, np.inf),
            where=drained_s > start_s,
        )
        out.append(
            PhaseResult(
                first_step=phase.first_step,
                repeat=phase.repeat,
                num_flows=len(phase),
                start_s=float(run.slot_start[in_slots].min()) if in_slots.any() else 0.0,
                end_s=float((run.slot_end[in_slots] + run.delay[run.slot_rank[in_slots]]).max())
                if in_slots.any()
                else 0.0,
                slowest_rate_Bps=float(rates.min()) if rates.size else float("inf"),
                fair_share_Bps=float(np.median(rates)) if rates.size else float("inf"),
            )
        )
    return tuple(out)
