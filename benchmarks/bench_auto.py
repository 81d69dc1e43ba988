"""What ``algorithm="auto"`` picks over shared memory, against every candidate forced, in one run.

    .venv/bin/python benchmarks/bench_auto.py [--world-sizes 2,4] [--sizes 64KiB,256KiB,1MiB,4MiB] [--reps 5]

For each world size, buffer kind (plain numpy arrays, staged; ``group.empty()`` buffers, read in place) and size:
the time per call of auto and of ring, halving-doubling and recursive doubling forced, each the median over
``--reps`` alternating batches of the slowest rank's mean, the algorithm auto picked for that very buffer
(``choose_algorithm(..., like=x)``), and auto's time over the fastest forced candidate's ("regret": 1.00 when the
pick is the best; a pick within noise of the best shows a few percent either way). float32 sum in place; the data
overflows to inf after a few hundred calls, which costs the same time. The footer gives the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np

from allreduce.runtime.launcher._spawn import spawn
from allreduce.units import format_bytes, parse_bytes

FORCED = ("ring", "halving_doubling", "recursive_doubling")
TIMED = ("auto", *FORCED)
KINDS = ("plain", "empty")
_BATCH_BYTES = 40 << 20
"""Bytes one batch all-reduces (so small sizes get many calls, large ones enough to average)."""


def _rank(group: Any, sizes: list[int], reps: int) -> dict[tuple[str, int, str], Any]:
    np.seterr(all="ignore")
    out: dict[tuple[str, int, str], Any] = {}
    for kind in KINDS:
        for size in sizes:
            count = size // 4
            x = group.empty(count, np.float32) if kind == "empty" else np.empty(count, np.float32)
            x[...] = 1
            out[kind, size, "pick"] = group.choose_algorithm(count, like=x)
            calls = max(20, min(400, _BATCH_BYTES // size))
            times: dict[str, list[float]] = {a: [] for a in TIMED}
            for _ in range(reps):
                for algorithm in TIMED:
                    for _ in range(3):
                        group.all_reduce(x, algorithm=algorithm)
                    group.barrier()
                    start = time.perf_counter()
                    for _ in range(calls):
                        group.all_reduce(x, algorithm=algorithm)
                    times[algorithm].append((time.perf_counter() - start) / calls)
            for algorithm in TIMED:
                out[kind, size, algorithm] = times[algorithm]
            del x
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--sizes", default="64KiB,256KiB,1MiB,4MiB")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(parse_bytes(s)) for s in args.sizes.split(",")]
    print(
        f"{'N':>2} {'buffer':>6} {'size':>8} | {'auto':>9} "
        + " ".join(f"{a:>18}" for a in FORCED)
        + f" | {'auto picked':>18} {'regret':>6}"
    )
    for world_size in (int(w) for w in args.world_sizes.split(",")):
        per_rank = spawn(world_size, _rank, sizes, args.reps, init_options={"transport": "shm"}, timeout_s=3600)
        for kind in KINDS:
            for size in sizes:
                # a cell: the median over batches of the slowest rank's batch mean
                cell = {
                    a: statistics.median(max(r[kind, size, a][i] for r in per_rank) for i in range(args.reps))
                    for a in TIMED
                }
                best = min(cell[a] for a in FORCED)
                print(
                    f"{world_size:>2} {kind:>6} {format_bytes(size):>8} | {cell['auto'] * 1e6:>7.1f}µs "
                    + " ".join(f"{cell[a] * 1e6:>16.1f}µs" for a in FORCED)
                    + f" | {per_rank[0][kind, size, 'pick']:>18} {cell['auto'] / best:>6.2f}"
                )
    print(f"# load average (1, 5, 15 min) at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
