"""TCP transport vs torch.distributed Gloo, over loopback, measured in the same run (alternating per repetition).

    .venv/bin/python benchmarks/bench_tcp.py [-n 2] [--sizes 4KiB,1MiB,16MiB,64MiB,256MiB] [--reps 5]

Prints, per size: the median time and busbw of allreduce's TCP transport (ring and the best other algorithm)
and of Gloo, and the ratio; then the median CPU time (user + system, all threads of a rank) per all-reduce, which
on a loaded machine decides the wall time more than anything else. float32 sum, in place.
busbw = S/t * 2(N-1)/N (nccl-tests convention). The header gives the load average.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from typing import Any

import numpy as np

from allreduce.runtime import compile_plan
from allreduce.runtime._spawn import new_token, spawn
from allreduce.runtime._store import TCPStore
from allreduce.runtime.tcp import TcpTransport
from allreduce.schedules import all_reduce
from allreduce.units import format_bytes, parse_bytes

ALGORITHMS = ("ring", "halving_doubling")


def _rank_main(store_port: int, sizes: list[int], reps: int, segments: int) -> list[Any]:
    import torch.distributed as dist

    import torch

    dist.init_process_group("gloo", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store = TCPStore("127.0.0.1", store_port, is_server=False, world_size=world_size, rank=rank, timeout_s=300)
    transport = TcpTransport(rank, world_size, store, timeout_s=300)
    seq = 0

    def add_into(dst: np.ndarray, src: np.ndarray) -> None:
        np.add(dst, src, out=dst)

    rows = []
    for size in sizes:
        count = size // 4
        ours = np.ones(count, np.float32)
        theirs = torch.ones(count, dtype=torch.float32)
        plans = {a: compile_plan(all_reduce(a, world_size, segments=segments), rank, count) for a in ALGORITHMS}
        times: dict[str, list[float]] = {name: [] for name in (*ALGORITHMS, "gloo")}
        cpu_times: dict[str, list[float]] = {name: [] for name in (*ALGORITHMS, "gloo")}
        for rep in range(reps + 1):  # the first repetition warms up connections and buffers
            for name in (*ALGORITHMS, "gloo"):
                dist.barrier()
                start = time.perf_counter()
                usage = resource.getrusage(resource.RUSAGE_SELF)
                if name == "gloo":
                    dist.all_reduce(theirs)
                else:
                    seq += 1
                    transport.execute(plans[name], ours, add_into, seq=seq, timeout_s=300, checksum=False)
                elapsed = time.perf_counter() - start
                after = resource.getrusage(resource.RUSAGE_SELF)
                if rep:
                    times[name].append(elapsed)
                    cpu_times[name].append(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime)
        # Everything reduced is exact in float32 (small integers), so check it.
        expected = float(world_size) ** (2 * (reps + 1))
        wrong = int(np.count_nonzero(ours != expected))
        if wrong:
            raise RuntimeError(f"rank {rank}: {wrong} wrong elements at size {size}")
        rows.append(
            (
                size,
                {name: statistics.median(ts) for name, ts in times.items()},
                {name: statistics.median(ts) for name, ts in cpu_times.items()},
            )
        )
    transport.close()
    store.close()
    dist.destroy_process_group()
    # The parent reports the slowest rank's median: a collective is done when its last rank is.
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--sizes", default="4KiB,1MiB,16MiB,64MiB,256MiB")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--segments", type=int, default=1)
    args = parser.parse_args()
    sizes = [int(parse_bytes(s)) for s in args.sizes.split(",")]
    token = new_token()
    server = TCPStore("127.0.0.1", 0, is_server=True, world_size=args.n, rank=-1, timeout_s=300, token=token)
    results = spawn(
        args.n,
        _rank_main,
        server.port,
        sizes,
        args.reps,
        args.segments,
        group=False,
        timeout_s=3600,
        env={"ALLREDUCE_TOKEN": token},
    )
    server.close()
    bus = 2 * (args.n - 1) / args.n
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"TCP over loopback, N={args.n}, float32 sum, median of {args.reps} (slowest rank), segments={args.segments}, "
        f"load average {load}"
    )
    header = f"{'size':>9} | " + " | ".join(f"{n + ' µs':>22} {'busbw GB/s':>10}" for n in (*ALGORITHMS, "gloo"))
    print(header + " | best/gloo")
    print("-" * len(header) + "-+----------")
    for i, size in enumerate(sizes):
        worst = {name: max(r[i][1][name] for r in results) for name in (*ALGORITHMS, "gloo")}
        cells = []
        for name in (*ALGORITHMS, "gloo"):
            busbw = size / worst[name] * bus / 1e9 if args.n > 1 else float("nan")
            cells.append(f"{worst[name] * 1e6:>22.0f} {busbw:>10.2f}")
        best = min(worst[a] for a in ALGORITHMS)
        print(f"{format_bytes(size):>9} | " + " | ".join(cells) + f" | {worst['gloo'] / best:>8.2f}×")
    print("CPU time per all-reduce, median, busiest rank (ms):")
    print(f"{'size':>9} | " + " | ".join(f"{name:>16}" for name in (*ALGORITHMS, "gloo")))
    for i, size in enumerate(sizes):
        cpu = {name: max(r[i][2][name] for r in results) for name in (*ALGORITHMS, "gloo")}
        print(f"{format_bytes(size):>9} | " + " | ".join(f"{cpu[name] * 1e3:>16.1f}" for name in (*ALGORITHMS, "gloo")))


if __name__ == "__main__":
    main()
