"""Recording what a group's collectives did: per-step wait records, the group-wide summary, Perfetto traces.

:class:`GroupStats` and its parts are exported by :mod:`allreduce.runtime`; here, what ``allreduce run --trace``
takes besides."""

from allreduce.runtime.stats._trace import TRACE_ENV, check_trace_path

__all__ = ["TRACE_ENV", "check_trace_path"]
