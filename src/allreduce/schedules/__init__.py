"""Collective algorithms as data: schedules, their verifier, the α–β–γ cost model, and the algorithm registry.

Pure: no I/O, no threads. The runtime executes :meth:`Schedule.program`; the simulator and the cost model read
:meth:`Schedule.phases`. Algorithms are looked up by name in the registry (:func:`algorithms`,
:func:`make_schedule`); users add their own with :func:`register_algorithm`, :func:`load_algorithm`, an entry
point or ``ALLREDUCE_ALGORITHMS``, and may write them with :class:`Program`. :mod:`._plugins` is the one module
that imports user code. The timing recurrence's verbs, for an engine that times schedules itself (the
simulator), are the other face: :mod:`allreduce.schedules.timing`.
"""

from allreduce.schedules._algorithms import (
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
from allreduce.schedules._personalized import (
    binomial_gather,
    binomial_scatter,
    bruck_all_to_all,
    direct_all_to_all,
    direct_gather,
    direct_scatter,
    pairwise_all_to_all,
)
from allreduce.schedules._plugins import (
    ENVIRONMENT_VARIABLE,
    AlgorithmLoadError,
    PluginWarning,
    load_algorithm,
    plugin_errors,
)
from allreduce.schedules._registry import (
    MAX_ALGORITHM_NAME_BYTES,
    VERIFY_WORLD_SIZES,
    Algorithm,
    algorithms,
    all_reduce,
    get_algorithm,
    make_schedule,
    register_algorithm,
    unregister_algorithm,
)
from allreduce.schedules._reorder import (
    SLOW_LINK_RATIO,
    RingOrder,
    best_ring_order,
    ordered_ring,
    relabelled,
    ring_bottleneck,
    ring_time_s,
)
from allreduce.schedules._replan import Replan, best_schedule, link_time_s, replan_schedule, slow_ranks
from allreduce.schedules._schedule import (
    Collective,
    Op,
    Phase,
    Schedule,
    Streams,
    Verb,
    block_bounds,
)
from allreduce.schedules._verify import ScheduleError, verify, verify_programs

__all__ = [
    "ENVIRONMENT_VARIABLE",
    "MAX_ALGORITHM_NAME_BYTES",
    "SLOW_LINK_RATIO",
    "VERIFY_WORLD_SIZES",
    "Algorithm",
    "AlgorithmLoadError",
    "Collective",
    "CostModel",
    "Op",
    "Phase",
    "PluginWarning",
    "Prediction",
    "Program",
    "Replan",
    "RingOrder",
    "Schedule",
    "ScheduleError",
    "Step",
    "Streams",
    "Verb",
    "algorithms",
    "all_reduce",
    "best_ring_order",
    "best_schedule",
    "binary_tree_broadcast",
    "binary_tree_reduce",
    "binomial_broadcast",
    "binomial_gather",
    "binomial_reduce",
    "binomial_scatter",
    "block_bounds",
    "bruck_all_to_all",
    "bus_factor",
    "direct_all_gather",
    "direct_all_reduce",
    "direct_all_to_all",
    "direct_gather",
    "direct_reduce_scatter",
    "direct_scatter",
    "double_binary_tree_all_reduce",
    "get_algorithm",
    "halving_doubling_all_reduce",
    "hierarchical_all_reduce",
    "link_time_s",
    "load_algorithm",
    "make_schedule",
    "naive_all_reduce",
    "ordered_ring",
    "pairwise_all_to_all",
    "plugin_errors",
    "predict",
    "predict_seconds",
    "recursive_doubling_all_reduce",
    "register_algorithm",
    "relabelled",
    "replan_schedule",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_bottleneck",
    "ring_reduce_scatter",
    "ring_time_s",
    "slow_ranks",
    "unregister_algorithm",
    "verify",
    "verify_programs",
]
