"""Collective algorithms as data: schedules, their verifier, and the α–β–γ cost model.

Pure: no I/O, no threads. The runtime executes :meth:`Schedule.program`; the simulator and the cost model read
:meth:`Schedule.phases`.
"""

from allreduce.schedules._algorithms import (
    ALL_REDUCE_ALGORITHMS,
    all_reduce,
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
    recursive_doubling_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from allreduce.schedules._cost import CostModel, Prediction, bus_factor, predict
from allreduce.schedules._registry import (
    MAX_ALGORITHM_NAME_BYTES,
    PARAMETERS,
    Algorithm,
    algorithms,
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
    "MAX_ALGORITHM_NAME_BYTES",
    "PARAMETERS",
    "Algorithm",
    "Collective",
    "CostModel",
    "Op",
    "Phase",
    "PhaseTiming",
    "Prediction",
    "Schedule",
    "ScheduleError",
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
    "make_schedule",
    "predict",
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
