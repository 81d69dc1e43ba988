"""How compact the schedules are at scale: build time, flow-pattern read time and peak memory per case.

Each case runs in a fresh subprocess so its peak memory is its own. Peak memory is measured two ways:
tracemalloc's peak of the allocations the case makes (numpy buffers included), and the process's max RSS above its
baseline after imports.

    .venv/bin/python benchmarks/bench_schedules.py [--ranks 131072]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASE = r"""
import json, resource, sys, time, tracemalloc
import numpy as np
from allreduce import schedules as S
name, n = sys.argv[1], int(sys.argv[2])
base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tracemalloc.start()
t0 = time.perf_counter()
if name == "hierarchical":
    s = S.hierarchical_all_reduce(n, 8)
elif name == "double_binary_tree":
    s = S.double_binary_tree_all_reduce(n, 8)
else:
    s = S.all_reduce(name, n)
t1 = time.perf_counter()
phases = list(s.phases())
flows = sum(len(p) for p in phases)
t2 = time.perf_counter()
t3 = None
if name in ("ring", "hierarchical", "halving_doubling"):
    S.predict_seconds = getattr(S, "predict_seconds", None)
    from allreduce.schedules._cost import predict_seconds
    predict_seconds(s, 2**30, S.CostModel(latency_s=5e-6, bandwidth_Bps=50e9))
    t3 = time.perf_counter()
_, peak = tracemalloc.get_traced_memory()
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"build_s": t1 - t0, "phases_s": t2 - t1, "predict_s": None if t3 is None else t3 - t2,
                  "phases": len(phases), "flows": flows, "steps": s.num_steps, "streams": len(s.streams),
                  "peak_MB": peak / 1e6, "rss_MB": (rss - base_rss) / 1e3}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=131_072)
    args = parser.parse_args()
    n = args.ranks
    print(f"Schedules for N = {n:,} ranks (each case in a fresh process)\n")
    header = (
        f"{'algorithm':<20} {'steps':>8} {'streams':>9} {'phases':>7} {'flows':>10} {'build':>8} "
        f"{'phases()':>9} {'total':>8} {'predict':>9} {'peak (tracemalloc)':>19} {'+RSS':>8}"
    )
    print(header)
    print("-" * len(header))
    for name in ("ring", "halving_doubling", "recursive_doubling", "double_binary_tree", "hierarchical"):
        out = subprocess.run([sys.executable, "-c", CASE, name, str(n)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout)
        predict = "-" if r["predict_s"] is None else f"{r['predict_s']:.3f} s"
        print(
            f"{name:<20} {r['steps']:>8,} {r['streams']:>9,} {r['phases']:>7,} {r['flows']:>10,} "
            f"{r['build_s']:>6.3f} s {r['phases_s']:>7.3f} s {r['build_s'] + r['phases_s']:>6.3f} s {predict:>9} "
            f"{r['peak_MB']:>16.1f} MB {r['rss_MB']:>5.0f} MB"
        )
    print("\nTarget (issue #2): ring for 131,072 ranks built and its flow pattern read in < 1 s and < 200 MB.")


if __name__ == "__main__":
    main()
