"""Monte Carlo of the tail: K samples of a collective with packet loss, jitter, stragglers and timed faults.

Every sample runs the fast engine's recurrence (:mod:`allreduce.schedules.timing`) on the flow durations of
the noise-free run — path latency + bytes at the pattern's max-min fair rate — plus what the noise adds. The
samples are a column axis of the clocks, so each step is a few array operations over all samples at once.
Two methods, chosen by what the noise is, both exact with respect to that recurrence:

- ``sensitivity`` — noise only in when ranks reach the collective (compute jitter per rank, any ECMP draw):
  the recurrence is max-plus linear, so the end time is ``T = max_r (a_r + m_r)`` for arrival offsets ``a``,
  where ``m_r`` is the longest path from rank r's start to the end. ``m`` comes from one backward pass (the
  transposed recurrence, which has the forward one's form and its cycle jumps), then every sample costs
  O(ranks). The culprit is the argmax rank.
- ``stepping`` — noise per transfer (packet loss, latency jitter, faults that come and go): every step of every
  sample is stepped (clocks ``(ranks, samples)``); the largest single delay on each sample's critical path and
  its cause (a rank's late arrival or delay, a link that dropped a packet, jittered or failed) ride along with
  the clocks through the argmax the recurrence takes anyway (:class:`allreduce.schedules.timing.Blame`).
  Phases free of per-transfer noise still jump whole cycles once every sample's clocks advance uniformly.

The recurrence is the event engine's exactly where the fast engine certifies its noise-free run (lockstep or
timing-independent rates: see :mod:`allreduce.sim._fast`); ``TailResult.exact`` reports that certificate, and
``engine`` names the method. Noise can make ranks drift where the noise-free run was in lockstep; with
timing-independent rates (rings with linear placement on fat-trees, Clos, tori) the durations, and so the
result, stay exact under any noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from allreduce.schedules import Phase, Schedule
from allreduce.schedules.timing import Blame, blame_key, jump_samples, propagate, step_samples
from allreduce.sim._cyclic import step_cyclic
from allreduce.sim._event import run_event
from allreduce.sim._fast import rates_fixed_under_any_timing, run_fast_checked
from allreduce.sim._faults import Faults, TimedFault, apply_faults, resolve_links
from allreduce.sim._phases import PhaseData, agreement_delays, check_recoverable, draw_losses, phase_data
from allreduce.sim._rerun import (
    DEFAULT_EXACT_BUDGET_S,
    TAIL_EXACT_MAX_RANKS,
    NoiseRecorder,
    event_transfers,
    rerun_cost_s,
)
from allreduce.sim._routing import Router
from allreduce.sim._tailresult import (
    SAMPLE_EVENT,
    SAMPLE_FAST,
    SAMPLE_FAST_UNCERTIFIED,
    TAIL_MEMORY_LIMIT_BYTES,
    TailConfig,
    TailResult,
    tail_memory_bytes,
)
from allreduce.topology import PathTable, Topology, place
from allreduce.units import format_seconds

__all__ = ["simulate_tail"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# Samples stepped together: (ranks x samples) arrays of about this many elements (256 KiB of float64) stay in
# the CPU's caches with the step's temporaries (measured, 256 samples of a 1,024-rank ring with loss: 2^15
# elements per chunk took 25% less CPU time than 2^17, and 2^14 more again, Python's cost per call showing).
_CHUNK_ELEMENTS = 2**15
# States kept to detect that every sample's clocks advance uniformly (as in schedules/_timing.py).
_MAX_HISTORY = 5
# How many times a transfer that finds no path waits for the fault's next change before giving up.
_MAX_WAITS = 64


def _backward(world_size: int, data: list[PhaseData], rank_delay: FloatArray | None) -> FloatArray:
    """Per rank, the longest path from its start to the end of the schedule: the transposed recurrence run
    from the last step to the first. A step's transpose is ``y = step(y' + rank_seconds)`` — the same form as
    the forward step — so :func:`propagate` (and its cycle jumps) runs it: with rank delays it adds them after
    each step, so the input is pre-shifted and the last addition taken back."""
    y = np.zeros(world_size)
    for d in reversed(data):
        delay = None
        if rank_delay is not None:
            active = np.zeros(world_size, dtype=np.bool_)
            active[d.phase.src] = True
            active[d.phase.dst] = True
            delay = np.where(active, rank_delay, 0.0)
            y = y + delay

        def flows(_: Phase, seconds: FloatArray = d.seconds) -> FloatArray:
            return seconds

        def ranks(_: Phase, delay: FloatArray | None = delay) -> FloatArray | None:
            return delay

        y, _ = propagate(world_size, [d.phase], flows, ranks, clock=y)
        if delay is not None:
            y = y - delay
    return y


# ------------------------------------------------------------------------------------------------------------
# Noise per step
# ------------------------------------------------------------------------------------------------------------
class _TimedRates:
    """Flow durations of one phase under each combination of active timed faults (cached), for the transfers
    that start while some are active."""

    def __init__(
        self,
        topology: Topology,
        router: Router,
        d: PhaseData,
        *,
        faults: Sequence[TimedFault],
        fault_link: IntArray,
        size_bytes: float,
    ) -> None:
        self.topology = topology
        self.router = router
        self.d = d
        self.faults = faults
        self.fault_link = fault_link
        self.size_bytes = size_bytes
        self._table: dict[int, FloatArray] = {0: d.seconds}
        # Which flows cross each fault's links on their healthy route: those wait when a fault leaves no path.
        routes = d.pattern.routes
        entry_flow = routes.flow_of_entry()
        self._crosses = []
        for fault in faults:
            links = resolve_links(topology, fault.link)
            hit = np.zeros(len(d.phase), dtype=np.bool_)
            hit[np.unique(entry_flow[np.isin(routes.link, links)])] = True
            self._crosses.append(hit)

    def seconds(self, mask: int) -> FloatArray:
        hit = self._table.get(mask)
        if hit is not None:
            return hit
        combined = Faults(
            degraded=tuple(x for i, f in enumerate(self.faults) if mask >> i & 1 for x in f.as_faults().degraded),
            failed=tuple(x for i, f in enumerate(self.faults) if mask >> i & 1 for x in f.as_faults().failed),
        )
        faulted = apply_faults(self.topology, combined)
        router = Router(faulted, self.router.rank_gpu, self.router.routing, self.router.seed)
        try:
            pattern = router.pattern(self.d.phase.src, self.d.phase.dst)
            seconds = pattern.routes.latency_s + pattern.transfer_seconds(self.d.nbytes)
        except ValueError:
            # No path for some flow: the flows that crossed a failed link wait; the others keep their pace.
            seconds = self.d.seconds.copy()
            for i, crosses in enumerate(self._crosses):
                if mask >> i & 1 and self.faults[i].kind != "degrade":
                    seconds[crosses] = math.inf
        self._table[mask] = seconds
        return seconds

    def extra(self, start: FloatArray) -> tuple[FloatArray, IntArray]:
        """Per flow and sample, the delay the faults add to a transfer starting at ``start`` (waiting for a
        link to come back included; negative for a link running faster than before), and its culprit code
        (the first active fault's link). A transfer is rated by the faults active when it starts."""
        extra = np.zeros_like(start)
        culprit = np.full(start.shape, -1, dtype=np.int64)
        base = np.broadcast_to(self.d.seconds[:, None], start.shape)
        t = start.copy()
        pending = np.ones(start.shape, dtype=np.bool_)
        for _ in range(_MAX_WAITS):
            mask = np.zeros(start.shape, dtype=np.int64)
            for i, fault in enumerate(self.faults):
                mask |= fault.active(t).astype(np.int64) << i
            healthy = pending & (mask == 0)
            extra[healthy] = (t - start)[healthy]
            pending &= ~healthy
            blocked = np.zeros(start.shape, dtype=np.bool_)
            for value in np.unique(mask[pending]):
                here = pending & (mask == value)
                seconds = np.broadcast_to(self.seconds(int(value))[:, None], start.shape)
                lowest = (int(value) & -int(value)).bit_length() - 1
                culprit[here] = self.fault_link[lowest]
                ok = here & np.isfinite(seconds)
                extra[ok] = (t - start)[ok] + seconds[ok] - base[ok]
                blocked |= here & ~ok
            pending = blocked
            if not pending.any():
                return extra, culprit
            changes = np.full(start.shape, math.inf)
            for fault in self.faults:
                changes = np.minimum(changes, fault.next_change(t))
            if not np.all(np.isfinite(changes[pending])):
                raise ValueError(
                    f"{self.topology.name}: a transfer waits for a link that never comes back "
                    f"({', '.join(f.describe() for f in self.faults)})"
                )
            t = np.where(pending, changes, t)
        raise ValueError(f"{self.topology.name}: a transfer waited through {_MAX_WAITS} fault changes")


# ------------------------------------------------------------------------------------------------------------
# The simulation
# ------------------------------------------------------------------------------------------------------------
def _describe(config: TailConfig, faults: Faults) -> str:
    parts = []
    if config.loss:
        loss = config.loss
        what = f"loss {loss.probability:g}/packet" if loss.probability else "loss"
        what += "".join(f", {name} {p:g}" for name, p in loss.links)
        if loss.burst > 1:
            what += f", in bursts of {loss.burst:g} packets"
        if loss.fabric == "tcp":
            rto = "rto_min" if loss.rack_tlp else "RTO"
            parts.append(f"{what} (tcp {loss.tcp}, MTU {loss.mtu} B, {rto} {format_seconds(loss.rto)})")
        else:
            parts.append(f"{what} ({loss.fabric}, MTU {loss.mtu} B, RTO {format_seconds(loss.rto)})")
    if config.link_jitter is not None and not config.link_jitter.is_zero:
        parts.append(f"link jitter {config.link_jitter}")
    if config.rank_jitter is not None and not config.rank_jitter.is_zero:
        parts.append(f"rank jitter {config.rank_jitter}")
    parts.extend(f"rank {r} {format_seconds(s)} late" for r, s in config.stragglers)
    parts.extend(f.describe() for f in config.timed_faults)
    parts.extend(f"{link} x{f:g}" for link, f in faults.degraded)
    parts.extend(f"{link} failed" for link in faults.failed)
    parts.extend(f"rank {r} +{format_seconds(s)}/step" for r, s in faults.slow_ranks)
    if config.ecmp_seeds:
        parts.append(f"{config.ecmp_seeds} ECMP seeds")
    return ", ".join(parts) or "no noise"


def simulate_tail(
    schedule: Schedule,
    topology: Topology,
    *,
    size_bytes: float,
    config: TailConfig,
    placement: str | Sequence[int] = "linear",
    routing: str | PathTable | None = None,
    seed: int = 0,
    faults: Faults | None = None,
    progress: Callable[[float], None] | None = None,
    exact_budget_s: float = DEFAULT_EXACT_BUDGET_S,
) -> TailResult:
    """Monte Carlo of ``schedule`` on ``topology`` with ``config.samples`` draws of ``config``'s noise.

    ``placement``, ``routing``, ``seed`` (placement and ECMP) and ``faults`` (static: degraded or failed links,
    slow ranks) are :func:`allreduce.sim.simulate`'s. ``progress`` (if given) is called now and then with the
    fraction of samples done. Reproducible: the same ``config.seed`` gives the same samples. Under engine
    "auto", the samples the fast engine cannot certify are re-run by the event engine on at most
    TAIL_EXACT_MAX_RANKS ranks if the re-runs are planned to take at most ``exact_budget_s`` CPU seconds (a
    plan from their transfers, not a clock: the same call re-runs the same samples on any machine)."""
    size = float(size_bytes)
    if not (math.isfinite(size) and size >= 0):
        raise ValueError(f"size_bytes must be a finite number >= 0, got {size_bytes!r}")
    if not (math.isfinite(exact_budget_s) and exact_budget_s >= 0):
        raise ValueError(f"exact_budget_s must be a finite number of seconds >= 0, got {exact_budget_s!r}")
    faults = faults or Faults()
    n = schedule.world_size
    if n > topology.num_gpus:
        raise ValueError(f"{schedule.name} needs {n} ranks but {topology.name} has only {topology.num_gpus} GPUs")
    need = tail_memory_bytes(n, config.samples)
    if need > TAIL_MEMORY_LIMIT_BYTES:
        raise ValueError(
            f"samples: {config.samples:,} samples of {n:,} ranks need about {need / 2**30:,.1f} GiB "
            f"(limit {TAIL_MEMORY_LIMIT_BYTES / 2**30:g} GiB); use fewer samples"
        )
    rank_delay = faults.rank_delay_s(n)
    base_topology = apply_faults(topology, faults)
    rank_gpu = np.asarray(place(n, base_topology, placement, seed=seed), dtype=np.int64)
    link_loss = np.full(base_topology.num_links, config.loss.probability)
    for name, p in config.loss.links:
        link_loss[resolve_links(base_topology, name)] = p
    fault_link = np.asarray([resolve_links(base_topology, f.link)[0] for f in config.timed_faults], dtype=np.int64)
    rng = np.random.default_rng(config.seed)
    k = config.samples

    # The noise-free run (the simulation's own ECMP seed): the baseline, and the fast engine's certificate.
    baseline, free_exact = run_fast_checked(
        schedule,
        Router(base_topology, rank_gpu, routing, seed),
        size_bytes=size,
        rank_delay_s=rank_delay,
        trace_ranks=0,
    )
    seeds = [seed] if config.ecmp_seeds == 0 else [int(s) for s in rng.integers(0, 2**31 - 1, config.ecmp_seeds)]
    group = np.arange(k) % len(seeds)

    arrival = np.zeros((n, k))
    if config.rank_jitter is not None and not config.rank_jitter.is_zero:
        arrival = config.rank_jitter.sample(rng, (k, n)).T.copy()
    for rank, seconds in config.stragglers:
        if not 0 <= rank < n:
            raise ValueError(f"straggler rank {rank} is not a rank of a group of {n}")
        arrival[rank] += seconds
    step_s = np.zeros(k)
    culprit = np.full(k, -1, dtype=np.int64)
    culprit_s = np.zeros(k)
    lost = np.zeros(k, dtype=np.int64)
    timeouts = np.zeros(k, dtype=np.int64)
    sample_engine = np.full(k, SAMPLE_FAST, dtype=np.int64)
    rank_culprit = np.arange(n, dtype=np.int64)
    transfers = event_transfers(schedule, config, k)
    # The link jitter of every transfer is kept for the event engine only if all samples' fit its budget.
    keep_dense = transfers is not None and (
        config.engine == "event" or rerun_cost_s(len(transfers), k) <= exact_budget_s
    )
    # When each rank starts the collective's data: its arrival, plus (RACK-TLP stacks) what lost agreement
    # messages held it back, and the blame of the larger of the two.
    start = arrival
    start_blame: tuple[FloatArray, IntArray] | None = None
    agreement = config.loss.rack_tlp and config.loss.agreement and n > 1
    if agreement:
        start = arrival.copy()
        start_blame = (arrival.copy(), np.where(arrival > 0, rank_culprit[:, None], -1))
    done = 0
    for g, ecmp_seed in enumerate(seeds):
        router = Router(base_topology, rank_gpu, routing, ecmp_seed)
        data = phase_data(
            schedule, router, size, link_loss, connections=config.loss.rack_tlp, next_barrier=config.loss.held_bursts
        )
        if config.loss:
            check_recoverable(data, config.loss, k)
        any_timing = rates_fixed_under_any_timing([(d.phase, d.pattern.routes) for d in data], n, base_topology)
        members = np.flatnonzero(group == g)
        record = (
            NoiseRecorder(schedule, transfers, [d.phase for d in data], dense=keep_dense)
            if transfers is not None
            else None
        )
        if agreement and start_blame is not None:
            held, held_code, held_lost, held_timeouts = agreement_delays(
                rng, router, members.size, config.loss, link_loss, data=data
            )
            start[:, members] += held
            later = held > start_blame[0][:, members]
            start_blame[0][:, members] = np.where(later, held, start_blame[0][:, members])
            start_blame[1][:, members] = np.where(later, held_code, start_blame[1][:, members])
            lost[members] += held_lost
            timeouts[members] += held_timeouts
        if not config.per_transfer:
            to_end = _backward(n, data, rank_delay)
            total = arrival[:, members] + to_end[:, None]
            last = np.argmax(total, axis=0)
            step_s[members] = total[last, np.arange(members.size)]
            late = arrival[last, members] > 0
            culprit[members] = np.where(late, last, -1)
            culprit_s[members] = np.where(late, arrival[last, members], 0.0)
        else:
            _step_group(
                members,
                data,
                config=config,
                arrival=start,
                start_blame=start_blame,
                rng=rng,
                base_topology=base_topology,
                router=router,
                size=size,
                fault_link=n + fault_link,
                rank_delay=rank_delay,
                rank_culprit=rank_culprit,
                out=(step_s, culprit, culprit_s, lost, timeouts),
                record=record,
                progress=None if progress is None else _offset_progress(progress, done, k),
            )
        # Which samples the fast engine's recurrence gives exactly: all, if no timing can change a rate;
        # else the noise-free ones, if the noise-free run (with this ECMP seed) was certified.
        if not any_timing:
            quiet = ~np.any(start[:, members] != 0, axis=0) & (lost[members] == 0)
            quiet &= not config.timed_faults and (config.link_jitter is None or config.link_jitter.is_zero)
            if quiet.any() and (g > 0 or config.ecmp_seeds):
                quiet &= run_fast_checked(schedule, router, size_bytes=size, rank_delay_s=rank_delay, trace_ranks=0)[1]
            elif quiet.any():
                quiet &= free_exact
            sample_engine[members] = np.where(quiet, SAMPLE_FAST, SAMPLE_FAST_UNCERTIFIED)
        if record is not None:
            rerun = members if config.engine == "event" else members[sample_engine[members] == SAMPLE_FAST_UNCERTIFIED]
            affordable = config.engine == "event" or (
                n <= TAIL_EXACT_MAX_RANKS
                and rerun_cost_s(len(record.transfers), rerun.size) <= exact_budget_s
                and (keep_dense or config.link_jitter is None or config.link_jitter.is_zero)
            )
            if rerun.size and affordable:
                record.rerun(
                    rerun,
                    router,
                    size_bytes=size,
                    rank_delay=rank_delay,
                    arrival=start,
                    attribution=config.attribution,
                    out=(step_s, culprit, culprit_s),
                )
                sample_engine[rerun] = SAMPLE_EVENT
        done += members.size
        if progress is not None:
            progress(done / k)
    exact = bool(np.all(sample_engine != SAMPLE_FAST_UNCERTIFIED))
    baseline_s = baseline.seconds
    if exact and not free_exact:
        # Every sample is exact, some by the event engine: so is the noise-free time the slowdowns divide by.
        # (With uncertified samples left, the fast engine's noise-free time is the one they compare with.)
        router = Router(base_topology, rank_gpu, routing, seed)
        baseline_s = run_event(schedule, router, size_bytes=size, rank_delay_s=rank_delay, trace_ranks=0).seconds
    arrived = arrival.max(axis=0)
    return TailResult(
        name=schedule.name,
        world_size=n,
        size_bytes=size,
        topology_name=topology.name,
        engine="stepping" if config.per_transfer else "sensitivity",
        exact=exact,
        baseline_s=baseline_s,
        step_s=step_s,
        collective_s=step_s - arrived,
        culprit=culprit,
        culprit_delay_s=culprit_s,
        lost_transfers=lost,
        timeouts=timeouts,
        topology=base_topology,
        description=_describe(config, faults),
        sample_engine=sample_engine,
    )


def _offset_progress(progress: Callable[[float], None], done: int, total: int) -> Callable[[int], None]:
    """A callback for samples done within a group, reporting the fraction done over all samples."""

    def report(count: int) -> None:
        progress((done + count) / total)

    return report


def _step_group(
    members: IntArray,
    data: list[PhaseData],
    *,
    config: TailConfig,
    arrival: FloatArray,
    start_blame: tuple[FloatArray, IntArray] | None = None,
    rng: np.random.Generator,
    base_topology: Topology,
    router: Router,
    size: float,
    fault_link: IntArray,
    rank_delay: FloatArray | None,
    rank_culprit: IntArray,
    out: tuple[FloatArray, IntArray, FloatArray, IntArray, IntArray],
    record: NoiseRecorder | None,
    progress: Callable[[int], None] | None,
) -> None:
    """The stepping method for the samples ``members`` (of one ECMP seed), chunk by chunk; ``progress`` is
    called with the count of samples done."""
    step_s, culprit, culprit_s, lost, timeouts = out
    n = arrival.shape[0]
    timed = [
        _TimedRates(base_topology, router, d, faults=config.timed_faults, fault_link=fault_link, size_bytes=size)
        if config.timed_faults
        else None
        for d in data
    ]
    chunk = max(1, min(members.size, _CHUNK_ELEMENTS // max(n, 1)))
    for lo in range(0, members.size, chunk):
        cols = members[lo : lo + chunk]
        clock = arrival[:, cols].copy()
        blame = None
        if config.attribution and start_blame is not None:
            # C order, as the clocks: an indexed column selection comes out transposed, and the cyclic step's
            # arithmetic on keys in that order took 6x as long
            key = blame_key(start_blame[0][:, cols], start_blame[1][:, cols])
            blame = Blame(np.ascontiguousarray(key))
        elif config.attribution:
            blame = Blame(blame_key(clock, np.where(clock > 0, rank_culprit[:, None], -1)))
        for index, (d, rates) in enumerate(zip(data, timed, strict=True)):
            clock = _run_phase(
                clock,
                d,
                rates=rates,
                rng=rng,
                config=config,
                rank_delay=rank_delay,
                rank_culprit=rank_culprit,
                blame=blame,
                n=n,
                lost=lost,
                timeouts=timeouts,
                cols=cols,
                record=None if record is None else (record, index),
            )
        last = np.argmax(clock, axis=0)
        columns = np.arange(cols.size)
        step_s[cols] = clock[last, columns]
        if blame is not None:
            final = Blame(blame.key[last, columns])
            culprit[cols] = final.culprit
            culprit_s[cols] = final.seconds
        if progress is not None and lo + chunk < members.size:
            progress(lo + chunk)


def _run_phase(
    clock: FloatArray,
    d: PhaseData,
    *,
    rates: _TimedRates | None,
    rng: np.random.Generator,
    config: TailConfig,
    rank_delay: FloatArray | None,
    rank_culprit: IntArray,
    blame: Blame | None,
    n: int,
    lost: IntArray,
    timeouts: IntArray,
    cols: IntArray,
    record: tuple[NoiseRecorder, int] | None = None,
) -> FloatArray:
    """Step ``clock`` (ranks x samples of the chunk ``cols``) through the ``repeat`` steps of one phase;
    ``record``: (recorder, this phase's index), which keeps the noise drawn for the event engine."""
    phase = d.phase
    samples = clock.shape[1]
    flows = len(phase)
    if flows == 0:
        return clock
    delay = None
    delay_blame = None
    if rank_delay is not None:
        delay = np.zeros(n)
        delay[d.incidence.active] = rank_delay[d.incidence.active]
        delay_blame = blame_key(delay, rank_culprit)
    losses = draw_losses(rng, config.loss, d, samples) if config.loss else None
    loss_keys: IntArray | None = None
    if losses is not None:
        np.add.at(lost, cols[losses.sample], 1)
        np.add.at(timeouts, cols[losses.sample], losses.timeouts)
        bounds = losses.bounds(phase.repeat)
        if blame is not None or record is not None:  # once for the phase: per step it cost more than the step
            loss_keys = blame_key(losses.extra_s, n + losses.link)
    jitter = config.link_jitter if config.link_jitter is not None and not config.link_jitter.is_zero else None
    link_code = np.where(d.blame_link >= 0, n + d.blame_link, -1)
    quiet = losses is None and jitter is None and rates is None
    cyclic = d.cyclic
    if cyclic is not None:
        # Per-flow arrays in rank order (the draws stay in flow order: the same samples either way).
        rank_seconds_of_flow = d.seconds[cyclic.order]
        loss_rows = phase.src[losses.flow] if losses is not None else None
    history: list[FloatArray] = [clock]
    blames: list[IntArray | None] = [_snapshot(blame)]
    remaining = phase.repeat
    j = 0
    while remaining > 0:
        extra: FloatArray | None = None
        code: IntArray | None = None
        sparse = None
        if jitter is not None:
            extra = jitter.sample(rng, (flows, samples))
            code = np.broadcast_to(link_code[:, None], (flows, samples))
        if losses is not None and bounds[j + 1] > bounds[j]:
            sl = slice(int(bounds[j]), int(bounds[j + 1]))
            seconds = losses.extra_s[sl]
            key = loss_keys[sl] if loss_keys is not None else None
            sparse = (losses.flow[sl], losses.sample[sl], seconds, key)
        if rates is not None:
            start = np.maximum(clock[phase.src], clock[phase.dst])
            fault_extra, fault_code = rates.extra(start)
            if extra is None or code is None:
                extra, code = fault_extra, fault_code
            else:
                code = np.where(fault_extra > extra, fault_code, code)
                extra = extra + fault_extra
        extra_blame = None
        if extra is not None and (blame is not None or record is not None):
            extra_blame = blame_key(extra, -1 if code is None else code)
        if record is not None:
            record[0].add(record[1], j, cols, extra=extra, extra_key=extra_blame, sparse=sparse)
        if cyclic is not None:
            clock = step_cyclic(
                clock,
                cyclic,
                rank_seconds_of_flow,
                delay,
                extra_s=None if extra is None else np.take(extra, cyclic.order, axis=0),
                extra_blame=None if extra_blame is None else np.take(extra_blame, cyclic.order, axis=0),
                rank_blame=delay_blame,
                sparse=None if sparse is None or loss_rows is None else (loss_rows[sl], *sparse[1:]),
                blame=blame,
            )
        else:
            clock = step_samples(
                clock,
                phase,
                d.incidence,
                d.seconds,
                delay,
                extra_s=extra,
                extra_blame=extra_blame,
                rank_blame=delay_blame,
                sparse=None if sparse is None else (*sparse[:3], _keys(sparse[3], sparse[2].size)),
                blame=blame,
            )
        remaining -= 1
        j += 1
        if not quiet or remaining == 0:
            continue
        history.append(clock)
        blames.append(_snapshot(blame))
        jumped = jump_samples(history, remaining, d.incidence.active)
        # Jump only once the blame has settled too: it moves with the argmax, which repeats with the clocks.
        settled = all(_same(b, blames[-1]) for b in blames)
        if jumped is not None and settled:
            shift, left = jumped
            clock = clock.copy()
            clock[d.incidence.active] += shift
            j += remaining - left
            remaining = left
            history, blames = [clock], [_snapshot(blame)]
        elif len(history) > _MAX_HISTORY:
            history.pop(0)
            blames.pop(0)
    return clock


def _keys(key: IntArray | None, size: int) -> IntArray:
    """Blame keys of sparse delays, or placeholders where no blame is carried (step_samples ignores them)."""
    return key if key is not None else np.zeros(size, dtype=np.int64)


def _snapshot(blame: Blame | None) -> IntArray | None:
    return None if blame is None else blame.key.copy()


def _same(a: IntArray | None, b: IntArray | None) -> bool:
    if a is None or b is None:
        return a is b
    return bool(np.array_equal(a, b))
