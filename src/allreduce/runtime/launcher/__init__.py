"""Starting N local ranks and watching them: :func:`spawn` for Python functions, the launcher for commands
(``allreduce run``), the watch over the children, the reaper that outlives a killed launcher, and the failure report.

``spawn`` and ``launch`` are exported by :mod:`allreduce.runtime`; here, what the command line and the emulator
take besides: the launcher's limits and a child's ties to its parent."""

from allreduce.runtime.launcher._spawn import DEFAULT_GRACE_S, MAX_RESTARTS, die_with_parent, stop_signal_handlers

__all__ = ["DEFAULT_GRACE_S", "MAX_RESTARTS", "die_with_parent", "stop_signal_handlers"]
