"""Collective algorithms as data: schedules, their verifier, the α–β–γ cost model, and the algorithm registry.

Pure: no I/O, no threads. The runtime executes :meth:`Schedule.program`; the simulator and the cost model read
:meth:`Schedule.phases`. Algorithms are looked up by name in the registry (:func:`algorithms`,
:func:`make_schedule`); users add their own with :func:`register_algorithm`, :func:`load_algorithm`, an entry
point or ``ALLREDUCE_ALGORITHMS``, and may write them with :class:`Program`. :mod:`._plugins` is the one module
that imports user code.
"""

from allreduce.schedules._algorithms import (
    ALL_REDUCE_ALGORITHMS,
    NAIVE_MAX_RANKS,
    binary_tree_broadcast,
    binary_tree_reduce,
    binomial_broadcast,
    binomial_reduce,
    direct_all_gather,
    direct_all_reduce,
    direct_reduce_scatter,
    double_binary_tree_all_reduce,
    halving_doubling_all_reduce,
    hierarchical_all_reduce,
    naive_all_reduce,
    recursive_doubling_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from allreduce.schedules._author import Program, Step
from allreduce.schedules._cost import CostModel, Prediction, bus_factor, predict, predict_seconds
from allreduce.schedules._plugins import (
    ENTRY_POINT_GROUP,
    ENVIRONMENT_VARIABLE,
    AlgorithmLoadError,
    PluginWarning,
    load_algorithm,
    plugin_errors,
)
from allreduce.schedules._registry import (
    MAX_ALGORITHM_NAME_BYTES,
    PARAMETERS,
    VERIFY_WORLD_SIZES,
    Algorithm,
    algorithms,
    all_reduce,
    get_algorithm,
    make_schedule,
    register_algorithm,
    unregister_algorithm,
)
from allreduce.schedules._schedule import (
    Collective,
    Op,
    Phase,
    Schedule,
    Streams,
    Verb,
    block_bounds,
    concat_streams,
)
from allreduce.schedules._timing import PhaseTiming, propagate, step_once
from allreduce.schedules._verify import ScheduleError, verify, verify_programs

__all__ = [
    "ALL_REDUCE_ALGORITHMS",
    "ENTRY_POINT_GROUP",
    "ENVIRONMENT_VARIABLE",
    "MAX_ALGORITHM_NAME_BYTES",
    "NAIVE_MAX_RANKS",
    "PARAMETERS",
    "VERIFY_WORLD_SIZES",
    "Algorithm",
    "AlgorithmLoadError",
    "Collective",
    "CostModel",
    "Op",
    "Phase",
    "PhaseTiming",
    "PluginWarning",
    "Prediction",
    "Program",
    "Schedule",
    "ScheduleError",
    "Step",
    "Streams",
    "Verb",
    "algorithms",
    "all_reduce",
    "binary_tree_broadcast",
    "binary_tree_reduce",
    "binomial_broadcast",
    "binomial_reduce",
    "block_bounds",
    "bus_factor",
    "concat_streams",
    "direct_all_gather",
    "direct_all_reduce",
    "direct_reduce_scatter",
    "double_binary_tree_all_reduce",
    "get_algorithm",
    "halving_doubling_all_reduce",
    "hierarchical_all_reduce",
    "load_algorithm",
    "make_schedule",
    "naive_all_reduce",
    "plugin_errors",
    "predict",
    "predict_seconds",
    "propagate",
    "recursive_doubling_all_reduce",
    "register_algorithm",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "step_once",
    "unregister_algorithm",
    "verify",
    "verify_programs",
]
