"""How much a ring all-reduce could gain from pipelining its segments across steps, measured as an upper bound.

Pipelining across steps (segment k of step t+1 leaves as soon as segment k of step t is reduced, instead of
after the whole step) only fills time in which a core waits: the bubble at each step's end, where a rank that
finished waits for its slowest neighbour. So the time the machine's cores sit idle during the collectives bounds
what any such reordering can gain; a collective that keeps every core busy cannot get faster by overlapping
more, only by doing less work. This script measures exactly that, one row per case:

- ``wall/call``: the slowest rank's time per all-reduce over a timed loop;
- ``CPU/call``: the CPU time (user + system, every thread of the rank, the kernel's socket copies included) of all
  ranks together per all-reduce; for shared memory also the reduction and copies;
- ``busy``: CPU/call ÷ (wall/call × cores used) — cores used is min(N, the machine's cores);
- ``bound``: 1 − busy, the largest share of the time pipelining could remove on this machine.

Each case also runs the ring with every transfer cut into 4 segments (streamed within a step), the pipelining
the executors already do, as a reference.

    .venv/bin/python benchmarks/bench_ring_idle.py [--world-sizes 4,8] [--sizes 16MiB,64MiB,256MiB]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

from allreduce.runtime import spawn
from allreduce.units import format_bytes, parse_size_range


def _rank(group: Any, size_bytes: int, segments: int, iters: int) -> tuple[float, float]:
    """Wall and CPU seconds (this rank, every thread) over ``iters`` ring all-reduces after one warm-up."""
    data = group.empty(size_bytes // 4, np.float32)
    data[:] = 1.0
    group.all_reduce(data, op="max", algorithm="ring", segments=segments)
    group.barrier()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(iters):  # max, not sum: the values stay put (a sum of ones overflows after 40-odd calls)
        group.all_reduce(data, op="max", algorithm="ring", segments=segments)
    cpu = time.process_time() - cpu0
    group.barrier()
    return time.perf_counter() - wall0, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--world-sizes", default="4,8")
    parser.add_argument("--sizes", default="16MiB,64MiB,256MiB")
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per case, about")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    print(f"load average {os.getloadavg()[0]:.1f} at start; {cores} cores")
    print(
        f"{'transport':>9} {'N':>3} {'size':>8} {'segments':>8} {'wall/call':>10} {'CPU/call':>10} {'busy':>6} "
        f"{'bound':>6}"
    )
    for transport in args.transports.split(","):
        for n in (int(x) for x in args.world_sizes.split(",")):
            for size in parse_size_range(args.sizes):
                for segments in (1, 4):
                    probe = spawn(n, _rank, size, segments, 1, init_options={"transport": transport})
                    per_call_s = max(w for w, _ in probe)
                    iters = max(2, int(args.seconds / max(per_call_s, 1e-6)))
                    results = spawn(n, _rank, size, segments, iters, init_options={"transport": transport})
                    wall = max(w for w, _ in results) / iters
                    cpu = sum(c for _, c in results) / iters
                    busy = cpu / (wall * min(n, cores))
                    bound = max(0.0, 1 - busy)
                    print(
                        f"{transport:>9} {n:>3} {format_bytes(size):>8} {segments:>8} {wall * 1e3:>8.1f}ms "
                        f"{cpu * 1e3:>8.1f}ms {busy:>6.0%} {bound:>6.0%}",
                        flush=True,
                    )
    print(f"load average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
