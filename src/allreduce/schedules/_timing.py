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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from allreduce.schedules._schedule import Phase

__all__ = ["PhaseTiming", "propagate", "step_once"]

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
