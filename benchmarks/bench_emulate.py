"""The simulator against real TCP: a standard suite of emulated clusters, measured and predicted side by side.

    sudo .venv/bin/python benchmarks/bench_emulate.py [--rate 200Mbps] [--reps 3] [--sizes 1MiB,8MiB,32MiB]
                                                      [--only CASE] [--congestion cubic] [--json FILE]

Each case builds its cluster as network namespaces (see `allreduce emulate`), runs all-reduce with the real
runtime over TCP at every size, and prints the slowest rank's median time beside the simulator's prediction for
the same topology, placement and emulated rates, with the ratio; then the summary the goal is stated in: median
|measured/predicted - 1| and the worst case, and whether the link the counters show busiest is one the simulator
names as a bottleneck. Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

from allreduce.emulate import DEFAULT_CONGESTION, EmulationSpec, check_privileges, run, running
from allreduce.units import format_bytes, format_seconds, parse_bandwidth, parse_size_range


@dataclass(frozen=True)
class Case:
    name: str
    topology: str
    algorithm: str = "ring"
    placement: str | tuple[int, ...] = "linear"
    degrade: tuple[tuple[str, float], ...] = ()


CLOS_1_1 = "clos:leaves=2,spines=2,hosts_per_leaf=4"
CLOS_4_1 = "clos:leaves=2,spines=2,hosts_per_leaf=4,oversub=4"
INTERLEAVED = (0, 4, 1, 5, 2, 6, 3, 7)  # neighbours in the ring sit on different leaves: every hop crosses a spine

CASES = (
    Case("ring, 1:1 Clos, linear", CLOS_1_1),
    Case("ring, 1:1 Clos, interleaved", CLOS_1_1, placement=INTERLEAVED),
    Case("ring, 4:1 Clos, linear", CLOS_4_1),
    Case("ring, 4:1 Clos, interleaved", CLOS_4_1, placement=INTERLEAVED),
    Case("halving-doubling, 1:1 Clos", CLOS_1_1, algorithm="halving_doubling"),
    Case("halving-doubling, 4:1 Clos", CLOS_4_1, algorithm="halving_doubling"),
    Case("ring, 1:1 Clos, gpu0 link at 10%", CLOS_1_1, degrade=(("gpu0<->leaf0", 0.1),)),
    Case("ring, 4 hosts, 2 spines (ECMP)", "clos:leaves=2,spines=2,hosts_per_leaf=2"),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="200Mbps", help="shaped rate of the fastest host link")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sizes", default="1MiB,8MiB,32MiB")
    parser.add_argument("--only", help="run the cases whose name contains this text")
    parser.add_argument(
        "--congestion",
        default=DEFAULT_CONGESTION,
        help="TCP congestion control of the ranks (default %(default)s; 'default': the kernel's)",
    )
    parser.add_argument("--json", help="write every row to this file")
    args = parser.parse_args()
    check_privileges()
    rate_bps = parse_bandwidth(args.rate) * 8
    sizes = parse_size_range(args.sizes)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"# load average at start: {load}; rate {args.rate}; congestion control {args.congestion}")
    header = f"{'case':<36} {'size':>8} {'measured':>10} {'predicted':>10} {'ECMP luck':>19} {'ratio':>6} {'exact':>5} "
    print(header + f"{'busiest link':<14} {'sim bottleneck':<14} {'agree':>5} {'paths':>6} {'retrans':>7}")
    rows = []
    started = time.monotonic()
    for case in CASES:
        if args.only and args.only not in case.name:
            continue
        spec = EmulationSpec(case.topology, name="bench", rate_bps=rate_bps, degrade=case.degrade)
        with running(spec) as built:
            placement = case.placement if isinstance(case.placement, str) else ",".join(map(str, case.placement))
            result = run(built, algorithm=case.algorithm, sizes=sizes, reps=args.reps, placement=case.placement,
                         congestion=args.congestion)  # fmt: skip
        for row in result.rows:
            bottlenecks = row.predicted_bottleneck
            print(
                f"{case.name:<36} {format_bytes(row.size_bytes):>8} {format_seconds(row.median_s):>10} "
                f"{format_seconds(row.predicted_s):>10} "
                f"{format_seconds(row.predicted_range_s[0]) + '-' + format_seconds(row.predicted_range_s[1]):>19} "
                f"{row.ratio:>6.3f} {'yes' if row.exact else 'NO':>5} "
                f"{row.busiest_link:<14} {bottlenecks:<14} {'yes' if row.bottleneck_agrees else 'no':>5} "
                f"{'kernel' if row.paths == 'kernel' else 'seed':>6} {row.retransmissions:>7}",
                flush=True,
            )
        rows.extend({"case": case.name, "placement": placement, **entry} for entry in result.to_json()["rows"])
    errors = [abs(r["ratio"] - 1) for r in rows]
    within5 = sum(e <= 0.05 for e in errors)
    within15 = sum(e <= 0.15 for e in errors)
    agree = sum(bool(r["bottleneck_agrees"]) for r in rows)
    print(
        f"# {len(rows)} rows in {time.monotonic() - started:.0f} s; median |measured/predicted - 1| = "
        f"{100 * statistics.median(errors):.1f}%, worst {100 * max(errors):.1f}%; {within5} within 5%, "
        f"{within15} within 15%; bottleneck agrees on {agree}; load average at end: "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
