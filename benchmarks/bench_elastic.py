"""Time to recover from a dead rank: SIGKILL one rank of N in an all-reduce loop, the survivors shrink and sum,
and a restarted process takes the dead rank's seat and rejoins.

    .venv/bin/python benchmarks/bench_elastic.py [--ranks 8] [--reps 3] [--transports shm,tcp] [--count 262144]
    .venv/bin/python benchmarks/bench_elastic.py --soak 200      # kills in a row: hangs, wrong sums, leftovers

For each transport and repetition, N ranks (plain processes with the rendezvous variables) loop float32
all-reduces of ``--count`` elements; rank N-3 (never rank 0, which hosts the store) SIGKILLs itself after the first
one. Printed per case: how long after the kill the survivors' collective raised (detection), how long
``group.shrink()`` plus the first all-reduce on the survivors took, how long the restarted rank took from its
process's start to its first all-reduce with the group (the members call ``group.grow()`` between all-reduces),
and whether every sum, on the shrunk and on the regrown group, was exact. ``--soak K`` runs K such kills, the
transports in turn, and counts hangs (a case not done within its deadline), wrong sums, processes left running
and ``/dev/shm`` files left behind.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import signal
import statistics
import time
from typing import Any

import numpy as np

from allreduce.runtime.launcher._spawn import new_token, rank_environment, reserve_port


def _rank(rank: int, env: dict[str, str], case: tuple[str, int, int], out: Any) -> None:
    transport, victim, count = case
    os.environ.update(env)
    import allreduce

    world_size = int(env["WORLD_SIZE"])
    group = allreduce.init(transport=transport, timeout_s=60)
    x = np.full(count, float(rank + 1), np.float32)
    calls = 0  # the collectives this rank completed: every survivor must fail at the same one
    try:
        group.all_reduce(x)  # the victim dies right after it: the others may still be finishing this one
        calls += 1
        if rank == victim:
            out.put((rank, time.time()))  # the kill's moment, on the clock every process shares
            out.close()
            out.join_thread()  # the message is in the pipe before the process dies
            os.kill(os.getpid(), signal.SIGKILL)
        while True:
            x[:] = rank + 1  # the sum grows N-fold per call: start afresh, never overflow
            group.all_reduce(x)
            calls += 1
    except allreduce.CollectiveError:
        raised = time.time()
    started = time.monotonic()
    group = group.shrink()
    y = np.full(count, float(rank + 1), np.float32)
    group.all_reduce(y)
    recovered = time.monotonic() - started
    exact = bool(np.all(y == float(sum(r + 1 for r in range(world_size) if r != victim))))
    deadline = time.monotonic() + CASE_DEADLINE_S  # a member never outlives the case (its launcher may be gone)
    while group.world_size < world_size and time.monotonic() < deadline:  # between steps: admit the restart
        y[:] = rank + 1
        group.all_reduce(y)
        group = group.grow()
        time.sleep(0.005)
    z = np.full(count, float(rank + 1), np.float32)
    group.all_reduce(z)
    exact = exact and bool(np.all(z == float(sum(range(1, world_size + 1)))))
    group.close()
    out.put((rank, (raised, recovered, exact, calls)))


def _joiner(rank: int, env: dict[str, str], case: tuple[str, int, int], out: Any) -> None:
    transport, _, count = case
    os.environ.update({**env, "ALLREDUCE_JOIN": "1"})
    import allreduce

    with allreduce.init(transport=transport, timeout_s=60) as group:
        z = np.full(count, float(rank + 1), np.float32)
        group.all_reduce(z)
        joined = time.time()
        world_size = int(env["WORLD_SIZE"])
        out.put(("joiner", (joined, bool(np.all(z == float(sum(range(1, world_size + 1))))))))


_SEGMENT_OWNER = re.compile(r"^allreduce-.+-\d+-\d+x(\d+)-\d+$")  # a data segment names its owner's pid


def _files_of(pids: set[int]) -> list[str]:
    """The /dev/shm data segments of processes ``pids`` (other jobs on the machine have their own)."""
    return sorted(n for n in os.listdir("/dev/shm") if (m := _SEGMENT_OWNER.match(n)) and int(m[1]) in pids)


PIDS: set[int] = set()
"""Every rank process the benchmark started (for the soak's leftover count)."""


def run_case(world_size: int, transport: str, count: int) -> tuple[float, float, float, bool, bool]:
    """(slowest detection after the kill, slowest shrink + first all-reduce, the restarted rank's start to its
    first all-reduce with the group, every sum exact, every survivor failed at the same collective)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    reservation = reserve_port()
    port, token = int(reservation.getsockname()[1]), new_token()
    victim = world_size - 3 if world_size > 2 else 1
    envs = [rank_environment(r, world_size, master_port=port, token=token) for r in range(world_size)]
    case = (transport, victim, count)
    procs = [ctx.Process(target=_rank, args=(r, envs[r], case, out)) for r in range(world_size)]
    for p in procs:
        p.start()
    reservation.close()
    try:
        results: dict[Any, Any] = dict([out.get(timeout=CASE_DEADLINE_S)])  # the victim's kill comes first
        procs[victim].join(timeout=CASE_DEADLINE_S)
        restarted_at = time.time()
        procs.append(ctx.Process(target=_joiner, args=(victim, envs[victim], case, out)))
        procs[-1].start()
        results.update(out.get(timeout=CASE_DEADLINE_S) for _ in range(world_size))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        PIDS.update(p.pid for p in procs if p.pid is not None)
    killed_at = results.pop(victim)
    joined_at, joiner_exact = results.pop("joiner")
    detection = max(r[0] for r in results.values()) - killed_at
    recovery = max(r[1] for r in results.values())
    exact = joiner_exact and all(r[2] for r in results.values())
    agreed = len({r[3] for r in results.values()}) == 1
    return detection, recovery, joined_at - restarted_at, exact, agreed


CASE_DEADLINE_S = 120.0


def soak(kills: int, world_size: int, transports: list[str], count: int) -> None:
    """``kills`` cases in a row: hangs, wrong sums, processes and /dev/shm files left behind."""
    import queue

    hangs = wrong = split = 0
    started = time.monotonic()
    for i in range(kills):
        try:
            *_, exact, agreed = run_case(world_size, transports[i % len(transports)], count)
            wrong += not exact
            split += not agreed
        except queue.Empty:
            hangs += 1
        if (i + 1) % 10 == 0 or i + 1 == kills:
            print(f"  {i + 1}/{kills} kills, {time.monotonic() - started:.0f} s: {hangs} hangs, {wrong} wrong, "
                  f"{split} with survivors failing at different collectives", flush=True)  # fmt: skip
    left = len(mp.active_children())
    files = _files_of(PIDS)
    shown = f" {files[:3]}" if files else ""
    print(f"soak: {kills} kills ({', '.join(transports)} in turn, {world_size} ranks): {hangs} hangs, {wrong} wrong "
          f"sums, {split} splits, {left} processes and {len(files)} /dev/shm files left behind{shown}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8, help="ranks before the kill (default 8)")
    parser.add_argument("--reps", type=int, default=3, help="kills per transport (default 3)")
    parser.add_argument("--transports", default="shm,tcp", help="comma-separated: shm, tcp (default both)")
    parser.add_argument("--count", type=int, default=1 << 18, help="float32 elements per all-reduce (default 1 MiB)")
    parser.add_argument("--soak", type=int, default=0, metavar="K", help="run K kills in a row and count failures")
    args = parser.parse_args()
    if not 3 <= args.ranks <= 64:
        parser.error("--ranks must be in [3, 64]")
    if not 0 <= args.soak <= 10_000:
        parser.error("--soak must be in [0, 10000]")
    transports = args.transports.split(",")
    if not set(transports) <= {"shm", "tcp"}:
        parser.error(f"--transports: shm and/or tcp, got {args.transports!r}")
    load = os.getloadavg()[0]
    print(f"bench_elastic: {args.ranks} ranks, rank {args.ranks - 3} killed, {args.count * 4:,} B all-reduces")
    if args.soak:
        soak(args.soak, args.ranks, transports, args.count)
    else:
        print(f"{'transport':<10} {'detection s (median, max)':<28} {'shrink + first call s':<26} "
              f"{'rejoin s (median, max)':<25} exact")  # fmt: skip
        for transport in transports:
            rows = [run_case(args.ranks, transport, args.count) for _ in range(args.reps)]
            detect, recover, rejoin = ([r[i] for r in rows] for i in range(3))
            print(
                f"{transport:<10} {statistics.median(detect):>8.3f}, {max(detect):<17.3f} "
                f"{statistics.median(recover):>8.3f}, {max(recover):<15.3f} "
                f"{statistics.median(rejoin):>8.3f}, {max(rejoin):<14.3f} {all(r[3] for r in rows)}"
            )
    print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (1-min), {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
