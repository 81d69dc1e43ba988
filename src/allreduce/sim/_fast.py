"""The fast engine: one fair-rate computation per flow pattern, per-rank clocks advanced as arrays.

For each phase of :meth:`Schedule.phases` (a flow pattern that ``repeat`` consecutive steps reuse), the flows
are routed and their max-min fair rates computed once (patterns are cached, so ring all-reduce routes once for
its 2(N-1) steps). Each flow then takes ``path latency + bytes / rate`` and the per-rank clocks advance through
the project's one timing recurrence, :func:`allreduce.schedules.propagate`, which also skips whole cycles of a
repeated pattern once the clocks move in lockstep. Nothing is one Python object per transfer.

The approximation, against the event engine: every flow of a step is assumed to run at the rate it gets when
*all* flows of its pattern run together, for its whole duration. That is exact when the run stays in lockstep:
every flow of a step starts at one instant, after the previous step ended, and all end at one instant (equal
bytes at equal rates and equal path latencies; symmetric patterns on symmetric topologies, spraying, one
switch). ``run_fast_checked`` reports whether that held, and ``engine="auto"`` keeps the fast result only then
(the tests check it equals the event engine's to 1e-6 whenever it does).

When ranks drift apart the two engines legitimately differ. ``benchmarks/bench_sim_agreement.py`` measures
it (256 MiB, 16-256 ranks): the fast engine is pessimistic by up to +23% (halving-doubling and recursive
doubling on an ECMP fat-tree, random placement on tori and rails), +1% to +6% for double binary trees and
hierarchical with random placement, +1.5% to +10% for rings on randomly placed tori; once optimistic, -0.7%
(hierarchical, 64 ranks, ECMP fat-tree). Cause, measured phase by phase: an ECMP collision or an uneven path
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
busy while path latencies overlap. Not exact (1.3%), so not used either. Hence "auto": the event engine
wherever the fast run left lockstep and the schedule has at most ``AUTO_EVENT_MAX_TRANSFERS`` transfers (a
few CPU-seconds); beyond that (ring and direct at 256 ranks) the fast engine, with the gaps above.

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

__all__ = ["run_fast", "run_fast_checked"]

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
    """The fast engine's result, and whether the run stayed in lockstep (then the result is exact: see the
    module docstring)."""
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
    lockstep = True
    step_end = 0.0  # when the last step so far ended, while in lockstep
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

        if lockstep and len(phase):
            lockstep, step_end = _still_in_lockstep(clock, phase, flow_seconds, delay, step_end)
        before = clock[:k].copy()
        clock, (timing,) = propagate(n, [phase], flows, ranks, clock=clock)
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
    )
    return result, lockstep


def _still_in_lockstep(
    clock: FloatArray, phase: Phase, flow_seconds: FloatArray, delay: FloatArray, step_end: float
) -> tuple[bool, float]:
    """Whether every step of ``phase`` runs in lockstep after the previous ones, and when its last step ends.

    Lockstep: all flows of the step start at one instant, no earlier than the previous step ended, and end at
    one instant, and their ranks then wait the same delay; so the next step starts in lockstep again."""
    start = np.maximum(clock[phase.src], clock[phase.dst])
    first = float(start.min())
    scale = max(float(start.max()) + float(flow_seconds.max()), 1e-300)
    wait = delay[np.concatenate([phase.src, phase.dst])]
    tol = _LOCKSTEP_RTOL * scale
    same = (
        float(np.ptp(start)) <= tol
        and float(np.ptp(flow_seconds)) <= tol
        and float(np.ptp(wait)) <= tol
        and first >= step_end - tol
    )
    return same, first + phase.repeat * (float(flow_seconds.max()) + float(wait.max()))
