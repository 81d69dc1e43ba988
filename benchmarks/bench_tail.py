"""Speed of the tail Monte Carlo (``allreduce.sim.simulate_tail``): wall time and peak memory per case.

Each case runs in a fresh process (so its peak resident memory is its own) and prints one row: wall time,
and CPU time of the simulation (what the wall time would be on an idle core; the machine is shared), between
the load averages before and after. The
targets: 1,000 samples of a 1 GiB ring on a 1,024-GPU fat-tree with loss and jitter <= 10 s; 100 samples at
16,384 GPUs <= 60 s; 20 samples at 131,072 GPUs (hierarchical on a rail-optimised fabric) <= 120 s and
<= 4 GB. Run: ``PYTHONPATH=src python benchmarks/bench_tail.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

GIB = 2**30
# (label, topology spec, ranks, algorithm, samples, noise) - noise: "loss+jitter" steps every transfer with
# RoCE loss 1e-6 per packet per link and lognormal compute jitter per rank; "jitter+ecmp" is compute jitter and
# 8 ECMP seeds (the max-plus sensitivity method).
CASES = [
    ("1,024 GPUs, ring", "fat-tree:k=16", 1024, "ring", 1000, "loss+jitter"),
    ("1,024 GPUs, ring, no attribution", "fat-tree:k=16", 1024, "ring", 1000, "loss+jitter-noblame"),
    ("1,024 GPUs, ring", "fat-tree:k=16", 1024, "ring", 1000, "jitter+ecmp"),
    ("16,384 GPUs, hierarchical", "rail:nodes=2048,gpus=8", 16384, "hierarchical", 100, "loss+jitter"),
    (
        "16,384 GPUs, hierarchical, no attr.",
        "rail:nodes=2048,gpus=8",
        16384,
        "hierarchical",
        100,
        "loss+jitter-noblame",
    ),
    ("16,384 GPUs, ring", "fat-tree:k=42", 16384, "ring", 100, "jitter+ecmp"),
    ("131,072 GPUs, hierarchical", "rail:nodes=16384,gpus=8", 131072, "hierarchical", 20, "jitter+ecmp"),
    (
        "131,072 GPUs, hierarchical, no attr.",
        "rail:nodes=16384,gpus=8",
        131072,
        "hierarchical",
        20,
        "loss+jitter-noblame",
    ),
]
QUICK = [c for c in CASES if c[2] <= 1024]
# --exact: every sample exact (engine "auto" with an unlimited --exact-budget), 64 MiB, random placement, RoCE
# loss 1e-6 and the same rank jitter: the samples the fast engine cannot certify are re-run by the event engine.
EXACT_CASES = [
    ("1,024 GPUs, halving-doubling, exact", "fat-tree:k=16", 1024, "halving_doubling", 1000, "exact"),
    ("1,024 GPUs, double binary tree, exact", "fat-tree:k=16", 1024, "double_binary_tree", 1000, "exact"),
]


def run_case(topology: str, ranks: int, algorithm: str, samples: int, noise: str) -> dict[str, object]:
    from allreduce.schedules import all_reduce
    from allreduce.sim import LossModel, TailConfig, parse_distribution, simulate_tail
    from allreduce.topology import parse_topology

    topo = parse_topology(topology)
    schedule = (
        all_reduce(algorithm, ranks, group_size=8) if algorithm == "hierarchical" else all_reduce(algorithm, ranks)
    )
    jitter = parse_distribution("lognormal:median=100us,p99=1ms")
    size, placement, budget = GIB, "linear", 60.0
    if noise == "exact":
        config = TailConfig(samples=samples, seed=1, loss=LossModel(1e-6), rank_jitter=jitter)
        size, placement, budget = 64 * 2**20, "random", 1e6
    elif noise.startswith("loss+jitter"):
        config = TailConfig(
            samples=samples, seed=1, loss=LossModel(1e-6), rank_jitter=jitter, attribution=not noise.endswith("noblame")
        )
    else:
        config = TailConfig(samples=samples, seed=1, rank_jitter=jitter, ecmp_seeds=8)
    started = time.perf_counter()
    cpu_before = resource.getrusage(resource.RUSAGE_SELF).ru_utime
    result = simulate_tail(schedule, topo, size_bytes=size, config=config, placement=placement, exact_budget_s=budget)
    seconds = time.perf_counter() - started
    p = result.percentiles()
    return {
        "seconds": seconds,
        "cpu_s": resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu_before,
        "peak_GB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        "engine": result.engine,
        "p50_s": p["p50"],
        "p99_s": p["p99"],
        "free_s": result.baseline_s,
        "by_engine": result.engine_counts(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="only the 1,024-GPU cases")
    parser.add_argument("--exact", action="store_true", help="instead: 1,024 GPUs with every sample exact")
    parser.add_argument("--case", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cases = EXACT_CASES if args.exact else CASES
    if args.case is not None:
        _, topology, ranks, algorithm, samples, noise = cases[args.case]
        print(json.dumps(run_case(topology, ranks, algorithm, samples, noise)))
        return
    print(f"load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
    header = (
        f"{'case':<34} {'noise':<20} {'samples':>7} {'method':<11} {'wall':>8} {'cpu':>8} {'peak':>8} "
        f"{'noise-free':>10} {'p50':>9} {'p99':>9}"
    )
    print(header)
    for index, (label, _, _, _, samples, noise) in enumerate(cases):
        if args.quick and cases[index] not in QUICK:
            continue
        argv = [sys.executable, __file__, "--case", str(index), *(["--exact"] if args.exact else [])]
        out = subprocess.run(argv, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(f"{label:<34} {noise:<20} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        row = json.loads(out.stdout)
        print(
            f"{label:<34} {noise:<20} {samples:>7} {row['engine']:<11} {row['seconds']:>7.1f}s {row['cpu_s']:>7.1f}s "
            f"{row['peak_GB']:>6.2f}GB {row['free_s'] * 1e3:>8.2f}ms {row['p50_s'] * 1e3:>7.1f}ms "
            f"{row['p99_s'] * 1e3:>7.1f}ms {row['by_engine']}",
            flush=True,
        )
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")


if __name__ == "__main__":
    main()
