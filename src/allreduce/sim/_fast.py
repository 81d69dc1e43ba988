"""The fast engine: one fair-rate computation per flow pattern, per-rank clocks advanced as arrays.

For each phase of :meth:`Schedule.phases` (a flow pattern that ``repeat`` consecutive steps reuse), the flows
are routed and their max-min fair rates computed once (patterns are cached, so ring all-reduce routes once for
its 2(N-1) steps). Each flow then takes ``path latency + bytes / rate`` and the per-rank clocks advance through
the project's one timing recurrence, :func:`allreduce.schedules.propagate`, which also skips whole cycles of a
repeated pattern once the clocks move in lockstep. Nothing is one Python object per transfer.

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

import numpy as np
import numpy.typing as npt

from allreduce.schedules import Phase, Schedule, propagate
from allreduce.sim._result import CriticalStep, PhaseResult, SimResult
from allreduce.sim._routing import Router
from allreduce.sim._summary import summarize_bottlenecks
from allreduce.topology import Routes, Topology

__all__ = ["rates_fixed_under_any_timing", "run_fast", "run_fast_checked"]

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
    result, _ = run_fast_checked(
        schedule, router, size_bytes=size_bytes, rank_delay_s=rank_delay_s, trace_ranks=trace_ranks
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
    see the module docstring)."""
    topology = router.topology
    n = schedule.world_size
    clock = np.zeros(n, dtype=np.float64)
    link_bytes = np.zeros(topology.num_links, dtype=np.float64)
    waited = np.zeros(topology.num_links, dtype=np.float64)
    zero_delay = np.zeros(n, dtype=np.float64)
    delay = zero_delay if rank_delay_s is None else rank_delay_s
    phases: list[PhaseResult] = []
    critical: list[CriticalStep] = []
    labels: list[str] = []
    trace_start: list[FloatArray] = []
    trace_end: list[FloatArray] = []
    k = min(n, trace_ranks)
    path_end = 0.0
    exact = True
    latest_end = 0.0  # when the last rank so far finished its steps (its clock), while exact
    # Per earlier phase, while exact: when its last flow was delivered, and its flows that carry bytes (as
    # src * n + dst keys).
    earlier: list[tuple[float, IntArray]] = []
    for phase in schedule.phases():
        pattern = router.pattern(phase.src, phase.dst)
        nbytes = phase.fraction * float(size_bytes)
        transfer = pattern.transfer_seconds(nbytes)
        latency = pattern.routes.latency_s
        flow_seconds = latency + transfer

        def flows(_: Phase, seconds: FloatArray = flow_seconds) -> FloatArray:
            return seconds

        def ranks(_: Phase) -> FloatArray | None:
            return rank_delay_s

        if exact and len(phase):
            pairs = phase.src[nbytes > 0] * n + phase.dst[nbytes > 0]
            starts = np.maximum(clock[phase.src], clock[phase.dst])
            if not _in_lockstep(starts, phase, flow_seconds, delay, latest_end):
                # This phase's flows, and every earlier phase's that may still drain when its first one
                # starts. A rank pair counts once: its transfers run one after the other.
                first = float(starts.min())
                live = np.unique(np.concatenate([pairs, *(q for end, q in earlier if end > first)]))
                exact = _rates_independent_of_timing(router.route_ranks(live // n, live % n), topology)
        before = clock[:k].copy()
        clock, (timing,) = propagate(n, [phase], flows, ranks, clock=clock)
        if exact and len(phase):
            latest_end = max(latest_end, float(clock.max()))
            earlier.append((latest_end, pairs))
        link_bytes += pattern.link_bytes(nbytes, topology.num_links) * phase.repeat

        # The phase's share of the end time, and who set its pace.
        share_s = max(0.0, timing.end_s - path_end)
        path_end = max(path_end, timing.end_s)
        flow_delay = np.maximum(delay[phase.src], delay[phase.dst])
        pace = flow_seconds + flow_delay
        worst = int(np.argmax(pace)) if pace.size else 0
        if pace.size:
            tied = pace >= pace[worst] * (1 - _CRITICAL_RTOL)
            limited = tied & (transfer > 0) & (pattern.bottleneck_link >= 0)
            if share_s > 0 and limited.any():
                # The share of the pace that was bytes on the link, not path latency or a slow rank.
                fraction = transfer[worst] / pace[worst] if pace[worst] > 0 else 0.0
                links = np.unique(pattern.bottleneck_link[limited])
                waited[links] += share_s * fraction
            critical.append(
                CriticalStep(
                    first_step=phase.first_step,
                    last_step=phase.first_step + phase.repeat - 1,
                    src_rank=int(phase.src[worst]),
                    dst_rank=int(phase.dst[worst]),
                    seconds=share_s,
                    transfer_s=float(transfer[worst]),
                    latency_s=float(latency[worst]),
                    rank_delay_s=float(flow_delay[worst]),
                    rate_Bps=float(pattern.rate_Bps[worst]),
                    bottleneck_link=int(pattern.bottleneck_link[worst]),
                )
            )
        rates = pattern.rate_Bps
        phases.append(
            PhaseResult(
                first_step=phase.first_step,
                repeat=phase.repeat,
                num_flows=len(phase),
                start_s=timing.start_s,
                end_s=timing.end_s,
                slowest_rate_Bps=float(rates.min()) if rates.size else float("inf"),
                fair_share_Bps=float(np.median(rates)) if rates.size else float("inf"),
            )
        )
        last = phase.first_step + phase.repeat - 1
        labels.append(f"steps {phase.first_step}-{last}" if phase.repeat > 1 else f"step {phase.first_step}")
        trace_start.append(before)
        trace_end.append(clock[:k].copy())

    seconds = float(clock.max()) if n else 0.0
    bottlenecks, count = summarize_bottlenecks(topology, waited, link_bytes, seconds)
    result = SimResult(
        name=schedule.name,
        collective=schedule.collective,
        world_size=n,
        size_bytes=float(size_bytes),
        seconds=seconds,
        engine="fast",
        topology=topology,
        rank_gpu=router.rank_gpu,
        phases=tuple(phases),
        link_bytes=link_bytes,
        critical_path=tuple(critical),
        bottlenecks=bottlenecks,
        critical_links=count,
        rank_end_s=clock,
        trace_labels=tuple(labels),
        trace_start_s=np.asarray(trace_start, dtype=np.float64).reshape(len(labels), k),
        trace_end_s=np.asarray(trace_end, dtype=np.float64).reshape(len(labels), k),
        exact=exact,
    )
    return result, exact


def _in_lockstep(
    starts: FloatArray, phase: Phase, flow_seconds: FloatArray, delay: FloatArray, latest_end: float
) -> bool:
    """Whether every step of ``phase`` runs in lockstep: all flows of a step start at one instant, after every
    earlier flow was delivered, and end at one instant, and their ranks then wait the same delay; so the next
    step starts in lockstep again, and every flow of a step overlaps every other one for its whole duration."""
    first = float(starts.min())
    scale = max(float(starts.max()) + float(flow_seconds.max()), 1e-300)
    wait = delay[np.concatenate([phase.src, phase.dst])]
    tol = _LOCKSTEP_RTOL * scale
    return (
        float(np.ptp(starts)) <= tol
        and float(np.ptp(flow_seconds)) <= tol
        and float(np.ptp(wait)) <= tol
        and first >= latest_end - tol
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
