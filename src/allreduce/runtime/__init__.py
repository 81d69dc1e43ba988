"""Executing schedules between real ranks: process group, transports (shm, tcp, in-process), store, launcher."""

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
from allreduce.runtime._store_api import KeyValueStore, Store
from allreduce.runtime.bench._bench import BenchConfig, BenchRow, default_iters, expected_result, pattern, run_bench
from allreduce.runtime.group._bootstrap import init
from allreduce.runtime.group._cost_models import SHM_FUSED_BYTES, default_cost_model
from allreduce.runtime.group._group import STATS_FILE_ENV, ProcessGroup
from allreduce.runtime.group._local import LocalTransport, local_groups, local_transports
from allreduce.runtime.group._transports import (
    TransportSetup,
    register_transport,
    transport_names,
    unregister_transport,
)
from allreduce.runtime.group._tune import load_cost_model, save_cost_model, tune_file
from allreduce.runtime.launcher._launch import LaunchResult, launch
from allreduce.runtime.launcher._spawn import (
    DEFAULT_GRACE_S,
    MAX_LOCAL_RANKS,
    MAX_RESTARTS,
    Departure,
    ElasticOutcome,
    JobInterruptedError,
    RankFailedError,
    die_with_parent,
    new_token,
    reserve_port,
    spawn,
    spawn_elastic,
    stop_signal_handlers,
)
from allreduce.runtime.pipeline._descriptor import DTYPES, OPS
from allreduce.runtime.pipeline._threads import WrongThreadError
from allreduce.runtime.pipeline._work import Work
from allreduce.runtime.stats._stats import GroupStats, LinkStats, RankStats
from allreduce.runtime.stats._trace import TRACE_ENV, check_trace_path
from allreduce.runtime.transport._inject import ENV_VAR as INJECT_ENV
from allreduce.runtime.transport._plan import RankPlan, Step, Transfer, compile_plan
from allreduce.runtime.transport._transport import (
    ABORT_KINDS,
    PLAN_CACHE_ENTRIES,
    Call,
    PlanCache,
    ReduceInto,
    Transport,
    abort_kind,
    error_class,
)

__all__ = [
    "ABORT_KINDS",
    "DEFAULT_GRACE_S",
    "DTYPES",
    "INJECT_ENV",
    "MAX_LOCAL_RANKS",
    "MAX_RESTARTS",
    "OPS",
    "PLAN_CACHE_ENTRIES",
    "SHM_FUSED_BYTES",
    "STATS_FILE_ENV",
    "TRACE_ENV",
    "BenchConfig",
    "BenchRow",
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
    "PlanCache",
    "ProcessGroup",
    "ProtocolError",
    "RankFailedError",
    "RankPlan",
    "RankStats",
    "ReduceInto",
    "ShrinkError",
    "Step",
    "Store",
    "Transfer",
    "Transport",
    "TransportSetup",
    "Work",
    "WrongThreadError",
    "abort_kind",
    "check_trace_path",
    "compile_plan",
    "corrupted",
    "default_cost_model",
    "default_iters",
    "die_with_parent",
    "error_class",
    "expected_result",
    "init",
    "launch",
    "load_cost_model",
    "local_groups",
    "local_transports",
    "new_token",
    "pattern",
    "register_transport",
    "reserve_port",
    "run_bench",
    "save_cost_model",
    "spawn",
    "spawn_elastic",
    "stop_signal_handlers",
    "transport_names",
    "tune_file",
    "unregister_transport",
]
