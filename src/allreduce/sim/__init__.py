"""Flow-level network simulation: run a schedule on a topology with max-min fair link sharing.

:func:`simulate` is the entry point; :func:`max_min_rates` the rate model both engines share.
"""

from allreduce.sim._event import Transfers, match_transfers
from allreduce.sim._fair import FairShare, max_min_rates
from allreduce.sim._faults import Faults, apply_faults, resolve_links
from allreduce.sim._result import Bottleneck, CriticalStep, PhaseResult, SimResult
from allreduce.sim._simulate import AUTO_EXACT_MAX_RANKS, TRACE_RANKS, simulate
from allreduce.sim._trace import chrome_trace, write_trace

__all__ = [
    "AUTO_EXACT_MAX_RANKS",
    "TRACE_RANKS",
    "Bottleneck",
    "CriticalStep",
    "FairShare",
    "Faults",
    "PhaseResult",
    "SimResult",
    "Transfers",
    "apply_faults",
    "chrome_trace",
    "match_transfers",
    "max_min_rates",
    "resolve_links",
    "simulate",
    "write_trace",
]
