"""Heartbeat gaps under load, and how long a stopped rank takes to be declared dead.

    nice -n 19 .venv/bin/python benchmarks/bench_heartbeat.py [--ranks 4] [--seconds 30] [--lease 10]
    nice -n 19 .venv/bin/python benchmarks/bench_heartbeat.py --stop [--transports tcp,shm] [--reps 3]

Gaps: for each workload, N ranks (``spawn``, a tcp group with ``lease_s=--lease``) run it for ``--seconds``, then
all-reduce once; rank 0, which hosts the store and runs the same workload, reports per rank the longest its store
server went without reading anything from that rank's connection (``TCPStore.heartbeat_gaps``): the silence a lease
must outlast, beats arriving every lease/5 plus whatever delayed them (the sender's thread waiting for the GIL or a
core, the server's thread likewise). Workloads: ``idle`` (sleeping), ``python`` (a pure-Python loop: the heartbeat
thread gets the GIL at CPython's switch interval), ``numpy`` (element-wise ufuncs on 8 Mi float64 and 512x512
products, one BLAS thread), ``collective`` (4 MiB all-reduces back to back). Printed: the worst gap per workload
and rank, how late that is against the beat period, and the share of the lease, with the load average (1-minute,
at the workload's start and end). The gaps include each group's start (16 processes importing numpy at once).

``--beats``: the store server's CPU per heartbeat, what a lease costs rank 0 at scale: ``--ranks`` client processes
each take a rank's seat (the real handshake) and send a heartbeat every millisecond for ``--seconds``, one
``send`` each as the heartbeat thread does, to a store hosted by this otherwise idle process; printed: the beats
sent, and this process's CPU seconds (its server thread's) per beat.

``--stop``: N ranks loop all-reduces of 64 Ki float32 with ``timeout_s=120`` and ``lease_s=--lease``; this script
SIGSTOPs rank N-1 (at a random point of its heartbeat period) and prints how long after the stop each
survivor's collective raised and what it named, then how long ``group.shrink()`` and one all-reduce on the
survivors took (those a stop mid-call left behind take its result first); the stopped rank is SIGKILLed after.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import signal
import statistics
import time
from typing import Any

import numpy as np

WORKLOADS = ("idle", "python", "numpy", "collective")


def _work(group: Any, workload: str, seconds: float) -> dict[int, float]:
    end = time.monotonic() + seconds
    if workload == "idle":
        while time.monotonic() < end:
            time.sleep(0.1)
    elif workload == "python":
        while time.monotonic() < end:
            sum(i * i for i in range(100_000))
    elif workload == "numpy":
        a = np.random.default_rng(group.rank).random(8 << 20)
        b = np.empty_like(a)
        m = np.random.default_rng(group.rank).random((512, 512))
        while time.monotonic() < end:
            np.sqrt(a, out=b)
            np.multiply(b, 1.5, out=a)
            m = m @ m
            m /= np.abs(m).max()
    elif workload == "collective":
        x = np.ones(1 << 20, np.float32)
        going = np.ones(1, np.float32)
        while going[0]:  # every rank makes the same calls: rank 0's clock decides when to stop
            x[:] = 1.0
            group.all_reduce(x)
            going[0] = float(group.rank != 0 or time.monotonic() < end)
            group.all_reduce(going, op="min")
    group.all_reduce(np.ones(1, np.float32))  # every rank is done: the gaps cover the whole workload
    store = group._store  # the benchmark reads the server it hosts
    return dict(store.heartbeat_gaps()) if group.rank == 0 else {}


def gaps(ranks: int, seconds: float, lease_s: float) -> None:
    from allreduce.runtime import spawn

    print(f"heartbeat gaps: {ranks} ranks over tcp, lease {lease_s:g} s (a beat every {lease_s / 5:g} s), "
          f"{seconds:g} s per workload")  # fmt: skip
    period = lease_s / 5
    print(f"{'workload':<12}{'load':>10}{'worst gap':>11}{'late':>9}  per rank (s)")
    worst_all = 0.0
    env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for workload in WORKLOADS:
        load = os.getloadavg()[0]
        results = spawn(
            ranks, _work, workload, seconds, init_options={"transport": "tcp", "lease_s": lease_s},
            timeout_s=seconds + 120, env=env,
        )  # fmt: skip
        per_rank = results[0]
        worst = max(per_rank.values())
        worst_all = max(worst_all, worst)
        shown = " ".join(f"{per_rank[r]:.3f}" for r in sorted(per_rank))
        loads = f"{load:.1f}-{os.getloadavg()[0]:.1f}"
        print(f"{workload:<12}{loads:>10}{worst:>10.3f}s{worst - period:>8.3f}s  {shown}")
    print(f"worst gap overall {worst_all:.3f} s ({worst_all - period:.3f} s late on a {period:g} s period): "
          f"{worst_all / lease_s:.1%} of the lease; load now {os.getloadavg()[0]:.1f}")  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# --stop: a stopped rank
# ----------------------------------------------------------------------------------------------------------------
def _stopped_case_rank(env: dict[str, str], transport: str, lease_s: float, out: Any) -> None:
    os.environ.update(env)
    import allreduce
    from allreduce.runtime import shrink_and_resume

    rank = int(env["RANK"])
    group = allreduce.init(transport=transport, timeout_s=120, lease_s=lease_s)
    x = np.ones(1 << 16, np.float32)
    group.all_reduce(x)
    out.put(("ready", rank, 0.0, None, ""))
    try:
        while True:
            x[:] = 1.0
            group.all_reduce(x)
    except allreduce.CollectiveError as exc:
        raised = time.time()
        error = (type(exc).__name__, exc.peer)
    started = time.monotonic()
    group = shrink_and_resume(group, x, lambda buffer, _: buffer.fill(1.0), kept=None)  # the same step again
    resumed = time.monotonic() - started
    exact = bool(np.all(x == group.world_size))
    group.close()
    out.put(("done", rank, raised, error, f"{resumed:.3f}:{exact}"))


def stopped(ranks: int, transports: list[str], reps: int, lease_s: float) -> None:
    from allreduce.runtime import silent_detection_s
    from allreduce.runtime.launcher._spawn import new_token, rank_environment, reserve_port

    victim = ranks - 1
    print(f"a stopped rank: {ranks} ranks, rank {victim} SIGSTOPped mid-loop; timeout_s=120, lease_s={lease_s:g}")
    print(f"{'transport':<10}{'load':>6}{'declared (s)':>14}{'named':>8}{'shrink+step (s)':>17}  exact")
    ctx = mp.get_context("spawn")
    for transport in transports:
        detections = []
        for _ in range(reps):
            reservation = reserve_port()
            port, token = int(reservation.getsockname()[1]), new_token()
            out = ctx.Queue()
            procs = [
                ctx.Process(
                    target=_stopped_case_rank,
                    args=(rank_environment(r, ranks, master_port=port, token=token), transport, lease_s, out),
                )
                for r in range(ranks)
            ]
            for p in procs:
                p.start()
            reservation.close()
            try:
                for _ in range(ranks):
                    out.get(timeout=120)
                # the ranks are looping all-reduces; stopped at a random point of the victim's beat period, so the
                # repetitions sample when its last beat left
                time.sleep(1.0 + random.uniform(0.0, lease_s / 5))
                load = os.getloadavg()[0]
                stopped_at = time.time()
                os.kill(procs[victim].pid, signal.SIGSTOP)
                reports = [out.get(timeout=300) for _ in range(ranks - 1)]
            finally:
                for p in procs:
                    if p.is_alive():
                        p.kill()  # the stopped rank (SIGKILL ends a stopped process too)
                    p.join(timeout=30)
            declared = max(r[2] for r in reports) - stopped_at
            detections.append(declared)
            named = sorted({r[3][1] for r in reports})
            resumed = max(float(r[4].split(":")[0]) for r in reports)
            exact = all(r[4].endswith("True") for r in reports)
            kinds = sorted({r[3][0] for r in reports})
            print(f"{transport:<10}{load:>6.1f}{declared:>14.2f}{named!s:>8}{resumed:>17.3f}  {exact} {kinds}")
        mean, worst = silent_detection_s(lease_s)
        print(f"{transport}: {min(detections):.2f} to {max(detections):.2f} s, mean "
              f"{statistics.mean(detections):.2f} s to declare the stopped rank dead (lease {lease_s:g} s; the "
              f"model: mean {mean:.2f} s, at most {worst:.2f} s)")  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# --beats: the server's CPU per heartbeat
# ----------------------------------------------------------------------------------------------------------------
BEAT_EVERY_S = 0.001


def _beating_client(job: tuple[int, int, int, str, float], go: Any, out: Any) -> None:
    import socket

    from allreduce.runtime.store._store_protocol import BEAT_FRAME
    from allreduce.runtime.tcp import ClientHello, connect_handshake

    port, rank, world_size, token, seconds = job
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    hello = ClientHello(rank=rank, world_size=world_size, target=0)
    connect_handshake(sock, b"store", token.encode(), hello, what="store")
    go.wait()
    sent, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        sock.sendall(BEAT_FRAME)
        sent += 1
        time.sleep(BEAT_EVERY_S)
    out.put(sent)
    time.sleep(1.0)  # the server reads the last ones before the connection drops
    sock.close()


def beats(clients: int, seconds: float) -> None:
    import resource
    import secrets

    from allreduce.runtime.store._store import TCPStore

    token = secrets.token_hex(16)
    server = TCPStore(
        "127.0.0.1", 0, is_server=True, world_size=clients + 1, rank=0, timeout_s=60, token=token, lease_s=3600
    )
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_beating_client, args=((server.port, r, clients + 1, token, seconds), go, out))
        for r in range(1, clients + 1)
    ]
    for proc in procs:
        proc.start()
    time.sleep(3.0)  # the clients import and connect before the clock starts
    load = os.getloadavg()[0]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0, t0 = usage.ru_utime + usage.ru_stime, time.perf_counter()
    go.set()
    sent = sum(out.get(timeout=seconds + 60) for _ in procs)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu, wall = usage.ru_utime + usage.ru_stime - cpu0, time.perf_counter() - t0
    for proc in procs:
        proc.join(timeout=30)
    server.close(wait_for_ranks_s=0)
    print(f"beats: {clients} clients, one every {BEAT_EVERY_S * 1e3:g} ms each for {seconds:g} s, load {load:.1f}: "
          f"{sent:,} beats ({sent / wall:,.0f}/s), server {cpu:.2f} CPU s: "
          f"{cpu / sent * 1e6:.1f} us per beat")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--lease", type=float, default=10.0)
    parser.add_argument("--stop", action="store_true")
    parser.add_argument("--beats", action="store_true")
    parser.add_argument("--transports", default="tcp,shm")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if args.beats:
        beats(args.ranks, args.seconds)
    elif args.stop:
        stopped(args.ranks, args.transports.split(","), args.reps, args.lease)
    else:
        gaps(args.ranks, args.seconds, args.lease)


if __name__ == "__main__":
    main()
