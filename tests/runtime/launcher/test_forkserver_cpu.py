"""The CPU time of ranks forked from the fork server is not lost to whoever counts its children's: the suite's
``--cpu-durations`` (tests/cpu_seconds.py) reads the server's, and a process that forked ranks reaps its server
as it exits, so a parent counting that process's children (``RUSAGE_CHILDREN``) counts its ranks too.

Each rank burns a known amount of CPU and says how much it used (``time.process_time``: a fork starts at 0); the
count must hold at least that (and the command's own), whatever the load (CPU seconds, not wall).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from allreduce.runtime.launcher._forkserver import START_METHOD_ENV
from allreduce.runtime.launcher._spawn import spawn
from cpu_seconds import cpu_s

BURN_S = 0.3
TICK_S = 0.01  # /proc's and rusage's granularity, per process


def _burn(seconds: float) -> float:
    """Spin until this process has used ``seconds`` of CPU; return what it used."""
    while time.process_time() < seconds:
        pass
    return time.process_time()


def test_cpu_seconds_count_the_ranks_forked_from_this_process_s_server() -> None:
    before = cpu_s()
    used = spawn(2, _burn, BURN_S, group=False, env={START_METHOD_ENV: "forkserver"})
    assert cpu_s() - before >= sum(used) - 2 * TICK_S, used


def _children_cpu_s() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime


def test_a_process_that_forked_ranks_reaps_its_server_at_exit_so_its_parent_counts_their_cpu() -> None:
    script = f"""
        import sys
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[2])!r}]
        from test_forkserver_cpu import _burn
        import resource
        from allreduce.runtime.launcher._spawn import spawn
        ranks = sum(spawn(2, _burn, {BURN_S}, group=False))
        own = resource.getrusage(resource.RUSAGE_SELF)
        print(ranks, own.ru_utime + own.ru_stime)
    """
    env = {**os.environ, START_METHOD_ENV: "forkserver"}
    before = _children_cpu_s()
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env, timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    ranks, own = map(float, done.stdout.split())
    assert _children_cpu_s() - before >= ranks + own - 3 * TICK_S, done.stdout
