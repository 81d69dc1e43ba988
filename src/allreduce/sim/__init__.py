"""Flow-level network simulation: run a schedule on a topology with max-min fair link sharing.

:func:`simulate` is the entry point (:func:`simulate_sizes` for several buffer sizes in one pass);
:func:`max_min_rates` the rate model both engines share; :func:`simulate_tail` the Monte Carlo of the tail (packet
loss, jitter, stragglers, timed faults).
"""

from allreduce.sim._event import Transfers, match_transfers
from allreduce.sim._fair import FairShare, max_min_rates
from allreduce.sim._faults import (
    DegradedLink,
    FailedLink,
    Fault,
    Faults,
    LinkDegrade,
    LinkDown,
    LinkFlap,
    SlowRank,
    TimedFault,
    apply_faults,
    fault_kinds,
    parse_fault,
    parse_timed_fault,
    register_fault_kind,
    resolve_links,
    unregister_fault_kind,
)
from allreduce.sim._loss import FABRICS, LossModel, transfer_loss_probability
from allreduce.sim._mitigate import MAX_MITIGATE_RANKS, Mitigation, mitigate_ring
from allreduce.sim._montecarlo import simulate_tail
from allreduce.sim._rerun import DEFAULT_EXACT_BUDGET_S, TAIL_EXACT_MAX_RANKS
from allreduce.sim._result import Bottleneck, CriticalStep, PhaseResult, SimResult
from allreduce.sim._simulate import (
    AUTO_EXACT_MAX_RANKS,
    AUTO_EXACT_MAX_TRANSFERS,
    ENGINES,
    FAST_ERROR_RANGE,
    TRACE_RANKS,
    simulate,
    simulate_sizes,
)
from allreduce.sim._stochastic import DISTRIBUTIONS, Distribution, parse_distribution, parse_time
from allreduce.sim._tailresult import (
    EVENT_MAX_TRANSFERS,
    PERCENTILES,
    SAMPLE_EVENT,
    SAMPLE_FAST,
    SAMPLE_FAST_UNCERTIFIED,
    TAIL_MEMORY_LIMIT_BYTES,
    Culprit,
    TailConfig,
    TailResult,
    tail_memory_bytes,
)
from allreduce.sim._tcp import TCP_STACKS, TcpStack
from allreduce.sim._trace import chrome_trace, write_trace

__all__ = [
    "AUTO_EXACT_MAX_RANKS",
    "AUTO_EXACT_MAX_TRANSFERS",
    "DEFAULT_EXACT_BUDGET_S",
    "DISTRIBUTIONS",
    "ENGINES",
    "EVENT_MAX_TRANSFERS",
    "FABRICS",
    "FAST_ERROR_RANGE",
    "MAX_MITIGATE_RANKS",
    "PERCENTILES",
    "SAMPLE_EVENT",
    "SAMPLE_FAST",
    "SAMPLE_FAST_UNCERTIFIED",
    "TAIL_EXACT_MAX_RANKS",
    "TAIL_MEMORY_LIMIT_BYTES",
    "TCP_STACKS",
    "TRACE_RANKS",
    "Bottleneck",
    "CriticalStep",
    "Culprit",
    "DegradedLink",
    "Distribution",
    "FailedLink",
    "FairShare",
    "Fault",
    "Faults",
    "LinkDegrade",
    "LinkDown",
    "LinkFlap",
    "LossModel",
    "Mitigation",
    "PhaseResult",
    "SimResult",
    "SlowRank",
    "TailConfig",
    "TailResult",
    "TcpStack",
    "TimedFault",
    "Transfers",
    "apply_faults",
    "chrome_trace",
    "fault_kinds",
    "match_transfers",
    "max_min_rates",
    "mitigate_ring",
    "parse_distribution",
    "parse_fault",
    "parse_time",
    "parse_timed_fault",
    "register_fault_kind",
    "resolve_links",
    "simulate",
    "simulate_sizes",
    "simulate_tail",
    "tail_memory_bytes",
    "transfer_loss_probability",
    "unregister_fault_kind",
    "write_trace",
]
