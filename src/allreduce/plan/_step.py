"""One training step on one GPU: compute, then the bucket all-reduces overlapped with backward as DDP does.

The timeline of the last micro-batch of a step (earlier micro-batches of gradient accumulation run without
communication, as under ``DistributedDataParallel.no_sync``)::

    forward = (1 - backward_fraction) · compute;  backward produces gradient bytes at a constant rate
    bucket k is ready when backward has produced the bytes of buckets 0..k (reverse registration order)
    all-reduce k starts at max(ready k, end of all-reduce k-1)     one communication stream, in bucket order
    step ends at max(end of compute, end of the last all-reduce)

With ``bucket_ready`` (measured on a real model or read from a profile: :mod:`allreduce.plan._measured`) bucket k
is ready at that fraction of backward instead of at its share of the bytes. With ``overlap=False`` every bucket
is ready when compute ends. A straggler computes ``1 + straggler_slowdown``
times longer; every all-reduce needs every rank's bucket, so the others wait for it. The step splits exactly
into ``compute_s`` (a typical GPU's compute), ``waiting_s`` (for the slowest GPU's compute) and
``exposed_comm_s`` (all-reduce time not hidden behind compute).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "BACKWARD_FRACTION",
    "BucketSpan",
    "Compute",
    "StepTime",
    "StepTimeline",
    "step_seconds",
    "step_time",
    "step_timeline",
]

# Backward costs about twice forward (gradients of activations and of weights), so 2/3 of a step's compute.
BACKWARD_FRACTION = 2.0 / 3.0


@dataclass(frozen=True)
class Compute:
    """Compute of one micro-batch on one GPU (``micro_batch_s``), how it overlaps, and how many per step."""

    micro_batch_s: float
    backward_fraction: float = BACKWARD_FRACTION
    accumulation_steps: int = 1
    overlap: bool = True
    straggler_slowdown: float = 0.0
    bucket_ready: tuple[float, ...] | None = None  # per bucket (all-reduce order): ready at this share of backward

    def __post_init__(self) -> None:
        if not (math.isfinite(self.micro_batch_s) and self.micro_batch_s >= 0):
            raise ValueError(
                f"compute per micro-batch must be a finite number of seconds >= 0, got {self.micro_batch_s}"
            )
        if not 0.0 <= self.backward_fraction <= 1.0:
            raise ValueError(f"the backward fraction must be in [0, 1], got {self.backward_fraction}")
        if self.accumulation_steps < 1:
            raise ValueError(f"gradient accumulation steps must be >= 1, got {self.accumulation_steps}")
        if not (math.isfinite(self.straggler_slowdown) and self.straggler_slowdown >= 0):
            raise ValueError(f"the straggler slowdown must be a finite number >= 0, got {self.straggler_slowdown}")
        if self.bucket_ready is not None and not all(0.0 <= f <= 1.0 for f in self.bucket_ready):
            raise ValueError("bucket ready times must be shares of backward in [0, 1]")

    def ready_shares(self, bucket_bytes: Sequence[int]) -> list[float]:
        """When each bucket is ready, as a share of backward: measured, or its cumulative share of the bytes."""
        if self.bucket_ready is not None:
            if len(self.bucket_ready) != len(bucket_bytes):
                raise ValueError(f"{len(bucket_bytes)} buckets but {len(self.bucket_ready)} ready times")
            return list(self.bucket_ready)
        total = float(sum(bucket_bytes))
        produced, shares = 0.0, []
        for nbytes in bucket_bytes:
            produced += nbytes
            shares.append(produced / total if total > 0 else 1.0)
        return shares


@dataclass(frozen=True)
class StepTime:
    """A step's time and its split: ``step_s = compute_s + waiting_s + exposed_comm_s``.

    ``comm_s`` is the sum of the bucket all-reduces (hidden or not); ``bucket_bytes`` and ``bucket_s`` are the
    buckets in all-reduce order with each one's all-reduce time.
    """

    step_s: float
    compute_s: float
    waiting_s: float
    exposed_comm_s: float
    comm_s: float
    bucket_bytes: tuple[int, ...]
    bucket_s: tuple[float, ...]

    @property
    def hidden_comm_s(self) -> float:
        return self.comm_s - self.exposed_comm_s

    def to_json(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "waiting_s": self.waiting_s,
            "exposed_comm_s": self.exposed_comm_s,
            "comm_s": self.comm_s,
            "buckets": len(self.bucket_bytes),
        }


@dataclass(frozen=True)
class BucketSpan:
    """One bucket in the last micro-batch's timeline: ready when backward produced it, all-reduced from
    ``start_s`` to ``end_s`` (seconds from the step's start)."""

    size_bytes: int
    ready_s: float
    start_s: float
    end_s: float

    def to_json(self) -> dict[str, Any]:
        return {"size_bytes": self.size_bytes, "ready_s": self.ready_s, "start_s": self.start_s, "end_s": self.end_s}


@dataclass(frozen=True)
class StepTimeline:
    """One step on the slowest GPU, in seconds from its start: the last micro-batch's forward and backward, and
    each bucket's ready time and all-reduce (in all-reduce order)."""

    forward_start_s: float
    backward_start_s: float
    compute_end_s: float
    buckets: tuple[BucketSpan, ...]

    @property
    def step_s(self) -> float:
        return max(self.compute_end_s, self.buckets[-1].end_s if self.buckets else 0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "forward_start_s": self.forward_start_s,
            "backward_start_s": self.backward_start_s,
            "compute_end_s": self.compute_end_s,
            "buckets": [b.to_json() for b in self.buckets],
        }


def step_timeline(bucket_bytes: Sequence[int], bucket_s: Sequence[float], compute: Compute) -> StepTimeline:
    """When each bucket of ``compute``'s step (in all-reduce order, ``bucket_s`` seconds each) is ready and
    all-reduced: the timeline of the module docstring."""
    if len(bucket_bytes) != len(bucket_s):
        raise ValueError(f"{len(bucket_bytes)} buckets but {len(bucket_s)} all-reduce times")
    slowest_s = compute.micro_batch_s * (1.0 + compute.straggler_slowdown)
    compute_end_s = compute.accumulation_steps * slowest_s
    forward_start_s = compute_end_s - slowest_s
    backward_s = slowest_s * compute.backward_fraction
    backward_start_s = compute_end_s - backward_s
    comm_end_s = 0.0
    spans = []
    for nbytes, share, seconds in zip(bucket_bytes, compute.ready_shares(bucket_bytes), bucket_s, strict=True):
        ready_s = backward_start_s + backward_s * share if compute.overlap else compute_end_s
        start_s = max(ready_s, comm_end_s)
        comm_end_s = start_s + float(seconds)
        spans.append(BucketSpan(int(nbytes), ready_s, start_s, comm_end_s))
    return StepTimeline(forward_start_s, backward_start_s, compute_end_s, tuple(spans))


def step_time(bucket_bytes: Sequence[int], bucket_s: Sequence[float], compute: Compute) -> StepTime:
    """The step of ``compute`` whose buckets (in all-reduce order) take ``bucket_s`` seconds each."""
    timeline = step_timeline(bucket_bytes, bucket_s, compute)
    step_s = timeline.step_s
    compute_s = compute.accumulation_steps * compute.micro_batch_s
    return StepTime(
        step_s=step_s,
        compute_s=compute_s,
        waiting_s=timeline.compute_end_s - compute_s,
        exposed_comm_s=step_s - timeline.compute_end_s,
        comm_s=float(sum(bucket_s)),
        bucket_bytes=tuple(int(b) for b in bucket_bytes),
        bucket_s=tuple(float(s) for s in bucket_s),
    )


def step_seconds(
    bucket_bytes: Sequence[int], bucket_s: npt.NDArray[np.float64], compute: Compute
) -> npt.NDArray[np.float64]:
    """:func:`step_time`'s ``step_s`` for many draws at once: row i of ``bucket_s`` (samples x buckets) holds
    draw i's all-reduce time of every bucket. The same timeline, one array operation per bucket."""
    times = np.asarray(bucket_s, dtype=np.float64)
    if times.ndim != 2 or times.shape[1] != len(bucket_bytes):
        raise ValueError(f"{len(bucket_bytes)} buckets but all-reduce times of shape {times.shape}")
    accumulation = compute.accumulation_steps
    slowest_s = compute.micro_batch_s * (1.0 + compute.straggler_slowdown)
    compute_end_s = accumulation * slowest_s
    backward_s = slowest_s * compute.backward_fraction
    backward_start_s = compute_end_s - backward_s
    comm_end_s = np.zeros(times.shape[0])
    for k, share in enumerate(compute.ready_shares(bucket_bytes)):
        ready_s = backward_start_s + backward_s * share if compute.overlap else compute_end_s
        comm_end_s = np.maximum(comm_end_s, ready_s) + times[:, k]
    return np.asarray(np.maximum(comm_end_s, compute_end_s), dtype=np.float64)
