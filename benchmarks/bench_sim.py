"""Simulator speed: wall time and peak memory per case, each case in a fresh subprocess.

    .venv/bin/python benchmarks/bench_sim.py            # every case
    .venv/bin/python benchmarks/bench_sim.py --case ring-16k-random

Wall time covers building the topology and the schedule and simulating (fast engine, 1 GiB per GPU); peak
memory is the child's ru_maxrss, which includes the interpreter and numpy (~40 MB). The issue's targets are
printed next to each case, with the ratio time / target (below 1 meets it), and whether the fast engine certified
its result exact (SimResult.exact; see docs/design.md). For orientation, the issue quotes
ASTRA-sim's analytical backend on this machine at 13 CPU-seconds and 355 MB for a 1,024-NPU ring all-reduce
and 571 s and 5.4 GB at 4,096 NPUs (not re-measured here: it is not installed).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    name: str
    topology: str
    algorithm: str
    ranks: int
    placement: str
    group_size: int | None
    target_s: float
    target_bytes: float


GiB = 2**30
CASES = (
    Case("ring-1k-linear", "fat-tree:k=16", "ring", 1024, "linear", None, 1.0, 4e9),
    Case("ring-1k-random", "fat-tree:k=16", "ring", 1024, "random", None, 1.0, 4e9),
    # k=42 holds 18,522 hosts; 16,384 of them run ranks.
    Case("ring-16k-linear", "fat-tree:k=42", "ring", 16384, "linear", None, 10.0, 4e9),
    Case("ring-16k-random", "fat-tree:k=42", "ring", 16384, "random", None, 10.0, 4e9),
    Case("hier-131k-rail", "rail:nodes=16384,gpus=8", "hierarchical", 131072, "linear", 8, 60.0, 4e9),
)


def run_case(case: Case) -> dict[str, object]:
    from allreduce.schedules import all_reduce
    from allreduce.sim import simulate
    from allreduce.topology import parse_topology

    start = time.perf_counter()
    topology = parse_topology(case.topology)
    schedule = all_reduce(case.algorithm, case.ranks, group_size=case.group_size)
    built = time.perf_counter()
    result = simulate(schedule, topology, size_bytes=GiB, placement=case.placement, seed=1, engine="fast")
    done = time.perf_counter()
    top = result.bottlenecks[0] if result.bottlenecks else None
    return {
        "case": case.name,
        "build_s": built - start,
        "sim_s": done - built,
        "wall_s": done - start,
        "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "predicted_s": result.seconds,
        "exact": result.exact,
        "busbw_GBps": result.busbw_Bps / 1e9,
        "bottleneck": f"{top.name} ({top.utilization:.0%})" if top else "-",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=[c.name for c in CASES], help="run one case (in this process)")
    args = parser.parse_args()
    if args.case:
        case = next(c for c in CASES if c.name == args.case)
        print(json.dumps(run_case(case)))
        return 0
    header = (
        f"{'case':<17} {'GPUs':>7} {'placement':<9} {'build':>7} {'simulate':>9} {'wall':>7} {'target':>7} "
        f"{'ratio':>6} {'peak RSS':>9} {'predicted':>10} {'exact':>5} {'busbw':>10}  bottleneck"
    )
    print(header)
    print("-" * len(header))
    for case in CASES:
        proc = subprocess.run(
            [sys.executable, __file__, "--case", case.name], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            print(f"{case.name:<17} failed: {proc.stderr.strip().splitlines()[-1:]}")
            continue
        row = json.loads(proc.stdout)
        wall = float(row["wall_s"])
        peak = float(row["peak_bytes"])
        print(
            f"{case.name:<17} {case.ranks:>7} {case.placement:<9} {row['build_s']:>6.2f}s {row['sim_s']:>8.2f}s "
            f"{wall:>6.2f}s {case.target_s:>6.0f}s {wall / case.target_s:>6.2f} {peak / 1e6:>7.0f}MB "
            f"{float(row['predicted_s']) * 1e3:>8.1f}ms {'yes' if row['exact'] else 'no':>5} "
            f"{float(row['busbw_GBps']):>6.2f}GB/s  {row['bottleneck']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
