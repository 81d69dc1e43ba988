"""Planner and sweep speed: `allreduce plan` at 1,024 GPUs, its scaling table to 131,072, and a 1,000-case sweep.

    .venv/bin/python benchmarks/bench_plan.py [--skip plan,scaling,local,dask] [--workers 2]
    .venv/bin/python benchmarks/bench_plan.py --skip local,dask --before OTHER/src --rounds 3
    .venv/bin/python benchmarks/bench_plan.py --store [--store-clients 4]

Rows: wall time and CPU time (of this process and its children) of

- `plan` for Llama-2-7B on 1,024 GPUs of a k=16 fat tree with its what-if table, its scaling table and goodput
  under failures (auto algorithm);
- `plan --algorithm ring --no-what-if` on 131,072 GPUs of a k=82 fat tree (the scaling table from 8 GPUs, with
  each row's goodput);
- the same 1,000-case sweep (5 GPU counts x 5 bucket caps x 5 model sizes x 2 dtypes x overlap on/off x
  accumulation 1/4, ring on a k=8 fat tree) on a local process pool and on a local Dask cluster of the same
  number of worker processes, with cases per second.

``--store`` measures instead what the planner's model of elastic recovery at scale takes from this machine
(``allreduce.plan.STORE_REQUEST_S``): the runtime's store server in this process, ``--store-clients`` client
processes each sending ``check`` requests (what a shrink's agreement sends most) as fast as the server answers;
the server's CPU seconds per request (this process's CPU: its main thread only waits) and requests per wall second.

The goals: the 1,024-GPU plan in at most 3 s, the scaling table to 131,072 GPUs in at most 10 s. The machine may
be shared: the table prints the 1-minute load average before each row, and `uptime` after the last. Run it with
PYTHONPATH pointing at another checkout's src/ to time that code; or, for a before/after pair under the same load,
with ``--before OTHER/src``: each `plan` row then runs ``--rounds`` times, alternating that checkout's code
("before") with this process's ("after"), and the table ends with each side's median.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from allreduce.cli._plan import DEMO_ARGS
from allreduce.plan import DaskExecutor, expand_grid, run_sweep

PLAN_1024 = ["plan", *DEMO_ARGS]  # the demo's plan: Llama-2-7B on 1,024 GPUs
PLAN_131072 = [
    "plan",
    "--model",
    "llama2-7b",
    "--gpus",
    "131072",
    "--topology",
    "fat-tree:k=82",
    "--gpu-tflops",
    "989",
    "--mfu",
    "0.4",
    "--tokens-per-gpu",
    "4096",
    "--algorithm",
    "ring",
    "--no-what-if",
]
# Width of the table's first column (a row's name, with its side and median under --before).
WIDTH = 76
SWEEP_BASE = {"compute_ms": 100, "topology": "fat-tree:k=8", "algorithm": "ring"}
SWEEP_GRID = {
    "gpus": [8, 16, 32, 64, 128],
    "bucket_mb": [5, 10, 25, 50, 100],
    "params": [1e8, 3e8, 1e9, 3e9, 1e10],
    "dtype": ["bf16", "fp32"],
    "overlap": [True, False],
    "accumulation": [1, 4],
}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def time_cli(argv: list[str], src: str | None = None) -> tuple[float, float]:
    """Wall and CPU seconds of ``allreduce ARGV``; with ``src``, of the code in that src/ directory."""
    env = None if src is None else {**os.environ, "PYTHONPATH": src}
    cpu0, t0 = _children_cpu_s(), time.perf_counter()
    subprocess.run([sys.executable, "-m", "allreduce", *argv], check=True, stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t0, _children_cpu_s() - cpu0


def time_sweep(executor: Executor, cases: list[dict[str, object]]) -> tuple[float, int, int]:
    with tempfile.TemporaryDirectory() as tmp:
        summary = run_sweep(cases, Path(tmp) / "sweep.csv", executor)
    return summary.wall_s, summary.ran, summary.failed


STORE_REQUESTS_PER_CLIENT = 20_000


def _store_client(port: int, rank: int, clients: int, token: str, go: Any) -> None:
    from allreduce.runtime.store._store import TCPStore  # a benchmark of the runtime's store: its own class

    store = TCPStore("127.0.0.1", port, is_server=False, world_size=clients + 1, rank=rank, timeout_s=60, token=token)
    go.wait()
    for _ in range(STORE_REQUESTS_PER_CLIENT):
        store.check([f"allreduce/elastic/1/in/{rank}"])
    store.close()


def time_store(clients: int) -> None:
    """The store server's CPU seconds per request with ``clients`` processes sending ``check`` back to back."""
    import multiprocessing as mp
    import secrets

    from allreduce.runtime.store._store import TCPStore

    token = secrets.token_hex(16)
    server = TCPStore("127.0.0.1", 0, is_server=True, world_size=clients + 1, rank=0, timeout_s=60, token=token)
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    procs = [
        ctx.Process(target=_store_client, args=(server.port, r, clients, token, go)) for r in range(1, clients + 1)
    ]
    for proc in procs:
        proc.start()
    time.sleep(3.0)  # the clients import and connect before the clock starts
    load = _load()
    cpu0, t0 = _self_cpu_s(), time.perf_counter()
    go.set()
    for proc in procs:
        proc.join()
    wall, cpu = time.perf_counter() - t0, _self_cpu_s() - cpu0
    server.close()
    requests = clients * STORE_REQUESTS_PER_CLIENT
    print(f"store: {clients} client processes x {STORE_REQUESTS_PER_CLIENT:,} check requests, load {load}: "
          f"{wall:.2f} s wall, server {cpu:.2f} CPU s: {cpu / requests * 1e6:.1f} us of server CPU per request, "
          f"{requests / wall:,.0f} requests/s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip", default="", help="comma-separated rows to skip: plan, scaling, local, dask")
    parser.add_argument("--workers", type=int, default=2, help="worker processes of the pool and the Dask cluster")
    parser.add_argument("--before", metavar="SRC", help="another checkout's src/ to time against, run by run")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each plan row (per side with --before)")
    parser.add_argument("--store", action="store_true", help="time the runtime's store server per request instead")
    parser.add_argument("--store-clients", type=int, default=4, help="client processes of --store")
    args = parser.parse_args()
    if args.store:
        if not 1 <= args.store_clients <= 64:
            parser.error("--store-clients must be in [1, 64]")
        time_store(args.store_clients)
        return
    skip = set(args.skip.split(","))
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    sides: list[tuple[str, str | None]] = [("after", None)]
    if args.before:
        if not Path(args.before, "allreduce").is_dir():
            parser.error(f"--before {args.before}: no allreduce package there")
        sides = [("before", str(Path(args.before).resolve())), ("after", None)]
    plan_rows = [
        ("plan", PLAN_1024, "plan llama2-7b, 1,024 GPUs, scaling, what-ifs, goodput"),
        ("scaling", PLAN_131072, "plan ring, scaling table 8 -> 131,072 GPUs"),
    ]
    rows: list[str] = []
    header = f"{'what':<{WIDTH}} {'load':>5} {'wall s':>8} {'CPU s':>8} {'cases/s':>8}"
    print(header)
    print("-" * len(header))

    def emit(line: str) -> None:
        rows.append(line)
        print(line, flush=True)

    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for key, argv, what in plan_rows:
        if key in skip:
            continue
        for _ in range(args.rounds):
            for side, src in sides:
                load = _load()
                wall, cpu = time_cli(argv, src)
                times.setdefault((what, side), []).append((wall, cpu))
                label = f"{what} ({side})" if args.before else what
                emit(f"{label:<{WIDTH}} {load:>5} {wall:>8.2f} {cpu:>8.2f} {'':>8}")
    if args.rounds > 1 or args.before:
        for (what, side), runs in times.items():
            wall = statistics.median(w for w, _ in runs)
            cpu = statistics.median(c for _, c in runs)
            label = f"{what} ({side}, median of {len(runs)})"
            emit(f"{label:<{WIDTH}} {'':>5} {wall:>8.2f} {cpu:>8.2f} {'':>8}")
    cases = expand_grid(SWEEP_BASE, SWEEP_GRID)
    if "local" not in skip:
        load = _load()
        cpu0 = _self_cpu_s()
        with ProcessPoolExecutor(args.workers) as pool:
            children0 = _children_cpu_s()
            wall, ran, failed = time_sweep(pool, cases)
        cpu = _self_cpu_s() - cpu0 + _children_cpu_s() - children0
        what = f"sweep {ran} cases ({failed} failed), local pool of {args.workers}"
        emit(f"{what:<{WIDTH}} {load:>5} {wall:>8.2f} {cpu:>8.2f} {ran / wall:>8.1f}")
    if "dask" not in skip:
        from distributed import LocalCluster

        load = _load()
        with LocalCluster(
            n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster:
            executor = DaskExecutor(cluster.scheduler_address)
            try:
                wall, ran, failed = time_sweep(executor, cases)
            finally:
                executor.shutdown()
        what = f"sweep {ran} cases ({failed} failed), Dask {args.workers} workers"
        emit(f"{what:<{WIDTH}} {load:>5} {wall:>8.2f} {'-':>8} {ran / wall:>8.1f}")
    uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"uptime after the runs: {uptime}")


if __name__ == "__main__":
    main()
