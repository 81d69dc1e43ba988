"""The timing recurrence, for engines that time a schedule themselves (the simulator).

The cost model runs the recurrence for the user (:func:`allreduce.schedules.predict`); an engine that feeds it
its own flow durations needs its verbs: one step of the per-rank clocks (:func:`step_once`), a whole schedule
with steady states skipped (:func:`propagate`), the same with a sample axis and the blame carried through it
(:func:`step_samples`, :func:`jump_samples`, :class:`Blame`), and :class:`Bandwidths`, the algbw/busbw
definitions every timed result shares. Defined in :mod:`allreduce.schedules._timing` and ``_cost``; exported here
rather than by :mod:`allreduce.schedules` so that the package's face stays what users write schedules with.
"""

from allreduce.schedules._cost import Bandwidths
from allreduce.schedules._timing import (
    Blame,
    Incidence,
    PhaseTiming,
    add_flow_delays,
    blame_key,
    jump_samples,
    propagate,
    step_once,
    step_samples,
)

__all__ = [
    "Bandwidths",
    "Blame",
    "Incidence",
    "PhaseTiming",
    "add_flow_delays",
    "blame_key",
    "jump_samples",
    "propagate",
    "step_once",
    "step_samples",
]
