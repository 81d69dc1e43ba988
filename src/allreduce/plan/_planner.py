"""The step-time planner: a workload on a cluster, its scaling from 8 GPUs, and what one change would do.

Every all-reduce time comes from the simulator (:func:`allreduce.sim.simulate_sizes`: each schedule once for all
the bucket sizes it runs, each size's result what :func:`allreduce.sim.simulate` gives it alone); the planner
adds only the overlap timeline of :mod:`allreduce.plan._step`. ``algorithm="auto"`` takes, for each distinct
bucket size, the fastest all-reduce in the simulator (as NCCL's tuner picks per message size); the scaling rows
and what-if rows keep the base plan's per-size choice, so each row changes one thing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from allreduce.plan._answer import Plan, ScalingRow, SizeRun, StepPlan, WhatIf
from allreduce.plan._goodput import FailureSettings, Network, goodput_plan
from allreduce.plan._request import AUTO, PlanRequest
from allreduce.plan._step import step_time, step_timeline
from allreduce.plan._tail import (
    LOSS_TAIL_SAMPLES,
    STEP_SAMPLES,
    StepQuantiles,
    compute_step_quantiles,
    loss_step_quantiles,
)
from allreduce.plan._workload import (
    TRAINING_FLOPS_PER_PARAM_TOKEN,
    TRAINING_PER_FORWARD_FLOPS,
    Model,
)
from allreduce.schedules import Collective, Schedule, algorithms, all_reduce, get_algorithm
from allreduce.sim import (
    DEFAULT_EXACT_BUDGET_S,
    Distribution,
    LossModel,
    SimResult,
    TailConfig,
    TailResult,
    simulate_sizes,
    simulate_tail,
)
from allreduce.topology import NodeKind, Topology, parse_topology
from allreduce.units import format_bytes, format_seconds

__all__ = [
    "WHAT_IF_LOSS_PROBABILITY",
    "compute_quantiles",
    "compute_seconds",
    "plan",
    "plan_step",
    "scaling_counts",
]

PLAN_EXACT_MAX_RANKS = 256
"""Under engine "auto" the planner asks the simulator for exact times up to this many GPUs and for the fast
engine's beyond (marked where it could not certify them, see the plan's notes): a plan simulates every candidate
algorithm at every bucket size and scaling row, and at 1,024 GPUs the event engine made a plan 20x slower (78
against 4 CPU-seconds, ``benchmarks/bench_plan.py``). ``--engine event`` asks for exact times at any size."""


def plan_engine(engine: str, gpus: int) -> str:
    """The simulator engine a plan uses for ``gpus`` GPUs when asked for ``engine``."""
    return "fast" if engine == "auto" and gpus > PLAN_EXACT_MAX_RANKS else engine


MiB = 2**20
# A quadratic all-reduce (direct: one flow pattern per step) is O(N^2) to simulate: auto considers it on small groups.
DIRECT_MAX_RANKS = 256
# Group size for hierarchical when the topology does not say what a node is (a common 8-GPU server).
FALLBACK_GROUP_SIZE = 8
# The scaling table starts at one 8-GPU server and doubles.
SCALING_FIRST_GPUS = 8
# What-if rows: bucket caps a fifth and four times the base (5 and 100 MiB around DDP's 25 MiB), the leaf
# uplinks at 2:1 and 4:1 (common oversubscription of cost-reduced fabrics), the bottleneck link at 10% of its
# bandwidth (a link negotiated down, e.g. 400G to 40G), one GPU 10% slower (thermal throttling, a noisy host).
WHAT_IF_BUCKET_CAP_FACTORS = (0.2, 4.0)
WHAT_IF_OVERSUBSCRIPTION = (2.0, 4.0)
WHAT_IF_DEGRADED_LINK_FACTOR = 0.1
WHAT_IF_STRAGGLER_SLOWDOWN = 0.1
# Sizes of the busbw-versus-message-size curve: 1 KiB to 1 GiB by factors of 4.
CURVE_SIZES_BYTES = tuple(2**e for e in range(10, 31, 2))
# A step whose exposed communication is at most this share of it is called compute-bound: below what step-time
# measurements resolve (run-to-run variation of a training step is typically a few percent).
COMPUTE_BOUND_EXPOSED_SHARE = 0.01
# Links the report's utilization view shows.
UTILIZATION_LINKS = 16
# The loss what-if: one packet in a million dropped on every link (a healthy datacenter link drops far fewer; a
# marginal optic or a congested lossy fabric this many), under three retransmission models that span practice:
# RoCE with the InfiniBand ACK timeout NCCL and HCCL default to (4.096 us x 2^20 = 4.29 s), TCP with Linux's
# minimum RTO (200 ms), and TCP with a tuned 4 ms RTO.
WHAT_IF_LOSS_PROBABILITY = 1e-6
WHAT_IF_LOSS_MODELS: tuple[tuple[str, str, float | None], ...] = (
    ("RoCE", "roce", None),
    ("TCP", "tcp", None),
    ("TCP", "tcp", 4e-3),
)


def compute_seconds(
    model: Model,
    *,
    gpu_tflops: float,
    mfu: float,
    tokens_per_gpu: float | None = None,
    samples_per_gpu: float | None = None,
) -> float:
    """Compute of one micro-batch: 6·params·tokens FLOPs for a transformer, 3·forward FLOPs·samples for a CNN,
    at ``gpu_tflops`` × ``mfu`` (model FLOPs utilization)."""
    if not (gpu_tflops > 0 and math.isfinite(gpu_tflops)):
        raise ValueError(f"--gpu-tflops must be a number > 0, got {gpu_tflops}")
    if not 0 < mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {mfu}")
    if model.forward_flops_per_sample is None:
        if tokens_per_gpu is None or tokens_per_gpu <= 0:
            raise ValueError(f"{model.name}: compute from FLOPs needs --tokens-per-gpu > 0 (6 x params x tokens)")
        flops = TRAINING_FLOPS_PER_PARAM_TOKEN * model.params * tokens_per_gpu
    else:
        if samples_per_gpu is None or samples_per_gpu <= 0:
            raise ValueError(f"{model.name}: compute from FLOPs needs --samples-per-gpu > 0 (images per GPU)")
        flops = TRAINING_PER_FORWARD_FLOPS * model.forward_flops_per_sample * samples_per_gpu
    return flops / (gpu_tflops * 1e12 * mfu)


def _leaf_uplinks(topology: Topology) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Links between a switch that GPUs (or their NICs) attach to and a switch above it, both directions."""
    kind = topology.node_kind
    src, dst = topology.link_src, topology.link_dst
    endpoint = kind[src] != NodeKind.SWITCH
    leaves = np.unique(dst[endpoint & (kind[dst] == NodeKind.SWITCH)])
    is_leaf = np.zeros(topology.num_nodes, dtype=np.bool_)
    is_leaf[leaves] = True
    switch_to_switch = (kind[src] == NodeKind.SWITCH) & (kind[dst] == NodeKind.SWITCH)
    return np.flatnonzero(switch_to_switch & (is_leaf[src] ^ is_leaf[dst])).astype(np.int64)


class _Simulator:
    """Topologies, schedules and simulation results of one plan, each computed once."""

    def __init__(self) -> None:
        self._topologies: dict[tuple[str, float], Topology] = {}
        self._schedules: dict[tuple[str, int, int | None], Schedule] = {}
        self._results: dict[tuple[Any, ...], SimResult] = {}
        # Seconds by size of each (algorithm, gpus, setting) already simulated: lower bounds for auto (see fastest).
        self._seconds_by_size: dict[tuple[Any, ...], dict[int, float]] = {}
        self._networks: dict[tuple[str, float], Network] = {}

    def topology(self, spec: str, oversubscription: float) -> Topology:
        key = (spec, oversubscription)
        if key not in self._topologies:
            if (spec, 1.0) not in self._topologies:
                self._topologies[(spec, 1.0)] = parse_topology(spec)
            topology = self._topologies[(spec, 1.0)]
            if oversubscription != 1.0:
                uplinks = _leaf_uplinks(topology)
                if not uplinks.size:
                    raise ValueError(f"{topology.name}: no switch tier above the GPUs' switches to oversubscribe")
                topology = topology.scaled(uplinks, 1.0 / oversubscription)
            self._topologies[key] = topology
        return self._topologies[key]

    def network(self, request: PlanRequest) -> Network:
        """The request's network parts that can fail (counted once per topology)."""
        key = (request.topology, request.uplink_oversubscription)
        if key not in self._networks:
            self._networks[key] = Network.of(self.topology(*key))
        return self._networks[key]

    def group_size(self, request: PlanRequest, gpus: int) -> int | None:
        if request.group_size is not None:
            return request.group_size if 1 < request.group_size < gpus and gpus % request.group_size == 0 else None
        structure = self.topology(request.topology, 1.0).structure
        for attribute in ("gpus_per_node", "hosts_per_leaf"):
            g = getattr(structure, attribute, None)
            if isinstance(g, int) and 1 < g < gpus and gpus % g == 0:
                return g
        g = FALLBACK_GROUP_SIZE
        return g if 1 < g < gpus and gpus % g == 0 else None

    def candidates(self, request: PlanRequest, gpus: int) -> list[str]:
        """The registered all-reduce algorithms that auto may choose (see ``Algorithm.automatic``) and that apply
        to ``gpus`` GPUs."""
        names = []
        for name in algorithms(Collective.ALL_REDUCE):
            entry = get_algorithm(Collective.ALL_REDUCE, name)
            if not entry.automatic:
                continue
            if entry.quadratic and gpus > DIRECT_MAX_RANKS:
                continue
            if "group_size" in entry.parameters and self.group_size(request, gpus) is None:
                continue
            names.append(name)
        return names

    def needs_group(self, name: str) -> bool:
        return "group_size" in get_algorithm(Collective.ALL_REDUCE, name).parameters

    def schedule(self, request: PlanRequest, name: str, gpus: int) -> Schedule:
        group = self.group_size(request, gpus) if self.needs_group(name) else None
        if self.needs_group(name) and group is None:
            raise ValueError(f"{name} on {gpus} GPUs: no group size divides them into several groups")
        key = (name, gpus, group)
        if key not in self._schedules:
            self._schedules[key] = (
                all_reduce(name, gpus, group_size=group) if group is not None else all_reduce(name, gpus)
            )
        return self._schedules[key]

    @staticmethod
    def _setting(request: PlanRequest, name: str, gpus: int) -> tuple[Any, ...]:
        return (
            name,
            gpus,
            request.topology,
            request.uplink_oversubscription,
            request.placement,
            request.seed,
            request.faults,
            request.engine,
            request.group_size,
        )

    def run(self, request: PlanRequest, name: str, gpus: int, size_bytes: int) -> SimResult:
        """:func:`allreduce.sim.simulate` of one candidate at one size, remembered (on the engine
        :func:`plan_engine` picks)."""
        return self.run_sizes(request, name, gpus, [size_bytes])[size_bytes]

    def run_sizes(self, request: PlanRequest, name: str, gpus: int, sizes: Sequence[int]) -> dict[int, SimResult]:
        """:meth:`run` for several bucket sizes: those not yet simulated in one :func:`allreduce.sim.simulate_sizes`
        call (routes, fair rates and the recurrence's steps shared by the sizes)."""
        setting = self._setting(request, name, gpus)
        missing = sorted({size for size in sizes if (*setting, size) not in self._results})
        if missing:
            topology = self.topology(request.topology, request.uplink_oversubscription)
            if gpus > topology.num_gpus:
                raise ValueError(f"--gpus {gpus}: {topology.name} has only {topology.num_gpus} GPUs")
            results = simulate_sizes(
                self.schedule(request, name, gpus),
                topology,
                sizes_bytes=missing,
                placement=request.placement,
                seed=request.seed,
                faults=request.faults,
                engine=plan_engine(request.engine, gpus),
            )
            known = self._seconds_by_size.setdefault(setting, {})
            for size, result in zip(missing, results, strict=True):
                self._results[(*setting, size)] = result
                known[size] = result.seconds
        return {size: self._results[(*setting, size)] for size in sizes}

    def prefetch(self, request: PlanRequest, gpus: int, sizes: Sequence[int]) -> None:
        """Simulate every candidate algorithm at every one of ``sizes``, each candidate in one pass: what the
        what-if rows need (one row per algorithm), done before the base plan's :meth:`fastest` so that it finds
        them, rather than searching size by size and completing the sizes it pruned later. A candidate that
        cannot run is left to the row that names it, which reports why."""
        for name in self.candidates(request, gpus):
            try:
                self.run_sizes(request, name, gpus, sizes)
            except ValueError:
                continue

    def fastest(self, request: PlanRequest, gpus: int, sizes: Sequence[int]) -> dict[int, SimResult]:
        """The fastest candidate algorithm for each bucket size (the first in candidate order among equals).

        Where the fast engine computes every time, an all-reduce's time is non-decreasing in its size (flow
        durations are latency + bytes / a rate that does not depend on bytes, and the recurrence only adds and
        takes maxima), so a time already simulated at a smaller size is a lower bound. The smallest size is
        searched first, candidates in order of that bound; then each candidate whose bound does not exceed the
        best time found at some larger size is simulated at all such sizes in one pass. A candidate is skipped
        at a size only when its bound exceeds the best time there: it cannot win or tie, so every choice and its
        time are the full search's. The event engine's times carry no such guarantee, so where it may run every
        candidate is simulated at every size."""
        names = self.candidates(request, gpus)
        if not names:
            raise ValueError(f"no all-reduce algorithm applies to {gpus} GPUs")
        monotone = plan_engine(request.engine, gpus) == "fast"

        def bound(name: str, size_bytes: int) -> float:
            known = self._seconds_by_size.get(self._setting(request, name, gpus), {})
            smaller = [seconds for size, seconds in known.items() if size <= size_bytes]
            return max(smaller) if monotone and smaller else 0.0

        ordered = sorted(set(sizes))
        best: dict[int, tuple[float, int, SimResult]] = {}
        for group in (ordered[:1], ordered[1:]):
            if not group:
                continue
            for index, name in sorted(enumerate(names), key=lambda item: bound(item[1], group[0])):
                needed = [size for size in group if size not in best or bound(name, size) <= best[size][0]]
                if not needed:
                    continue
                for size, result in self.run_sizes(request, name, gpus, needed).items():
                    if size not in best or (result.seconds, index) < best[size][:2]:
                        best[size] = (result.seconds, index, result)
        return {size: best[size][2] for size in sizes}

    def tail(self, request: PlanRequest, name: str, gpus: int, size_bytes: int, config: TailConfig) -> TailResult:
        """:func:`allreduce.sim.simulate_tail` of one bucket size under the request's topology, placement, faults
        (its uncertified samples re-run on the event engine only where :func:`plan_engine` would run it)."""
        exact = plan_engine(request.engine, gpus) != "fast"
        if not exact and config.engine == "auto":
            # No sample is re-run on the event engine: then the tail need not record their noise for it either.
            config = dataclasses.replace(config, engine="fast")
        return simulate_tail(
            self.schedule(request, name, gpus),
            self.topology(request.topology, request.uplink_oversubscription),
            size_bytes=size_bytes,
            config=config,
            placement=request.placement,
            seed=request.seed,
            faults=request.faults,
            exact_budget_s=DEFAULT_EXACT_BUDGET_S if exact else 0.0,
        )


def _size_run(result: SimResult, size_bytes: int, count: int, *, busiest: bool) -> SizeRun:
    """One bucket size's all-reduce; with ``busiest``, its busiest links too (a sort of every link: the base plan's
    utilization view needs them, its scaling and what-if rows do not)."""
    return SizeRun(
        size_bytes=size_bytes,
        count=count,
        algorithm=result.name,
        seconds=result.seconds,
        busbw_Bps=result.busbw_Bps,
        exact=result.exact,
        links=tuple(result.busiest_links(UTILIZATION_LINKS)) if busiest else (),
        bottleneck_link=result.bottlenecks[0].name if result.bottlenecks else None,
    )


def _plan_step(
    request: PlanRequest,
    sim: _Simulator,
    *,
    gpus: int | None = None,
    algorithms: dict[int, str] | None = None,
    busiest: bool = False,
) -> StepPlan:
    n = request.gpus if gpus is None else gpus
    buckets = request.bucket_bytes
    sizes = sorted(set(buckets))
    results: dict[int, SimResult] = {}
    if n > 1:
        # Sizes by the algorithm that runs them (each algorithm's sizes in one simulation), and those auto picks.
        fixed: dict[str, list[int]] = {}
        chosen_by_auto: list[int] = []
        for size in sizes:
            if algorithms is not None and size in algorithms:
                name = algorithms[size]
                if sim.needs_group(name) and sim.group_size(request, n) is None:
                    chosen_by_auto.append(size)  # it has no groups to form on n GPUs: what auto takes there
                else:
                    fixed.setdefault(name, []).append(size)
            elif request.algorithm == AUTO:
                chosen_by_auto.append(size)
            else:
                fixed.setdefault(request.algorithm, []).append(size)
        for name, group in fixed.items():
            results.update(sim.run_sizes(request, name, n, group))
        if chosen_by_auto:
            results.update(sim.fastest(request, n, chosen_by_auto))
    runs: dict[int, SizeRun] = {}
    for size in sizes:
        count = buckets.count(size)
        if n == 1:
            runs[size] = SizeRun(size, count, "none", 0.0, 0.0, True, (), None)
        else:
            runs[size] = _size_run(results[size], size, count, busiest=busiest)
    step = step_time(buckets, [runs[b].seconds for b in buckets], request.step_compute)
    return StepPlan(request, step, tuple(runs[s] for s in sizes))


def plan_step(request: PlanRequest) -> StepPlan:
    """The step time of one configuration (what a sweep case computes)."""
    return _plan_step(request, _Simulator())


def scaling_counts(gpus: int) -> list[int]:
    """8, 16, 32, ... doubling below ``gpus``, then ``gpus`` itself."""
    counts = []
    n = SCALING_FIRST_GPUS
    while n < gpus:
        counts.append(n)
        n *= 2
    counts.append(gpus)
    return counts


def _bottleneck(base: StepPlan) -> str:
    step = base.step
    if step.waiting_s > step.exposed_comm_s and step.waiting_s > 0:
        return f"a straggler: GPUs wait {step.waiting_s / step.step_s:.0%} of the step for the slowest one's compute"
    if step.step_s <= 0 or step.exposed_comm_s <= COMPUTE_BOUND_EXPOSED_SHARE * step.step_s:
        return (
            f"compute: the all-reduces ({step.comm_s:.3g} s in all) hide behind backward; "
            f"exposed communication is {step.exposed_comm_s / step.step_s if step.step_s else 0:.1%} of the step"
        )
    dominant = base.dominant
    share = step.exposed_comm_s / step.step_s
    where = (
        f"its critical path waits most on link {dominant.bottleneck_link}"
        if dominant.bottleneck_link
        else "it is latency-bound (no link limits it)"
    )
    return (
        f"communication: {share:.0%} of the step is exposed all-reduce; the {dominant.count} all-reduces of "
        f"{format_bytes(dominant.size_bytes)} ({dominant.algorithm}) dominate and {where}"
    )


def _what_ifs(
    base: StepPlan, sim: _Simulator, request: PlanRequest, loss_probability: float
) -> tuple[list[WhatIf], list[str]]:
    rows: list[WhatIf] = []
    notes: list[str] = []
    chosen = base.algorithms

    def row(change: str, changed: PlanRequest, *, keep_algorithms: bool = True) -> None:
        try:
            plan_ = _plan_step(changed, sim, algorithms=chosen if keep_algorithms else None)
        except ValueError as exc:
            rows.append(WhatIf(change, None, str(exc)))
            return
        rows.append(WhatIf(change, plan_.step))

    replace = dataclasses.replace
    if request.gpus > 1:
        names = sim.candidates(request, request.gpus)
        for name in names:
            if request.algorithm != AUTO and name == request.algorithm:
                continue
            row(f"algorithm {name}", replace(request, algorithm=name), keep_algorithms=False)
        if request.algorithm != AUTO:
            row("algorithm auto (fastest per bucket size)", replace(request, algorithm=AUTO), keep_algorithms=False)
    for factor in WHAT_IF_BUCKET_CAP_FACTORS:
        cap = int(request.bucket_cap_bytes * factor)
        row(f"bucket cap {cap / 2**20:g} MiB", replace(request, bucket_cap_bytes=cap), keep_algorithms=False)
    for ratio in WHAT_IF_OVERSUBSCRIPTION:
        row(
            f"leaf uplinks at {ratio:g}:1",
            replace(request, uplink_oversubscription=request.uplink_oversubscription * ratio),
        )
    other_placement = "random" if request.placement == "linear" else "linear"
    row(f"{other_placement} placement", replace(request, placement=other_placement))
    link = base.dominant.bottleneck_link or (base.dominant.links[0][0] if base.dominant.links else None)
    if link is None:
        rows.append(WhatIf(f"one link at {WHAT_IF_DEGRADED_LINK_FACTOR:.0%}", None, "no link carries traffic"))
    else:
        faults = replace(request.faults, degraded=(*request.faults.degraded, (link, WHAT_IF_DEGRADED_LINK_FACTOR)))
        row(f"{link} at {WHAT_IF_DEGRADED_LINK_FACTOR:.0%}", replace(request, faults=faults))
    row(
        f"one GPU {WHAT_IF_STRAGGLER_SLOWDOWN:.0%} slower",
        replace(request, compute=replace(request.compute, straggler_slowdown=WHAT_IF_STRAGGLER_SLOWDOWN)),
    )
    row(
        "no overlap (all-reduce after backward)" if request.compute.overlap else "overlap with backward",
        replace(request, compute=replace(request.compute, overlap=not request.compute.overlap)),
    )
    other_dtype = "fp32" if request.gradient_dtype != "fp32" else "bf16"
    row(f"{other_dtype} gradients", replace(request, gradient_dtype=other_dtype), keep_algorithms=False)
    if loss_probability > 0 and request.gpus > 1:
        for label, fabric, rto_s in WHAT_IF_LOSS_MODELS:
            model = LossModel(loss_probability, fabric=fabric, rto_s=rto_s)
            timeout = "timeout" if fabric == "roce" else f"({model.tcp} stack) RTO"  # the tail's TCP preset
            change = f"loss {loss_probability:g}, {label} {timeout} {format_seconds(model.rto)}"
            try:
                quantiles = loss_quantiles(base, sim, model)
            except ValueError as exc:
                rows.append(WhatIf(change, None, str(exc)))
                continue
            rows.append(WhatIf(change, quantiles.p50, quantiles.method, quantiles))
        notes.append(
            f"loss rows: p50 (step ms) and p99 of {STEP_SAMPLES} sampled steps; each bucket's all-reduce is drawn "
            f"from {LOSS_TAIL_SAMPLES} samples of allreduce tail for its size (loss {loss_probability:g} per packet "
            "on every link), added to the plan's own time"
        )
    return rows, notes


def loss_quantiles(base: StepPlan, sim: _Simulator, loss: LossModel) -> StepQuantiles:
    """The base step with packet loss (see :func:`allreduce.plan._tail.loss_step_quantiles`)."""
    request = base.request

    def tail(name: str, size_bytes: int, config: TailConfig) -> TailResult:
        return sim.tail(request, name, request.gpus, size_bytes, config)

    runs = [(r.size_bytes, r.algorithm, r.seconds) for r in base.runs]
    return loss_step_quantiles(base.step, request.step_compute, runs, loss, tail, seed=request.seed)


def compute_quantiles(step: StepPlan, distribution: Distribution, *, gpus: int) -> StepQuantiles:
    """p50 and p99 of ``step`` with compute drawn from ``distribution`` on ``gpus`` GPUs (see
    :func:`allreduce.plan._tail.compute_step_quantiles`)."""
    return compute_step_quantiles(step.step, step.request.step_compute, distribution, gpus=gpus, seed=step.request.seed)


# The what-if rows of the recovery policies (with failures counted), and what each row's step per useful step holds.
POLICY_CHANGES = {
    "restart": "restart from the last checkpoint",
    "spares": "restart, hot spare hosts",
    "elastic": "shrink and continue",
}
POLICY_NOTES = {
    "restart": "rolls back to the last checkpoint and waits for a new host",
    "spares": "rolls back to the last checkpoint; a spare host takes over at once",
    "elastic": "the survivors go on (group.shrink): the step in flight and the pause are lost",
}


def plan(
    request: PlanRequest,
    *,
    scaling: bool = True,
    what_ifs: bool = True,
    curve: bool = True,
    loss_probability: float = WHAT_IF_LOSS_PROBABILITY,
    progress: Callable[[str], None] | None = None,
    failures: FailureSettings | None = None,
) -> Plan:
    """The base step, the scaling table from 8 GPUs (doubling, same per-GPU batch), and the what-if table.

    ``loss_probability`` (per packet, every link) sets the loss rows of the what-if table; 0 leaves them out.
    With ``request.compute_distribution`` the base and every scaling row also carry their p50 and p99. With
    ``failures`` the base carries each recovery policy's goodput and every scaling row the restart policy's."""
    if not (math.isfinite(loss_probability) and 0 <= loss_probability < 1):
        raise ValueError(f"--loss must be a probability in [0, 1), got {loss_probability}")
    distribution = request.compute_distribution
    sim = _Simulator()
    say = progress or (lambda _text: None)
    say(f"base plan on {request.gpus} GPUs")
    if what_ifs and request.gpus > 1:
        sim.prefetch(request, request.gpus, sorted(set(request.bucket_bytes)))
    base = _plan_step(request, sim, busiest=True)
    rows: list[ScalingRow] = []
    if scaling:
        first: float | None = None
        for n in scaling_counts(request.gpus):
            say(f"scaling: {n} GPUs")
            row_plan = _plan_step(request, sim, gpus=n, algorithms=base.algorithms) if n != request.gpus else base
            step = row_plan.step
            first = step.step_s if first is None else first
            algorithm = "/".join(sorted({r.algorithm for r in row_plan.runs}))
            quantiles = compute_quantiles(row_plan, distribution, gpus=n) if distribution else None
            goodput = (
                goodput_plan(failures, gpus=n, parameters=request.model.params, step_s=step.step_s,
                             network=sim.network(request)).row("restart")
                if failures is not None
                else None
            )  # fmt: skip
            efficiency = first / step.step_s if step.step_s > 0 else 1.0
            rows.append(ScalingRow(n, step, efficiency, algorithm, quantiles, goodput.goodput if goodput else None))
    whats: list[WhatIf] = []
    notes: list[str] = []
    if what_ifs:
        say("what-if table")
        whats, notes = _what_ifs(base, sim, request, loss_probability)
    points: list[tuple[int, float, float]] = []
    if curve and request.gpus > 1:
        say("busbw curve")
        curve_runs = sim.run_sizes(request, base.dominant.algorithm, request.gpus, CURVE_SIZES_BYTES)
        points = [(size, curve_runs[size].seconds, curve_runs[size].busbw_Bps) for size in CURVE_SIZES_BYTES]
    if not all(r.exact for r in base.runs):
        notes.append("some all-reduce times are the fast engine's approximation (ranks left lockstep)")
    base_quantiles = compute_quantiles(base, distribution, gpus=request.gpus) if distribution else None
    failure_plan = None
    if failures is not None:
        say("failures and goodput")
        failure_plan = goodput_plan(
            failures, gpus=request.gpus, parameters=request.model.params, step_s=base.step.step_s,
            network=sim.network(request),
        )  # fmt: skip
        if what_ifs:
            whats += [
                WhatIf(
                    f"failures: {POLICY_CHANGES[row.policy]}", base.step, POLICY_NOTES[row.policy], None, row.goodput
                )
                for row in failure_plan.rows
            ]
    timeline = None
    if request.measured is not None or request.model.tensor_ready is not None:
        timeline = step_timeline(base.step.bucket_bytes, base.step.bucket_s, request.step_compute)
    return Plan(
        base,
        tuple(rows),
        tuple(whats),
        _bottleneck(base),
        tuple(points),
        tuple(notes),
        base_quantiles,
        failure_plan,
        timeline,
    )
