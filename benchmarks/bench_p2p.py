"""Point-to-point on the "allreduce" torch.distributed backend against Gloo: ping-pong latency and bandwidth.

Two ranks (processes of this host) hold both a default "allreduce" group and a Gloo group and take turns in
rounds (the order alternating round by round, so both see the machine's conditions). ``ping-pong``: rank 0 sends
a 4-byte tensor, rank 1 sends it back; half the median round trip is the one-way latency. ``16 MiB``: rank 0
sends 16 MiB, rank 1 answers with 4 bytes once it has them all; the median time of that is the transfer time,
and 16 MiB over it the bandwidth. The table gives each figure, per backend, the median over rounds and the
ratio to Gloo; the load average is printed with it.

    .venv/bin/python benchmarks/bench_p2p.py [--rounds 6] [--pings 200] [--transfers 20] [--transport shm|tcp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

BACKENDS = ("gloo", "allreduce")
BIG_BYTES = 16 << 20


def _round_trips(group: Any, rank: int, out_bytes: int, repeats: int) -> float:
    """The median time of: rank 0 sends ``out_bytes``, rank 1 answers with 4 bytes once it has them all."""
    import torch.distributed as dist

    import torch

    out, back = torch.ones(out_bytes // 4), torch.zeros(1)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        if rank == 0:
            dist.send(out, 1, group=group)
            dist.recv(back, 1, group=group)
        else:
            dist.recv(out, 0, group=group)
            dist.send(back, 0, group=group)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _rank(rounds: int, pings: int, transfers: int) -> dict[str, dict[str, list[float]]]:
    import torch.distributed as dist

    import allreduce.torch  # noqa: F401

    dist.init_process_group("allreduce")
    rank = dist.get_rank()
    groups = {"allreduce": None, "gloo": dist.new_group(backend="gloo")}
    figures: dict[str, dict[str, list[float]]] = {b: {"latency_s": [], "transfer_s": []} for b in BACKENDS}
    for backend in BACKENDS:  # warm up: connections, first-call costs
        _round_trips(groups[backend], rank, 4, 10)
        _round_trips(groups[backend], rank, BIG_BYTES, 2)
    for round_ in range(rounds):
        for backend in BACKENDS if round_ % 2 == 0 else BACKENDS[::-1]:
            figures[backend]["latency_s"].append(_round_trips(groups[backend], rank, 4, pings) / 2)
            figures[backend]["transfer_s"].append(_round_trips(groups[backend], rank, BIG_BYTES, transfers))
    dist.barrier()
    dist.destroy_process_group()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--rounds", 6), ("--pings", 200), ("--transfers", 20)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--transport", choices=["shm", "tcp"], default="shm", help="the backend's collectives")
    args = parser.parse_args()
    from allreduce.runtime import spawn

    load_before = os.getloadavg()[0]
    env = {"OMP_NUM_THREADS": "1", "ALLREDUCE_TRANSPORT": args.transport}
    figures = spawn(2, _rank, args.rounds, args.pings, args.transfers, group=False, timeout_s=1800, env=env)[0]
    medians = {b: {k: statistics.median(v) for k, v in figures[b].items()} for b in BACKENDS}
    gloo = medians["gloo"]
    print(f"2 ranks, {args.rounds} rounds ({args.pings} ping-pongs, {args.transfers} transfers of 16 MiB each)")
    print(f"{'backend':<10} {'one-way latency':>16} {'16 MiB send':>12} {'bandwidth':>11} {'latency/Gloo':>13} "
          f"{'16 MiB/Gloo':>12}")  # fmt: skip
    for backend in BACKENDS:
        m = medians[backend]
        print(
            f"{backend:<10} {m['latency_s'] * 1e6:>13.1f} µs {m['transfer_s'] * 1e3:>9.2f} ms "
            f"{BIG_BYTES / m['transfer_s'] / 1e9:>6.2f} GB/s {m['latency_s'] / gloo['latency_s']:>12.2f}x "
            f"{m['transfer_s'] / gloo['transfer_s']:>11.2f}x"
        )
    print(f"load average (1-min): {load_before:.2f} at the start, {os.getloadavg()[0]:.2f} at the end, "
          f"{os.cpu_count()} cores")  # fmt: skip


if __name__ == "__main__":
    main()
