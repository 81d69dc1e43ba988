"""Per-rank clocks advanced through a schedule's phases: the critical path of a schedule.

This is the one timing recurrence of the project. The α–β–γ cost model feeds it flow durations from three
constants; the simulator feeds it durations from max-min fair link rates. Per step:

    start[f] = max(clock[src[f]], clock[dst[f]])            both ends have reached the step (rendezvous)
    end[f]   = start[f] + flow_seconds[f]
    clock[r] = max(clock[r], end[f] for every flow f at r) + rank_seconds[r]

``rank_seconds`` is what a rank does after its transfers (reducing, or a straggler's delay). The recurrence is
max-plus linear and shift-invariant (adding c to every clock adds c to the result), so once a repeated pattern's
clocks advance by the same amount every c steps, the remaining repeats are extrapolated exactly instead of
stepped: a ring of 131,072 ranks costs a few array passes, not 262,142.

:func:`step_samples` is the same step with a sample axis (clocks of shape (ranks, samples)), for the Monte
Carlo of :mod:`allreduce.sim._montecarlo`; it carries each clock's :class:`Blame` (the largest single delay on
its critical path and its cause) through the argmax the recurrence takes.

What other packages use of it, :mod:`allreduce.schedules.timing` exports (the one list of its public names).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from allreduce.schedules._schedule import Phase

FloatArray = npt.NDArray[np.float64]

# How many past states are kept to detect a periodic steady state (max-plus systems may cycle with period > 1).
_MAX_PERIOD = 4
# Clocks are "advancing uniformly" when their increments agree to this relative tolerance.
_UNIFORM_RTOL = 1e-12


@dataclass(frozen=True)
class PhaseTiming:
    """When a phase ended (latest clock of its ranks) and how long it took (from the phase's earliest start)."""

    first_step: int
    repeat: int
    start_s: float
    end_s: float


def step_once(clock: FloatArray, phase: Phase, flow_seconds: FloatArray, rank_seconds: FloatArray | None) -> FloatArray:
    """Clocks after one step of ``phase``."""
    start = np.maximum(clock[phase.src], clock[phase.dst])
    end = start + flow_seconds
    done = clock.copy()
    np.maximum.at(done, phase.src, end)
    np.maximum.at(done, phase.dst, end)
    if rank_seconds is not None:
        done += rank_seconds
    return done


def _active(world_size: int, phase: Phase) -> npt.NDArray[np.bool_]:
    mask = np.zeros(world_size, dtype=np.bool_)
    mask[phase.src] = True
    mask[phase.dst] = True
    return mask


def propagate(
    world_size: int,
    phases: Iterable[Phase],
    flow_seconds: Callable[[Phase], FloatArray],
    rank_seconds: Callable[[Phase], FloatArray | None],
    clock: FloatArray | None = None,
) -> tuple[FloatArray, list[PhaseTiming]]:
    """Run the recurrence through ``phases``; return the final clocks and each phase's timing.

    ``flow_seconds(phase)`` gives each flow's duration, ``rank_seconds(phase)`` each rank's per-step extra time
    (zero where the rank is idle in the phase), or None.
    """
    clock = np.zeros(world_size, dtype=np.float64) if clock is None else clock.astype(np.float64, copy=True)
    timings: list[PhaseTiming] = []
    for phase in phases:
        flows = np.asarray(flow_seconds(phase), dtype=np.float64)
        extra = rank_seconds(phase)
        active = _active(world_size, phase)
        if extra is not None:
            extra = np.where(active, extra, 0.0)
        begin = float(clock[active].min()) if active.any() else float(clock.max())
        history = [clock[active]]
        remaining = phase.repeat
        while remaining > 0:
            clock = step_once(clock, phase, flows, extra)
            remaining -= 1
            now = clock[active]
            history.append(now)
            if remaining == 0:
                break
            jumped = _jump(history, remaining)
            if jumped is not None:
                shift, left = jumped
                clock[active] = now + shift
                remaining = left
                history = [clock[active]]
            elif len(history) > _MAX_PERIOD + 1:
                history.pop(0)
        timings.append(PhaseTiming(phase.first_step, phase.repeat, begin, float(clock[active].max())))
    return clock, timings


def _jump(history: list[FloatArray], remaining: int) -> tuple[FloatArray | float, int] | None:
    """If the clocks advance by the same amount every c steps, skip whole cycles of the remaining steps.

    Returns (shift to add, steps still to simulate), or None when no steady state is visible yet."""
    now = history[-1]
    scale = max(float(np.abs(now).max()), 1e-300)
    for period in range(1, min(_MAX_PERIOD, len(history) - 1) + 1):
        delta = now - history[-1 - period]
        if float(np.ptp(delta)) <= _UNIFORM_RTOL * scale:
            cycles = remaining // period
            if cycles == 0:
                return None
            return float(delta.mean()) * cycles, remaining - cycles * period
    return None


# ------------------------------------------------------------------------------------------------------------
# The same recurrence with a sample axis: clocks of shape (world_size, samples), one column per Monte Carlo
# sample, every array operation covering all samples at once.
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Incidence:
    """A phase's flows grouped into layers in which every rank appears at most once, per side: the scatter
    ``clock[rank] = max(clock[rank], end[flow])`` is then a plain gather/maximum/store per layer (``np.maximum.at``
    is unbuffered and slow on 2-D arrays). A ring has one layer per side."""

    active: npt.NDArray[np.int64]  # ranks that transfer in the phase
    # (ranks, flows, every rank, identity): with every rank, ranks is 0..N-1 and flows[r] is rank r's flow, so
    # the update is a gather of ``end`` in rank order and a maximum, no scatter; identity: flows is 0..N-1 too.
    layers: tuple[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], bool, bool], ...]
    src_identity: bool  # phase.src is 0..world_size-1 in order (a ring): gathers by it are the array itself

    @classmethod
    def of(cls, world_size: int, phase: Phase) -> Incidence:
        layers: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], bool, bool]] = []
        everyone = np.arange(world_size)
        for side in (phase.src, phase.dst):
            order = np.argsort(side, kind="stable")
            ranks = side[order]
            first = np.searchsorted(ranks, ranks, side="left")
            occurrence = np.arange(ranks.size) - first
            for j in range(int(occurrence.max()) + 1 if ranks.size else 0):
                chosen = order[occurrence == j].astype(np.int64)
                ranks = side[chosen].astype(np.int64)
                # Sorted by rank: a layer of every rank has ranks == 0..N-1 and chosen[r] is rank r's flow.
                every_rank = bool(np.array_equal(ranks, everyone))
                identity = every_rank and side.size == world_size and bool(np.array_equal(chosen, everyone))
                layers.append((ranks, chosen, every_rank, identity))
        src_identity = np.array_equal(phase.src, everyone)
        return cls(np.flatnonzero(_active(world_size, phase)).astype(np.int64), tuple(layers), src_identity)


# A blame is one int64 per rank and sample: the delay in whole nanoseconds above the culprit's code, so the
# larger delay is the larger integer and one maximum compares two blames. 23 bits of code (ranks, then links:
# 2^23 > 131,072 ranks + the links of any topology built here) leave 40 bits of nanoseconds (18 minutes).
BLAME_CODE_BITS = 23
_CODE_MASK = (1 << BLAME_CODE_BITS) - 1
_NS = 1e9
_MAX_BLAME_NS = (1 << (63 - BLAME_CODE_BITS)) - 1


def blame_key(seconds: FloatArray, culprit: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """Blames of delays ``seconds`` caused by ``culprit`` codes (>= 0; -1 means none and is stored as 0 ns
    with the all-ones code)."""
    code = np.asarray(culprit, dtype=np.int64)
    ns = np.clip(np.rint(np.asarray(seconds) * _NS), 0, _MAX_BLAME_NS).astype(np.int64)
    return np.asarray((ns << BLAME_CODE_BITS) | (code & _CODE_MASK), dtype=np.int64)


@dataclass(eq=False)
class Blame:
    """Per rank and sample, the largest single delay on the critical path that reached the rank's clock, and
    its culprit (an integer code chosen by the caller; -1: none), packed as :func:`blame_key`. Carried through
    the max-plus recurrence: a clock that takes its value from a flow takes that flow's blame, or the flow's
    own delay if larger. Delays compare at 1 ns resolution."""

    key: npt.NDArray[np.int64]  # (world_size, samples)

    @classmethod
    def zeros(cls, world_size: int, samples: int) -> Blame:
        return cls(np.full((world_size, samples), _CODE_MASK, dtype=np.int64))

    @property
    def seconds(self) -> FloatArray:
        return np.asarray((self.key >> BLAME_CODE_BITS) / _NS, dtype=np.float64)

    @property
    def culprit(self) -> npt.NDArray[np.int64]:
        code = self.key & _CODE_MASK
        return np.where(code == _CODE_MASK, -1, code)


_Rows = TypeVar("_Rows", FloatArray, npt.NDArray[np.int64])


def _rows(values: _Rows, index: npt.NDArray[np.int64], identity: bool) -> _Rows:
    """``values[index]`` along the rank axis; ``np.take`` gathers whole rows about 3x faster than indexing."""
    return values if identity else np.take(values, index, axis=0)


def _select_into(target: npt.NDArray[np.int64], source: npt.NDArray[np.int64], mask: npt.NDArray[np.bool_]) -> None:
    """``target[mask] = source[mask]`` as arithmetic: a masked copy with an unpredictable mask costs ~15x a
    maximum (branch mispredictions), ``target += (source − target)·mask`` three plain passes. Keys are
    non-negative int64, so the difference cannot overflow."""
    difference = source - target
    difference *= mask
    target += difference


def add_flow_delays(
    end: FloatArray,
    end_blame: npt.NDArray[np.int64] | None,
    base_s: FloatArray,
    extra_s: FloatArray | None,
    sparse: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], FloatArray, npt.NDArray[np.int64] | None] | None,
) -> None:
    """Add to each flow's start ``end`` (flows, samples) its duration ``base_s``, its dense extra delay and its
    sparse ones (row, sample, seconds, blame key); the sparse keys go into ``end_blame`` when blame is kept. In
    this order, which :func:`step_samples` and the simulator's cyclic step share so that their clocks agree to
    the bit."""
    end += base_s
    if extra_s is not None:
        end += extra_s
    if sparse is not None:
        rows, sample, seconds, key = sparse
        np.add.at(end, (rows, sample), seconds)
        if end_blame is not None and key is not None:
            np.maximum.at(end_blame, (rows, sample), key)


def step_samples(
    clock: FloatArray,
    phase: Phase,
    incidence: Incidence,
    flow_seconds: FloatArray,
    rank_seconds: FloatArray | None,
    *,
    extra_s: FloatArray | None = None,
    extra_blame: npt.NDArray[np.int64] | None = None,
    rank_blame: npt.NDArray[np.int64] | None = None,
    sparse: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], FloatArray, npt.NDArray[np.int64]] | None = None,
    blame: Blame | None = None,
) -> FloatArray:
    """Clocks ``(world_size, samples)`` after one step of ``phase``: :func:`step_once` per column.

    ``flow_seconds`` is ``(flows,)`` (the same in every sample) or ``(flows, samples)``; ``extra_s``, a delay
    per flow and sample added to it, is what ``blame`` tracks, with ``extra_blame`` its blame keys
    (:func:`blame_key`, ``(flows, samples)``); ``sparse`` = (flow, sample, seconds, blame key) adds a few
    delays without a dense array (lost packets); ``rank_seconds`` (per rank) is blamed as ``rank_blame[rank]``."""
    base = flow_seconds if flow_seconds.ndim == 2 else flow_seconds[:, None]
    from_src = _rows(clock, phase.src, incidence.src_identity)
    from_dst = np.take(clock, phase.dst, axis=0)
    end = np.maximum(from_src, from_dst)
    if blame is not None:
        end_blame = _rows(blame.key, phase.src, incidence.src_identity).copy()
        _select_into(end_blame, np.take(blame.key, phase.dst, axis=0), from_dst > from_src)
        if extra_blame is not None:
            np.maximum(end_blame, extra_blame, out=end_blame)
    add_flow_delays(end, end_blame if blame is not None else None, base, extra_s, sparse)
    # A flow ends no earlier than either end's clock (durations are >= 0), so the first layer's flows win
    # outright: their ranks take the flow's end and blame, with no comparison.
    done = clock.copy()
    for index, (ranks, flows, every_rank, identity) in enumerate(incidence.layers):
        first = index == 0
        if every_rank:
            candidate = end if identity else np.take(end, flows, axis=0)
            if blame is not None:
                flow_blame = end_blame if identity else np.take(end_blame, flows, axis=0)
                if first:
                    blame.key[...] = flow_blame
                else:
                    _select_into(blame.key, flow_blame, candidate > done)
            if first:
                done[...] = candidate
            else:
                np.maximum(done, candidate, out=done)
            continue
        candidate = np.take(end, flows, axis=0)
        if first:
            if blame is not None:
                blame.key[ranks] = np.take(end_blame, flows, axis=0)
            done[ranks] = candidate
            continue
        current = np.take(done, ranks, axis=0)
        if blame is not None:
            keys = np.take(blame.key, ranks, axis=0)
            _select_into(keys, np.take(end_blame, flows, axis=0), candidate > current)
            blame.key[ranks] = keys
        done[ranks] = np.maximum(current, candidate)
    if rank_seconds is not None:
        rows = incidence.active
        done[rows] += rank_seconds[rows][:, None]
        if blame is not None and rank_blame is not None:
            blame.key[rows] = np.maximum(blame.key[rows], rank_blame[rows][:, None])
    return done


def jump_samples(
    history: list[FloatArray], remaining: int, active: npt.NDArray[np.int64]
) -> tuple[FloatArray, int] | None:
    """:func:`_jump` per sample: if every sample's active clocks advance by one amount every c steps (the
    amount may differ between samples), the per-sample shift of the whole cycles left, and the steps still to
    step; None when some sample is not there yet."""
    now = history[-1][active]
    scale = max(float(np.abs(now).max()) if now.size else 0.0, 1e-300)
    for period in range(1, min(_MAX_PERIOD, len(history) - 1) + 1):
        delta = now - history[-1 - period][active]
        if float(np.ptp(delta, axis=0).max()) <= _UNIFORM_RTOL * scale:
            cycles = remaining // period
            if cycles == 0:
                return None
            return delta.mean(axis=0) * cycles, remaining - cycles * period
    return None
