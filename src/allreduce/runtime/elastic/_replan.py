"""Re-planning around a slow link or rank: when one is the bottleneck consistently, the schedule that avoids it.

The group records, per directed link, the bytes its receiver got and the time they took to move
(:class:`~allreduce.runtime.GroupStats` ``links``); over TCP between hosts the senders' kernels know better (a
receiver cannot time a link whose data arrives while it is busy, or at line rate through a shaped link's burst:
runtime/tcp/_tcpinfo.py), and their counters (:func:`sender_rates`) are used instead. Every rank reads the same
gathered data, so every rank that runs :class:`Replanner` on it reaches the same decision (nothing is decided from
one rank's view).

The rule, with hysteresis so that noise never flaps the order:

- a *window* is ``window_calls`` collectives; at its end each link's rate is its bytes over its transfer time;
- a link is *slow* when even the highest rate its measurement allows is below ``slow_ratio`` times the median of
  the lowest rates the others' allow (:class:`MeasuredRate`: a receiver's timing is exact, a kernel's busy time is
  counted in jiffies, so its rate is an interval); the ratio is 1/4, not 1/2, because a healthy TCP link that
  shares a switch uplink with two other flows reads a third of the others: contention, not a slow link; when the
  slow links are most of those measured (a slow cable under most of a ring's hops) the median is one of them,
  and a gap names them instead (:func:`slow_links`);
- the order changes only when a link was seen slow in each of ``confirm_windows`` consecutive windows (links read
  slow beside it in some of them do not reset the count: a slow cable under several hops does not slow each of
  them below the bar in every window) and the α–β model, fed with the measured rates (the slow links at their
  highest, the others at their lowest), predicts the new ring at least ``min_speedup`` times faster: a ring
  all-reduce of S bytes on N ranks takes ``2(N-1)·α + 2(N-1)/N · S / r_min`` (Patarasuk and Yuan, 2009), where
  ``r_min`` is the slowest link the ring uses, so the order that maximises ``r_min`` is the one to run;
- the new order may use pairs never measured (rated at the median measured link until then): a pair that the
  kernel's counters put below the ratio in the first window it is used is acted on at once (re-planned around
  with everything measured so far), since the episode was confirmed already and a first measurement is not a
  change; a receiver's record of it (no interval) is confirmed like any other;
- over TCP, once the slow links are confirmed and before the order is chosen, the group measures every ordered
  pair (:mod:`._replan_probe`: one pairwise all-to-all on the group's own connections, sized so that the interval
  rule resolves a pair as slow as the confirmed link, read from the senders' counters) and the α–β model is fed
  all their rates, so the new order avoids every slow pair at once, not only those the old ring used, and the
  links the windows confirmed slow, which the probe's reading replaces only where it is slower: the probe is short,
  and on an emulated Clos with one spine cable at a twentieth it read 2-5 of the 4-5 ring hops that the windows had
  confirmed on the cable (0.87-0.97 MB/s) at 2.1-10 MB/s, not slow beside the median pair's lowest 7.5-9.7 MB/s (in
  five runs of seven at load 9-17; a new ring that took one back was re-planned again a window later); the probe
  runs at most once per ``probe_windows`` windows (between two, decisions stand on the rates measured so far), and
  a healthy group never runs it, since nothing is confirmed there; with all pairs known, every ring order is
  scored (up to 9 ranks), slowest link first;
- a *slow rank* is one whose every link the last measurements hold is slow: even the fastest, into it or out of
  it, below ``slow_ratio`` times the median of the other ranks' fastest links, with at least one link into it and
  one out of it, to or from two or more peers (:func:`allreduce.schedules.slow_ranks`): its own port, not a
  cable, since a slow cable slows one pair. It is acted on once slow links are confirmed (``confirm_windows``
  windows; over TCP the probe then measures all of its pairs). A ring window sees two of its links, which two slow
  cables beside one rank would also make slow: until every pair is measured, the links of a slow rank that were
  never measured are rated at its fastest measured one (not at the healthy median: no schedule is chosen for a
  rate the rank never showed);
- the schedule is the fastest that the cost model fed with those rates predicts
  (:func:`allreduce.schedules.best_schedule`: a flow takes the longest of its link's time and its two ports' time
  for all they move in the step): the best ring order, and, around a slow rank, each registered all-reduce (and a
  single binary tree) with that rank on the position that moves the fewest bytes, a tree's leaf, which moves the
  buffer once each way where a ring moves it ``2(N-1)/N`` times;
- a link the new schedule avoids is no longer measured, so after ``probe_windows`` windows the replanner goes back
  to the original ring for one window to look again (a healed link or rank is then kept, a still slow one avoided
  again). A schedule chosen around a slow rank is not re-decided from its own windows before that: a pipelined
  tree's receiver times, inside a transfer, its wait for the chunk its sender is still receiving, so those windows
  read the slow rank's links at 20-60% of the others (4 ranks over shared memory, its links paced at 2 MB/s),
  and deciding from them flapped back to a ring and to the tree again within 30 calls;
- a step's latency is measured too when a schedule is chosen: what the window's median call took beyond its
  transfers at the measured rates, per step, at least the cost model's α. A tree of 128 chunks has 135 steps; at
  the quiet machine's 25 us they are free, while the paced rank above cost 0.2-0.7 ms a step (sleeps that
  overshoot on a loaded machine), and the 128-chunk tree chosen with 25 us ran 160-380 ms a call against the
  ring's 200, where the 8-chunk tree chosen with the measured 694 us ran 145. At load 16 the same rank's steps
  cost 7-15 ms, a tree was predicted 1.1-1.2x faster and ran 0.7-1.1x: below ``min_speedup``, which keeps the
  ring there.

A rank late to every call by its own compute (a straggler: its links fine) is none of these: every schedule waits
for every rank's data, so no schedule routes around it and nothing changes (the windows show no slow link). Where
the windows gather the link records (shared memory, Unix sockets), a rank that ``group.stats()`` names late by a
quarter of a call or more, for ``confirm_windows`` windows with no link slow, is said to be one, once
(:meth:`GroupReplanning._straggler`).

The new schedule is a registered one with ranks relabelled (position ``i`` played by rank ``order[i]``,
:func:`allreduce.schedules.replan_schedule`), verified before it is offered.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from allreduce.runtime.elastic._replan_probe import ProbedGroup, gather_sent_counters, probe_pair_bytes, run_probe
from allreduce.runtime.stats._stats import GroupStats, LinkStats
from allreduce.runtime.tcp._tcpinfo import JIFFY_S
from allreduce.schedules import (
    SLOW_LINK_RATIO,
    Replan,
    Schedule,
    best_schedule,
    link_time_s,
    replan_schedule,
    slow_ranks,
)

__all__ = [
    "CONFIDENCE_Z",
    "MEASURED_SLOW_RATIO",
    "REPLAN_ENV",
    "Decision",
    "GroupReplanning",
    "MeasuredRate",
    "Probe",
    "ReplanRule",
    "Replanner",
    "busy_interval_s",
    "link_rates",
    "rate_matrix",
    "rule_from_env",
    "sender_rates",
    "slow_links",
]

Link = tuple[int, int]

Probe = Callable[[int], Mapping[Link, float]]
"""The all-pairs probe as the re-planner sees it: bytes per pair in, the rate of every pair it measured out."""


MEASURED_SLOW_RATIO = SLOW_LINK_RATIO
"""A link is slow below this share of the others (the rule's default; the schedules' constant says why)."""


@dataclass(frozen=True)
class ReplanRule:
    """When to change the ring order (the module docstring gives the rule)."""

    window_calls: int = 50
    slow_ratio: float = MEASURED_SLOW_RATIO
    confirm_windows: int = 2
    min_speedup: float = 1.25
    probe_windows: int = 20

    def __post_init__(self) -> None:
        if self.window_calls < 1 or self.confirm_windows < 1 or self.probe_windows < 1:
            raise ValueError("window_calls, confirm_windows and probe_windows must be >= 1")
        if not 0.0 < self.slow_ratio < 1.0:
            raise ValueError(f"slow_ratio must be in (0, 1), got {self.slow_ratio}")
        if not self.min_speedup >= 1.0:
            raise ValueError(f"min_speedup must be >= 1, got {self.min_speedup}")


@dataclass(frozen=True)
class Decision:
    """A new schedule and why: ``algorithm`` (``chunks`` for a pipelined tree) with position ``i`` played by rank
    ``order[i]``; ``reason`` is what ``group.stats()`` and ``ALLREDUCE_DEBUG`` print."""

    order: tuple[int, ...]
    reason: str
    predicted_speedup: float
    algorithm: str = "ring"
    chunks: int = 0

    def schedule(self) -> Schedule:
        """The schedule decided on, verified (:func:`allreduce.schedules.replan_schedule`)."""
        return replan_schedule(self.algorithm, self.order, chunks=self.chunks)


class MeasuredRate(float):
    """A link's rate in bytes per second (the float's value, the best estimate) with the interval its measurement
    allows: the true rate lies in ``[low, high]`` (``high`` may be infinite: a link never seen busy). A plain float
    is a rate measured exactly (a receiver's timing of its own transfers)."""

    __slots__ = ("high", "low")
    low: float
    high: float

    def __new__(cls, value: float, low: float, high: float) -> MeasuredRate:
        rate = super().__new__(cls, value)
        rate.low, rate.high = low, high
        return rate


def _low(rate: float) -> float:
    return rate.low if isinstance(rate, MeasuredRate) else rate


def _high(rate: float) -> float:
    return rate.high if isinstance(rate, MeasuredRate) else rate


def link_rates(links: Iterable[LinkStats]) -> dict[Link, float]:
    """Bytes per second of each link that moved data in the records."""
    return {
        (link.src, link.dst): link.size_bytes / link.transfer_total_s
        for link in links
        if link.size_bytes > 0 and link.transfer_total_s > 0
    }


CONFIDENCE_Z = 3.0
"""How many standard deviations of the jiffy count a kernel-counted busy time's interval spans (both sides)."""


def busy_interval_s(measured_s: float, *, z: float = CONFIDENCE_Z, jiffy_s: float = JIFFY_S) -> tuple[float, float]:
    """The interval of true network-limited time ``T`` that a kernel count of ``measured_s`` allows.

    The kernel adds to a connection's busy time, per busy period, the jiffies that ticked during it: a period of
    ``k + f`` jiffies counts ``k`` or ``k + 1``, ``k + 1`` with probability ``f`` when it starts at a random phase.
    So the count is unbiased, and its variance, ``Σ f(1 - f)·J²`` over the periods, is at most ``J·T`` (a period
    shorter than a jiffy adds at most ``f·J² = d·J``, a longer one at most ``J²/4 <= d·J``): whatever the number
    of periods, ``M`` lies within ``z·sqrt(J·T)`` of ``T``. Solving ``M = T ± z·sqrt(J·T)`` for ``T`` gives the
    interval; a count of 0 still allows up to ``z²`` jiffies."""
    measured = max(measured_s, 0.0)
    root_j = math.sqrt(jiffy_s)
    spread = math.sqrt(z * z * jiffy_s + 4.0 * measured)
    low = 2.0 * measured / (spread + z * root_j)  # (spread - z·sqrt(J)) / 2, without the cancellation
    high = (spread + z * root_j) / 2.0
    return low * low, high * high


DATA_LINK_SHARE = 0.25
"""In the senders' counters, a link that carried less than this share of the busiest link's bytes in a window did not
carry the collectives' data (agreement and control frames, a pair the schedule does not use): it is not rated."""


def sender_rates(before: npt.NDArray[np.float64], after: npt.NDArray[np.float64]) -> dict[Link, float]:
    """Link rates from the senders' kernel counters (``Transport.sent_counters``) gathered at two window ends: row
    ``src``, columns ``2·dst`` and ``2·dst + 1`` the bytes ``dst`` acknowledged and the seconds the network limited
    sending to it (NaN: no counters). Each is a :class:`MeasuredRate`: the bytes over the counted time (at least a
    jiffy), within the bytes over :func:`busy_interval_s`'s ends; only links that carried data are rated
    (:data:`DATA_LINK_SHARE`)."""
    acked = after[:, 0::2] - before[:, 0::2]
    busy = after[:, 1::2] - before[:, 1::2]
    moved = np.nan_to_num(acked, nan=0.0)
    floor = DATA_LINK_SHARE * float(moved.max(initial=0.0))
    src, dst = np.nonzero((moved > 0) & (moved >= floor))
    rates: dict[Link, float] = {}
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        if s == d:
            continue
        nbytes, measured = float(acked[s, d]), max(float(busy[s, d]), 0.0)
        shortest, longest = busy_interval_s(measured)
        high = nbytes / shortest if shortest > 0 else math.inf
        rates[(int(s), int(d))] = MeasuredRate(nbytes / max(measured, JIFFY_S), nbytes / longest, high)
    return rates


SPLIT_MIN_ABOVE = 3
"""A group of slow links is named by its gap (:func:`slow_links`) only below at least this many links that are
clearly faster, where one of those is a receiver's record: a receiver that never waited for a link's data times it at
any rate, so with fewer the "others" could be two links that merely never waited. Above the kernel's counts one link
is enough: a count's lowest rate is the bytes the link delivered over the longest time the count allows, a rate it
certainly reached (never waiting makes its interval wide, not its lowest rate high)."""


def slow_links(rates: Mapping[Link, float], slow_ratio: float) -> frozenset[Link]:
    """The links whose highest possible rate is below ``slow_ratio`` times the median of the others' lowest (none
    with fewer than three links measured: with two, neither is "the others"), and the links below a gap: when the
    links sorted by their highest rate split into a lower group whose highest rates are all below ``slow_ratio``
    times the lowest rate of every link above it (at least :data:`SPLIT_MIN_ABOVE` of them, or one where all are
    the kernel's counts), the lower group is slow. The gap names the slow links when they are most of the ring,
    where the median is one of them: a slow spine cable that the switches' hash gave five of a ring's eight hops
    read 1.7-3.3 MB/s beside 34-1,150 MB/s for the three others (senders' counters, an emulated 2x2 Clos at 25 MB/s
    a cable, one at a tenth), and one that it gave six read 0.8-1.0 MB/s beside 60-290 MB/s for the two others (one
    at a twentieth; every hop's highest rate at most 3.4% of the two's lowest); the healthy ring's windows there
    never split: with one or two links above, the lower group's highest rates were at least 1.7 times the lowest
    above them (100 windows at load 12-18)."""
    if len(rates) < 3:
        return frozenset()
    lows = {link: _low(rate) for link, rate in rates.items()}
    slow = []
    for link, rate in rates.items():
        others = statistics.median(low for other, low in lows.items() if other != link)
        if _high(rate) < slow_ratio * others:
            slow.append(link)
    by_high = sorted(rates, key=lambda link: (_high(rates[link]), link))
    for below in range(len(by_high) - 1, 0, -1):  # the widest lower group first
        above = by_high[below:]
        if len(above) < SPLIT_MIN_ABOVE and not all(isinstance(rates[link], MeasuredRate) for link in above):
            continue
        lowest_above = min(lows[link] for link in above)
        if _high(rates[by_high[below - 1]]) < slow_ratio * lowest_above:
            slow.extend(by_high[:below])
            break
    return frozenset(slow)


def rate_matrix(world_size: int, rates: Mapping[Link, float], slow: Iterable[int] = ()) -> npt.NDArray[np.float64]:
    """``rates`` as a matrix (``[src, dst]``), links never measured at the median measured rate (assumed healthy:
    nothing says otherwise), except those of a ``slow`` rank: at the fastest of its measured links (a rank whose
    every link measured slow is slow on the others too, so no schedule is chosen for a rate it never showed)."""
    default = statistics.median(rates.values()) if rates else 1.0
    matrix = np.full((world_size, world_size), default)
    for rank in slow:
        own = max(rate for link, rate in rates.items() if rank in link)
        matrix[rank, :] = np.minimum(matrix[rank, :], own)
        matrix[:, rank] = np.minimum(matrix[:, rank], own)
    for (src, dst), rate in rates.items():
        matrix[src, dst] = rate
    return matrix


def _cautious(rates: Mapping[Link, float], slow: frozenset[Link]) -> dict[Link, float]:
    """The rates a prediction can stand on: slow links at the highest their measurement allows, the others at the
    lowest (the gain it predicts is then the least the measurements allow)."""
    return {link: _high(rate) if link in slow else _low(rate) for link, rate in rates.items()}


@dataclass
class Replanner:
    """Feeds on one window of link rates at a time and says when to change the schedule (and back)."""

    world_size: int
    rule: ReplanRule = field(default_factory=ReplanRule)
    order: tuple[int, ...] = ()
    """Which rank plays each position of the schedule run now (:attr:`algorithm`)."""
    algorithm: str = "ring"
    chunks: int = 0
    _seen: frozenset[Link] = frozenset()
    _streak: int = 0
    _since_change: int = 0
    _probing: bool = False
    _refining: bool = False
    _last_rates: dict[Link, float] = field(default_factory=dict)
    _estimates: dict[Link, float] = field(default_factory=dict)
    """The last reading of each link at its best estimate (``_last_rates`` holds the cautious ends)."""
    _since_probe: int | None = None
    _schedule: Schedule | None = None
    probes: list[str] = field(default_factory=list)
    """What each probe found and whether the order changed, in the words ``group.stats()`` prints."""

    def __post_init__(self) -> None:
        if not self.order:
            self.order = tuple(range(self.world_size))

    @property
    def schedule(self) -> Schedule | None:
        """The schedule to run, verified; None for the original ring."""
        if (self.algorithm, self.order) == ("ring", tuple(range(self.world_size))):
            return None
        if self._schedule is None:
            self._schedule = replan_schedule(self.algorithm, self.order, chunks=self.chunks)
        return self._schedule

    def observe(
        self,
        rates: Mapping[Link, float],
        *,
        size_bytes: float,
        alpha_s: float,
        probe: Probe | None = None,
        call_s: Callable[[], float] | None = None,
    ) -> Decision | None:
        """One window's link rates; a :class:`Decision` when the schedule changes, else None. ``probe`` (bytes per
        pair -> the rate of every pair) is run when slow links are confirmed and no probe ran in the last
        ``probe_windows`` windows; its rates then replace everything measured before, except the confirmed slow
        links that it reads faster (see the module docstring). ``call_s`` (the window's median call, in seconds) is
        asked for when a schedule is to be chosen: a step's latency is then at least what the call took beyond its
        transfers (:meth:`_latency_s`)."""
        identity = tuple(range(self.world_size))
        self._since_change += 1
        if self._since_probe is not None:
            self._since_probe += 1
        slow = slow_links(rates, self.rule.slow_ratio)
        if self._probing:  # the window in the original order is over: keep it if nothing is slow any more
            self._probing = False
            if not slow:
                self._seen, self._streak = frozenset(), 0
                return None
        elif (self.order, self.algorithm) != (identity, "ring") and self._since_change >= self.rule.probe_windows:
            self._probing, self._since_change = True, 0
            self.order, self.algorithm, self.chunks, self._schedule = identity, "ring", 0, None
            return Decision(identity, "probing the original ring order: avoided links are not measured", 1.0)
        elif self.algorithm != "ring":
            return None  # a tree's windows rate no link (see the module docstring): it stands until the look back
        if slow & self._seen:  # a link slow in every window of the streak: confirmed, whatever else read slow
            self._streak, self._seen = self._streak + 1, slow & self._seen
        else:
            self._streak, self._seen = (1 if slow else 0), slow
        refining, self._refining = self._refining, False
        # A pair the new order uses for the first time, read slow by the kernel's interval in its first window, is a
        # first measurement, not a change to confirm: the episode was confirmed already. Links read slow beside it
        # are taken as read (a slow cable delays the ACKs of flows whose return path crosses it).
        first_seen = any(link not in self._last_rates and isinstance(rates[link], MeasuredRate) for link in slow)
        self._last_rates = {**self._last_rates, **_cautious(rates, slow)}
        self._estimates = {**self._estimates, **{link: float(rate) for link, rate in rates.items()}}
        if not slow or (self._streak < self.rule.confirm_windows and not (refining and first_seen)):
            return None
        median = statistics.median(rate for link, rate in rates.items() if link not in slow)
        worst = min(slow, key=lambda link: rates[link])
        calls = f"for {self._streak * self.rule.window_calls} calls"
        seen = f"link {worst[0]}->{worst[1]} at {_share(rates[worst] / median)} of the others' median {calls}"
        probed = ""
        if probe is not None and (self._since_probe is None or self._since_probe >= self.rule.probe_windows):
            pair_bytes = probe_pair_bytes(max(_high(rates[link]) for link in slow))
            measured = probe(pair_bytes)
            self._since_probe = 0
            if len(measured) >= 3:  # every pair measured at once: the earlier windows' rates are older news,
                found = slow_links(measured, self.rule.slow_ratio)
                kept = {link: rates[link] for link in self._seen - found}  # but for the slow links they confirmed
                measured, found = {**measured, **kept}, found | frozenset(kept)
                self._last_rates = _cautious(measured, found)
                self._estimates = {link: float(rate) for link, rate in measured.items()}
                probed = f"; probed {len(measured)} pairs with {pair_bytes / 2**20:.2g} MiB each: {_named(found)} slow"
                probed += f" ({len(kept)} read faster by the probe, slow as confirmed)" if kept else ""
        return self._choose(seen, probed, median=median, size_bytes=size_bytes, alpha_s=alpha_s, call_s=call_s)

    def _latency_s(self, ranks: tuple[int, ...], size_bytes: float, alpha_s: float, call_s: float) -> float:
        """A step's latency as measured: what the schedule run now took per call beyond its transfers at the
        measured rates (their best estimates), per step; at least ``alpha_s``. Steps cost more than the cost model's
        α where ranks share cores or links are shaped by sleeping senders, and a tree of many chunks has many steps:
        a choice made with the quiet machine's α would take them for free."""
        running = self.schedule or replan_schedule("ring", self.order)
        transfers_s = link_time_s(running, size_bytes, rate_matrix(self.world_size, self._estimates, ranks))
        return max(alpha_s, (call_s - transfers_s) / max(running.num_steps, 1))

    def _choose(
        self,
        seen: str,
        probed: str,
        *,
        median: float,
        size_bytes: float,
        alpha_s: float,
        call_s: Callable[[], float] | None,
    ) -> Decision | None:
        """The schedule the measured rates predict fastest (:func:`allreduce.schedules.best_schedule`), as a
        :class:`Decision` when it is new and at least ``min_speedup`` times faster than the schedule run now."""
        ranks = slow_ranks(self._last_rates, self.rule.slow_ratio)
        matrix = rate_matrix(self.world_size, self._last_rates, ranks)
        if call_s is not None:
            alpha_s = self._latency_s(ranks, size_bytes, alpha_s, call_s())
        current = self.order if self.algorithm == "ring" else None
        proposal = best_schedule(matrix, size_bytes, latency_s=alpha_s, slow=ranks, current=current)
        running = self.schedule or replan_schedule("ring", self.order)
        before = link_time_s(running, size_bytes, matrix, latency_s=alpha_s)
        speedup = before / proposal.seconds if proposal.seconds > 0 else 1.0
        if ranks:
            rank = ranks[0]
            own = max(rate for link, rate in self._last_rates.items() if rank in link)
            links = sum(rank in link for link in self._last_rates)
            seen = (f"rank {rank}: all {links} of its links measured slow, the fastest at {_share(own / median)} of "
                    f"the others' median ({seen})")  # fmt: skip
        unchanged = (proposal.algorithm, proposal.order, proposal.chunks) == (self.algorithm, self.order, self.chunks)
        if unchanged or speedup < self.rule.min_speedup:
            if probed:
                kept = f"schedule kept (no schedule predicted {self.rule.min_speedup}x faster)"
                self.probes.append(f"{seen}{probed}: {kept}")
            return None
        schedule = proposal.schedule()  # verified before it is offered
        self.order, self.algorithm, self.chunks, self._schedule = (
            proposal.order, proposal.algorithm, proposal.chunks, schedule
        )  # fmt: skip
        self._since_change, self._refining = 0, True
        reason = f"{seen}{probed}: {_described(proposal, ranks)}; predicted {speedup:.1f}x faster"
        reason += f" (a step's latency {alpha_s * 1e6:.3g} us)" if proposal.algorithm != "ring" else ""
        if probed:
            self.probes.append(reason)
        return Decision(proposal.order, reason, speedup, proposal.algorithm, proposal.chunks)


def _described(plan: Replan, ranks: tuple[int, ...]) -> str:
    """``ring reordered 0,2,1,3``, or ``double_binary_tree (32 chunks) with rank 3 on a leaf, ranks 3,1,2,0``."""
    order = ",".join(map(str, plan.order))
    if plan.algorithm == "ring":
        return f"ring reordered {order}"
    chunks = f" ({plan.chunks} chunks)" if plan.chunks else ""
    where = "on a leaf" if plan.algorithm == "binary_tree" else "where it moves the fewest bytes"
    named = ", ".join(map(str, ranks))
    return f"{plan.algorithm}{chunks} with rank{'s' if len(ranks) > 1 else ''} {named} {where}, positions {order}"


def _share(fraction: float) -> str:
    """``10%``, ``0.12%``: a share in two significant digits (a link paced at 2 MB/s beside 2 GB/s is not 0%)."""
    return f"{100 * fraction:.2g}%"


def _named(links: frozenset[Link]) -> str:
    """``3 (1->2, 1->3, 2->3)``: how many links, and which (the first eight)."""
    if not links:
        return "none"
    names = [f"{src}->{dst}" for src, dst in sorted(links)]
    more = ", ..." if len(names) > 8 else ""
    return f"{len(names)} ({', '.join(names[:8])}{more})"


REPLAN_ENV = "ALLREDUCE_REPLAN"
"""``1`` turns re-planning on with the default rule; ``window=20,ratio=0.25,confirm=2,speedup=1.25,probe=20`` sets
the rule (any of the five, the others default); unset, empty or ``0`` leaves it off."""

_RULE_FIELDS = {
    "window": ("window_calls", int),
    "ratio": ("slow_ratio", float),
    "confirm": ("confirm_windows", int),
    "speedup": ("min_speedup", float),
    "probe": ("probe_windows", int),
}
STRAGGLER_SHARE = 0.25
"""A rank whose median lateness is at least this share of the median call (and which ``group.stats()`` names as
standing out) is reported as a compute straggler: less is the ordinary spread of ranks sharing cores."""
_MAX_RULE_INT = 1_000_000
_MIN_AUTO_BYTES = 1 << 20
"""An ``auto`` all-reduce takes the re-planned ring from this size on (there the ring's bandwidth matters; below it
auto's latency-bound picks stay)."""


def rule_from_env(value: str | None) -> ReplanRule | None:
    """The rule :data:`REPLAN_ENV` asks for, or None; ``ValueError`` naming the variable and the field."""
    text = (value or "").strip()
    if text in ("", "0"):
        return None
    if text == "1":
        return ReplanRule()
    fields: dict[str, float | int] = {}
    for item in text.split(","):
        key, sep, raw = item.partition("=")
        if not sep or key.strip() not in _RULE_FIELDS:
            raise ValueError(
                f"{REPLAN_ENV}={text[:60]!r}: {item.strip()[:20]!r} is not one of "
                f"{', '.join(f'{k}=...' for k in _RULE_FIELDS)} (or 1 for the defaults)"
            )
        name, kind = _RULE_FIELDS[key.strip()]
        try:
            number = kind(raw.strip())
        except ValueError:
            what = "whole number" if kind is int else "number"
            raise ValueError(f"{REPLAN_ENV}: {key.strip()}={raw.strip()[:20]!r} is not a {what}") from None
        if kind is int and not 1 <= number <= _MAX_RULE_INT:
            raise ValueError(f"{REPLAN_ENV}: {key.strip()} must be in 1..{_MAX_RULE_INT:,}, got {number}")
        fields[name] = number
    try:
        return ReplanRule(**fields)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"{REPLAN_ENV}: {exc}") from None


class GroupReplanning:
    """A group's re-planning: which schedule its all-reduces run, and the window count that calls for a look.

    Every rank of the group counts the same all-reduces and, every ``window_calls`` of them, gathers the link
    rates of all ranks (the senders' kernel counters, all-gathered, or ``group.stats``: collectives), and runs the
    all-pairs probe together when the rule asks for it, so every rank feeds :class:`Replanner` the same rates and
    adopts the same order: nothing is decided from one rank's view."""

    def __init__(self, world_size: int, rule: ReplanRule, latency_s: float) -> None:
        self.rule = rule
        self.replanner = Replanner(world_size, rule)
        self.latency_s = latency_s
        self.calls = 0
        self.window_bytes = 0
        self.schedule: Schedule | None = None
        self.changes: list[str] = []
        """Each change of order, and each probe that kept the order, with the call it came after."""
        self._sent_before: npt.NDArray[np.float64] | None = None
        self._stats: GroupStats | None = None  # the window's records, where they were gathered
        self._late_windows = 0
        self._said_late: int | None = None  # the straggler named last: not named again while it stays the one

    def sent_rates(self, table: npt.NDArray[np.float64]) -> dict[Link, float]:
        """:func:`sender_rates` between the counters gathered last (zeros the first time, and for a connection made
        since) and ``table``, which the next rates are then counted from."""
        before = np.zeros_like(table) if self._sent_before is None else self._sent_before
        before = np.where(np.isnan(before) & ~np.isnan(table), 0.0, before)  # a connection made since: from zero
        self._sent_before = table
        return sender_rates(before, table)

    def algorithm(self, requested: object, nbytes: int) -> object:
        """The algorithm to run for a call that asked for ``requested``: the re-planned ring for ``ring``, and for
        ``auto`` from :data:`_MIN_AUTO_BYTES` on; anything else (another name, a schedule) as asked."""
        if self.schedule is None or requested.__class__ is not str:
            return requested
        if requested == "ring" or (requested == "auto" and nbytes >= _MIN_AUTO_BYTES):
            return self.schedule
        return requested

    def measured_rates(self, group: ProbedGroup, last: int) -> Mapping[Link, float]:
        """The link rates since the last look (a collective): the senders' kernel counters, all-gathered, where the
        transport keeps them (tcp across hosts), else the receivers' records of the last ``last`` calls. Every rank
        decides from the same gathered data, so every rank takes the same source."""
        table = gather_sent_counters(group)
        if table is not None:
            rates = self.sent_rates(table)
            if rates:
                return rates
        stats = group.stats(last)
        self._stats = stats
        return link_rates(stats.links)

    def probe(self, group: ProbedGroup, pair_bytes: int) -> Mapping[Link, float]:
        """The all-pairs probe (:mod:`._replan_probe`) and the rate of every pair it measured (collectives): from
        the senders' counters only. A receiver's record of an all-to-all step is no rate: it waits there for a
        sender still busy with the step before (over shared memory, or Unix sockets, the windows decide alone)."""
        run_probe(group, pair_bytes)
        table = gather_sent_counters(group)
        return {} if table is None else self.sent_rates(table)

    def after_call(self, nbytes: int, group: ProbedGroup) -> Decision | None:
        """Count one all-reduce of ``nbytes``; at a window's end, gather the link rates of the last calls and decide
        (probing every pair first when the rule asks)."""
        self.calls += 1
        self.window_bytes += nbytes
        window = self.rule.window_calls
        if self.calls % window:
            return None
        self._stats = None
        rates = self.measured_rates(group, window)
        size, self.window_bytes = self.window_bytes / window, 0
        probes = len(self.replanner.probes)
        counted = all(isinstance(rate, MeasuredRate) for rate in rates.values())  # the kernel's: a probe can be read
        decision = self.replanner.observe(
            rates, size_bytes=size, alpha_s=self.latency_s,
            probe=(lambda pair_bytes: self.probe(group, pair_bytes)) if counted else None,
            call_s=lambda: max(rank.time_p50_s for rank in group.stats(window).ranks),
        )  # fmt: skip
        if decision is not None:
            self.schedule = self.replanner.schedule
            self.changes.append(f"after call {self.calls}: {decision.reason}")
        elif len(self.replanner.probes) > probes:
            self.changes.append(f"after call {self.calls}: {self.replanner.probes[-1]}")
        else:
            self._straggler(rates, group.rank)
        return decision

    def _straggler(self, rates: Mapping[Link, float], rank: int) -> None:
        """Say once, when it is confirmed, that a rank is late to its calls while no link is slow: a compute
        straggler, which no schedule routes around (every one waits for its data). Confirmed as a slow link is
        (``confirm_windows`` windows running) from the window's gathered records (:data:`STRAGGLER_SHARE`), and not
        said again while the same rank is the one; over TCP, where the senders' counters are gathered instead,
        ``group.stats()`` names the late rank as always."""
        stats = self._stats
        late = None if stats is None or stats.slowest_rank is None else stats.ranks[stats.slowest_rank]
        call_s = 0.0 if stats is None else max((r.time_p50_s for r in stats.ranks), default=0.0)
        if late is None or slow_links(rates, self.rule.slow_ratio) or late.late_p50_s < STRAGGLER_SHARE * call_s:
            self._late_windows = 0
            return
        self._late_windows += 1
        if self._late_windows < self.rule.confirm_windows or late.rank == self._said_late:
            return
        self._said_late = late.rank
        note = (
            f"after call {self.calls}: rank {late.rank} late by a median {late.late_p50_s * 1e3:.3g} ms a call for "
            f"{self._late_windows * self.rule.window_calls} calls, no link slow: a compute straggler, which no "
            "schedule routes around (every one waits for its data); nothing changed"
        )
        self.changes.append(note)
        if rank == 0 and os.environ.get("ALLREDUCE_DEBUG"):
            print(f"allreduce: re-planning: {note.partition(': ')[2]}", file=sys.stderr, flush=True)
