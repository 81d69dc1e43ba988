"""Time to recover from a dead rank over real TCP across an emulated Clos (root, iproute2): bench_elastic's case
with one rank per host namespace.

    sudo .venv/bin/python benchmarks/bench_elastic_emulated.py [--reps 3] [--count 65536] [--link-rate 200Mbps]

An emulated 1:1 Clos of 2 leaves and 2 spines with 4 hosts each (``allreduce emulate``), links at ``--link-rate``;
rank r on host r, every rank a process in its host's namespace joining over TCP (the store on host 0). Each
repetition: the 8 ranks loop float32 all-reduces of ``--count`` elements, rank 5 SIGKILLs itself after the first,
the survivors raise, ``group.shrink()`` and sum again, and a restarted process in rank 5's namespace rejoins
(``ALLREDUCE_JOIN=1``; the members call ``group.grow()`` between all-reduces). Printed: detection (kill to the
last survivor's raise), shrink + first all-reduce, the restarted rank's start to its first all-reduce with the
group, every sum exact, and whether every survivor failed at the same collective.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from typing import Any

from allreduce.runtime.launcher import die_with_parent
from bench_elastic import _joiner, _rank

CLOS = "clos:leaves=2,spines=2,hosts_per_leaf=4"
STORE_PORT = 29_533
VICTIM = 5
CASE_DEADLINE_S = 120.0


class _Lines:
    """What a rank puts on bench_elastic's queue, as one JSON line on stdout."""

    def put(self, item: Any) -> None:
        print(json.dumps(item), flush=True)

    def close(self) -> None:
        pass

    def join_thread(self) -> None:
        pass


def _worker(kind: str, rank: int, count: int) -> None:
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ALLREDUCE_TOKEN")}
    if kind == "join":
        _joiner(rank, env, ("tcp", VICTIM, count), _Lines())
    else:
        _rank(rank, env, ("tcp", VICTIM, count), _Lines())


def _start(built: Any, kind: str, rank: int, count: int, env: dict[str, str]) -> subprocess.Popen[str]:
    cmd = ["ip", "netns", "exec", built.host_namespace(rank), sys.executable, __file__, "--worker", kind, str(rank),
           str(count)]  # fmt: skip
    return subprocess.Popen(cmd, env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, preexec_fn=die_with_parent(os.getpid()))  # fmt: skip  # noqa: PLW1509


def _line(proc: subprocess.Popen[str], what: str) -> Any:
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        raise SystemExit(f"{what}: no report (exit {proc.wait(timeout=CASE_DEADLINE_S)})")
    return json.loads(line)


def run_case(built: Any, n: int, count: int) -> tuple[float, float, float, bool, bool]:
    env = dict(os.environ, WORLD_SIZE=str(n), MASTER_ADDR=built.host_address[0], MASTER_PORT=str(STORE_PORT),
               ALLREDUCE_TOKEN=secrets.token_hex(16))  # fmt: skip
    procs = [_start(built, "rank", r, count, env) for r in range(n)]
    try:
        killed_at = _line(procs[VICTIM], "the victim")[1]
        procs[VICTIM].wait(timeout=CASE_DEADLINE_S)
        restarted_at = time.time()
        joiner = _start(built, "join", VICTIM, count, dict(env, ALLREDUCE_JOIN="1"))
        procs.append(joiner)
        results = {r: _line(procs[r], f"rank {r}")[1] for r in range(n) if r != VICTIM}
        joined_at, joiner_exact = _line(joiner, "the restarted rank")[1]
    finally:
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    detection = max(r[0] for r in results.values()) - killed_at
    recovery = max(r[1] for r in results.values())
    exact = joiner_exact and all(r[2] for r in results.values())
    agreed = len({r[3] for r in results.values()}) == 1
    return detection, recovery, joined_at - restarted_at, exact, agreed


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    from allreduce.emulate import EmulationSpec, check_privileges, running
    from allreduce.units import parse_bandwidth

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="kills (default 3)")
    parser.add_argument("--count", type=int, default=1 << 16, help="float32 elements per all-reduce (256 KiB)")
    parser.add_argument("--link-rate", default="200Mbps", help="the links' shaped rate")
    args = parser.parse_args()
    if not 1 <= args.reps <= 100:
        parser.error("--reps must be in 1..100")
    if not 1 <= args.count <= 1 << 24:
        parser.error("--count must be in 1..16777216")
    check_privileges()
    load = os.getloadavg()[0]
    print(f"bench_elastic_emulated: 8 ranks over TCP on {CLOS} at {args.link_rate}, rank {VICTIM} killed, "
          f"{args.count * 4:,} B all-reduces")  # fmt: skip
    with running(EmulationSpec(CLOS, name="elastic", rate_bps=parse_bandwidth(args.link_rate) * 8)) as built:
        rows = [run_case(built, 8, args.count) for _ in range(args.reps)]
    detect, recover, rejoin = ([r[i] for r in rows] for i in range(3))
    print(f"{'detection s (median, max)':<28} {'shrink + first call s':<26} {'rejoin s (median, max)':<25} exact "
          f"same collective failed")  # fmt: skip
    print(f"{statistics.median(detect):>8.3f}, {max(detect):<17.3f} {statistics.median(recover):>8.3f}, "
          f"{max(recover):<15.3f} {statistics.median(rejoin):>8.3f}, {max(rejoin):<14.3f} "
          f"{all(r[3] for r in rows)!s:<5} {all(r[4] for r in rows)}")  # fmt: skip
    print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (1-min), {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
