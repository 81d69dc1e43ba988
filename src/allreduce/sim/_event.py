"""The event-driven engine: per-rank programs, flows that share links max-min fairly as they come and go.

The model (the issue's, stated once):

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
Events due at the same instant are processed together and the rates re-solved once. Cost: one rate solve per
distinct start/finish instant and a few Python operations per transfer, so it is meant for up to a few hundred
ranks; it checks the fast engine there (see :mod:`allreduce.sim._fast` for where and why the two differ).

The critical path is found by walking back from the rank that finished last: the transfer that ended its last
step, the rank whose arrival started that transfer, that rank's previous step, and so on to time zero.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from allreduce.schedules import Schedule, Verb
from allreduce.sim._fair import fill_dense
from allreduce.sim._result import CriticalStep, PhaseResult, SimResult
from allreduce.sim._routing import Router
from allreduce.sim._summary import summarize_bottlenecks

__all__ = ["Transfers", "match_transfers", "run_event"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

_START = 0  # a rank begins its next step
_DELIVER = 1  # a transfer's last byte arrived
# Transfers whose drains end within this relative distance of the earliest end finish together (one re-solve,
# not one per transfer whose float sum came out a few ulps later).
_DRAIN_RTOL = 1e-9
# ... or within this many seconds of it (a drain due now, or a few ulps ago).
_DRAIN_ATOL_S = 1e-15
# Events within this relative distance of the current time are processed with it.
_EVENT_RTOL = 1e-12
# A link is saturated, and a transfer the fastest on it, to this relative tolerance (rates kept from an
# earlier solve carry its rounding).
_CHECK_RTOL = 1e-9


@dataclass(frozen=True, eq=False)
class Transfers:
    """Every transfer of a schedule, matched from the per-rank programs: rank ``src`` sends ``fraction`` of the
    buffer to rank ``dst`` at ``step``."""

    src: IntArray
    dst: IntArray
    step: IntArray
    fraction: FloatArray

    def __len__(self) -> int:
        return int(self.src.shape[0])


def match_transfers(schedule: Schedule) -> Transfers:
    """Pair the k-th send from a to b with the k-th receive at b from a, over all per-rank programs.

    ValueError naming the rank, peer and step when a send has no matching receive (or the reverse), or when
    the two sides disagree on the step or the blocks."""
    sends: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for rank in range(schedule.world_size):
        for op in schedule.program(rank):
            if op.verb is Verb.SEND:
                sends.setdefault((rank, op.peer), []).append((op.step, op.block_start, op.block_stop))
            else:
                recvs.setdefault((op.peer, rank), []).append((op.step, op.block_start, op.block_stop))
    src: list[int] = []
    dst: list[int] = []
    step: list[int] = []
    blocks: list[int] = []
    for pair in sorted(sends.keys() | recvs.keys()):
        a, b = pair
        out, into = sends.get(pair, []), recvs.get(pair, [])
        for k in range(max(len(out), len(into))):
            if k >= len(into):
                raise ValueError(
                    f"{schedule.name}: rank {a} sends blocks [{out[k][1]}, {out[k][2]}) to rank {b} at step "
                    f"{out[k][0]}, but rank {b} never receives them"
                )
            if k >= len(out):
                raise ValueError(
                    f"{schedule.name}: rank {b} expects blocks [{into[k][1]}, {into[k][2]}) from rank {a} at step "
                    f"{into[k][0]}, but rank {a} never sends them"
                )
            if out[k] != into[k]:
                raise ValueError(
                    f"{schedule.name}: send {k} from rank {a} to rank {b} is step {out[k][0]} blocks "
                    f"[{out[k][1]}, {out[k][2]}) but rank {b} receives step {into[k][0]} blocks "
                    f"[{into[k][1]}, {into[k][2]})"
                )
            src.append(a)
            dst.append(b)
            step.append(out[k][0])
            blocks.append(out[k][2] - out[k][1])
    order = np.lexsort((np.asarray(dst), np.asarray(src), np.asarray(step))) if src else np.zeros(0, np.int64)
    return Transfers(
        src=np.asarray(src, dtype=np.int64)[order],
        dst=np.asarray(dst, dtype=np.int64)[order],
        step=np.asarray(step, dtype=np.int64)[order],
        fraction=(np.asarray(blocks, dtype=np.float64) / schedule.num_blocks)[order],
    )


class _Run:
    """One event-driven simulation: the state that changes as time advances."""

    def __init__(
        self,
        schedule: Schedule,
        router: Router,
        transfers: Transfers,
        size_bytes: float,
        rank_delay_s: FloatArray | None,
        *,
        keep_rates: bool = True,
    ) -> None:
        """``keep_rates=False`` re-solves the rates by progressive filling at every change (the reference the
        shortcut of :meth:`_keep_rates` is tested against)."""
        self.keep_rates = keep_rates
        self.schedule = schedule
        self.router = router
        self.capacity = router.topology.link_bandwidth_Bps
        n = schedule.world_size
        t = transfers
        self.t = t
        self.nbytes = t.fraction * float(size_bytes)
        self.delay = np.zeros(n) if rank_delay_s is None else rank_delay_s

        # Route each distinct (src, dst) pair once.
        pair_key = t.src * n + t.dst
        keys, self.pair = np.unique(pair_key, return_inverse=True)
        self.pair = self.pair.reshape(-1)
        routes = router.route_ranks(keys // n, keys % n)
        self.pair_ptr = routes.flow_ptr
        self.pair_len = np.diff(routes.flow_ptr)
        # Links renumbered densely over the ones this schedule uses: every rate solve works on those alone.
        self.used_links, pair_link = np.unique(routes.link, return_inverse=True)
        self.pair_link = pair_link.reshape(-1).astype(np.int64)
        self.pair_weight = routes.weight
        self.link_capacity = self.capacity[self.used_links]
        if np.any(~(self.link_capacity > 0)):
            bad = int(self.used_links[~(self.link_capacity > 0)][0])
            raise ValueError(f"link {bad} carries flows but has capacity {self.capacity[bad]} (must be > 0)")
        self.latency = routes.latency_s[self.pair]

        # Slots: one per (rank, step) in which the rank transfers; each transfer sits in two (send, receive).
        slot_rank = np.concatenate([t.src, t.dst])
        slot_step = np.concatenate([t.step, t.step])
        slot_key = slot_rank * (int(t.step.max()) + 1 if len(t) else 1) + slot_step
        slot_keys, slot_of = np.unique(slot_key, return_inverse=True)
        slot_of = slot_of.reshape(-1)
        self.num_slots = int(slot_keys.size)
        self.send_slot = slot_of[: len(t)]
        self.recv_slot = slot_of[len(t) :]
        # Unique keys sort by rank then step, so a rank's slots are consecutive and in step order.
        first_of = np.unique(slot_of, return_index=True)[1]
        self.slot_rank = slot_rank[first_of]
        self.slot_step = slot_step[first_of]
        self.rank_first_slot = np.searchsorted(self.slot_rank, np.arange(n), side="left")
        self.rank_stop_slot = np.searchsorted(self.slot_rank, np.arange(n), side="right")
        members = np.argsort(slot_of, kind="stable")  # entries 0..2T-1 grouped by slot
        self.slot_ptr = np.concatenate([[0], np.cumsum(np.bincount(slot_of, minlength=self.num_slots))])
        self.slot_members = (members % max(len(t), 1)).tolist()
        self.pending = np.diff(self.slot_ptr).astype(np.int64)

        self.slot_start = np.full(self.num_slots, np.nan)
        self.slot_end = np.full(self.num_slots, np.nan)
        self.slot_last = np.full(self.num_slots, -1, dtype=np.int64)  # transfer that completed the slot
        self.ready_ends = np.zeros(len(t), dtype=np.int64)
        self.trigger = np.full(len(t), -1, dtype=np.int64)  # slot whose start let the transfer begin
        self.start_s = np.full(len(t), np.nan)
        self.drained_s = np.full(len(t), np.nan)
        self.delivered_s = np.full(len(t), np.nan)
        self.slowest_rate = np.full(len(t), np.inf)
        self.bottleneck = np.full(len(t), -1, dtype=np.int64)
        self.rank_end = np.zeros(n)

        self.heap: list[tuple[float, int, int, int]] = []
        self.counter = 0
        self.active: list[int] = []
        self.remaining: FloatArray = np.zeros(0)
        self.rate: FloatArray = np.zeros(0)
        self.now = 0.0
        self.solves = 0
        self.full_solves = 0  # solves that needed progressive filling (the rest kept the rates)

    def push(self, time_s: float, kind: int, what: int) -> None:
        heapq.heappush(self.heap, (time_s, self.counter, kind, what))
        self.counter += 1

    # -- events ---------------------------------------------------------------------------------------
    def begin_slot(self, slot: int) -> None:
        self.slot_start[slot] = self.now
        for x in self.slot_members[self.slot_ptr[slot] : self.slot_ptr[slot + 1]]:
            self.ready_ends[x] += 1
            if self.ready_ends[x] == 2:
                self.trigger[x] = slot
                self.start_transfer(x)

    def start_transfer(self, x: int) -> None:
        self.start_s[x] = self.now
        if self.nbytes[x] <= 0 or self.pair_len[self.pair[x]] == 0:
            self.drained_s[x] = self.now
            self.push(self.now + float(self.latency[x]), _DELIVER, x)
            return
        self.active.append(x)
        self.remaining = np.append(self.remaining, self.nbytes[x])
        self.rate = np.append(self.rate, np.nan)

    def deliver(self, x: int) -> None:
        self.delivered_s[x] = self.now
        slots = (int(self.send_slot[x]), int(self.recv_slot[x]))
        for slot in slots if slots[0] != slots[1] else slots[:1]:
            self.pending[slot] -= 1 if slots[0] != slots[1] else 2
            if self.pending[slot] == 0:
                self.end_slot(slot, x)

    def end_slot(self, slot: int, last: int) -> None:
        self.slot_end[slot] = self.now
        self.slot_last[slot] = last
        rank = int(self.slot_rank[slot])
        after = self.now + float(self.delay[rank])
        if slot + 1 < self.rank_stop_slot[rank]:
            self.push(after, _START, slot + 1)
        else:
            self.rank_end[rank] = after

    # -- fluid drain ----------------------------------------------------------------------------------
    def solve_rates(self) -> None:
        """Max-min fair rates of the active transfers; ``self.rate`` is aligned with ``self.active``, NaN for
        transfers that started since the last solve."""
        ids = np.asarray(self.active, dtype=np.int64)
        pair = self.pair[ids]
        lens = self.pair_len[pair]
        ptr = np.concatenate([[0], np.cumsum(lens)])
        entries = np.repeat(self.pair_ptr[pair] - ptr[:-1], lens) + np.arange(int(ptr[-1]))
        flow = np.repeat(np.arange(ids.size, dtype=np.int64), lens)
        link = self.pair_link[entries]
        weight = self.pair_weight[entries]
        checked = self._keep_rates(flow, link, weight) if self.keep_rates else None
        if checked is not None:
            rate, bottleneck = checked
        else:
            rate, bottleneck, _ = fill_dense(ids.size, flow, link, weight, self.link_capacity)
            self.full_solves += 1
        self.solves += 1
        self.rate = rate
        slower = np.flatnonzero(rate < self.slowest_rate[ids])
        self.slowest_rate[ids[slower]] = rate[slower]
        self.bottleneck[ids[slower]] = self.used_links[bottleneck[slower]]

    def _keep_rates(self, flow: IntArray, link: IntArray, weight: FloatArray) -> tuple[FloatArray, IntArray] | None:
        """The max-min fair rates without progressive filling, when the previous ones still are.

        A change of the active set often leaves every other transfer's rate alone (a transfer that finished
        alone on its bottleneck; one that starts on links with room to spare). Candidate: the transfers that
        kept running keep their rates; one that just started takes the room left on its path. A feasible
        allocation is the (unique) max-min fair one iff every transfer crosses a saturated link on which no
        transfer is faster (its bottleneck), which one pass over the incidence checks. Returns (rates,
        bottleneck link per transfer), or None when the check fails and the rates must be re-solved."""
        rate = self.rate
        fresh = np.isnan(rate)
        capacity = self.link_capacity
        if fresh.any():
            rate = rate.copy()
            known = ~fresh[flow]
            load = np.bincount(link[known], weights=weight[known] * rate[flow[known]], minlength=capacity.size)
            room = (capacity - load)[link] / weight
            new = ~known
            # Entries are grouped by transfer; new transfers are the last ones, each with >= 1 entry.
            starts = np.flatnonzero(np.diff(flow[new], prepend=-1))
            rate[fresh] = np.minimum.reduceat(room[new], starts)
            if not (rate[fresh] > 0).all():
                return None
        entry_rate = rate[flow]
        load = np.bincount(link, weights=weight * entry_rate, minlength=capacity.size)
        if (load > capacity * (1 + _CHECK_RTOL)).any():
            return None
        fastest = np.zeros(capacity.size)
        np.maximum.at(fastest, link, entry_rate)
        ok = (load[link] >= capacity[link] * (1 - _CHECK_RTOL)) & (entry_rate >= fastest[link] * (1 - _CHECK_RTOL))
        hit = np.flatnonzero(ok)
        hit_flow = flow[hit]
        first = np.ones(hit.size, dtype=np.bool_)
        first[1:] = hit_flow[1:] != hit_flow[:-1]
        if int(first.sum()) != rate.size:
            return None
        return rate, link[hit[first]]

    def advance(self, to_s: float) -> None:
        if self.active:
            self.remaining -= self.rate * (to_s - self.now)
        self.now = to_s

    def run(self) -> None:
        for rank in range(self.schedule.world_size):
            if self.rank_first_slot[rank] < self.rank_stop_slot[rank]:
                self.push(0.0, _START, int(self.rank_first_slot[rank]))
        dirty = False
        while self.heap or self.active:
            if dirty and self.active:
                self.solve_rates()
            dirty = False
            next_event = self.heap[0][0] if self.heap else np.inf
            if self.active:
                finish = self.remaining / self.rate
                # Rounding can leave a few bytes' worth of negative time: never step backwards.
                soonest = max(float(finish.min()), 0.0)
                if self.now + soonest <= next_event:
                    self.advance(self.now + soonest)
                    done = finish <= soonest * (1 + _DRAIN_RTOL) + _DRAIN_ATOL_S
                    ids = np.asarray(self.active, dtype=np.int64)
                    for x in ids[done].tolist():
                        self.drained_s[x] = self.now
                        self.push(self.now + float(self.latency[x]), _DELIVER, x)
                    self.active = ids[~done].tolist()
                    self.remaining = self.remaining[~done]
                    self.rate = self.rate[~done]
                    dirty = True
                    continue
            self.advance(next_event)
            horizon = self.now * (1 + _EVENT_RTOL)
            before = len(self.active)
            while self.heap and self.heap[0][0] <= horizon:
                _, _, kind, what = heapq.heappop(self.heap)
                if kind == _START:
                    self.begin_slot(what)
                else:
                    self.deliver(what)
            dirty = len(self.active) != before


def run_event(
    schedule: Schedule,
    router: Router,
    *,
    size_bytes: float,
    rank_delay_s: FloatArray | None,
    trace_ranks: int,
) -> SimResult:
    topology = router.topology
    transfers = match_transfers(schedule)
    run = _Run(schedule, router, transfers, size_bytes, rank_delay_s)
    if len(transfers):
        run.run()
    n = schedule.world_size
    seconds = float(run.rank_end.max()) if n else 0.0

    # Per-link bytes: every transfer's bytes spread over its route with the route's weights.
    t = transfers
    pair = run.pair
    lens = run.pair_len[pair]
    ptr = np.concatenate([[0], np.cumsum(lens)])
    entries = np.repeat(run.pair_ptr[pair] - ptr[:-1], lens) + np.arange(int(ptr[-1]))
    entry_transfer = np.repeat(np.arange(len(t)), lens)
    link_bytes = np.bincount(
        run.used_links[run.pair_link[entries]],
        weights=run.pair_weight[entries] * run.nbytes[entry_transfer],
        minlength=topology.num_links,
    ).astype(np.float64)

    critical, waited = _critical_path(run, seconds, topology.num_links)
    phases = _phase_results(schedule, run)
    bottlenecks, count = summarize_bottlenecks(topology, waited, link_bytes, seconds)

    # Trace: one slice per step of the first ranks.
    k = min(n, trace_ranks)
    steps = np.unique(t.step)
    row = np.searchsorted(steps, run.slot_step)
    trace_start = np.full((steps.size, k), np.nan)
    trace_end = np.full((steps.size, k), np.nan)
    shown = run.slot_rank < k
    trace_start[row[shown], run.slot_rank[shown]] = run.slot_start[shown]
    trace_end[row[shown], run.slot_rank[shown]] = run.slot_end[shown] + run.delay[run.slot_rank[shown]]
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
        rank_end_s=run.rank_end,
        trace_labels=tuple(f"step {s}" for s in steps.tolist()),
        trace_start_s=trace_start,
        trace_end_s=trace_end,
    )


def _critical_path(run: _Run, seconds: float, num_links: int) -> tuple[tuple[CriticalStep, ...], FloatArray]:
    """Walk back from the last rank to finish; per link, the seconds the path spent draining through it."""
    waited = np.zeros(num_links)
    if not len(run.t):
        return (), waited
    last_rank = int(np.argmax(run.rank_end))
    slot = int(run.rank_stop_slot[last_rank]) - 1
    chain: list[tuple[int, int]] = []  # (transfer, slot it completed), latest first
    while slot >= 0:
        x = int(run.slot_last[slot])
        chain.append((x, slot))
        cause = int(run.trigger[x])
        rank = int(run.slot_rank[cause])
        slot = cause - 1 if cause > run.rank_first_slot[rank] else -1
    steps: list[CriticalStep] = []
    for x, slot in reversed(chain):
        drain = float(run.drained_s[x] - run.start_s[x])
        delay = float(run.delay[run.slot_rank[slot]])
        link = int(run.bottleneck[x])
        if link >= 0:
            waited[link] += drain
        src, dst, step = int(run.t.src[x]), int(run.t.dst[x]), int(run.t.step[x])
        total = float(run.delivered_s[x] - run.start_s[x]) + delay
        latency = float(run.delivered_s[x] - run.drained_s[x])
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
                rate_Bps=min(prev.rate_Bps, float(run.slowest_rate[x])),
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
                    rate_Bps=float(run.slowest_rate[x]),
                    bottleneck_link=link,
                )
            )
    return tuple(steps), waited


def _phase_results(schedule: Schedule, run: _Run) -> tuple[PhaseResult, ...]:
    t = run.t
    effective = np.divide(
        run.nbytes,
        run.drained_s - run.start_s,
        out=np.full(len(t), np.inf),
        where=run.drained_s > run.start_s,
    )
    slot_done = run.slot_end + run.delay[run.slot_rank]
    out = []
    for phase in schedule.phases():
        last = phase.first_step + phase.repeat
        in_slots = (run.slot_step >= phase.first_step) & (run.slot_step < last)
        in_transfers = (t.step >= phase.first_step) & (t.step < last)
        rates = effective[in_transfers]
        out.append(
            PhaseResult(
                first_step=phase.first_step,
                repeat=phase.repeat,
                num_flows=len(phase),
                start_s=float(run.slot_start[in_slots].min()) if in_slots.any() else 0.0,
                end_s=float(slot_done[in_slots].max()) if in_slots.any() else 0.0,
                slowest_rate_Bps=float(rates.min()) if rates.size else float("inf"),
                fair_share_Bps=float(np.median(rates)) if rates.size else float("inf"),
            )
        )
    return tuple(out)
