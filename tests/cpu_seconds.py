"""The CPU seconds a test used, for ``--cpu-durations`` (tests/conftest.py); no tests of its own.

This process's, its reaped children's (spawned ranks, command-line runs, each of which reaps its own fork server at
exit), and those of the fork server this process runs, if any, with the ranks forked from it that it has reaped:
the server is this process's child, but reaped only when this process exits, so ``RUSAGE_CHILDREN`` alone would
miss every forked rank.
"""

import resource

from allreduce.runtime.launcher._forkserver import fork_server_cpu_s


def cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + fork_server_cpu_s()
