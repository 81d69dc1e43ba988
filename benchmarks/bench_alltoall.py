"""all_to_all_single on the "allreduce" torch.distributed backend against Gloo, at 2 and 4 ranks, 1 and 16 MiB.

N processes of this host hold a default "allreduce" group and a Gloo group and take turns in rounds (the order
rotating round by round, so each sees the machine's conditions). Each round times ``--calls`` calls of
``dist.all_to_all_single`` with equal splits of a float32 tensor of SIZE bytes per rank (what each rank sends, all
destinations together); a round's figure is rank 0's median wall time per call, and the CPU time its process spent
(all threads) per call. Three ways are timed: Gloo; allreduce, which runs the pairwise schedule (each rank sends
(N-1)/N of SIZE); and, for comparison, what the backend did before the schedule existed: an all-gather of every
rank's whole input on the allreduce group, of which each rank keeps its parts (N-1 times SIZE received). The table
gives the median over rounds and the ratio to Gloo; the load average is printed with it.

    .venv/bin/python benchmarks/bench_alltoall.py [--ranks 2 4] [--sizes 1MiB 16MiB] [--rounds 6] [--calls 10]
        [--transport shm|tcp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

WAYS = ("gloo", "allreduce", "all-gather")
MiB = 1 << 20


def _all_gather_emulation(out: Any, local: Any, world_size: int, rank: int) -> None:
    """The backend's old all_to_all_single: every rank's input all-gathered, this rank's parts kept."""
    import torch.distributed as dist

    import torch

    gathered = torch.empty(local.numel() * world_size, dtype=local.dtype)
    dist.all_gather_single(gathered, local)
    part = local.numel() // world_size
    rows = gathered.view(world_size, world_size, part)
    out.view(world_size, part).copy_(rows[:, rank])


def _time_calls(way: str, groups: dict[str, Any], size_bytes: int, calls: int) -> tuple[float, float]:
    """Rank 0's median wall time and mean CPU time (its process, all threads) per call."""
    import torch.distributed as dist

    import torch

    world_size, rank = dist.get_world_size(), dist.get_rank()
    local = torch.full((size_bytes // 4,), float(rank))
    out = torch.empty_like(local)
    walls = []
    cpu_started = time.process_time()
    for _ in range(calls):
        dist.barrier(group=groups[way])
        started = time.perf_counter()
        if way == "all-gather":
            _all_gather_emulation(out, local, world_size, rank)
        else:
            dist.all_to_all_single(out, local, group=groups[way])
        walls.append(time.perf_counter() - started)
    return statistics.median(walls), (time.process_time() - cpu_started) / calls


def _rank(sizes: list[int], rounds: int, calls: int) -> dict[int, dict[str, list[tuple[float, float]]]]:
    import torch.distributed as dist

    import allreduce.torch  # noqa: F401

    dist.init_process_group("allreduce")
    groups = {"allreduce": None, "all-gather": None, "gloo": dist.new_group(backend="gloo")}
    figures: dict[int, dict[str, list[tuple[float, float]]]] = {s: {w: [] for w in WAYS} for s in sizes}
    for size in sizes:
        for way in WAYS:  # warm up: connections, first-call costs
            _time_calls(way, groups, size, 2)
        for round_ in range(rounds):
            shift = round_ % len(WAYS)
            for way in WAYS[shift:] + WAYS[:shift]:
                figures[size][way].append(_time_calls(way, groups, size, calls))
    dist.barrier()
    dist.destroy_process_group()
    return figures


def _bytes(text: str) -> int:
    from allreduce.units import parse_bytes

    return int(parse_bytes(text, what="--sizes"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=_bytes, nargs="+", default=[MiB, 16 * MiB])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--transport", choices=["shm", "tcp"], default="shm", help="the backend's collectives")
    args = parser.parse_args()
    from allreduce.runtime import spawn

    load_before = os.getloadavg()[0]
    env = {"OMP_NUM_THREADS": "1", "ALLREDUCE_TRANSPORT": args.transport}
    print(f"all_to_all_single, float32, equal splits; {args.rounds} rounds of {args.calls} calls; rank 0's median "
          f"per call; allreduce over {args.transport}")  # fmt: skip
    print(f"{'ranks':>5} {'size':>7} {'way':<11} {'ms/call':>8} {'/Gloo':>6} {'CPU ms/call':>12} {'/Gloo':>6}")
    for world_size in args.ranks:
        figures = spawn(world_size, _rank, args.sizes, args.rounds, args.calls, group=False, timeout_s=3600, env=env)
        for size in args.sizes:
            medians = {w: [statistics.median(f[i] for f in figures[0][size][w]) for i in (0, 1)] for w in WAYS}
            gloo_wall, gloo_cpu = medians["gloo"]
            for way in WAYS:
                wall, cpu = medians[way]
                print(
                    f"{world_size:>5} {size // MiB:>4} MiB {way:<11} {wall * 1e3:>8.2f} {wall / gloo_wall:>5.2f}x "
                    f"{cpu * 1e3:>12.2f} {cpu / gloo_cpu:>5.2f}x"
                )
    print(f"load average (1-min): {load_before:.2f} at the start, {os.getloadavg()[0]:.2f} at the end, "
          f"{os.cpu_count()} cores")  # fmt: skip


if __name__ == "__main__":
    main()
