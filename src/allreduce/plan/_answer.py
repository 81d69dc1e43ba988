"""What the planner answers: one configuration's step and its all-reduces, the scaling table's rows, the what-ifs,
and the whole plan, each with the JSON that ``allreduce report`` reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from allreduce.plan._goodput import GoodputPlan
from allreduce.plan._request import PlanRequest
from allreduce.plan._step import StepTime, StepTimeline
from allreduce.plan._tail import StepQuantiles

__all__ = ["Plan", "ScalingRow", "SizeRun", "StepPlan", "WhatIf"]


@dataclass(frozen=True)
class SizeRun:
    """The all-reduce of one distinct bucket size: ``count`` buckets of ``size_bytes``, each ``seconds``."""

    size_bytes: int
    count: int
    algorithm: str
    seconds: float
    busbw_Bps: float
    exact: bool
    links: tuple[tuple[str, float], ...]  # the busiest links and their utilization (a plan's base step only)
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
class ScalingRow:
    gpus: int
    step: StepTime
    efficiency: float  # step time at the first row / step time here (same per-GPU batch)
    algorithm: str
    quantiles: StepQuantiles | None = None  # with a compute distribution
    goodput: float | None = None  # restarting from checkpoints, with failures counted (plan(failures=...))

    def to_json(self) -> dict[str, Any]:
        extra = self.quantiles.to_json() if self.quantiles else {}
        return {
            "gpus": self.gpus,
            "efficiency": self.efficiency,
            "algorithm": self.algorithm,
            **({"goodput": self.goodput} if self.goodput is not None else {}),
            **self.step.to_json(),
            **extra,
        }


@dataclass(frozen=True)
class WhatIf:
    """One change against the base plan; ``step`` is None when the change does not apply (``note`` says why).

    A random change (packet loss) has ``quantiles``; ``step`` is then its p50 step. A recovery policy's row (with
    failures counted) has the base step and that policy's ``goodput``: its step per useful step is step / goodput."""

    change: str
    step: StepTime | None
    note: str = ""
    quantiles: StepQuantiles | None = None
    goodput: float | None = None

    def to_json(self) -> dict[str, Any]:
        extra = self.quantiles.to_json() if self.quantiles else {}
        if self.goodput is not None and self.step is not None:
            effective = self.step.step_s / self.goodput if self.goodput > 0 else None
            extra = {**extra, "goodput": self.goodput, "effective_step_s": effective}
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
    goodput: GoodputPlan | None = None  # failures and recovery policies on the base GPUs
    timeline: StepTimeline | None = None  # of the base step, when backward was measured or profiled

    def to_json(self) -> dict[str, Any]:
        dominant = self.base.dominant
        measured = self.base.request.measured
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
            **({"goodput": self.goodput.to_json()} if self.goodput else {}),
            **({"measured": measured.to_json()} if measured else {}),
            **({"timeline": self.timeline.to_json()} if self.timeline else {}),
        }


# ------------------------------------------------------------------------------------------------------------
# Simulation, memoised within one plan
# ------------------------------------------------------------------------------------------------------------
