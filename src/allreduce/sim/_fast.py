"""The fast engine: one fair-rate computation per flow pattern, per-rank clocks advanced as arrays.

For each phase of :meth:`Schedule.phases` (a flow pattern that ``repeat`` consecutive steps reuse), the flows
are routed and their max-min fair rates computed once (patterns are cached, so ring all-reduce routes once for
its 2(N-1) steps). Each flow then takes ``path latency + bytes / rate`` and the per-rank clocks advance through
the project's one timing recurrence (:func:`allreduce.schedules.timing.propagate`), which also skips whole cycles of a
repeated pattern once the clocks move in lockstep. Nothing is one Python object per transfer.

Sizes axis (:func:`run_fast_sizes`): the patterns, routes and fair rates do not depend on the buffer size, only
the bytes per flow do, so one run takes several sizes: the clocks are an array of sizes x ranks, stepped together
(by slices for cyclic shifts such as a ring's, else by the phase's incidence layers), and each size skips its own
cycles by propagate's rule when its own clocks settle. Every step is additions and maxima, element by element,
and the one sum (a cycle's mean increment) is taken over the same contiguous values, so each size's result is the
one it gets alone, to the bit; one size is the same run with one row. The certificate below is kept per size.

The approximation, against the event engine: every flow of a step is assumed to run at the rate it gets when
*all* flows of its pattern run together, for its whole duration. The engine certifies its own result
(``SimResult.exact``; ``run_fast_checked`` returns the flag) in two cases where that is provably right:

- lockstep: every flow of a step starts at one instant, after every earlier flow was delivered, and all end
  at one instant (equal bytes at equal rates and equal path latencies; symmetric patterns on symmetric
  topologies, spraying, one switch);
- timing-independent rates: no link can be a shared bottleneck, i.e. with every flow of the phase (and of
  earlier phases that may still drain) at its solo rate at once, every link has room. Then whichever flows
  overlap, each gets its solo rate, its duration is fixed, and the shared recurrence is exactly the event
  engine's. This covers rings with linear placement on fat-trees, Clos and tori, whose hops take paths of
  different lengths (so ranks leave lockstep) but never share a link, and a degraded link on such a ring.

``engine="auto"`` keeps a certified result and runs the event engine otherwise, for every schedule on at most
256 ranks; beyond, it returns the fast result with ``exact`` False (the CLI marks it).

When ranks drift apart the two engines legitimately differ. ``benchmarks/bench_sim_agreement.py`` measures
it (256 MiB, 16-256 ranks, 160 cases, 53 certified): uncertified, the fast engine is pessimistic by up to
+22.6% (halving-doubling and recursive doubling with ECMP collisions, random placement on tori and rails), up
to +9% for double binary trees, +4.6% for hierarchical and +10.2% for rings on randomly placed tori, and
optimistic by at most -0.9% (hierarchical, linear placement on an ECMP fat-tree); 56 of the 107 uncertified
cases are within 1% all the same. Cause, measured phase by phase: an ECMP collision or an uneven path
in step k makes some ranks finish late, so in step k+1 their flows start later than their competitors' and
overlap them only partly; in the event engine a flow runs faster while its competitors have not started or
have already finished, the fast engine charges it full contention for its whole duration. (The optimistic
case is the converse: a rank that ran ahead starts its next step's flows while others still drain, and those
compete across steps, which a per-phase model never sees.) Two per-phase remedies were measured and not
adopted: re-solving the rates as flows of a step finish (water-filling from a common start) changed no
16- or 64-rank case of the grid by even 0.01%, because the flows that collide share one link and finish
together; the gap is the staggered *starts*, which follow from every rank's clock in the previous steps, and
resolving them is an event simulation of the step (one rate solve per distinct start time), i.e. the event
engine. For repeated rings on randomly placed tori the event engine's pace approaches the most loaded
link's bytes / capacity per step (256 ranks: bound 64.17 ms, event 65.0-65.1 ms, fast 71.82 ms): links stay
busy while path latencies overlap. Not exact (1.3%), and for other schedules that bound is far off (128 ranks:
-0.1% for a ring on a random torus, but -7% to -24% for halving-doubling on an ECMP fat-tree and -37% for
recursive doubling on a random rail), so not used either; nor is jumping to a periodic regime,
which such runs never reach (per-rank step times measured over all 126 steps of a 64-rank ring on a random
8x8 torus: no period up to 63 steps, the spread of one step's duration across ranks stays 5-15%). Hence the
certificate above, and the event engine wherever it fails on at most 256 ranks.

Attribution: the steady-state pace of a repeated pattern under the recurrence is its max cycle mean, which is
the slowest flow's duration plus the larger delay of its two ranks (every cycle mean is an average of such
terms, and that flow's self-loop attains it). So each phase's share of the end time is attributed to its
slowest flows; their bottleneck links are the links the critical path waited on.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt

from allreduce.schedules import Phase, Schedule
from allreduce.schedules.timing import Incidence
from allreduce.sim._cyclic import Cyclic
from allreduce.sim._result import CriticalStep, PhaseResult, SimResult
from allreduce.sim._routing import Pattern, Router
from allreduce.sim._summary import summarize_bottlenecks
from allreduce.topology import Routes, Topology

__all__ = [
    "PhaseSteps",
    "phase_steps",
    "rates_fixed_under_any_timing",
    "run_fast",
    "run_fast_certified",
    "run_fast_checked",
    "run_fast_sizes",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# Flows whose pace is within this relative distance of the slowest one are all "critical".
_CRITICAL_RTOL = 1e-9
# Starts and durations that agree to this relative distance are "the same instant" for the lockstep check.
_LOCKSTEP_RTOL = 1e-9


def run_fast(
    schedule: Schedule,
    router: Router,
    *,
    size_bytes: float,
    rank_delay_s: FloatArray | None,
    trace_ranks: int,
) -> SimResult:
    (result,) = run_fast_sizes(
        schedule, router, sizes_bytes=[size_bytes], rank_delay_s=rank_delay_s, trace_ranks=trace_ranks
    )
    return result


def run_fast_checked(
    schedule: Schedule,
    router: Router,
    *,
    size_bytes: float,
    rank_delay_s: FloatArray | None,
    trace_ranks: int,
) -> tuple[SimResult, bool]:
    """The fast engine's result, and whether it is certified exact (lockstep, or rates no timing can change:
    see the module docstring). The last few are remembered per schedule (see :data:`_CHECKED`): the result is
    shared, to be read, not changed."""
    where = router.shared_key
    key = None
    if where is not None:
        delay = b"-" if rank_delay_s is None else np.ascontiguousarray(rank_delay_s, dtype=np.float64).tobytes()
        key = where + np.asarray([size_bytes, trace_ranks], dtype=np.float64).tobytes() + delay
        known = _CHECKED.get(schedule)
        hit = None if known is None else known.get(key)
        if hit is not None and hit[0]() is router.topology:
            return hit[1], hit[1].exact
    result = run_fast(schedule, router, size_bytes=size_bytes, rank_delay_s=rank_delay_s, trace_ranks=trace_ranks)
    if key is not None:
        known = _CHECKED.setdefault(schedule, OrderedDict())
        known[key] = (weakref.ref(router.topology), result)
        if len(known) > _CHECKED_PER_SCHEDULE:
            known.popitem(last=False)
    return result, result.exact


# The Monte Carlo's noise-free runs (run_fast_checked), per schedule object, by router (topology object,
# placement, routing, seed), size, trace ranks and rank delays: a plan's loss rows run each bucket size's tail
# once per loss model, each beginning with the same noise-free run. A few per schedule (the plan's bucket sizes),
# gone with it.
_CHECKED: weakref.WeakKeyDictionary[Schedule, OrderedDict[bytes, tuple[weakref.ref[Topology], SimResult]]] = (
    weakref.WeakKeyDictionary()
)
_CHECKED_PER_SCHEDULE = 4


def run_fast_sizes(
    schedule: Schedule,
    router: Router,
    *,
    sizes_bytes: Sequence[float],
    rank_delay_s: FloatArray | None,
    trace_ranks: int,
) -> list[SimResult]:
    """The fast engine's result for every buffer size of ``sizes_bytes``, each the one that size gets alone
    (its ``exact`` says whether it is certified): one routing and fair-rate computation per phase for all of
    them, their clocks advanced together as columns (see the module docstring)."""
    results = _run_sizes(schedule, router, sizes_bytes, rank_delay_s, trace_ranks, certified_only=False)
    assert results is not None
    return results


def run_fast_certified(
    schedule: Schedule,
    router: Router,
    *,
    sizes_bytes: Sequence[float],
    rank_delay_s: FloatArray | None,
    trace_ranks: int,
) -> list[SimResult] | None:
    """:func:`run_fast_sizes`, for a caller that has no use for results not certified exact (it runs the event
    engine for those): None, without simulating the phases left, once no size is certified."""
    return _run_sizes(schedule, router, sizes_bytes, rank_delay_s, trace_ranks, certified_only=True)


def _run_sizes(
    schedule: Schedule,
    router: Router,
    sizes_bytes: Sequence[float],
    rank_delay_s: FloatArray | None,
    trace_ranks: int,
    *,
    certified_only: bool,
) -> list[SimResult] | None:
    topology = router.topology
    n = schedule.world_size
    sizes = np.asarray(sizes_bytes, dtype=np.float64).reshape(-1)
    count = sizes.size
    columns = np.arange(count)
    clock = np.zeros((count, n), dtype=np.float64)
    link_bytes = np.zeros((count, topology.num_links), dtype=np.float64)
    waited = np.zeros((count, topology.num_links), dtype=np.float64)
    delay = np.zeros(n, dtype=np.float64) if rank_delay_s is None else rank_delay_s
    phases: list[list[PhaseResult]] = [[] for _ in columns]
    critical: list[list[CriticalStep]] = [[] for _ in columns]
    labels: list[str] = []
    trace_start: list[FloatArray] = []
    trace_end: list[FloatArray] = []
    k = min(n, trace_ranks)
    path_end = np.zeros(count)
    certificate = _Certificate(router, n, count)
    for phase in schedule.phases():
        pattern = router.pattern(phase.src, phase.dst)
        nbytes = phase.fraction * sizes[:, None]  # (sizes, flows)
        transfer = pattern.transfer_seconds(nbytes)
        latency = pattern.routes.latency_s
        flow_seconds = latency + transfer
        certificate.check(phase, pattern, clock=clock, nbytes=nbytes, flow_seconds=flow_seconds, delay=delay)
        if certified_only and not certificate.exact.any():
            return None
        before = clock[:, :k].copy()
        active = phase_steps(n, phase).active
        begin = np.take(clock, active, axis=1).min(axis=1)
        clock = _advance(clock, phase, flow_seconds, rank_delay_s)
        end = np.take(clock, active, axis=1).max(axis=1)
        certificate.done(phase, clock)
        for j in columns:
            link_bytes[j] += pattern.link_bytes(nbytes[j], topology.num_links) * phase.repeat

        # Each size's share of the end time in this phase, and who set its pace.
        share_s = np.maximum(0.0, end - path_end)
        path_end = np.maximum(path_end, end)
        flow_delay = np.maximum(delay[phase.src], delay[phase.dst])
        pace = flow_seconds + flow_delay
        if len(phase):
            worst = np.argmax(pace, axis=1)
            tied = pace >= pace[columns, worst][:, None] * (1 - _CRITICAL_RTOL)
            limited = tied & (transfer > 0) & (pattern.bottleneck_link >= 0)
            for j in columns:
                w = int(worst[j])
                if share_s[j] > 0 and limited[j].any():
                    # The share of the pace that was bytes on the link, not path latency or a slow rank.
                    fraction = transfer[j, w] / pace[j, w] if pace[j, w] > 0 else 0.0
                    links = np.unique(pattern.bottleneck_link[limited[j]])
                    waited[j, links] += share_s[j] * fraction
                critical[j].append(
                    CriticalStep(
                        first_step=phase.first_step,
                        last_step=phase.first_step + phase.repeat - 1,
                        src_rank=int(phase.src[w]),
                        dst_rank=int(phase.dst[w]),
                        seconds=float(share_s[j]),
                        transfer_s=float(transfer[j, w]),
                        latency_s=float(latency[w]),
                        rank_delay_s=float(flow_delay[w]),
                        rate_Bps=float(pattern.rate_Bps[w]),
                        bottleneck_link=int(pattern.bottleneck_link[w]),
                    )
                )
        rates = pattern.rate_Bps
        slowest = float(rates.min()) if rates.size else float("inf")
        median = float(np.median(rates)) if rates.size else float("inf")
        for j in columns:
            phases[j].append(
                PhaseResult(
                    first_step=phase.first_step,
                    repeat=phase.repeat,
                    num_flows=len(phase),
                    start_s=float(begin[j]),
                    end_s=float(end[j]),
                    slowest_rate_Bps=slowest,
                    fair_share_Bps=median,
                )
            )
        last = phase.first_step + phase.repeat - 1
        labels.append(f"steps {phase.first_step}-{last}" if phase.repeat > 1 else f"step {phase.first_step}")
        trace_start.append(before)
        trace_end.append(clock[:, :k].copy())

    starts = np.asarray(trace_start, dtype=np.float64).reshape(len(labels), count, k)
    ends = np.asarray(trace_end, dtype=np.float64).reshape(len(labels), count, k)
    results = []
    for j in columns:
        rank_end = clock[j].copy()
        seconds = float(rank_end.max()) if n else 0.0
        bottlenecks, critical_links = summarize_bottlenecks(topology, waited[j], link_bytes[j], seconds)
        results.append(
            SimResult(
                name=schedule.name,
                collective=schedule.collective,
                world_size=n,
                size_bytes=float(sizes[j]),
                seconds=seconds,
                engine="fast",
                topology=topology,
                rank_gpu=router.rank_gpu,
                phases=tuple(phases[j]),
                link_bytes=link_bytes[j].copy(),
                critical_path=tuple(critical[j]),
                bottlenecks=bottlenecks,
                critical_links=critical_links,
                rank_end_s=rank_end,
                trace_labels=tuple(labels),
                trace_start_s=np.ascontiguousarray(starts[:, j]),
                trace_end_s=np.ascontiguousarray(ends[:, j]),
                exact=bool(certificate.exact[j]),
            )
        )
    return results


class _Certificate:
    """Whether each size's run is still certified exact (see the module docstring), checked phase by phase
    before the phase runs (:meth:`check`) and recorded after it (:meth:`done`). Each size keeps its own state;
    the routes of one set of live rank pairs are checked once for every size that has that set."""

    def __init__(self, router: Router, world_size: int, count: int) -> None:
        self.router = router
        self.world_size = world_size
        self.exact = np.ones(count, dtype=np.bool_)
        # When the last rank so far finished its steps, per size (while exact).
        self.latest_end = np.zeros(count)
        # Per earlier phase: when its last flow was delivered, per size, and per size its flows that carry
        # bytes (None for a size no longer exact).
        self.earlier: list[tuple[FloatArray, list[_Pairs | None]]] = []
        self._pairs: list[_Pairs | None] = [None] * count
        self._phases = 0
        self._verdicts: dict[tuple[tuple[int, int], ...], bool] = {}

    def check(
        self,
        phase: Phase,
        pattern: Pattern,
        *,
        clock: FloatArray,
        nbytes: FloatArray,
        flow_seconds: FloatArray,
        delay: FloatArray,
    ) -> None:
        self._phases += 1
        self._pairs = [None] * self.exact.size
        if not len(phase) or not self.exact.any():
            return
        n = self.world_size
        checked = np.flatnonzero(self.exact)
        self._pairs = _pairs_by_size(phase, nbytes, checked, n, self._phases)
        starts = np.maximum(np.take(clock, phase.src, axis=1), np.take(clock, phase.dst, axis=1))
        locked = _in_lockstep(starts[checked], phase, flow_seconds[checked], delay, self.latest_end[checked])
        for j in checked[~locked]:
            pairs = self._pairs[j]
            assert pairs is not None
            # This phase's flows, and every earlier phase's that may still drain when its first one starts.
            # A rank pair counts once: its transfers run one after the other.
            first = float(starts[j].min())
            parts = [pairs, *(q for end, kept in self.earlier if end[j] > first and (q := kept[j]) is not None)]
            key = tuple(part.label for part in parts)
            if key not in self._verdicts:
                live = np.unique(np.concatenate([part.keys for part in parts]))
                # The live pairs are often the phase's own flows in their order (a ring's, say), already routed.
                if np.array_equal(live, phase.src * n + phase.dst):
                    routes = pattern.routes
                else:
                    routes = self.router.route_ranks(live // n, live % n)
                self._verdicts[key] = _rates_independent_of_timing(routes, self.router.topology)
            self.exact[j] = self._verdicts[key]

    def done(self, phase: Phase, clock: FloatArray) -> None:
        if not len(phase) or not self.exact.any():
            return
        still = np.flatnonzero(self.exact)
        self.latest_end[still] = np.maximum(self.latest_end[still], clock[still].max(axis=1))
        self.earlier.append((self.latest_end.copy(), [p if self.exact[j] else None for j, p in enumerate(self._pairs)]))


@dataclass(frozen=True, eq=False)
class _Pairs:
    """A phase's flows that carry bytes, as src * n + dst keys; ``label`` (phase, which of its sets) names them."""

    label: tuple[int, int]
    keys: IntArray


def _pairs_by_size(
    phase: Phase, nbytes: FloatArray, sizes: IntArray, world_size: int, index: int
) -> list[_Pairs | None]:
    """Per size (those in ``sizes``; None for the others), the flows of phase ``index`` that carry bytes: one set
    for all sizes whose flows carry bytes alike."""
    out: list[_Pairs | None] = [None] * nbytes.shape[0]
    by_mask: dict[bytes, _Pairs] = {}
    for j in sizes:
        carries = nbytes[j] > 0
        mask = carries.tobytes()
        if mask not in by_mask:
            by_mask[mask] = _Pairs((index, len(by_mask)), phase.src[carries] * world_size + phase.dst[carries])
        out[j] = by_mask[mask]
    return out


def _in_lockstep(
    starts: FloatArray, phase: Phase, flow_seconds: FloatArray, delay: FloatArray, latest_end: FloatArray
) -> npt.NDArray[np.bool_]:
    """Per size (``starts`` and ``flow_seconds``: sizes x flows), whether every step of ``phase`` runs in
    lockstep: all flows of a step start at one instant, after every earlier flow was delivered, and end at one
    instant, and their ranks then wait the same delay; so the next step starts in lockstep again, and every flow
    of a step overlaps every other one for its whole duration."""
    first = starts.min(axis=1)
    scale = np.maximum(starts.max(axis=1) + flow_seconds.max(axis=1), 1e-300)
    wait = float(np.ptp(delay[np.concatenate([phase.src, phase.dst])]))
    tol = _LOCKSTEP_RTOL * scale
    return np.asarray(
        (np.ptp(starts, axis=1) <= tol)
        & (np.ptp(flow_seconds, axis=1) <= tol)
        & (wait <= tol)
        & (first >= latest_end - tol)
    )


def _rates_independent_of_timing(routes: Routes, topology: Topology) -> bool:
    """Whether flows on these routes get the same rate whichever of them overlap in time: true when no link
    can be a shared bottleneck, i.e. every flow at its *solo* rate (its path's smallest capacity / weight,
    the rate it gets alone) at once fits every link.

    Then any subset of them that overlaps gets max-min rates equal to the solo rates (a flow's solo rate
    bounds its rate, and all-solo is feasible), so each flow's duration is the same however the ranks drift,
    and the recurrence is exact without lockstep."""
    capacity = topology.link_bandwidth_Bps
    flow = routes.flow_of_entry()
    with np.errstate(divide="ignore"):
        per_entry = capacity[routes.link] / routes.weight
    solo = np.full(routes.num_flows, np.inf)
    np.minimum.at(solo, flow, per_entry)
    finite = np.isfinite(solo[flow])
    load = np.bincount(routes.link[finite], weights=routes.weight[finite] * solo[flow][finite], minlength=capacity.size)
    return bool(np.all(load <= capacity * (1 + _LOCKSTEP_RTOL)))


def rates_fixed_under_any_timing(phases: list[tuple[Phase, Routes]], world_size: int, topology: Topology) -> bool:
    """Whether every flow of a schedule gets its solo rate however the ranks drift — the certificate that
    survives noise (late arrivals, retransmissions, jitter), where lockstep does not: every rank pair the
    schedule uses (``phases``: each phase with the routes of its flows), each at its solo rate at once, fits
    every link. A pair counts once: its transfers run one after the other. Sufficient, not necessary:
    transfers of one rank in different steps never overlap either, but count here as if they might."""
    capacity = topology.link_bandwidth_Bps
    load = np.zeros(capacity.size)
    if not phases:
        return True
    keys = np.concatenate([phase.src * world_size + phase.dst for phase, _ in phases])
    # Each pair's first flow in the whole schedule (a stable sort, not np.unique: measured several times
    # faster on the 400,000 flows of a 131,072-rank hierarchical all-reduce).
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    first = np.ones(keys.size, dtype=np.bool_)
    first[1:] = ordered[1:] != ordered[:-1]
    fresh_all = np.zeros(keys.size, dtype=np.bool_)
    fresh_all[order[first]] = True
    offset = 0
    for phase, routes in phases:
        fresh = fresh_all[offset : offset + len(phase)]
        offset += len(phase)
        if not fresh.any():
            continue
        flow = routes.flow_of_entry()
        with np.errstate(divide="ignore"):
            per_entry = capacity[routes.link] / routes.weight
        solo = np.full(routes.num_flows, np.inf)
        np.minimum.at(solo, flow, per_entry)
        counted = fresh[flow] & np.isfinite(solo[flow])
        load += np.bincount(
            routes.link[counted], weights=routes.weight[counted] * solo[flow][counted], minlength=capacity.size
        )
    return bool(np.all(load <= capacity * (1 + _LOCKSTEP_RTOL)))


# ------------------------------------------------------------------------------------------------------------
# The timing recurrence of :func:`allreduce.schedules.timing.propagate` with a sizes axis: clocks of shape (sizes,
# ranks), one row per buffer size, and whole cycles skipped per row by propagate's own rule, so every row is what
# propagate makes of that size alone. Sizes come first (unlike the Monte Carlo's samples, which come last): a row
# is one size's clocks, contiguous, so the per-size reductions the cycle test takes every step (a maximum, a
# spread, a mean) are passes over contiguous memory; over the first axis of a (ranks, 3) array numpy's
# reductions were measured 40-200x slower than a pass over the whole array.
# ------------------------------------------------------------------------------------------------------------
# How many past states a row keeps to detect a periodic steady state (as propagate: periods up to 4).
_MAX_PERIOD = 4
# A row's clocks "advance uniformly" when their increments agree to this relative tolerance (propagate's).
_UNIFORM_RTOL = 1e-12
# Ranks whose increments are compared first, before all of them (see _jumps).
_PROBE_RANKS = 256


@dataclass(frozen=True, eq=False)
class PhaseSteps:
    """How a phase is stepped: by slices when it is a cyclic shift of the ranks, else by its incidence layers
    (computed when first asked for; the Monte Carlo asks for them on every phase)."""

    phase: Phase
    world_size: int
    cyclic: Cyclic | None

    @cached_property
    def incidence(self) -> Incidence:
        return Incidence.of(self.world_size, self.phase)

    @cached_property
    def active(self) -> IntArray:
        """The ranks that transfer in the phase, in order."""
        if self.cyclic is not None:  # every rank sends one flow and receives one
            return np.arange(self.world_size, dtype=np.int64)
        return self.incidence.active


# Per phase object (a schedule keeps its phases), so a schedule simulated again reuses them.
_STEPS: weakref.WeakKeyDictionary[Phase, PhaseSteps] = weakref.WeakKeyDictionary()


def phase_steps(world_size: int, phase: Phase) -> PhaseSteps:
    """How ``phase`` of a schedule of ``world_size`` ranks is stepped, remembered for the phase object."""
    steps = _STEPS.get(phase)
    if steps is None or steps.world_size != world_size:
        steps = PhaseSteps(phase, world_size, Cyclic.of(world_size, phase))
        _STEPS[phase] = steps
    return steps


def _step(clock: FloatArray, phase: Phase, steps: PhaseSteps, flow_seconds: FloatArray) -> FloatArray:
    """Clocks (sizes, ranks) after one step of ``phase``, before the ranks' own delays: each flow starts when
    both its ranks' clocks have reached it and ends ``flow_seconds`` (sizes, flows; a cyclic phase's in the
    order of their senders) later; each rank's clock becomes the latest end of its flows (never earlier than its
    own clock, as durations are >= 0). Maxima and one addition per flow: :func:`allreduce.schedules.timing.step_once`'s
    arithmetic, element by element."""
    cyclic = steps.cyclic
    if cyclic is not None:
        # A cyclic shift never crosses a row (ranks % block == 0): the rows as one long row of ranks.
        end = cyclic.max_ahead(clock.reshape(-1, 1)).reshape(clock.shape)
        end += flow_seconds
        return cyclic.max_behind(end.reshape(-1, 1)).reshape(clock.shape)
    end = np.maximum(np.take(clock, phase.src, axis=1), np.take(clock, phase.dst, axis=1))
    end += flow_seconds
    done = clock.copy()
    # Layers in which a rank appears at most once (Incidence); the first one's ranks take their flow's end outright.
    for index, (ranks, flows, every_rank, identity) in enumerate(steps.incidence.layers):
        candidate = end if identity else np.take(end, flows, axis=1)
        if every_rank:
            if index == 0:
                done[...] = candidate
            else:
                np.maximum(done, candidate, out=done)
        elif index == 0:
            done[:, ranks] = candidate
        else:
            done[:, ranks] = np.maximum(np.take(done, ranks, axis=1), candidate)
    return done


def _advance(clock: FloatArray, phase: Phase, flow_seconds: FloatArray, rank_seconds: FloatArray | None) -> FloatArray:
    """Clocks (sizes, ranks) after the ``repeat`` steps of ``phase``, ``flow_seconds`` per size and flow.

    A row whose clocks advance by one amount every c steps skips the whole cycles left, as
    :func:`allreduce.schedules.timing.propagate` does, and is then stepped through the rest alone; once its steps are
    done it leaves the arrays the others are stepped in."""
    steps = phase_steps(clock.shape[1], phase)
    active = steps.active
    everyone = active.size == clock.shape[1]  # then the active clocks are the clocks: no copy to take
    cyclic = steps.cyclic
    per_flow = flow_seconds if cyclic is None else np.take(flow_seconds, cyclic.order, axis=1)
    delay = None if rank_seconds is None else np.take(rank_seconds, active)
    out = clock.copy()
    work = clock
    rows = np.arange(clock.shape[0])
    remaining = np.full(rows.size, phase.repeat, dtype=np.int64)
    length = np.ones(rows.size, dtype=np.int64)  # how many of the last states in history are the row's
    history = [work if everyone else np.take(work, active, axis=1)]
    probe = slice(None, None, max(1, active.size // _PROBE_RANKS))
    probes = [history[0][:, probe]]  # views: a jump's shift reaches them
    # Per row, at least its largest clock: the largest before the phase, plus each step's longest flow and delay
    # (added in the step's own order, so rounding keeps it above every clock).
    ceiling = work.max(axis=1)
    longest = per_flow.max(axis=1)
    longest_delay = None if delay is None else float(delay.max())
    while rows.size:
        work = _step(work, phase, steps, per_flow)
        ceiling += longest
        if delay is not None:
            if everyone:
                work += delay
            else:
                work[:, active] += delay
            ceiling += longest_delay
        remaining -= 1
        now = work if everyone else np.take(work, active, axis=1)
        history.append(now)
        probes.append(now[:, probe])
        length += 1
        for row, shift, left in _jumps(history, probes, length, remaining, ceiling):
            now[row] += shift
            if not everyone:
                work[row, active] = now[row]
            ceiling[row] += shift
            remaining[row] = left
            length[row] = 1
        np.minimum(length, _MAX_PERIOD + 1, out=length)
        if len(history) > _MAX_PERIOD + 1:
            history.pop(0)
            probes.pop(0)
        finished = remaining == 0
        if finished.any():
            out[rows[finished]] = work[finished]
            keep = ~finished
            rows, work, per_flow = rows[keep], work[keep], per_flow[keep]
            remaining, length, ceiling, longest = remaining[keep], length[keep], ceiling[keep], longest[keep]
            history = [state[keep] for state in history]
            probes = [state[:, probe] for state in history]
    return out


def _jumps(
    history: list[FloatArray], probes: list[FloatArray], length: IntArray, remaining: IntArray, ceiling: FloatArray
) -> list[tuple[int, float, int]]:
    """The rows whose clocks now advance by the same amount every c steps (c <= 4, within the row's own
    ``length`` last states; the smallest such c decides, as in propagate), with steps left to skip: per row
    (row, shift to add, steps still to simulate).

    The test is propagate's: the increments' spread (max - min) within a tolerance relative to the largest clock
    (clocks are never negative, so their maximum is propagate's largest magnitude). The spread over a few probe
    ranks (``probes``: those ranks' clocks in each state of ``history``) is at most the spread over all, and
    ``ceiling`` (per row, at least its largest clock) gives a tolerance at least propagate's, so a period whose
    probe is too spread for it is rejected at once, every period and row in a few array operations; only those
    that pass are tested with the largest clock itself and over every rank: the same decisions, at a fraction of
    the work while the clocks are still settling."""
    periods = min(_MAX_PERIOD, len(history) - 1)
    if periods < 1:
        return []
    now = history[-1]
    # spread of the probes' increments over 1..periods steps: (periods, rows)
    increments = probes[-1][None] - np.stack(probes[-2 : -2 - periods : -1])
    spread = increments.max(axis=2) - increments.min(axis=2)
    span = np.arange(1, periods + 1)[:, None]
    possible = (length[None, :] - 1 >= span) & (remaining[None, :] > 0)
    possible &= spread <= _UNIFORM_RTOL * np.maximum(ceiling, 1e-300)[None, :]
    out: list[tuple[int, float, int]] = []
    for row in np.flatnonzero(possible.any(axis=0)).tolist():
        tolerance = _UNIFORM_RTOL * max(float(now[row].max()), 1e-300)
        for period in (np.flatnonzero(possible[:, row]) + 1).tolist():
            if float(spread[period - 1, row]) > tolerance:
                continue
            delta = now[row] - history[-1 - period][row]
            if float(np.ptp(delta)) > tolerance:
                continue
            cycles = int(remaining[row]) // period
            if cycles:
                # the mean over one contiguous row: the same summation as propagate's, to the bit
                out.append((row, float(delta.mean()) * cycles, int(remaining[row]) - cycles * period))
            break
    return out
