"""Plain numpy arrays beside ``group.empty()`` buffers over shm, in one set of rank processes, with the ranks placed
on the cores by hand: ``split`` (rank r on core r mod cores), ``same`` (every rank on core 0: what the scheduler
does now and then on a loaded 2-core machine, the slow mode of bench_runtime.py's bimodal 1 MiB rows) or ``free``
(the scheduler's choice, as bench_runtime.py runs).

    .venv/bin/python benchmarks/bench_shm_placement.py [--world-size 2] [--placement free] [--sizes 4KiB,1MiB]
        [--iters 300] [--rounds 3] [--trees /work/main,.] [--reps 4]

Each round times every size of both kinds in turn (their order swapped every other round); a cell is the median over
the rounds of the slowest rank's mean time per call, beside the median CPU time a rank spent per call (waits that
spin or yield count; waits that sleep do not). With ``--trees`` each repetition runs every tree in turn (a fresh
process with that tree's ``src/`` first on ``PYTHONPATH``), their order reversed every other repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from allreduce.runtime.launcher._spawn import spawn
from allreduce.units import format_bytes, parse_size_range

_KINDS = ("plain", "empty")


def _rank(group: Any, placement: str, sizes: list[int], iters: int, rounds: int) -> dict[str, list[list[float]]]:
    cores = os.cpu_count() or 1
    if placement == "split":
        os.sched_setaffinity(0, {group.rank % cores})
    elif placement == "same":
        os.sched_setaffinity(0, {0})
    buffers = {}
    for size in sizes:
        for kind in _KINDS:
            x = group.empty(size // 4, np.float32) if kind == "empty" else np.empty(size // 4, np.float32)
            x[...] = 1
            group.all_reduce(x)
            if not bool((x == group.world_size).all()):
                raise SystemExit(f"rank {group.rank}: wrong all_reduce result ({kind}, {format_bytes(size)})")
            buffers[f"{kind} {size}"] = x
    out: dict[str, list[list[float]]] = {key: [] for key in buffers}
    with np.errstate(all="ignore"):  # repeated in-place sums overflow; the timing does not care
        for r in range(rounds):
            for size in sizes:
                for kind in _KINDS if r % 2 == 0 else _KINDS[::-1]:
                    x = buffers[f"{kind} {size}"]
                    for _ in range(max(5, iters // 10)):
                        group.all_reduce(x)
                    group.barrier()
                    cpu, start = time.process_time(), time.perf_counter()
                    for _ in range(iters):
                        group.all_reduce(x)
                    elapsed = time.perf_counter() - start
                    out[f"{kind} {size}"].append([elapsed / iters, (time.process_time() - cpu) / iters])
    return out


def _sample(args: argparse.Namespace) -> dict[str, list[float]]:
    """(time, CPU per rank) medians over the rounds, per kind and size."""
    sizes = parse_size_range(args.sizes)
    per_rank = spawn(
        args.world_size, _rank, args.placement, sizes, args.iters, args.rounds,
        init_options={"transport": "shm"}, env={"ALLREDUCE_STATS": "0"}, timeout_s=1800,
    )  # fmt: skip
    result = {}
    for key in per_rank[0]:
        slowest = [max(rank[key][i][0] for rank in per_rank) for i in range(args.rounds)]
        cpu = [rank[key][i][1] for rank in per_rank for i in range(args.rounds)]
        result[key] = [statistics.median(slowest), statistics.median(cpu)]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--placement", choices=("free", "split", "same"), default="free")
    parser.add_argument("--sizes", default="4KiB,1MiB")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trees", default=None, help="comma-separated source trees, measured interleaved")
    parser.add_argument("--reps", type=int, default=4, help="repetitions per tree (with --trees)")
    parser.add_argument("--sample", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sample:
        print("SAMPLE-RESULT " + json.dumps(_sample(args)), flush=True)
        return
    trees = [Path(t).resolve() for t in (args.trees or str(Path(__file__).parents[1])).split(",")]
    passed = [f"--world-size={args.world_size}", f"--placement={args.placement}", f"--sizes={args.sizes}"]
    passed += [f"--iters={args.iters}", f"--rounds={args.rounds}", "--sample"]
    samples: dict[Path, list[dict[str, list[float]]]] = {tree: [] for tree in trees}
    load_start = os.getloadavg()
    for rep in range(args.reps if args.trees else 1):
        for tree in trees if rep % 2 == 0 else trees[::-1]:
            done = subprocess.run(
                [sys.executable, __file__, *passed], env={**os.environ, "PYTHONPATH": str(tree / "src")},
                capture_output=True, text=True, timeout=3600, check=False,
            )  # fmt: skip
            line = next((x for x in done.stdout.splitlines() if x.startswith("SAMPLE-RESULT ")), None)
            if line is None:
                raise SystemExit(f"{tree}: repetition {rep} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
            samples[tree].append(json.loads(line[len("SAMPLE-RESULT ") :]))
    load_end = os.getloadavg()
    loads = ", ".join(f"{a:.1f} → {b:.1f}" for a, b in zip(load_start, load_end, strict=True))
    print(f"# N={args.world_size}, placement {args.placement}; load average (1, 5, 15 min) {loads}")
    print("# cells: median over repetitions of µs per call (median CPU µs per rank per call); empty/plain: time")
    print(f"| {'tree':<20} | {'size':<8} | {'plain':<20} | {'group.empty':<20} | empty/plain |")
    print(f"|{'-' * 22}|{'-' * 10}|{'-' * 22}|{'-' * 22}|{'-' * 13}|")
    for tree in trees:
        for size in parse_size_range(args.sizes):
            cells = []
            for kind in _KINDS:
                values = [s[f"{kind} {size}"] for s in samples[tree]]
                cells.append([statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)])
            shown = [f"{t * 1e6:,.1f} ({c * 1e6:,.1f})" for t, c in cells]
            ratio = cells[1][0] / cells[0][0]
            print(f"| {tree.name:<20} | {format_bytes(size):<8} | {shown[0]:<20} | {shown[1]:<20} | {ratio:<11.2f} |")


if __name__ == "__main__":
    main()
