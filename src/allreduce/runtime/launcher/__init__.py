"""Starting N local ranks and watching them: :func:`spawn` for Python functions, the launcher for commands
(``allreduce run``), the watch over the children, the reaper that outlives a killed launcher, and the failure report."""
