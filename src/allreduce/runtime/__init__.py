"""Executing schedules between real processes: process group, transports (shm, tcp), store, launcher."""

from allreduce.runtime._errors import (
    ChecksumError,
    CollectiveError,
    CollectiveTimeoutError,
    MismatchError,
    PeerFailureError,
    ProtocolError,
)
from allreduce.runtime._plan import RankPlan, Step, Transfer, compile_plan

__all__ = [
    "ChecksumError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "MismatchError",
    "PeerFailureError",
    "ProtocolError",
    "RankPlan",
    "Step",
    "Transfer",
    "compile_plan",
]
