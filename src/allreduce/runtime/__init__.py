"""Executing schedules between real ranks: process group, transports (shm, tcp, in-process), store, launcher."""

from allreduce.runtime._bootstrap import init
from allreduce.runtime._descriptor import DTYPES, OPS
from allreduce.runtime._errors import (
    ChecksumError,
    CollectiveError,
    CollectiveTimeoutError,
    MismatchError,
    PeerFailureError,
    ProtocolError,
)
from allreduce.runtime._group import ProcessGroup
from allreduce.runtime._local import LocalTransport, local_groups, local_transports
from allreduce.runtime._plan import RankPlan, Step, Transfer, compile_plan
from allreduce.runtime._transport import (
    ABORT_KINDS,
    PLAN_CACHE_ENTRIES,
    PlanCache,
    ReduceInto,
    Transport,
    abort_kind,
    error_class,
)
from allreduce.runtime._work import Work

__all__ = [
    "ABORT_KINDS",
    "DTYPES",
    "OPS",
    "PLAN_CACHE_ENTRIES",
    "ChecksumError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "LocalTransport",
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
    "local_groups",
    "local_transports",
]
