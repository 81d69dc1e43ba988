"""Re-planning around a slow link, measured: busbw before, during and after, and no change on a healthy group.

    .venv/bin/python benchmarks/bench_replan.py [--ranks 8] [--size 1MiB] [--calls 200] [--rate 50MB/s]
        [--healthy-calls 10000]

Two runs of N local ranks over shared memory with ``ALLREDUCE_REPLAN=1`` (windows of 50 calls, 2 to confirm):
one with the link 1 -> 2 paced to ``--rate`` (``ALLREDUCE_INJECT``), a ring all-reduce of ``--size`` per call,
printing busbw per window and the change re-planning made; one healthy, counting the changes over
``--healthy-calls`` calls (none is the goal: no flapping). The same runs without re-planning are the reference.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

from allreduce.runtime import spawn
from allreduce.units import parse_bytes

WINDOW = 50


def _loop(group: Any, count: int, calls: int) -> tuple[list[float], tuple[str, ...]]:
    times = []
    x = np.ones(count, np.float32)
    for _ in range(calls):
        started = time.perf_counter()
        group.all_reduce(x, algorithm="ring")
        times.append(time.perf_counter() - started)
        x[:] = 1.0
    return times, group.stats().replans


def _busbw(times: list[float], nbytes: int, n: int) -> list[float]:
    """busbw (GB/s) per window of WINDOW calls: 2(N-1)/N x bytes / median call time (nccl-tests' definition)."""
    return [2 * (n - 1) / n * nbytes / float(np.median(times[i : i + WINDOW])) / 1e9 for i in range(0, len(times),
            WINDOW)]  # fmt: skip


def run(n: int, count: int, calls: int, env: dict[str, str]) -> tuple[list[float], tuple[str, ...]]:
    results = spawn(n, _loop, count, calls, env=env, init_options={"transport": "shm"}, timeout_s=600)
    times = np.max([r[0] for r in results], axis=0).tolist()  # a call ends when its slowest rank does
    return times, results[0][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--size", default="1MiB")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rate", default="50MB/s", help="the paced link's rate")
    parser.add_argument("--healthy-calls", type=int, default=10_000)
    args = parser.parse_args()
    if not 4 <= args.ranks <= 16:
        parser.error("--ranks must be in 4..16 (re-planning needs 4 ranks)")
    nbytes = parse_bytes(args.size, what="--size")
    count = max(1, nbytes // 4)
    pace = {"ALLREDUCE_INJECT": f"pace:link=1->2:rate={args.rate}"}
    print(f"bench_replan: {args.ranks} ranks, shm, ring all-reduce of {args.size}, link 1->2 paced to {args.rate}; "
          f"load {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores")  # fmt: skip
    healthy, _ = run(args.ranks, count, args.calls, {})
    slow, _ = run(args.ranks, count, args.calls, pace)
    replanned, changes = run(args.ranks, count, args.calls, {**pace, "ALLREDUCE_REPLAN": "1"})
    print(f"busbw GB/s per window of {WINDOW} calls (median call):")
    for name, times in (("healthy", healthy), ("paced", slow), ("paced, re-planning", replanned)):
        print(f"  {name:<20} " + "  ".join(f"{b:6.3f}" for b in _busbw(times, count * 4, args.ranks)))
    for change in changes:
        print(f"  re-planned {change}")
    last = _busbw(replanned, count * 4, args.ranks)[-1]
    print(f"  after re-planning: {last / _busbw(healthy, count * 4, args.ranks)[-1]:.0%} of the healthy busbw")
    started = time.monotonic()
    _, flaps = run(args.ranks, max(1, (64 << 10) // 4), args.healthy_calls, {"ALLREDUCE_REPLAN": "1"})
    print(f"healthy group with re-planning on: {len(flaps)} changes in {args.healthy_calls:,} calls of 64 KiB "
          f"({time.monotonic() - started:.0f} s); load {os.getloadavg()[0]:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
