"""Topology build and routing at scale: wall time and peak memory per case.

Cases: ring flows (rank r -> r+1) on fat-trees of 1,024 and 16,384 GPUs under ECMP hashing, with linear and
random placement (and spraying), and the flows of every phase of hierarchical all-reduce on a 131,072-GPU
rail-optimized cluster. The peer measured in the same run is our own graph-search routing (the path every
file-defined topology takes: a vectorised BFS per destination batch) on the same graph with its structure
hidden, as a ratio to the arithmetic routing of the structured builder.

A second table fails the busiest switch-to-switch link and times routing the same flows again (only the flows
that crossed it are searched anew).

Each case runs in a fresh subprocess so its peak memory is its own: tracemalloc's peak of what the case
allocates (numpy buffers included, measured in a second, traced run) and the process's max RSS above its
baseline after imports.

    .venv/bin/python benchmarks/bench_topology.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASE = r"""
import dataclasses, json, resource, sys, time, tracemalloc
import numpy as np
from allreduce.schedules import hierarchical_all_reduce
from allreduce.topology import fat_tree, place, rail_optimized, route

name, placement, routing, search = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "search"
traced = sys.argv[5] == "traced"
base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if traced:
    tracemalloc.start()
t0 = time.perf_counter()
if name.startswith("fat-tree"):
    k, ranks = (16, 1024) if name == "fat-tree-1k" else (42, 16384)
    topology = fat_tree(k)
    patterns = None
else:
    topology = rail_optimized(16384, 8)
    ranks = 131072
if search:
    topology = dataclasses.replace(topology, structure=None)
t1 = time.perf_counter()
gpu = place(ranks, topology, placement, seed=1)
if name.startswith("fat-tree"):
    pairs = [(gpu, np.roll(gpu, -1))]
else:
    pairs = [(gpu[p.src], gpu[p.dst]) for p in hierarchical_all_reduce(ranks, 8).phases()]
flows = entries = 0
max_load = 0.0
for src, dst in pairs:
    r = route(topology, src, dst, routing=routing, seed=0)
    flows += r.num_flows
    entries += r.link.size
    max_load = max(max_load, float(r.link_load(topology.num_links).max()))
t2 = time.perf_counter()
reroute_s = rerouted = None
if sys.argv[6] == "fail":
    # Fail the busiest switch-to-switch link of the last pattern and route that pattern again.
    switch = topology.node_kind[topology.link_src] == 2
    switch &= topology.node_kind[topology.link_dst] == 2
    load = r.link_load(topology.num_links)
    victim = int(np.flatnonzero(switch)[np.argmax(load[switch])])
    failed = topology.without([victim])
    t3 = time.perf_counter()
    again = route(failed, src, dst, routing=routing, seed=0)
    reroute_s = time.perf_counter() - t3
    rerouted = int(load[victim])
peak = tracemalloc.get_traced_memory()[1] if traced else 0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"build_s": t1 - t0, "route_s": t2 - t1, "gpus": topology.num_gpus, "links": topology.num_links,
                  "patterns": len(pairs), "flows": flows, "entries": entries, "max_load": max_load,
                  "peak_MB": peak / 1e6, "rss_MB": (rss - base_rss) / 1e3,
                  "reroute_s": reroute_s, "rerouted": rerouted}))
"""


def run(name: str, placement: str, routing: str, mode: str, *, traced: bool, fail: bool = False) -> dict[str, float]:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            CASE,
            name,
            placement,
            routing,
            mode,
            "traced" if traced else "plain",
            "fail" if fail else "intact",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, float] = json.loads(out.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 131,072-GPU case and the spraying cases")
    args = parser.parse_args()
    cases = [
        ("fat-tree-1k", "linear", "ecmp"),
        ("fat-tree-1k", "random", "ecmp"),
        ("fat-tree-1k", "random", "spray"),
        ("fat-tree-16k", "linear", "ecmp"),
        ("fat-tree-16k", "random", "ecmp"),
    ]
    if not args.quick:
        cases += [("fat-tree-16k", "random", "spray"), ("rail-131k", "linear", "ecmp")]
    header = (
        f"{'case':<14} {'placement':<9} {'routing':<8} {'GPUs':>7} {'links':>9} {'flows':>8} {'entries':>10} "
        f"{'max load':>8} {'build s':>8} {'route s':>8} {'peak MB':>8} {'RSS MB':>7} {'search s':>9} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for name, placement, routing in cases:
        plain = run(name, placement, routing, "arithmetic", traced=False)
        traced = run(name, placement, routing, "arithmetic", traced=True)
        search_s, ratio = "", ""
        if name == "fat-tree-1k":
            peer = run(name, placement, routing, "search", traced=False)
            search_s = f"{peer['route_s']:.3f}"
            ratio = f"{peer['route_s'] / plain['route_s']:.0f}x"
        print(
            f"{name:<14} {placement:<9} {routing:<8} {plain['gpus']:>7} {plain['links']:>9} {plain['flows']:>8} "
            f"{plain['entries']:>10} {plain['max_load']:>8.3g} {plain['build_s']:>8.3f} {plain['route_s']:>8.3f} "
            f"{traced['peak_MB']:>8.0f} {plain['rss_MB']:>7.0f} {search_s:>9} {ratio:>6}"
        )
    print()
    print("after one failed link (the busiest switch-to-switch link of the last pattern), routing that pattern again:")
    header = f"{'case':<14} {'placement':<9} {'routing':<8} {'flows on the failed link':>24} {'re-route s':>10}"
    print(header)
    print("-" * len(header))
    fail_cases = [("fat-tree-16k", "random", "ecmp")]
    if not args.quick:
        fail_cases.append(("rail-131k", "random", "ecmp"))
    for name, placement, routing in fail_cases:
        result = run(name, placement, routing, "arithmetic", traced=False, fail=True)
        print(f"{name:<14} {placement:<9} {routing:<8} {result['rerouted']:>24.0f} {result['reroute_s']:>10.3f}")


if __name__ == "__main__":
    main()
