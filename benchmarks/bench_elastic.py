"""Time to recover from a dead rank: SIGKILL one rank of N in an all-reduce loop, the survivors shrink and sum.

    .venv/bin/python benchmarks/bench_elastic.py [--ranks 8] [--reps 3] [--transports shm,tcp] [--count 262144]

For each transport and repetition, N ranks (plain processes with the rendezvous variables) loop float32
all-reduces of ``--count`` elements; rank N-3 (never rank 0, which hosts the store) SIGKILLs itself after the first
one. Printed per case: how long after the kill the survivors' collective raised (detection), how long
``group.shrink()`` plus the first all-reduce on the survivors took, and whether every survivor's sum was exact.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import statistics
import time
from typing import Any

import numpy as np

from allreduce.runtime._spawn import new_token, rank_environment, reserve_port


def _rank(rank: int, env: dict[str, str], case: tuple[str, int, int], out: Any) -> None:
    transport, victim, count = case
    os.environ.update(env)
    import allreduce

    group = allreduce.init(transport=transport, timeout_s=60)
    x = np.full(count, float(rank + 1), np.float32)
    group.all_reduce(x)
    if rank == victim:
        out.put((rank, time.time()))  # the kill's moment, on the clock every process shares
        out.close()
        out.join_thread()  # the message is in the pipe before the process dies
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        while True:
            group.all_reduce(x)
    except allreduce.CollectiveError:
        raised = time.time()
    started = time.monotonic()
    group = group.shrink()
    y = np.full(count, float(rank + 1), np.float32)
    group.all_reduce(y)
    recovered = time.monotonic() - started
    exact = bool(np.all(y == float(sum(r + 1 for r in range(int(env["WORLD_SIZE"])) if r != victim))))
    group.close()
    out.put((rank, (raised, recovered, exact)))


def run_case(world_size: int, transport: str, count: int) -> tuple[float, float, bool]:
    """(slowest detection after the kill, slowest shrink + first all-reduce, every sum exact)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    reservation = reserve_port()
    port, token = int(reservation.getsockname()[1]), new_token()
    victim = world_size - 3 if world_size > 2 else 1
    procs = [
        ctx.Process(
            target=_rank,
            args=(r, rank_environment(r, world_size, master_port=port, token=token), (transport, victim, count), out),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    reservation.close()
    results = dict(out.get(timeout=300) for _ in range(world_size))
    for p in procs:
        p.join(timeout=60)
    killed_at = results.pop(victim)
    detection = max(r[0] for r in results.values()) - killed_at
    recovery = max(r[1] for r in results.values())
    return detection, recovery, all(r[2] for r in results.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8, help="ranks before the kill (default 8)")
    parser.add_argument("--reps", type=int, default=3, help="kills per transport (default 3)")
    parser.add_argument("--transports", default="shm,tcp", help="comma-separated: shm, tcp (default both)")
    parser.add_argument("--count", type=int, default=1 << 18, help="float32 elements per all-reduce (default 1 MiB)")
    args = parser.parse_args()
    if not 3 <= args.ranks <= 64:
        parser.error("--ranks must be in [3, 64]")
    load = os.getloadavg()[0]
    print(f"bench_elastic: {args.ranks} ranks, rank {args.ranks - 3} killed, {args.count * 4:,} B all-reduces")
    print(f"{'transport':<10} {'detection s (median, max)':<28} {'shrink + first call s':<26} exact")
    for transport in args.transports.split(","):
        rows = [run_case(args.ranks, transport, args.count) for _ in range(args.reps)]
        detect = [r[0] for r in rows]
        recover = [r[1] for r in rows]
        print(
            f"{transport:<10} {statistics.median(detect):>8.3f}, {max(detect):<17.3f} "
            f"{statistics.median(recover):>8.3f}, {max(recover):<15.3f} {all(r[2] for r in rows)}"
        )
    print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (1-min), {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
