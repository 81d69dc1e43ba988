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
from allreduce.runtime._transport import Transport

__all__ = [
    "ALGORITHMS",
    "DTYPES",
    "OPS",
    "ChecksumError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "MismatchError",
    "PeerFailureError",
    "ProcessGroup",
    "ProtocolError",
    "RankPlan",
    "Step",
    "Transfer",
    "Transport",
    "Work",
    "compile_plan",
    "init",
]
