"""Choosing and caching what a group runs: the algorithm ``auto`` picks, schedules, and compiled plans.

A *run* is everything per-call constant about running one schedule on ``count`` elements; runs, schedules and the
transport's compiled forms share the group's one :class:`PlanCache`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from allreduce.runtime.pipeline._descriptor import NO_DIGEST, algorithm_name_bytes, schedule_digest
from allreduce.runtime.transport._plan import RankPlan, compile_plan
from allreduce.runtime.transport._transport import PlanCache
from allreduce.schedules import (
    Collective,
    CostModel,
    Schedule,
    algorithms,
    get_algorithm,
    make_schedule,
    predict_seconds,
    verify,
)

__all__ = ["DETERMINISTIC", "Run", "Runs"]

DETERMINISTIC = {Collective.ALL_REDUCE: "ring", Collective.REDUCE_SCATTER: "ring", Collective.REDUCE: "binomial"}
"""deterministic=True: one fixed schedule per collective, so each element is reduced along one fixed chain of
ranks for a given N whatever algorithm= says and whatever the transport."""

_ROOTED = frozenset((Collective.BROADCAST, Collective.REDUCE, Collective.GATHER, Collective.SCATTER))

# plan-cache keys of the group start with one of these (a transport's own keys start with its name)
_SCHEDULE_KEY = "group-schedule"
_RUN_KEY = "group-run"


class Run(NamedTuple):
    """Everything per-call constant about running one schedule on ``count`` elements (cached per group)."""

    schedule: Schedule
    plan: RankPlan
    name: bytes  # the algorithm field of the descriptor
    digest: bytes  # NO_DIGEST for a registered algorithm


class _Shape(Protocol):
    """What choosing needs of a group (read at each call: a group's cost model may be replaced)."""

    rank: int
    world_size: int
    group_size: int
    cost_model: CostModel


class Runs:
    """The runs of one group, cached in ``plans``."""

    def __init__(self, group: _Shape, plans: PlanCache) -> None:
        self._group = group
        self._plans = plans
        self._auto: dict[tuple[Collective, int, int, bool], str] = {}
        self._auto_model: CostModel | None = None
        """The cost model whose picks ``_auto`` holds (a group's model may be replaced between calls)."""

    def resolve(
        self,
        collective: Collective,
        algorithm: str,
        count: int,
        itemsize: int,
        deterministic: bool,
        *,
        fuses: Callable[[Any], bool] | None = None,
        buffer: Any = None,
    ) -> str:
        """The registered algorithm to run: ``algorithm`` itself, or the cost model's pick for ``auto``.

        ``fuses(buffer)`` asks whether the transport moves and reduces this call's ``buffer`` in one pass per step
        at any size (:meth:`~allreduce.runtime.Transport.fuses`); it is asked only when that would change the pick,
        so calls whose picks agree either way (most) pay two cached lookups, not the question."""
        if deterministic and collective in DETERMINISTIC:
            return DETERMINISTIC[collective]
        if algorithm != "auto":
            if not isinstance(algorithm, str):
                raise TypeError(f"algorithm: expected a registered name or a Schedule, got {type(algorithm).__name__}")
            return algorithm
        if self._auto_model is not self._group.cost_model:  # a new model: its own picks
            self._auto.clear()
            self._auto_model = self._group.cost_model
        size_class = max(count * itemsize, 1).bit_length()
        best = self._pick(collective, size_class, fused=False)
        if fuses is not None:
            fused_best = self._pick(collective, size_class, fused=True)
            if fused_best != best and fuses(buffer):
                return fused_best
        return best

    def _pick(self, collective: Collective, size_class: int, *, fused: bool) -> str:
        key = (collective, size_class, self._group.group_size, fused)
        best = self._auto.get(key)
        if best is None:
            model = self._group.cost_model
            if fused:
                model = dataclasses.replace(model, fused_bytes=math.inf)
            best = self._auto[key] = self._cheapest(collective, float(1 << (size_class - 1)), model)
        return best

    def _cheapest(self, collective: Collective, size_bytes: float, model: CostModel) -> str:
        """The registered algorithm the cost model predicts fastest for ``size_bytes``.

        Only algorithms registered as automatic (identical results on every rank) are candidates; those that take
        ranks per host only when the group spans several hosts of equal size; one that cannot be built for this
        world size is not a candidate.
        """
        group = self._group
        multi_host = group.group_size < group.world_size and group.world_size % group.group_size == 0
        best, best_s = "", math.inf
        for name in algorithms(collective):
            entry = get_algorithm(collective, name)
            if not entry.automatic or ("group_size" in entry.parameters and not multi_host):
                continue
            try:
                schedule = self.schedule(collective, name, 0, 1)
            except ValueError:
                continue
            # the model's size is a rank's buffer as its caller sees it (all-to-all: one row of the buffer here)
            predicted_s = predict_seconds(schedule, size_bytes * schedule.buffer_blocks / schedule.num_blocks, model)
            if predicted_s < best_s:
                best, best_s = name, predicted_s
        if not best:
            raise ValueError(f"algorithm: no registered {collective.value} algorithm runs on {group.world_size} ranks")
        return best

    def schedule(self, collective: Collective, name: str, root: int, segments: int) -> Schedule:
        """The registered algorithm's schedule for this group (cached); ``ValueError`` naming what is wrong."""
        world_size, group_size = self._group.world_size, self._group.group_size

        def build() -> Schedule:
            try:
                get_algorithm(collective, name)
            except ValueError:
                raise ValueError(
                    f"algorithm: unknown {collective.value} algorithm {name!r}; choose auto or one of "
                    f"{', '.join(algorithms(collective))}"
                ) from None
            try:
                return make_schedule(collective, name, world_size, root=root, group_size=group_size, segments=segments)
            except ValueError as exc:
                raise ValueError(f"algorithm: {name} on {world_size} ranks: {exc}") from None

        return self._plans.get((_SCHEDULE_KEY, collective, name, root, segments, group_size), build)

    def registered(self, collective: Collective, kind: int, name: str, *, root: int, segments: int, count: int) -> Run:
        """The cached run of a registered algorithm (``kind``: the collective's code, a cheaper key than the enum)."""

        def build() -> Run:
            schedule = self.schedule(collective, name, root, segments)
            return Run(schedule, compile_plan(schedule, self._group.rank, count), algorithm_name_bytes(name), NO_DIGEST)

        return self._plans.get((_RUN_KEY, kind, name, root, segments, self._group.group_size, count), build)

    def of_schedule(self, collective: Collective, schedule: Schedule, root: int, segments: int, count: int) -> Run:
        """The cached run of a :class:`Schedule` the caller passed (checked and verified on first use)."""
        world_size = self._group.world_size

        def build() -> Run:
            if schedule.collective is not collective:
                raise ValueError(
                    f"algorithm: schedule {schedule.name!r} is a {schedule.collective.value} schedule; "
                    f"this call is {collective.value}"
                )
            if schedule.world_size != world_size:
                raise ValueError(
                    f"algorithm: schedule {schedule.name!r} is for {schedule.world_size} ranks; "
                    f"this group has {world_size}"
                )
            if collective in _ROOTED and schedule.root != root:
                raise ValueError(
                    f"algorithm: schedule {schedule.name!r} is rooted at rank {schedule.root}, but root={root}"
                )
            name = algorithm_name_bytes(schedule.name)
            verify(schedule)
            effective = schedule if segments == 1 else schedule.with_segments(segments)
            return Run(effective, compile_plan(effective, self._group.rank, count), name, schedule_digest(effective))

        return self._plans.get((_RUN_KEY, schedule, root, segments, count), build)
