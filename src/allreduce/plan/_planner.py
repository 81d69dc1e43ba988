"""The step-time planner: a workload on a cluster, its scaling from 8 GPUs, and what one change would do.

Every all-reduce time comes from :func:`allreduce.sim.simulate` of the bucket's size with the chosen schedule;
the planner adds only the overlap timeline of :mod:`allreduce.plan._step`. ``algorithm="auto"`` takes, for each
distinct bucket size, the fastest all-reduce in the simulator (as NCCL's tuner picks per message size); the
scaling rows and what-if rows keep the base plan's per-size choice, so each row changes one thing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from allreduce.plan._step import Compute, StepTime, step_seconds, step_time
from allreduce.plan._workload import (
    DDP_BUCKET_CAP_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    GRADIENT_DTYPES,
    TRAINING_FLOPS_PER_PARAM_TOKEN,
    TRAINING_PER_FORWARD_FLOPS,
    Model,
    ddp_buckets,
)
from allreduce.schedules import ALL_REDUCE_ALGORITHMS, Schedule, all_reduce
from allreduce.sim import Distribution, Faults, LossModel, SimResult, TailConfig, TailResult, simulate, simulate_tail
from allreduce.topology import NodeKind, Topology, parse_topology
from allreduce.units import format_bytes, format_seconds

__all__ = [
    "AUTO",
    "Plan",
    "PlanRequest",
    "ScalingRow",
    "SizeRun",
    "StepPlan",
    "StepQuantiles",
    "WhatIf",
    "compute_seconds",
    "plan",
    "plan_step",
    "scaling_counts",
]

AUTO = "auto"
# The direct all-reduce has one flow pattern per step, O(N^2) to simulate: auto considers it on small groups only.
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
# simulate_tail samples per bucket size for the loss rows (a bucket size's all-reduce loses a timeout's worth in a
# few percent of runs, which 100 samples resolve; each costs O(ranks x steps) array work), and the steps sampled
# from them (enough that p99 rests on 10 steps beyond it).
LOSS_TAIL_SAMPLES = 100
STEP_SAMPLES = 1000
# Draws of the slowest GPU's compute under gradient accumulation (no closed form for the max of sums).
COMPUTE_SAMPLES = 1000
# The quantiles a distribution of step times reports.
STEP_QUANTILES = (0.5, 0.99)


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


@dataclass(frozen=True)
class PlanRequest:
    """Everything one step-time estimate depends on (a pure function of these: a sweep case)."""

    model: Model
    gpus: int
    topology: str
    compute: Compute
    gradient_dtype: str = "bf16"
    bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES
    first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES
    algorithm: str = AUTO
    group_size: int | None = None
    placement: str = "linear"
    seed: int = 0
    uplink_oversubscription: float = 1.0
    faults: Faults = field(default_factory=Faults)
    engine: str = "auto"
    # Compute per micro-batch as a distribution over GPUs and steps (``compute`` then holds its median).
    compute_distribution: Distribution | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"--gpus must be >= 1, got {self.gpus}")
        if self.gradient_dtype not in GRADIENT_DTYPES:
            raise ValueError(f"gradient dtype {self.gradient_dtype!r}: choose from {', '.join(GRADIENT_DTYPES)}")
        if self.algorithm != AUTO and self.algorithm not in ALL_REDUCE_ALGORITHMS:
            known = ", ".join((AUTO, *ALL_REDUCE_ALGORITHMS))
            raise ValueError(f"--algorithm {self.algorithm!r}: choose from {known}")
        if not (self.uplink_oversubscription >= 1.0 and math.isfinite(self.uplink_oversubscription)):
            raise ValueError(f"uplink oversubscription must be >= 1, got {self.uplink_oversubscription}")

    @property
    def bucket_bytes(self) -> tuple[int, ...]:
        element = GRADIENT_DTYPES[self.gradient_dtype]
        return ddp_buckets(
            [p * element for p in self.model.tensor_params],
            bucket_cap_bytes=self.bucket_cap_bytes,
            first_bucket_bytes=self.first_bucket_bytes,
            whole_tensors=self.model.whole_tensors,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "params": self.model.params,
            "gpus": self.gpus,
            "topology": self.topology,
            "algorithm": self.algorithm,
            "gradient_dtype": self.gradient_dtype,
            "bucket_cap_bytes": self.bucket_cap_bytes,
            "first_bucket_bytes": self.first_bucket_bytes,
            "micro_batch_s": self.compute.micro_batch_s,
            "backward_fraction": self.compute.backward_fraction,
            "accumulation_steps": self.compute.accumulation_steps,
            "overlap": self.compute.overlap,
            "placement": self.placement,
            "uplink_oversubscription": self.uplink_oversubscription,
            "engine": self.engine,
            "compute_distribution": self.compute_distribution.spec if self.compute_distribution else None,
        }


@dataclass(frozen=True)
class SizeRun:
    """The all-reduce of one distinct bucket size: ``count`` buckets of ``size_bytes``, each ``seconds``."""

    size_bytes: int
    count: int
    algorithm: str
    seconds: float
    busbw_Bps: float
    exact: bool
    links: tuple[tuple[str, float], ...]  # the busiest links and their utilization
    bottleneck_link: str | None  # the link the critical path waited on most

    def to_json(self) -> dict[str, Any]:
        return {
            "size_bytes": self.size_bytes,
            "count": self.count,
            "algorithm": self.algorithm,
            "seconds": self.seconds,
            "busbw_GBps": self.busbw_Bps / 1e9,
            "exact": self.exact,
            "bottleneck_link": self.bottleneck_link,
        }


@dataclass(frozen=True)
class StepPlan:
    """One configuration's step: its request, time split, and the all-reduce of each bucket size."""

    request: PlanRequest
    step: StepTime
    runs: tuple[SizeRun, ...]

    @property
    def algorithms(self) -> dict[int, str]:
        return {r.size_bytes: r.algorithm for r in self.runs}

    @property
    def dominant(self) -> SizeRun:
        """The bucket size whose all-reduces take the most time in all."""
        return max(self.runs, key=lambda r: r.seconds * r.count)

    def to_json(self) -> dict[str, Any]:
        return {**self.request.describe(), **self.step.to_json(), "sizes": [r.to_json() for r in self.runs]}


@dataclass(frozen=True)
class StepQuantiles:
    """The step at its p50 and p99 when something in it is random, and how they were computed."""

    p50: StepTime
    p99: StepTime
    method: str

    def to_json(self) -> dict[str, Any]:
        return {"p50_step_s": self.p50.step_s, "p99_step_s": self.p99.step_s, "method": self.method}


@dataclass(frozen=True)
class ScalingRow:
    gpus: int
    step: StepTime
    efficiency: float  # step time at the first row / step time here (same per-GPU batch)
    algorithm: str
    quantiles: StepQuantiles | None = None  # with a compute distribution

    def to_json(self) -> dict[str, Any]:
        extra = self.quantiles.to_json() if self.quantiles else {}
        return {
            "gpus": self.gpus,
            "efficiency": self.efficiency,
            "algorithm": self.algorithm,
            **self.step.to_json(),
            **extra,
        }


@dataclass(frozen=True)
class WhatIf:
    """One change against the base plan; ``step`` is None when the change does not apply (``note`` says why).

    A random change (packet loss) has ``quantiles``; ``step`` is then its p50 step."""

    change: str
    step: StepTime | None
    note: str = ""
    quantiles: StepQuantiles | None = None

    def to_json(self) -> dict[str, Any]:
        extra = self.quantiles.to_json() if self.quantiles else {}
        return {"change": self.change, "note": self.note, **(self.step.to_json() if self.step else {}), **extra}


@dataclass(frozen=True)
class Plan:
    """The answer of ``allreduce plan``: the base step, the scaling table, the what-ifs, the bottleneck."""

    base: StepPlan
    scaling: tuple[ScalingRow, ...]
    what_ifs: tuple[WhatIf, ...]
    bottleneck: str
    curve: tuple[tuple[int, float, float], ...]  # (size_bytes, seconds, busbw_Bps) of the dominant algorithm
    notes: tuple[str, ...] = ()
    quantiles: StepQuantiles | None = None  # of the base step, with a compute distribution

    def to_json(self) -> dict[str, Any]:
        dominant = self.base.dominant
        return {
            "kind": "plan",
            "base": {**self.base.to_json(), **(self.quantiles.to_json() if self.quantiles else {})},
            "bottleneck": self.bottleneck,
            "scaling": [row.to_json() for row in self.scaling],
            "what_ifs": [w.to_json() for w in self.what_ifs],
            "links": [{"link": name, "utilization": u} for name, u in dominant.links],
            "links_of": {"size_bytes": dominant.size_bytes, "algorithm": dominant.algorithm},
            "busbw_curve": [
                {"size_bytes": size, "seconds": s, "busbw_GBps": bw / 1e9, "algorithm": dominant.algorithm}
                for size, s, bw in self.curve
            ],
            "notes": list(self.notes),
        }


# ------------------------------------------------------------------------------------------------------------
# Simulation, memoised within one plan
# ------------------------------------------------------------------------------------------------------------
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
        names = []
        for name in ALL_REDUCE_ALGORITHMS:
            if name == "direct" and gpus > DIRECT_MAX_RANKS:
                continue
            if name == "hierarchical" and self.group_size(request, gpus) is None:
                continue
            names.append(name)
        return names

    def schedule(self, request: PlanRequest, name: str, gpus: int) -> Schedule:
        group = self.group_size(request, gpus) if name == "hierarchical" else None
        if name == "hierarchical" and group is None:
            raise ValueError(f"hierarchical on {gpus} GPUs: no group size divides them into several groups")
        key = (name, gpus, group)
        if key not in self._schedules:
            self._schedules[key] = (
                all_reduce(name, gpus, group_size=group) if group is not None else all_reduce(name, gpus)
            )
        return self._schedules[key]

    def run(self, request: PlanRequest, name: str, gpus: int, size_bytes: int) -> SimResult:
        key = (
            name,
            gpus,
            size_bytes,
            request.topology,
            request.uplink_oversubscription,
            request.placement,
            request.seed,
            request.faults,
            request.engine,
            request.group_size,
        )
        if key not in self._results:
            topology = self.topology(request.topology, request.uplink_oversubscription)
            if gpus > topology.num_gpus:
                raise ValueError(f"--gpus {gpus}: {topology.name} has only {topology.num_gpus} GPUs")
            self._results[key] = simulate(
                self.schedule(request, name, gpus),
                topology,
                size_bytes=size_bytes,
                placement=request.placement,
                seed=request.seed,
                faults=request.faults,
                engine=request.engine,
            )
        return self._results[key]

    def tail(self, request: PlanRequest, name: str, gpus: int, size_bytes: int, config: TailConfig) -> TailResult:
        """:func:`allreduce.sim.simulate_tail` of one bucket size under the request's topology, placement, faults."""
        return simulate_tail(
            self.schedule(request, name, gpus),
            self.topology(request.topology, request.uplink_oversubscription),
            size_bytes=size_bytes,
            config=config,
            placement=request.placement,
            seed=request.seed,
            faults=request.faults,
        )


def _size_run(result: SimResult, size_bytes: int, count: int) -> SizeRun:
    return SizeRun(
        size_bytes=size_bytes,
        count=count,
        algorithm=result.name,
        seconds=result.seconds,
        busbw_Bps=result.busbw_Bps,
        exact=result.exact,
        links=tuple(result.busiest_links(UTILIZATION_LINKS)),
        bottleneck_link=result.bottlenecks[0].name if result.bottlenecks else None,
    )


def _plan_step(
    request: PlanRequest, sim: _Simulator, *, gpus: int | None = None, algorithms: dict[int, str] | None = None
) -> StepPlan:
    n = request.gpus if gpus is None else gpus
    buckets = request.bucket_bytes
    sizes = sorted(set(buckets))
    runs: dict[int, SizeRun] = {}
    for size in sizes:
        count = buckets.count(size)
        if n == 1:
            runs[size] = SizeRun(size, count, "none", 0.0, 0.0, True, (), None)
            continue
        if algorithms is not None and size in algorithms:
            names = [algorithms[size]]
            if names[0] == "hierarchical" and sim.group_size(request, n) is None:
                names = ["ring"]
        elif request.algorithm == AUTO:
            names = sim.candidates(request, n)
        else:
            names = [request.algorithm]
        results = [sim.run(request, name, n, size) for name in names]
        runs[size] = _size_run(min(results, key=lambda r: r.seconds), size, count)
    step = step_time(buckets, [runs[b].seconds for b in buckets], request.compute)
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
            timeout = "timeout" if fabric == "roce" else "RTO"
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


def _nearest_rank(p: float, count: int) -> int:
    """Index of the p-quantile in ``count`` sorted values (the nearest-rank definition)."""
    return min(count - 1, max(0, math.ceil(p * count) - 1))


def loss_quantiles(base: StepPlan, sim: _Simulator, loss: LossModel, *, seed: int = 0) -> StepQuantiles:
    """The base step with packet loss: p50 and p99 of :data:`STEP_SAMPLES` steps.

    Per bucket size, :func:`allreduce.sim.simulate_tail` draws :data:`LOSS_TAIL_SAMPLES` all-reduces with loss;
    what loss adds to each (its collective time minus the tail's noise-free time) is added to the plan's time for
    that size. A step draws every bucket's all-reduce independently (loss is independent per packet) from those
    samples and runs the plan's timeline; the step at the p-quantile is reported whole (its split too)."""
    request = base.request
    buckets = base.step.bucket_bytes
    config = TailConfig(samples=LOSS_TAIL_SAMPLES, seed=seed, loss=loss, attribution=False)
    rng = np.random.default_rng(seed)
    draws = np.empty((STEP_SAMPLES, len(buckets)))
    exact = True
    for run in base.runs:
        columns = [k for k, b in enumerate(buckets) if b == run.size_bytes]
        if run.algorithm == "none":
            draws[:, columns] = 0.0
            continue
        tail = sim.tail(request, run.algorithm, request.gpus, run.size_bytes, config)
        exact = exact and tail.exact
        seconds = run.seconds + (tail.collective_s - tail.baseline_s)
        draws[:, columns] = seconds[rng.integers(0, seconds.size, size=(STEP_SAMPLES, len(columns)))]
    steps = step_seconds(buckets, draws, request.compute)
    order = np.argsort(steps, kind="stable")
    p50, p99 = (
        step_time(buckets, draws[order[_nearest_rank(p, STEP_SAMPLES)]], request.compute) for p in STEP_QUANTILES
    )
    method = (
        f"p50 of {STEP_SAMPLES} steps (p99 {format_seconds(p99.step_s)}); each bucket from "
        f"{LOSS_TAIL_SAMPLES} tail samples of its size{'' if exact else ' (~ fast engine)'}"
    )
    return StepQuantiles(p50, p99, method)


def slowest_compute_quantile(
    distribution: Distribution, p: float, *, gpus: int, accumulation: int, rng: np.random.Generator
) -> float:
    """The p-quantile of the slowest GPU's compute per step: max over ``gpus`` of the sum of ``accumulation``
    independent draws. With one micro-batch it is exact, F⁻¹(p^(1/gpus)) (the max of n iid draws is below x with
    probability F(x)^n); with several, the p-quantile of :data:`COMPUTE_SAMPLES` Monte Carlo draws."""
    if accumulation == 1:
        return distribution.quantile(p ** (1.0 / gpus))
    slowest = np.zeros(COMPUTE_SAMPLES)
    chunk = max(1, 2**22 // (COMPUTE_SAMPLES * accumulation))
    for start in range(0, gpus, chunk):
        count = min(chunk, gpus - start)
        sums = distribution.sample(rng, (COMPUTE_SAMPLES, count, accumulation)).sum(axis=2)
        slowest = np.maximum(slowest, sums.max(axis=1))
    return float(np.sort(slowest)[_nearest_rank(p, COMPUTE_SAMPLES)])


def compute_quantiles(step: StepPlan, distribution: Distribution, *, gpus: int) -> StepQuantiles:
    """p50 and p99 of the step when every GPU's compute per micro-batch is drawn from ``distribution``.

    Every all-reduce needs every GPU's bucket, so the step's timeline follows the slowest GPU's compute S, and
    the step time is non-decreasing in S: its p-quantile is the step at S's p-quantile, exactly (no sampling of
    the timeline). The typical GPU computes the distribution's median; ``waiting`` is the slowest's excess."""
    compute = step.request.compute
    accumulation = compute.accumulation_steps
    median_s = distribution.quantile(0.5)
    rng = np.random.default_rng(step.request.seed)
    times: list[StepTime] = []
    for p in STEP_QUANTILES:
        slowest_s = slowest_compute_quantile(distribution, p, gpus=gpus, accumulation=accumulation, rng=rng)
        per_micro_s = slowest_s / accumulation
        typical_s = min(median_s, per_micro_s)
        slowdown = per_micro_s / typical_s - 1.0 if typical_s > 0 else 0.0
        changed = dataclasses.replace(
            compute, micro_batch_s=typical_s if typical_s > 0 else per_micro_s, straggler_slowdown=max(slowdown, 0.0)
        )
        times.append(step_time(step.step.bucket_bytes, step.step.bucket_s, changed))
    method = f"the slowest of {gpus} GPUs' compute ({distribution.spec}) at its quantile: " + (
        "exact (F^-1(p^(1/n)))" if accumulation == 1 else f"{COMPUTE_SAMPLES} draws of the sum of {accumulation}"
    )
    return StepQuantiles(times[0], times[1], method)


def plan(
    request: PlanRequest,
    *,
    scaling: bool = True,
    what_ifs: bool = True,
    curve: bool = True,
    loss_probability: float = WHAT_IF_LOSS_PROBABILITY,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """The base step, the scaling table from 8 GPUs (doubling, same per-GPU batch), and the what-if table.

    ``loss_probability`` (per packet, every link) sets the loss rows of the what-if table; 0 leaves them out.
    With ``request.compute_distribution`` the base and every scaling row also carry their p50 and p99."""
    if not (math.isfinite(loss_probability) and 0 <= loss_probability < 1):
        raise ValueError(f"--loss must be a probability in [0, 1), got {loss_probability}")
    distribution = request.compute_distribution
    sim = _Simulator()
    say = progress or (lambda _text: None)
    say(f"base plan on {request.gpus} GPUs")
    base = _plan_step(request, sim)
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
            rows.append(ScalingRow(n, step, first / step.step_s if step.step_s > 0 else 1.0, algorithm, quantiles))
    whats: list[WhatIf] = []
    notes: list[str] = []
    if what_ifs:
        say("what-if table")
        whats, notes = _what_ifs(base, sim, request, loss_probability)
    points: list[tuple[int, float, float]] = []
    if curve and request.gpus > 1:
        say("busbw curve")
        name = base.dominant.algorithm
        for size in CURVE_SIZES_BYTES:
            result = sim.run(request, name, request.gpus, size)
            points.append((size, result.seconds, result.busbw_Bps))
    if not all(r.exact for r in base.runs):
        notes.append("some all-reduce times are the fast engine's approximation (ranks left lockstep)")
    base_quantiles = compute_quantiles(base, distribution, gpus=request.gpus) if distribution else None
    return Plan(base, tuple(rows), tuple(whats), _bottleneck(base), tuple(points), tuple(notes), base_quantiles)
