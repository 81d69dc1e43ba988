"""Executing schedules between real processes: process group, transports (shm, tcp), store, launcher."""

from allreduce.runtime._bootstrap import init
from allreduce.runtime._errors import (
    ChecksumError,
    CollectiveError,
    CollectiveTimeoutError,
    MismatchError,
    PeerFailureError,
    ProtocolError,
)
from allreduce.runtime._group import ALGORITHMS, DTYPES, OPS, ProcessGroup, Work
from allreduce.runtime._plan import RankPlan, Step, Transfer, compile_plan
from allreduce.runtime._transport import (
    ABORT_KINDS,
    PlanCache,
    ReduceInto,
    Transport,
    abort_kind,
    error_class,
)

__all__ = [
    "ABORT_KINDS",
    "ALGORITHMS",
    "DTYPES",
    "OPS",
    "ChecksumError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "MismatchError",
    "PeerFailureError",
    "PlanCache",
    "ProcessGroup",
    "ProtocolError",
    "RankPlan",
    "ReduceInto",
    "Step",
    "Transfer",
    "Transport",
    "Work",
    "abort_kind",
    "compile_plan",
    "error_class",
    "init",
]
