"""The transport interface every transport implements, the per-rank plan it executes, and the faults injected
into it.

The interface is exported by :mod:`allreduce.runtime`; here, the variable that turns fault injection on, which the
command line sets for its ranks."""

from allreduce.runtime.transport._inject import ENV_VAR as INJECT_ENV

__all__ = ["INJECT_ENV"]
