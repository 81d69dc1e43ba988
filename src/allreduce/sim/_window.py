"""The event engine's windowed core: the model of :mod:`allreduce.sim._event`, advanced in numpy arrays many
transfers at a time instead of one event at a time.

Lookahead makes that exact. A transfer is delivered its latency after its last byte drained, and drains no
faster than its solo rate. So no transfer draining at ``T`` (the earliest pending event) or starting later can
be delivered before ``T + L``, ``L`` the least of their bytes left at their solo rate plus their latency (never
less than the smallest latency). In the window ``[T, T + L)`` every delivery was therefore scheduled before
``T``; every step that begins in it begins because of one of those deliveries or an earlier one; and the drains
in it are delivered after it. A window is three passes over arrays:

1. its deliveries end steps; the steps that begin in the window begin; the transfers both of whose ranks have
   begun their step start (the k-th send from a to b meets the k-th receive at b from a);
2. the fluid: the transfers draining at ``T`` and those starting in the window share links max-min fairly.
   Max-min fair rates decompose over the connected components of the transfer-link incidence, and in the
   window no transfer outside a component of the window's transfers touches its links: so the components
   advance independently, each on its own clock, all of them in the same array passes (one pass per instant
   of the busiest one; at each, its draining transfers' rates are re-solved by progressive filling, every
   component at its own level). A transfer alone in its component keeps its rate for the whole window: its
   drain is a closed form;
3. the drains schedule their deliveries, after the window.

The result is the one the per-event core computes (same events, same formulas for rates and drain times; a
component's rates re-solved whole rather than partly, and events that are simultaneous to 1e-12 grouped per
component rather than globally: equal in mathematics and to rounding, which some runs amplify — see
docs/design.md, "The event engine at scale"), for a few dozen numpy calls per pass instead of a few dozen
Python operations per transfer and event; where passes are many, run_event goes back to the per-event core
(see _MAX_WORK).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.sim._layout import Layout

__all__ = ["WindowRun"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

# Events within this relative distance of a component's instant are processed with it (as the per-event core).
_EVENT_RTOL = 1e-12
# Links whose fill levels agree to this relative tolerance saturate together (as in sim/_fair.py).
_LEVEL_RTOL = 1e-9
# How many deliveries between two calls of run()'s progress callback.
_PROGRESS_EVERY = 4096

# The windowed core pays a few dozen numpy calls per pass and a dozen per filling level (170 us and 26 us of CPU,
# fitted to the tree and torus cases below; they predict the other two within 12%); the per-event core a few
# dozen Python operations per transfer and event (38-63 us per transfer on a fat-tree, more where components
# are large). Measured
# (benchmarks/bench_engines.py --cores 256: CPU seconds, random placement, 64 MiB), passes + levels per
# transfer, windowed against per-event: ring on a k=16 fat-tree 0.17, 2.0 s against 5.0 s; ring on an 8x8x32 4:1
# Clos 1.31, 10.0 s against 7.4 s; double binary tree there 32, 8.6 s against 3.4 s; ring on a 16x16 torus 13,
# 72 s against about 30 s; and ring on 1,024 ranks of the k=16 fat-tree 61 CPU-s against about 132. So the windowed
# core runs the first _TRIAL_SHARE of the transfers, and gives way to the per-event core when its work (passes
# plus _LEVEL_COST per level) exceeded _MAX_WORK per transfer delivered: at 5% the fat-tree rings above are at
# 0.10 (256 ranks) and 0.22 (1,024: kept), the Clos rings at 0.55 and 0.49 (1,024 ranks), the tree at 4.2 and
# the torus at 3.4 (given way). Those whose components are large are also the runs whose result rounding moves
# most; giving them to the per-event core keeps them bit for bit. The choice depends on counts only, so the same
# run always takes the same core.
_TRIAL_SHARE = 0.05
_LEVEL_COST = 0.15
_MAX_WORK = 0.35
# The window is shortened by this relative margin, so that rounding in the bound above never lets a delivery
# scheduled in the window land inside it.
_REACH_MARGIN = 1e-9

_NO_INT = np.zeros(0, dtype=np.int64)
_NO_FLOAT = np.zeros(0, dtype=np.float64)


def _segments(ptr: npt.NDArray[np.integer[Any]], ids: npt.NDArray[np.integer[Any]]) -> tuple[IntArray, IntArray]:
    """The entries ``ptr[i]:ptr[i+1]`` of each ``i`` in ``ids``, concatenated, and the position in ``ids`` of
    each entry's owner."""
    lens = ptr[ids + 1] - ptr[ids]
    total = int(lens.sum())
    owner = np.repeat(np.arange(ids.size, dtype=np.int64), lens)
    offsets = np.cumsum(lens) - lens
    return np.repeat(ptr[ids] - offsets, lens) + np.arange(total, dtype=np.int64), owner


def _last_per_group(keys: IntArray, times: FloatArray, tiebreak: IntArray) -> IntArray:
    """Per distinct key, the index of its latest entry; entries within _EVENT_RTOL of the latest are one
    instant (as the per-event core processes them), and of those the one with the largest ``tiebreak``."""
    unique, group = np.unique(keys, return_inverse=True)
    group = group.reshape(-1)
    latest = np.full(unique.size, -np.inf)
    np.maximum.at(latest, group, times)
    candidate = np.flatnonzero(times >= latest[group] * (1 - _EVENT_RTOL))
    order = candidate[np.lexsort((tiebreak[candidate], group[candidate]))]
    last = np.ones(order.size, dtype=np.bool_)
    last[:-1] = group[order][1:] != group[order][:-1]
    return order[last]


def _fill_components(
    num_flows: int,
    entry_flow: IntArray,
    entry_link: IntArray,
    entry_weight: FloatArray,
    capacity: FloatArray,
    *,
    link_comp_start: IntArray,
    link_comp: IntArray,
) -> tuple[FloatArray, IntArray, int]:
    """Progressive filling of many components at once, each at its own level: per flow its rate (inf when only
    infinitely fast links are left) and the first link on its path that froze it (-1: none); and how many
    levels it took (the busiest component's).

    Links are numbered so that each component's are consecutive (``link_comp_start``, ``link_comp`` per link);
    entries are grouped by flow in path order. Within a component it is sim/_fair.py's fill_dense: raise the
    unfrozen flows together, freeze those crossing the links that fill first (to _LEVEL_RTOL)."""
    rate = np.full(num_flows, np.inf)
    bottleneck = np.full(num_flows, -1, dtype=np.int64)
    remaining = capacity.copy()
    num_links = remaining.size
    frozen = np.zeros(num_flows, dtype=np.bool_)
    flow, link, weight = entry_flow, entry_link, entry_weight
    level = np.empty(num_links)
    levels = 0
    while flow.size:
        levels += 1
        demand = np.bincount(link, weights=weight, minlength=num_links)
        level.fill(np.inf)
        np.divide(remaining, demand, out=level, where=demand > 0)
        fill = np.minimum.reduceat(level, link_comp_start)[link_comp]  # per link: its component's level
        tight = (level <= fill * (1 + _LEVEL_RTOL)) & np.isfinite(fill)
        hit = np.flatnonzero(tight[link])
        if not hit.size:
            break  # only infinitely fast links left
        hit_flow = flow[hit]
        first = np.ones(hit.size, dtype=np.bool_)
        first[1:] = hit_flow[1:] != hit_flow[:-1]
        rate[hit_flow] = fill[link[hit]]
        bottleneck[hit_flow[first]] = link[hit[first]]
        frozen[hit_flow] = True
        done = frozen[flow]
        remaining -= np.bincount(link[done], weights=weight[done] * rate[flow[done]], minlength=num_links)
        np.maximum(remaining, 0.0, out=remaining)
        keep = ~done & np.isfinite(fill[link])
        flow, link, weight = flow[keep], link[keep], weight[keep]
    return rate, bottleneck, levels


class WindowRun(Layout):
    """One event-driven simulation, advanced a lookahead window at a time (see the module docstring).

    Fills in the arrays of :class:`Layout`, like the per-event core. ``usable`` is False where the lookahead is
    zero (a transfer delivered the instant it drained) or a route crosses a link twice: the per-event core
    then runs instead."""

    def _prepare(self) -> None:
        count = len(self.t)
        self.lookahead_s = float(self.latency.min()) if count else 0.0
        num_pairs = self.pair_len.size
        entry_pair = np.repeat(np.arange(num_pairs, dtype=np.int64), self.pair_len)
        num_links = max(self.link_capacity.size, 1)
        twice = np.unique(entry_pair * num_links + self.pair_link).size < entry_pair.size
        self.usable = self.lookahead_s > 0 and not twice
        # A transfer alone on its links drains at its solo rate: progressive filling of one flow.
        level = self.link_capacity[self.pair_link] / self.pair_weight
        self.solo_rate = np.full(num_pairs, np.inf)
        nonempty = self.pair_len > 0
        if nonempty.any():
            self.solo_rate[nonempty] = np.minimum.reduceat(level, self.pair_ptr[:-1][nonempty])
        tight = np.flatnonzero(level <= self.solo_rate[entry_pair] * (1 + _LEVEL_RTOL))
        self.solo_bottleneck = np.full(num_pairs, -1, dtype=np.int64)
        pairs, first = np.unique(entry_pair[tight], return_index=True)
        self.solo_bottleneck[pairs] = self.pair_link[tight[first]]

        self.flows = (self.nbytes > 0) & (self.pair_len[self.pair] > 0)
        # The soonest a transfer can be delivered after it starts: its bytes at its solo rate (no fair share is
        # faster), then its latency. Every window is at least the smallest of these long.
        self._solo_rate_of = self.solo_rate[self.pair]
        self._soonest_s = float(np.min(self.latency + self.nbytes / self._solo_rate_of)) if count else 0.0
        self._left = np.zeros(count)  # bytes still to drain at time _since
        self._since = np.zeros(count)
        self._rate = np.zeros(count)
        self._ready = np.zeros(count, dtype=np.int8)  # how many of its two slots have begun
        self._pending = np.diff(self.slot_ptr)  # deliveries each slot still waits for
        self.slowest_rate = np.full(count, np.inf)
        self._bottleneck = np.full(count, -1, dtype=np.int64)  # dense link
        self.windows = 0
        self.passes = 0  # fluid passes, summed over windows
        self.levels = 0  # progressive-filling levels, summed over passes

    # -- steps ----------------------------------------------------------------------------------------
    def _deliver(self, xs: IntArray, times: FloatArray) -> tuple[IntArray, FloatArray]:
        """Deliver transfers ``xs`` at ``times``; end the slots that were waiting for nothing else. Returns the
        slots that begin next and when."""
        self.delivered_s[xs] = times
        slots = np.concatenate([self.send_slot[xs], self.recv_slot[xs]])
        touched, count = np.unique(slots, return_counts=True)
        self._pending[touched] -= count
        ended = self._pending[slots] == 0
        if not ended.any():
            return _NO_INT, _NO_FLOAT
        slot = slots[ended]
        when = np.concatenate([times, times])[ended]
        who = np.concatenate([xs, xs])[ended]
        last = _last_per_group(slot, when, who)
        slot, when, who = slot[last], when[last], who[last]
        self.slot_end[slot] = when
        self.slot_last[slot] = who
        rank = self.slot_rank[slot]
        after = when + self.delay[rank]
        more = slot + 1 < self.rank_stop_slot[rank]
        self.rank_end[rank[~more]] = after[~more]
        return slot[more] + 1, after[more]

    def _begin(self, slots: IntArray, times: FloatArray) -> tuple[IntArray, FloatArray]:
        """Begin ``slots`` at ``times``: the transfers whose other end has begun too start. Returns them and
        when they start (the later of their two slots)."""
        self.slot_start[slots] = times
        entries, owner = _segments(self.slot_ptr, slots)
        member = self.slot_member[entries]
        np.add.at(self._ready, member, 1)
        ready = self._ready[member] == 2
        if not ready.any():
            return _NO_INT, _NO_FLOAT
        member, slot, when = member[ready], slots[owner[ready]], times[owner[ready]]
        last = _last_per_group(member, when, slot)
        member, slot, when = member[last], slot[last], when[last]
        self.trigger[member] = slot
        self.start_s[member] = when
        return member, when

    def _set_rates(self, xs: IntArray, rates: FloatArray, dense_links: IntArray, now: FloatArray) -> None:
        """Transfers ``xs`` drain at ``rates`` from ``now`` on (those whose rate changed): bytes left, the
        slowest rate and the link that set it (rates within _LEVEL_RTOL are one level: rounding must not move
        the bottleneck named)."""
        changed = rates != self._rate[xs]
        xs, rates, dense_links, now = xs[changed], rates[changed], dense_links[changed], now[changed]
        self._left[xs] -= self._rate[xs] * (now - self._since[xs])
        self._since[xs] = now
        self._rate[xs] = rates
        slowest = self.slowest_rate[xs]
        lower = rates < slowest * (1 - _LEVEL_RTOL)
        self._bottleneck[xs[lower]] = dense_links[lower]
        self.slowest_rate[xs] = np.minimum(slowest, rates)

    def _drain_at(self, xs: IntArray) -> FloatArray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.asarray(self._since[xs] + np.maximum(self._left[xs], 0.0) / self._rate[xs], dtype=np.float64)

    def _fluid(
        self, active: IntArray, arriving: IntArray, arrive_s: FloatArray, end_s: float
    ) -> tuple[IntArray, IntArray, FloatArray]:
        """Advance the draining transfers ``active`` and those ``arriving`` at ``arrive_s`` up to ``end_s``.
        Returns the transfers still draining, and those that drained and when."""
        flows = np.concatenate([active, arriving])
        arrive = np.concatenate([np.full(active.size, -np.inf), arrive_s])
        entries, entry_flow = _segments(self.pair_ptr, self.pair[flows])
        entry_link = self.pair_link[entries]
        # Alone: no other transfer of the window on any of its links (every link it crosses carries it only).
        crowded = np.bincount(entry_link, minlength=self.link_capacity.size)[entry_link] > 1
        alone = np.ones(flows.size, dtype=np.bool_)
        alone[entry_flow[crowded]] = False
        # Alone in its component: an arriving transfer gets its solo rate and keeps it; a draining one keeps its.
        new = alone & (arrive > -np.inf)
        if new.any():
            xs, at = flows[new], arrive[new]
            self._left[xs] = self.nbytes[xs]
            self._since[xs] = at
            self._rate[xs] = 0.0
            pair = self.pair[xs]
            self._set_rates(xs, self.solo_rate[pair], self.solo_bottleneck[pair], at)
        solo = flows[alone]
        drain_s = self._drain_at(solo)
        gone = drain_s < end_s
        still = [solo[~gone]]
        drained = [solo[gone]]
        drained_s = [drain_s[gone]]

        shared = np.flatnonzero(~alone)
        if shared.size:
            keep = ~alone[entry_flow]
            sub_flow = np.cumsum(~alone) - 1  # renumbered over the shared transfers
            _, sub_link = np.unique(entry_link[keep], return_inverse=True)
            label = self._components(shared.size, sub_flow[entry_flow[keep]], sub_link.reshape(-1))
            left, out, out_s = self._shared(flows[shared], arrive[shared], label, end_s)
            still.append(left)
            drained.append(out)
            drained_s.append(out_s)
        return np.concatenate(still), np.concatenate(drained), np.concatenate(drained_s)

    @staticmethod
    def _components(num_flows: int, entry_flow: IntArray, entry_link: IntArray) -> IntArray:
        """Per flow, the smallest flow of its connected component (flows joined by a shared link): minimum
        labels propagated flow -> link -> flow, with pointer jumping, until they settle."""
        label = np.arange(num_flows, dtype=np.int64)
        by_link = np.argsort(entry_link, kind="stable")
        sorted_link = entry_link[by_link]
        link_start = np.flatnonzero(np.concatenate([[True], sorted_link[1:] != sorted_link[:-1]]))
        flow_start = np.flatnonzero(np.concatenate([[True], entry_flow[1:] != entry_flow[:-1]]))
        while True:
            link_min = np.minimum.reduceat(label[entry_flow[by_link]], link_start)
            per_entry = np.empty(entry_flow.size, dtype=np.int64)
            per_entry[by_link] = np.repeat(link_min, np.diff(np.append(link_start, sorted_link.size)))
            new = np.minimum(label, np.minimum.reduceat(per_entry, flow_start))
            new = new[new]
            if np.array_equal(new, label):
                return label
            label = new

    def _shared(
        self, flows: IntArray, arrive: FloatArray, label: IntArray, end_s: float
    ) -> tuple[IntArray, IntArray, FloatArray]:
        """The components of more than one transfer, each on its own clock, all in the same passes."""
        order = np.argsort(label, kind="stable")
        xs = flows[order]
        arrive = arrive[order]
        comp_key = label[order]
        comp_start = np.flatnonzero(np.concatenate([[True], comp_key[1:] != comp_key[:-1]]))
        comp = np.repeat(np.arange(comp_start.size), np.diff(np.append(comp_start, xs.size)))
        entries, entry_flow = _segments(self.pair_ptr, self.pair[xs])
        global_link = self.pair_link[entries]
        weight = self.pair_weight[entries]
        # Links numbered component by component, for per-component minima by reduceat.
        stride = int(global_link.max()) + 1
        keys, entry_link = np.unique(comp[entry_flow] * stride + global_link, return_inverse=True)
        entry_link = entry_link.reshape(-1)
        link_comp = keys // stride
        link_dense = keys % stride
        capacity = self.link_capacity[link_dense]
        link_comp_start = np.flatnonzero(np.concatenate([[True], link_comp[1:] != link_comp[:-1]]))

        state = np.where(arrive > -np.inf, 0, 1)  # 0 not arrived, 1 draining, 2 drained
        drained: list[IntArray] = []
        drained_s: list[FloatArray] = []
        still: list[IntArray] = []
        while True:
            self.passes += 1
            event_s = np.where(state == 0, arrive, np.inf)
            draining = state == 1
            drain_s = np.full(xs.size, np.inf)
            drain_s[draining] = self._drain_at(xs[draining])
            np.minimum(event_s, drain_s, out=event_s)
            comp_now = np.minimum.reduceat(event_s, comp_start)
            live_comp = comp_now < end_s
            if not live_comp.any():
                break
            if 2 * int(np.count_nonzero(live_comp)) < live_comp.size:
                # Components done with the window leave the arrays, so the passes left cost what is left.
                kept = live_comp[comp]
                still.append(xs[~kept & draining])
                comp_id = np.cumsum(live_comp) - 1
                flow_id = np.cumsum(kept) - 1
                link_kept = live_comp[link_comp]
                link_id = np.cumsum(link_kept) - 1
                entry_kept = kept[entry_flow]
                xs, arrive, state, draining, drain_s = (
                    xs[kept],
                    arrive[kept],
                    state[kept],
                    draining[kept],
                    drain_s[kept],
                )
                comp = comp_id[comp[kept]]
                comp_start = np.flatnonzero(np.concatenate([[True], comp[1:] != comp[:-1]]))
                entry_flow = flow_id[entry_flow[entry_kept]]
                entry_link = link_id[entry_link[entry_kept]]
                weight = weight[entry_kept]
                link_comp = comp_id[link_comp[link_kept]]
                link_dense = link_dense[link_kept]
                capacity = capacity[link_kept]
                link_comp_start = np.flatnonzero(np.concatenate([[True], link_comp[1:] != link_comp[:-1]]))
                comp_now = comp_now[live_comp]
                live_comp = live_comp[live_comp]
            now = comp_now[comp]
            live = live_comp[comp]
            horizon = now * (1 + _EVENT_RTOL)
            out = live & draining & (drain_s <= horizon)
            come = live & (state == 0) & (arrive <= horizon)
            if out.any():
                drained.append(xs[out])
                drained_s.append(now[out])
                state[out] = 2
                self._rate[xs[out]] = 0.0
            if come.any():
                new = xs[come]
                state[come] = 1
                self._left[new] = self.nbytes[new]
                self._since[new] = now[come]
                self._rate[new] = 0.0
            solve = live & (state == 1)
            if not solve.any():
                continue
            keep = solve[entry_flow]
            rate, bottleneck, levels = _fill_components(
                xs.size,
                entry_flow[keep],
                entry_link[keep],
                weight[keep],
                capacity,
                link_comp_start=link_comp_start,
                link_comp=link_comp,
            )
            self.levels += levels
            which = np.flatnonzero(solve)
            dense = np.where(bottleneck[which] >= 0, link_dense[np.maximum(bottleneck[which], 0)], -1)
            self._set_rates(xs[which], rate[which], dense, now[which])
        still.append(xs[state == 1])
        return np.concatenate(still), np.concatenate([_NO_INT, *drained]), np.concatenate([_NO_FLOAT, *drained_s])

    # -- the loop -------------------------------------------------------------------------------------
    def run(self, progress: Callable[[float], None] | None = None, *, may_give_up: bool = True) -> bool:
        """Run to the end and return True; or (``may_give_up``) return False, the run abandoned, when after the
        first _TRIAL_SHARE of the transfers the passes cost more than the per-event core would (see _MAX_WORK).
        ``progress`` (if given) is called with the fraction of transfers delivered, once per _PROGRESS_EVERY
        deliveries (at the end of the window in which they were reached), from the end of that trial on."""
        total = max(len(self.t), 1)
        trial = _TRIAL_SHARE * total if may_give_up else 0.0
        has = self.rank_first_slot < self.rank_stop_slot
        self.rank_end[~has] = self.start_at[~has]
        start_slot = self.rank_first_slot[has].astype(np.int64)
        start_at = self.start_at[has].astype(np.float64)
        deliver_x, deliver_at = _NO_INT, _NO_FLOAT
        active = _NO_INT
        lookahead = self.lookahead_s
        delivered = 0
        reported = 0
        while True:
            first = np.inf
            if deliver_at.size:
                first = min(first, float(deliver_at.min()))
            if start_at.size:
                first = min(first, float(start_at.min()))
            if active.size:
                first = min(first, float(self._drain_at(active).min()))
            if not np.isfinite(first):
                break
            self.windows += 1
            # No transfer delivers in the window unless it was scheduled before it: those draining now need at
            # least their bytes left at their solo rate plus their latency, those starting in it more.
            reach = self._soonest_s
            if active.size:
                left = self._left[active] - self._rate[active] * (first - self._since[active])
                soonest = np.maximum(left, 0.0) / self._solo_rate_of[active] + self.latency[active]
                reach = min(reach, float(soonest.min()))
            end = first + max(reach * (1 - _REACH_MARGIN), lookahead)
            due = deliver_at < end
            if due.any():
                slots, at = self._deliver(deliver_x[due], deliver_at[due])
                delivered += int(due.sum())
                deliver_x, deliver_at = deliver_x[~due], deliver_at[~due]
                start_slot, start_at = np.concatenate([start_slot, slots]), np.concatenate([start_at, at])
            due = start_at < end
            arriving, arrive_s = _NO_INT, _NO_FLOAT
            if due.any():
                xs, at = self._begin(start_slot[due], start_at[due])
                start_slot, start_at = start_slot[~due], start_at[~due]
                instant = ~self.flows[xs]
                self.drained_s[xs[instant]] = at[instant]
                deliver_x = np.concatenate([deliver_x, xs[instant]])
                deliver_at = np.concatenate([deliver_at, at[instant] + self.latency[xs[instant]]])
                arriving, arrive_s = xs[~instant], at[~instant]
            if active.size or arriving.size:
                active, out, out_s = self._fluid(active, arriving, arrive_s, end)
                if out.size:
                    self.drained_s[out] = out_s
                    deliver_x = np.concatenate([deliver_x, out])
                    deliver_at = np.concatenate([deliver_at, out_s + self.latency[out]])
            if trial and delivered >= trial:
                if self.passes + _LEVEL_COST * self.levels > _MAX_WORK * delivered:
                    return False
                trial = 0
            while not trial and progress is not None and delivered >= reported + _PROGRESS_EVERY:
                reported += _PROGRESS_EVERY
                progress(reported / total)
        dense = self._bottleneck
        self.bottleneck = np.where(dense >= 0, self.used_links[np.maximum(dense, 0)], -1)
        return True
