"""Runtime statistics: the cost of recording, on vs off in one run, at 4 KiB, 1 MiB and 64 MiB, N = 2 and 4.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_stats.py [--transports shm,tcp] [--world-sizes 2,4]
                                                          [--sizes 4KiB,1MiB,64MiB] [--rounds 30]

Every rank alternates recording on and off call by call (``transport.recorder.enabled``), so load from other
jobs hurts both alike. The table shows rank 0's median time per call with recording on and off, their ratio, and
an A/A ratio (the off calls 1, 5, 9, ... over the off calls 3, 7, 11, ...): the noise floor of the comparison.
The last column is what the records alone cost: the measured cost of one record (a ring all-reduce records
2(N-1) per call) over the median all-reduce time; the difference to on/off is the rest of the instrumented path
(clock reads, the call records, tcp's per-step bookkeeping) and, with more ranks than cores, its cost to peers.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

from allreduce.runtime import spawn
from allreduce.runtime._stats import Recorder
from allreduce.units import format_bytes, parse_size_range

_BATCH_S = 0.05
"""Target length of one batch: long enough to average many calls, short enough for many alternations."""


def _rank(group: Any, sizes: list[int], rounds: int) -> list[tuple[float, float, float]]:
    recorder = group.transport.recorder  # toggled per call: the group's setter would add a queue round trip
    out = []
    for size in sizes:
        x = np.zeros(size // 4, np.float32)
        for _ in range(3):
            group.all_reduce(x, algorithm="ring")
        start = time.perf_counter()
        group.all_reduce(x, algorithm="ring")
        # every rank must run the same number of calls: rank 0 decides and tells the others
        iters_arr = np.array([max(4, int(_BATCH_S / max(time.perf_counter() - start, 1e-6)))], np.float64)
        group.broadcast(iters_arr)
        calls = 4 * (int(iters_arr[0]) * rounds // 4)
        times = np.empty(calls)
        clock = time.perf_counter
        for i in range(calls):
            recorder.enabled = i % 2 == 0
            t0 = clock()
            group.all_reduce(x, algorithm="ring")
            times[i] = clock() - t0
        recorder.enabled = False
        on, off = float(np.median(times[0::2])), float(np.median(times[1::2]))
        same = float(np.median(times[1::4]) / np.median(times[3::4]))
        out.append((on, off, same))
    return out


def _record_cost_s(records: int = 200_000) -> float:
    """What the shm path adds per received transfer: three clock reads and one record."""
    recorder = Recorder()
    transfer = recorder.transfer
    clock = time.perf_counter_ns
    start = time.perf_counter()
    for i in range(records):
        a = clock()
        b = clock()
        transfer(i, 1, 2, a, b - a, clock() - b, 4096)
    return (time.perf_counter() - start) / records


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--sizes", default="4KiB,1MiB,64MiB")
    parser.add_argument("--rounds", type=int, default=30, help="batches of ~50 ms worth of calls, per mode")
    args = parser.parse_args()
    sizes = parse_size_range(args.sizes)
    per_record_s = _record_cost_s()
    print(f"one record (three clock reads + the ring store): {per_record_s * 1e9:.0f} ns")
    print(
        f"{'transport':>9} {'N':>3} {'size':>9} {'on':>11} {'off':>11} {'on/off':>7} {'A/A':>7} {'records':>8} "
        f"{'records alone':>13}"
    )
    for transport in args.transports.split(","):
        for world_size in (int(w) for w in args.world_sizes.split(",")):
            results = spawn(world_size, _rank, sizes, args.rounds, init_options={"transport": transport})
            for size, (on_s, off_s, same) in zip(sizes, results[0], strict=True):
                records = 2 * (world_size - 1)
                modelled = records * per_record_s / off_s
                print(
                    f"{transport:>9} {world_size:>3} {format_bytes(size):>9} {on_s * 1e6:>9.1f}us "
                    f"{off_s * 1e6:>9.1f}us {on_s / off_s:>7.3f} {same:>7.3f} {records:>8} {modelled * 100:>12.3f}%"
                )
    print(f"load average (1, 5, 15 min): {os.getloadavg()}")


if __name__ == "__main__":
    main()
