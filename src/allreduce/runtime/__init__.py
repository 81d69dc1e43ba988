"""Executing schedules between real ranks: process group, transports (shm, tcp, in-process), store, launcher.

What users and transport writers need; what only one other package needs is exported by the subpackage that
defines it (``allreduce.runtime.bench`` for the bench command, ``allreduce.runtime.launcher`` for the launcher's
settings, ...), and tuning constants stay private.
"""

from allreduce.runtime._errors import (
    ChecksumError,
    CollectiveError,
    CollectiveTimeoutError,
    MismatchError,
    PeerFailureError,
    ProtocolError,
    ShrinkError,
    corrupted,
)
from allreduce.runtime._liveness import DEFAULT_LEASE_S, LEASE_ENV, MAX_LEASE_S, MIN_LEASE_S, silent_detection_s
from allreduce.runtime._store_api import KeyValueStore, Store
from allreduce.runtime.group._bootstrap import init
from allreduce.runtime.group._group import ProcessGroup
from allreduce.runtime.group._local import LocalTransport, local_groups, local_transports
from allreduce.runtime.group._resume import shrink_and_resume
from allreduce.runtime.group._transports import (
    TransportSetup,
    register_transport,
    transport_names,
    unregister_transport,
)
from allreduce.runtime.launcher._launch import LaunchResult, launch
from allreduce.runtime.launcher._spawn import (
    Departure,
    ElasticOutcome,
    JobInterruptedError,
    RankFailedError,
    spawn,
    spawn_elastic,
)
from allreduce.runtime.pipeline._descriptor import DTYPES, OPS
from allreduce.runtime.pipeline._threads import WrongThreadError
from allreduce.runtime.pipeline._work import Work
from allreduce.runtime.stats._stats import GroupStats, LinkStats, RankStats
from allreduce.runtime.transport._plan import PlanStep, RankPlan, Transfer, compile_plan
from allreduce.runtime.transport._transport import Call, ReduceInto, Transport, abort_kind, error_class

__all__ = [
    "DEFAULT_LEASE_S",
    "DTYPES",
    "LEASE_ENV",
    "MAX_LEASE_S",
    "MIN_LEASE_S",
    "OPS",
    "Call",
    "ChecksumError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "Departure",
    "ElasticOutcome",
    "GroupStats",
    "JobInterruptedError",
    "KeyValueStore",
    "LaunchResult",
    "LinkStats",
    "LocalTransport",
    "MismatchError",
    "PeerFailureError",
    "PlanStep",
    "ProcessGroup",
    "ProtocolError",
    "RankFailedError",
    "RankPlan",
    "RankStats",
    "ReduceInto",
    "ShrinkError",
    "Store",
    "Transfer",
    "Transport",
    "TransportSetup",
    "Work",
    "WrongThreadError",
    "abort_kind",
    "compile_plan",
    "corrupted",
    "error_class",
    "init",
    "launch",
    "local_groups",
    "local_transports",
    "register_transport",
    "shrink_and_resume",
    "silent_detection_s",
    "spawn",
    "spawn_elastic",
    "transport_names",
    "unregister_transport",
]
