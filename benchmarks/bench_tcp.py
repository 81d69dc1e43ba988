"""TCP transport vs torch.distributed Gloo, over loopback, measured in the same run (alternating per repetition).

    .venv/bin/python benchmarks/bench_tcp.py [-n 2] [--sizes 4KiB,1MiB,16MiB,64MiB,256MiB] [--reps 5]

Prints, per size: the median time and busbw of allreduce's TCP transport (ring and the best other algorithm, with
Unix sockets between the ranks as a same-host group takes by default; the ring with every connection on TCP; and
the ring sending large steps from the sender thread, which ranks that share cores do not use by default) and of
Gloo, and the ratio; then the ceiling: what one raw TCP stream (rank 0 -> rank 1, plain blocking socket,
1 MiB ``send``/``recv_into`` calls into a preallocated buffer, the better of the kernel's default buffers and the
transport's loopback send buffer) moves in the same run, beside one raw Unix-socket stream, and the transport's
busbw as a share of the TCP stream; then the median CPU time (user + system, all threads of a rank) per
all-reduce, which on a loaded machine decides the wall time more than anything else. float32 sum, in place.
busbw = S/t * 2(N-1)/N (nccl-tests convention). The header gives the load average.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import time
from typing import Any

import numpy as np

from allreduce.runtime import compile_plan
from allreduce.runtime.launcher._spawn import new_token, spawn
from allreduce.runtime.store._store import TCPStore
from allreduce.runtime.tcp import TcpTransport
from allreduce.runtime.tcp._socket import LOOPBACK_SNDBUF_BYTES
from allreduce.schedules import all_reduce
from allreduce.units import format_bytes, parse_bytes

ALGORITHMS = ("ring", "halving_doubling")
FORCED_TCP = "ring, tcp only"  # the ring with every connection on TCP (Unix sockets off)
THREADED = "ring, sender thread"  # the ring with large steps' sends on the sender thread (sender_thread=True)
OURS = (*ALGORITHMS, FORCED_TCP, THREADED)
RAW = ("raw tcp", "raw unix")
RAW_CHUNK_BYTES = 1 << 20  # per send/recv_into call of the raw streams, as the transport's own calls


class RawStreams:
    """Rank 0 -> rank 1 streams on plain blocking sockets: the ceiling the transport is measured against."""

    def __init__(self, rank: int, store: TCPStore) -> None:
        self.rank = rank
        self.socks: dict[str, list[socket.socket]] = {}
        if rank > 1:
            return
        unix_name = f"\0allreduce-bench-raw-{os.getppid()}"
        if rank == 1:
            listeners = {
                "tcp": socket.create_server(("127.0.0.1", 0)),
                "unix": socket.socket(socket.AF_UNIX, socket.SOCK_STREAM),
            }
            listeners["unix"].bind(unix_name)
            listeners["unix"].listen(4)
            store.set("raw/tcp", str(listeners["tcp"].getsockname()[1]).encode())
            store.set("raw/unix", b"ready")
            for family, listener in listeners.items():
                self.socks[family] = [listener.accept()[0] for _ in range(2)]
                listener.close()
        else:
            port = int(store.get("raw/tcp"))
            store.get("raw/unix")
            self.socks["tcp"] = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
            self.socks["unix"] = []
            for _ in range(2):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(unix_name)
                self.socks["unix"].append(sock)
        for family, socks in self.socks.items():
            if family == "tcp":
                for sock in socks:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                # The second TCP stream has the transport's loopback send buffer, the first the kernel's default.
                socks[1].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOOPBACK_SNDBUF_BYTES)

    def stream(self, family: str, which: int, data: np.ndarray, sink: np.ndarray) -> None:
        """Move ``data`` (rank 0) into ``sink`` (rank 1) whole; the receiver acknowledges with one byte."""
        if self.rank > 1:
            return
        sock = self.socks[family][which]
        if self.rank == 0:
            view = memoryview(data).cast("B")
            while view:
                view = view[sock.send(view[:RAW_CHUNK_BYTES]) :]
            sock.recv(1)
        else:
            view = memoryview(sink).cast("B")
            got = 0
            while got < len(view):
                got += sock.recv_into(view[got : got + RAW_CHUNK_BYTES])
            sock.send(b"k")

    def close(self) -> None:
        for socks in self.socks.values():
            for sock in socks:
                sock.close()


def _rank_main(store_port: int, sizes: list[int], reps: int, segments: int) -> list[Any]:
    import torch.distributed as dist

    import torch

    dist.init_process_group("gloo", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store = TCPStore("127.0.0.1", store_port, is_server=False, world_size=world_size, rank=rank, timeout_s=300)
    transport = TcpTransport(rank, world_size, store, timeout_s=300)
    tcp_only = TcpTransport(rank, world_size, store, timeout_s=300, prefix="tcp-only", unix_sockets=False)
    threaded = TcpTransport(rank, world_size, store, timeout_s=300, prefix="tcp-thread", sender_thread=True)
    chosen = {FORCED_TCP: tcp_only, THREADED: threaded}
    raw = RawStreams(rank, store)
    seq = 0

    def add_into(dst: np.ndarray, src: np.ndarray) -> None:
        np.add(dst, src, out=dst)

    names = (*OURS, "gloo", *RAW)
    rows = []
    for size in sizes:
        count = size // 4
        ours = np.ones(count, np.float32)
        theirs = torch.ones(count, dtype=torch.float32)
        sink = np.empty(count, np.float32)
        plans = {a: compile_plan(all_reduce(a, world_size, segments=segments), rank, count) for a in ALGORITHMS}
        plans[FORCED_TCP] = plans[THREADED] = plans["ring"]
        times: dict[str, list[float]] = {name: [] for name in names}
        cpu_times: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(reps + 1):  # the first repetition warms up connections and buffers
            for name in names:
                best = float("inf")
                for which in range(2 if name == "raw tcp" else 1):
                    dist.barrier()
                    start = time.perf_counter()
                    usage = resource.getrusage(resource.RUSAGE_SELF)
                    if name == "gloo":
                        dist.all_reduce(theirs)
                    elif name in RAW:
                        raw.stream(name.split()[1], which, ours, sink)
                    else:
                        seq += 1
                        which_transport = chosen.get(name, transport)
                        which_transport.execute(plans[name], ours, add_into, seq=seq, timeout_s=300, checksum=False)
                    elapsed = time.perf_counter() - start
                    after = resource.getrusage(resource.RUSAGE_SELF)
                    best = min(best, elapsed)
                if rep:
                    times[name].append(best)
                    cpu_times[name].append(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime)
        # Everything reduced is exact in float32 (small integers), so check it.
        expected = float(world_size) ** (len(OURS) * (reps + 1))
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
    raw.close()
    threaded.close()
    tcp_only.close()
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
    if args.n < 2:
        parser.error("-n: at least 2 ranks (the raw streams run from rank 0 to rank 1)")
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
    header = f"{'size':>9} | " + " | ".join(f"{n + ' µs':>22} {'busbw GB/s':>10}" for n in (*OURS, "gloo"))
    print(header + " | best/gloo | tcp only/gloo")
    print("-" * len(header) + "-+-----------+--------------")
    for i, size in enumerate(sizes):
        worst = {name: max(r[i][1][name] for r in results) for name in (*OURS, "gloo")}
        cells = []
        for name in (*OURS, "gloo"):
            busbw = size / worst[name] * bus / 1e9
            cells.append(f"{worst[name] * 1e6:>22.0f} {busbw:>10.2f}")
        best = min(worst[a] for a in ALGORITHMS)
        print(
            f"{format_bytes(size):>9} | " + " | ".join(cells) + f" | {worst['gloo'] / best:>8.2f}× | "
            f"{worst['gloo'] / worst[FORCED_TCP]:>7.2f}×"
        )
    print("Ceiling: one raw stream rank 0 -> rank 1, same run (GB/s = size/time); busbw as a share of raw tcp:")
    print(f"{'size':>9} | {'raw tcp GB/s':>12} | {'raw unix GB/s':>13} | best busbw / raw tcp | tcp only / raw tcp")
    for i, size in enumerate(sizes):
        # The receiver's time (rank 1) is the stream's: it ends when the last byte landed.
        raw = {name: results[1][i][1][name] for name in RAW}
        best = min(max(r[i][1][a] for r in results) for a in ALGORITHMS)
        share = raw["raw tcp"] / best * bus
        forced = raw["raw tcp"] / max(r[i][1][FORCED_TCP] for r in results) * bus
        print(
            f"{format_bytes(size):>9} | {size / raw['raw tcp'] / 1e9:>12.2f} | {size / raw['raw unix'] / 1e9:>13.2f} | "
            f"{share:>20.0%} | {forced:>17.0%}"
        )
    print("CPU time per all-reduce, median, busiest rank (ms):")
    print(f"{'size':>9} | " + " | ".join(f"{name:>16}" for name in (*OURS, "gloo")))
    for i, size in enumerate(sizes):
        cpu = {name: max(r[i][2][name] for r in results) for name in (*OURS, "gloo")}
        print(f"{format_bytes(size):>9} | " + " | ".join(f"{cpu[name] * 1e3:>16.1f}" for name in (*OURS, "gloo")))


if __name__ == "__main__":
    main()
