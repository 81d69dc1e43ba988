"""What one step-time estimate depends on: the model, the cluster, the compute and DDP's buckets (a pure value: a
sweep case is one)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from allreduce.plan._measured import MeasuredBackward
from allreduce.plan._step import Compute
from allreduce.plan._workload import (
    BYTES_PER_BUCKET,
    DDP_BUCKET_CAP_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    GRADIENT_DTYPES,
    MAX_BUCKETS,
    MiB,
    Model,
    bucket_count_bound,
    ddp_buckets,
    format_count,
)
from allreduce.schedules import Collective, get_algorithm
from allreduce.sim import Distribution, Faults

__all__ = ["AUTO", "PlanRequest"]

AUTO = "auto"


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
    # The measured or profiled step the model's ready times and the compute come from (what drove the plan).
    measured: MeasuredBackward | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"--gpus must be >= 1, got {self.gpus}")
        if self.gradient_dtype not in GRADIENT_DTYPES:
            raise ValueError(f"gradient dtype {self.gradient_dtype!r}: choose from {', '.join(GRADIENT_DTYPES)}")
        if self.algorithm != AUTO:
            try:
                get_algorithm(Collective.ALL_REDUCE, self.algorithm)
            except ValueError as exc:
                raise ValueError(f"--algorithm: {exc} or auto") from None
        if not (self.uplink_oversubscription >= 1.0 and math.isfinite(self.uplink_oversubscription)):
            raise ValueError(f"uplink oversubscription must be >= 1, got {self.uplink_oversubscription}")
        for flag, cap in (("--bucket-mb", self.bucket_cap_bytes), ("--first-bucket-mb", self.first_bucket_bytes)):
            if cap < 1:
                raise ValueError(f"{flag}: a bucket cap of {cap} bytes; a bucket holds at least one byte (1e-6 MiB)")
        total = self.model.params * GRADIENT_DTYPES[self.gradient_dtype]
        count = bucket_count_bound(
            total, bucket_cap_bytes=self.bucket_cap_bytes, first_bucket_bytes=self.first_bucket_bytes
        )
        if count > MAX_BUCKETS:
            shown = f"{count:,}" if count < 10**12 else f"{float(count):.4g}"
            raise ValueError(
                f"{self.model.name} ({format_count(self.model.params)} parameters) in buckets of --bucket-mb "
                f"{self.bucket_cap_bytes / MiB:g}: "
                f"{shown} buckets, more than the cap of {MAX_BUCKETS:,} (each bucket is an all-reduce the plan "
                f"times; that many would need about {count * BYTES_PER_BUCKET / 1e9:.3g} GB); "
                "give fewer parameters or a larger --bucket-mb"
            )

    @property
    def step_compute(self) -> Compute:
        """``compute``, with each bucket's measured ready time when the model has them (for these buckets)."""
        ready = self.model.bucket_ready(self.bucket_bytes, GRADIENT_DTYPES[self.gradient_dtype])
        return self.compute if ready is None else dataclasses.replace(self.compute, bucket_ready=ready)

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
