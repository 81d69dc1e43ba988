"""The α–β–γ cost model, evaluated from the schedule itself.

No formula per algorithm: the model walks the schedule's flow patterns through the shared critical-path
recurrence (:mod:`allreduce.schedules._timing`) with

    flow_seconds[f] = α + max(bytes rank src sends, bytes rank dst receives in the step) · β
    rank_seconds[r] = bytes rank r reduces in the step · γ

so a rank that sends to, or receives from, several peers in one step shares its one port among them. With S
segments a step's transfer and reduction overlap as a two-stage pipeline: α + max(T, R) + min(T, R)/S instead of
α + T + R (T = transfer time, R = reduce time). A transport whose receiver reduces straight out of the sender's
memory moves and reduces in one pass: a call the model marks *fused* (``CostModel.fused_bytes``) costs
α + max(T, R) per step, the pipeline's limit of infinitely many segments. The textbook closed forms follow from
this: ring 2(N−1)·α + 2(N−1)/N·S·β, Rabenseifner 2·log2(N)·α + 2(N−1)/N·S·β, recursive doubling log2(N)·(α + S·β)
(tests check them to 1e-9).

The latency, transfer and reduce terms of the prediction are the partial derivatives of the critical path with
respect to α, β and γ (times α, β, γ): the time each constant contributes along the path that decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from allreduce.schedules._schedule import Collective, Phase, Schedule
from allreduce.schedules._timing import propagate

__all__ = ["Bandwidths", "CostModel", "Prediction", "bus_factor", "predict", "predict_seconds"]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class CostModel:
    """α: ``latency_s`` per step; β = 1/``bandwidth_Bps``; γ = 1/``reduce_bandwidth_Bps`` (None: free).

    ``fused_bytes``: a call whose steps × size_bytes is at most this moves and reduces each step in one pass,
    α + max(T, R) per step rather than α + T + R (0: never; ``math.inf``: always). The shared-memory transport's
    receiver reduces out of the sender's memory (``np.add(mine, theirs, out=...)``): the read is the reduction's
    input stream, not a pass of its own, wherever the sent data is not also written in the same step."""

    latency_s: float
    bandwidth_Bps: float
    reduce_bandwidth_Bps: float | None = None
    fused_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency_s must be a finite number >= 0, got {self.latency_s}")
        if not (math.isfinite(self.bandwidth_Bps) and self.bandwidth_Bps > 0):
            raise ValueError(f"bandwidth_Bps must be a finite number > 0, got {self.bandwidth_Bps}")
        if self.reduce_bandwidth_Bps is not None and not (
            math.isfinite(self.reduce_bandwidth_Bps) and self.reduce_bandwidth_Bps > 0
        ):
            raise ValueError(f"reduce_bandwidth_Bps must be a finite number > 0, got {self.reduce_bandwidth_Bps}")
        if math.isnan(self.fused_bytes) or self.fused_bytes < 0:
            raise ValueError(f"fused_bytes must be a number >= 0 (math.inf: always), got {self.fused_bytes}")

    def fuses(self, schedule: Schedule, size_bytes: float) -> bool:
        """Whether a call of ``schedule`` on ``size_bytes`` per rank moves and reduces in one pass per step."""
        return schedule.num_steps * size_bytes <= self.fused_bytes

    @property
    def seconds_per_byte(self) -> float:
        return 1.0 / self.bandwidth_Bps

    @property
    def reduce_seconds_per_byte(self) -> float:
        return 0.0 if self.reduce_bandwidth_Bps is None else 1.0 / self.reduce_bandwidth_Bps


def bus_factor(collective: Collective, world_size: int) -> float:
    """busbw / algbw, nccl-tests conventions."""
    n = world_size
    if collective is Collective.ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if collective in (
        Collective.REDUCE_SCATTER, Collective.ALL_GATHER, Collective.ALL_TO_ALL, Collective.GATHER, Collective.SCATTER
    ):  # fmt: skip
        return (n - 1) / n
    return 1.0


class Bandwidths:
    """The bandwidths of a collective that took ``seconds`` on ``size_bytes`` per rank, nccl-tests definitions:
    the base of every figure that reports them (the model's :class:`Prediction`, the simulator's result), which
    declare these four fields."""

    collective: Collective
    world_size: int
    size_bytes: float
    seconds: float

    @property
    def algbw_Bps(self) -> float:
        """Algorithm bandwidth: the buffer's bytes over the time (inf for a call that took no time)."""
        return self.size_bytes / self.seconds if self.seconds > 0 else math.inf

    @property
    def busbw_Bps(self) -> float:
        """Bus bandwidth: algbw times :func:`bus_factor`, what each link carries, comparable across world sizes."""
        return self.algbw_Bps * bus_factor(self.collective, self.world_size)


@dataclass(frozen=True)
class Prediction(Bandwidths):
    """What the model predicts for one schedule and one buffer size."""

    name: str
    size_bytes: float
    seconds: float
    latency_s: float  # α's share of the critical path
    transfer_s: float  # β's share
    reduce_s: float  # γ's share
    steps: int
    bytes_sent_per_rank: float  # the most any rank sends
    world_size: int
    collective: Collective

    @property
    def bound(self) -> str:
        """'latency' when α's share of the critical path dominates, else 'bandwidth'."""
        return "latency" if self.latency_s >= self.transfer_s + self.reduce_s else "bandwidth"


def _critical_path_seconds(
    schedule: Schedule, size_bytes: float, alpha: float, beta: float, gamma: float, *, fused: bool = False
) -> float:
    n = schedule.world_size
    segments = math.inf if fused else schedule.segments

    def volumes(phase: Phase) -> tuple[FloatArray, FloatArray, FloatArray]:
        nbytes = phase.fraction * size_bytes
        sent = np.bincount(phase.src, weights=nbytes, minlength=n).astype(np.float64)
        received = np.bincount(phase.dst, weights=nbytes, minlength=n).astype(np.float64)
        reduced = np.bincount(phase.dst, weights=np.where(phase.reduce, nbytes, 0.0), minlength=n).astype(np.float64)
        return sent, received, reduced

    def flow_seconds(phase: Phase) -> FloatArray:
        sent, received, reduced = volumes(phase)
        transfer = np.maximum(sent[phase.src], received[phase.dst]) * beta
        if segments == 1:
            return alpha + transfer
        reduce_at_dst = reduced[phase.dst] * gamma
        # Two-stage pipeline: the longer stage runs whole, the shorter one's last segment trails it (fused: the
        # limit of infinitely many segments, max(T, R)).
        return np.asarray(alpha + transfer + np.maximum(reduce_at_dst - transfer, 0.0) * (1 - 1 / segments))

    def rank_seconds(phase: Phase) -> FloatArray | None:
        if gamma == 0.0 or fused:
            return None
        _, _, reduced = volumes(phase)
        return np.asarray(reduced * gamma / segments)

    clock, _ = propagate(n, schedule.phases(), flow_seconds, rank_seconds)
    return float(clock.max()) if clock.size else 0.0


def predict_seconds(schedule: Schedule, size_bytes: float, model: CostModel) -> float:
    """Just the predicted time (one pass; :func:`predict` also splits it into α, β and γ shares)."""
    return _critical_path_seconds(
        schedule,
        size_bytes,
        model.latency_s,
        model.seconds_per_byte,
        model.reduce_seconds_per_byte,
        fused=model.fuses(schedule, size_bytes),
    )


def predict(schedule: Schedule, size_bytes: float, model: CostModel) -> Prediction:
    """Predicted time of ``schedule`` on a buffer of ``size_bytes`` bytes per rank under ``model``."""
    if not (math.isfinite(size_bytes) and size_bytes >= 0):
        raise ValueError(f"size_bytes must be a finite number >= 0, got {size_bytes}")
    alpha, beta, gamma = model.latency_s, model.seconds_per_byte, model.reduce_seconds_per_byte
    fused = model.fuses(schedule, size_bytes)
    total = _critical_path_seconds(schedule, size_bytes, alpha, beta, gamma, fused=fused)
    # Shares of α, β, γ along the critical path: T is piecewise linear in each, so a relative nudge of one
    # constant changes T by (that constant's share) × nudge.
    nudge = 1e-6
    constants = (alpha, beta, gamma)
    shares = []
    for which, value in enumerate(constants):
        if value == 0.0:
            shares.append(0.0)
            continue
        nudged = [c * (1 + nudge) if i == which else c for i, c in enumerate(constants)]
        shares.append(max(0.0, (_critical_path_seconds(schedule, size_bytes, *nudged, fused=fused) - total) / nudge))
    return Prediction(
        name=schedule.name,
        size_bytes=float(size_bytes),
        seconds=total,
        latency_s=shares[0],
        transfer_s=shares[1],
        reduce_s=shares[2],
        steps=schedule.num_steps,
        bytes_sent_per_rank=float(schedule.bytes_sent_per_rank(size_bytes).max()) if schedule.world_size else 0.0,
        world_size=schedule.world_size,
        collective=schedule.collective,
    )
