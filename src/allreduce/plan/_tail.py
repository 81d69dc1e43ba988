"""The step's spread: p50 and p99 of a training step when compute is drawn from a distribution or packets are lost.

Two methods. Compute drawn per GPU moves the step only through the slowest GPU's compute, on which the step time
is non-decreasing, so its quantiles are the step at that compute's quantiles, exactly
(:func:`compute_step_quantiles`). Packet loss adds independent delays to every bucket's all-reduce; the step's
quantiles come from sampling the plan's timeline over all-reduce times drawn from
:func:`allreduce.sim.simulate_tail` per bucket size (:func:`loss_step_quantiles`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from allreduce.plan._step import Compute, StepTime, step_seconds, step_time
from allreduce.sim import Distribution, LossModel, TailConfig, TailResult
from allreduce.units import format_seconds

__all__ = [
    "COMPUTE_SAMPLES",
    "LOSS_TAIL_SAMPLES",
    "STEP_QUANTILES",
    "STEP_SAMPLES",
    "StepQuantiles",
    "compute_step_quantiles",
    "loss_step_quantiles",
    "nearest_rank",
    "slowest_compute_quantile",
]

# simulate_tail samples per bucket size for the loss rows (a bucket size's all-reduce loses a timeout's worth in a
# few percent of runs, which 100 samples resolve; each costs O(ranks x steps) array work), and the steps sampled
# from them (enough that p99 rests on 10 steps beyond it).
LOSS_TAIL_SAMPLES = 100
STEP_SAMPLES = 1000
# Draws of the slowest GPU's compute under gradient accumulation (no closed form for the max of sums).
COMPUTE_SAMPLES = 1000
# The quantiles a distribution of step times reports.
STEP_QUANTILES = (0.5, 0.99)


@dataclass(frozen=True)
class StepQuantiles:
    """The step at its p50 and p99 when something in it is random, and how they were computed."""

    p50: StepTime
    p99: StepTime
    method: str

    def to_json(self) -> dict[str, Any]:
        return {"p50_step_s": self.p50.step_s, "p99_step_s": self.p99.step_s, "method": self.method}


def nearest_rank(p: float, count: int) -> int:
    """Index of the p-quantile in ``count`` sorted values (the nearest-rank definition)."""
    return min(count - 1, max(0, math.ceil(p * count) - 1))


def loss_step_quantiles(
    step: StepTime,
    compute: Compute,
    runs: Sequence[tuple[int, str, float]],
    loss: LossModel,
    tail: Callable[[str, int, TailConfig], TailResult],
    *,
    seed: int = 0,
) -> StepQuantiles:
    """``step`` with packet loss: p50 and p99 of :data:`STEP_SAMPLES` steps.

    ``runs`` are (bucket size, algorithm, seconds) of every distinct bucket size; ``tail(algorithm, size,
    config)`` runs, with ``loss`` in ``config``, :func:`allreduce.sim.simulate_tail` of one of them.

    Per bucket size, :func:`allreduce.sim.simulate_tail` draws :data:`LOSS_TAIL_SAMPLES` all-reduces with loss;
    what loss adds to each (its collective time minus the tail's noise-free time) is added to the plan's time for
    that size. A step draws every bucket's all-reduce independently (loss is independent per packet) from those
    samples and runs the plan's timeline; the step at the p-quantile is reported whole (its split too)."""
    buckets = step.bucket_bytes
    config = TailConfig(samples=LOSS_TAIL_SAMPLES, seed=seed, loss=loss, attribution=False)
    rng = np.random.default_rng(seed)
    draws = np.empty((STEP_SAMPLES, len(buckets)))
    exact = True
    for size_bytes, algorithm, run_s in runs:
        columns = [k for k, b in enumerate(buckets) if b == size_bytes]
        if algorithm == "none":
            draws[:, columns] = 0.0
            continue
        result = tail(algorithm, size_bytes, config)
        exact = exact and result.exact
        seconds = run_s + (result.collective_s - result.baseline_s)
        draws[:, columns] = seconds[rng.integers(0, seconds.size, size=(STEP_SAMPLES, len(columns)))]
    steps = step_seconds(buckets, draws, compute)
    order = np.argsort(steps, kind="stable")
    p50, p99 = (step_time(buckets, draws[order[nearest_rank(p, STEP_SAMPLES)]], compute) for p in STEP_QUANTILES)
    stack = f", tcp {loss.tcp}" if loss.fabric == "tcp" else ""
    method = (
        f"p50 of {STEP_SAMPLES} steps (p99 {format_seconds(p99.step_s)}); each bucket from "
        f"{LOSS_TAIL_SAMPLES} tail samples of its size{'' if exact else ' (~ fast engine)'}{stack}"
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
    return float(np.sort(slowest)[nearest_rank(p, COMPUTE_SAMPLES)])


def compute_step_quantiles(
    step: StepTime, compute: Compute, distribution: Distribution, *, gpus: int, seed: int = 0
) -> StepQuantiles:
    """p50 and p99 of ``step`` when every GPU's compute per micro-batch is drawn from ``distribution``.

    Every all-reduce needs every GPU's bucket, so the step's timeline follows the slowest GPU's compute S, and
    the step time is non-decreasing in S: its p-quantile is the step at S's p-quantile, exactly (no sampling of
    the timeline). The typical GPU computes the distribution's median; ``waiting`` is the slowest's excess."""
    accumulation = compute.accumulation_steps
    median_s = distribution.quantile(0.5)
    rng = np.random.default_rng(seed)
    times: list[StepTime] = []
    for p in STEP_QUANTILES:
        slowest_s = slowest_compute_quantile(distribution, p, gpus=gpus, accumulation=accumulation, rng=rng)
        per_micro_s = slowest_s / accumulation
        typical_s = min(median_s, per_micro_s)
        slowdown = per_micro_s / typical_s - 1.0 if typical_s > 0 else 0.0
        changed = dataclasses.replace(
            compute, micro_batch_s=typical_s if typical_s > 0 else per_micro_s, straggler_slowdown=max(slowdown, 0.0)
        )
        times.append(step_time(step.bucket_bytes, step.bucket_s, changed))
    method = f"slowest of {gpus} GPUs drawing {distribution.spec}; " + (
        "exact quantile" if accumulation == 1 else f"{COMPUTE_SAMPLES} draws of the sum of {accumulation}"
    )
    return StepQuantiles(times[0], times[1], method)
