"""Re-planning around a slow link, measured: busbw before, during and after, and no change on a healthy group.

    .venv/bin/python benchmarks/bench_replan.py [--ranks 8] [--size 1MiB] [--calls 200] [--rate 50MB/s]
        [--healthy-calls 10000]

Two runs of N local ranks over shared memory with ``ALLREDUCE_REPLAN=1`` (windows of 50 calls, 2 to confirm):
one with the link 1 -> 2 paced to ``--rate`` (``ALLREDUCE_INJECT``), a ring all-reduce of ``--size`` per call,
printing busbw per window and the change re-planning made; one healthy, counting the changes over
``--healthy-calls`` calls (none is the goal: no flapping). The same runs without re-planning are the reference.

    sudo .venv/bin/python benchmarks/bench_replan.py --emulated [--size 256KiB] [--calls 150]
        [--replan window=10,confirm=2] [--healthy-calls 2000]

The same over real TCP on an emulated cluster (``allreduce emulate``, root and iproute2 needed): a 1:1 Clos of 2
leaves and 2 spines with 4 hosts each, links at ``--link-rate``, the cable leaf0<->spine0 at 10% of it, and the
ranks placed interleaved (rank r on host 0,4,1,5,2,6,3,7[r]) so that every hop of the ring crosses a spine and the
kernel's ECMP hash sends some of them over the slow cable. One rank per host namespace; every result checked
exactly. The healthy reference runs on the same cluster without the slow cable.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from typing import Any

import numpy as np

from allreduce.runtime import spawn
from allreduce.runtime.launcher import die_with_parent
from allreduce.units import parse_bandwidth, parse_bytes

WINDOW = 50
CLOS = "clos:leaves=2,spines=2,hosts_per_leaf=4"
INTERLEAVED = (0, 4, 1, 5, 2, 6, 3, 7)  # ring neighbours sit on different leaves: every hop crosses a spine
SLOW_CABLE = ("leaf0<->spine0", 0.1)
STORE_PORT = 29_531


def _loop(group: Any, count: int, calls: int) -> tuple[list[float], tuple[str, ...]]:
    times = []
    x = np.ones(count, np.float32)
    for _ in range(calls):
        started = time.perf_counter()
        group.all_reduce(x, algorithm="ring")
        times.append(time.perf_counter() - started)
        x[:] = 1.0
    return times, group.stats().replans


def _busbw(times: list[float], nbytes: int, n: int) -> list[float]:
    """busbw (GB/s) per window of WINDOW calls: 2(N-1)/N x bytes / median call time (nccl-tests' definition)."""
    return [2 * (n - 1) / n * nbytes / float(np.median(times[i : i + WINDOW])) / 1e9 for i in range(0, len(times),
            WINDOW)]  # fmt: skip


def run(n: int, count: int, calls: int, env: dict[str, str]) -> tuple[list[float], tuple[str, ...]]:
    results = spawn(n, _loop, count, calls, env=env, init_options={"transport": "shm"}, timeout_s=600)
    times = np.max([r[0] for r in results], axis=0).tolist()  # a call ends when its slowest rank does
    return times, results[0][1]


def _worker(spec_json: str) -> int:
    """One rank inside a host namespace: join over TCP, run the loop, check every result, print one JSON line."""
    import allreduce

    spec = json.loads(spec_json)
    group = allreduce.init(transport="tcp", timeout_s=120.0)
    try:
        n, rank, count = group.world_size, group.rank, int(spec["count"])
        base = (np.arange(count, dtype=np.int64) % 251).astype(np.float32)  # sums exact in float32
        expected, times, exact = base * (n * (n + 1) // 2), [], True
        for _ in range(int(spec["calls"])):
            x = base * (rank + 1)
            started = time.perf_counter()
            group.all_reduce(x, algorithm="ring")
            times.append(time.perf_counter() - started)
            exact = exact and bool(np.array_equal(x, expected))
        stats = group.stats()
        moving = [k for k in stats.links if k.transfer_total_s]
        rates = {f"{k.src}->{k.dst}": k.size_bytes / k.transfer_total_s / 1e6 for k in moving}
        print(json.dumps({"times": times, "exact": exact, "replans": list(stats.replans), "rates": rates}), flush=True)
    finally:
        group.close()
    return 0


def run_emulated(built: Any, count: int, calls: int, replan: str | None,
                 rates: dict[str, float] | None = None) -> tuple[list[float], tuple[str, ...]]:  # fmt: skip
    """The loop on one rank per host of the emulation ``built``, ranks placed :data:`INTERLEAVED`."""
    env = dict(os.environ, WORLD_SIZE=str(len(INTERLEAVED)), MASTER_ADDR=built.host_address[INTERLEAVED[0]],
               MASTER_PORT=str(STORE_PORT), ALLREDUCE_TOKEN=secrets.token_hex(16))  # fmt: skip
    env.pop("ALLREDUCE_REPLAN", None)
    if replan:
        env["ALLREDUCE_REPLAN"] = replan
    spec = json.dumps({"count": count, "calls": calls})
    in_child = die_with_parent(os.getpid())  # a rank never outlives this process
    procs = []
    for rank, host in enumerate(INTERLEAVED):
        cmd = ["ip", "netns", "exec", built.host_namespace(host), sys.executable, __file__, "--worker", spec]
        out = subprocess.PIPE
        procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(rank)), stdout=out, stderr=out, text=True,
                                      preexec_fn=in_child))  # fmt: skip  # noqa: PLW1509
    reports = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=60 + calls * 5)
            if proc.returncode != 0:
                raise SystemExit(f"rank {rank} failed: {err.strip().splitlines()[-1:] or proc.returncode}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if not all(r["exact"] for r in reports):
        raise SystemExit("a result was not exact")
    times = np.max([r["times"] for r in reports], axis=0).tolist()
    if rates is not None:
        rates.update(reports[0]["rates"])
    return times, tuple(reports[0]["replans"])


def _print_windows(rows: list[tuple[str, list[float]]], nbytes: int, n: int, window: int) -> list[list[float]]:
    out = []
    for name, times in rows:
        busbw = [2 * (n - 1) / n * nbytes / float(np.median(times[i : i + window])) / 1e9
                 for i in range(0, len(times), window)]  # fmt: skip
        print(f"  {name:<20} " + "  ".join(f"{b:6.3f}" for b in busbw))
        out.append(busbw)
    return out


def main_emulated(args: argparse.Namespace) -> None:
    from allreduce.emulate import EmulationSpec, check_privileges, running

    check_privileges()
    nbytes = parse_bytes(args.size, what="--size")
    count, n = max(1, nbytes // 4), len(INTERLEAVED)
    rate_bps = parse_bandwidth(args.link_rate) * 8
    window = int(dict(kv.split("=") for kv in args.replan.split(",") if "=" in kv).get("window", WINDOW))
    print(f"bench_replan --emulated: {n} ranks over TCP on {CLOS} at {args.link_rate}, {SLOW_CABLE[0]} at "
          f"{SLOW_CABLE[1]:.0%}, ranks interleaved, ring all-reduce of {args.size}, ALLREDUCE_REPLAN={args.replan}; "
          f"load {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores")  # fmt: skip
    started = time.monotonic()
    with running(EmulationSpec(CLOS, name="replan", rate_bps=rate_bps)) as built:
        healthy, _ = run_emulated(built, count, args.calls, None)
        _, flaps = run_emulated(built, max(1, (64 << 10) // 4), args.healthy_calls, args.replan)
    with running(EmulationSpec(CLOS, name="replan", rate_bps=rate_bps, degrade=(SLOW_CABLE,))) as built:
        measured: dict[str, float] = {}
        slow, _ = run_emulated(built, count, args.calls, None, measured)
        replanned, changes = run_emulated(built, count, args.calls, args.replan)
    print(f"busbw GB/s per window of {window} calls (median call):")
    bw = _print_windows([("healthy", healthy), ("slow cable", slow), ("slow cable, re-planning", replanned)],
                        nbytes, n, window)  # fmt: skip
    print("  link rates with the slow cable, no re-planning (MB/s, as the receivers measured them): "
          + ", ".join(f"{link} {rate:.1f}" for link, rate in sorted(measured.items())))  # fmt: skip
    for change in changes:
        print(f"  re-planned {change}")
    first = next((i for i, b in enumerate(bw[2]) if b >= 0.8 * bw[0][-1]), None)
    at = "never" if first is None else f"from call {first * window} on (window {first})"
    print(f"  >= 80% of the healthy busbw: {at}; last window {bw[2][-1] / bw[0][-1]:.0%} of healthy, "
          f"without re-planning {bw[1][-1] / bw[0][-1]:.0%}")  # fmt: skip
    print(f"healthy cluster with re-planning on: {len(flaps)} changes in {args.healthy_calls:,} calls of 64 KiB")
    print(f"wall {time.monotonic() - started:.0f} s; load {os.getloadavg()[0]:.1f}")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        raise SystemExit(_worker(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--size", default="1MiB")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rate", default="50MB/s", help="the paced link's rate")
    parser.add_argument("--healthy-calls", type=int, default=10_000)
    parser.add_argument("--straggler", default="5ms", help="the delayed rank's delay per call")
    parser.add_argument("--emulated", action="store_true", help="over TCP on an emulated Clos (root)")
    parser.add_argument("--link-rate", default="200Mbps", help="with --emulated: the links' shaped rate")
    parser.add_argument("--replan", default="window=10,confirm=2", help="with --emulated: ALLREDUCE_REPLAN")
    args = parser.parse_args()
    if args.emulated:
        main_emulated(args)
        return
    if not 4 <= args.ranks <= 16:
        parser.error("--ranks must be in 4..16 (re-planning needs 4 ranks)")
    nbytes = parse_bytes(args.size, what="--size")
    count = max(1, nbytes // 4)
    pace = {"ALLREDUCE_INJECT": f"pace:link=1->2:rate={args.rate}"}
    print(f"bench_replan: {args.ranks} ranks, shm, ring all-reduce of {args.size}, link 1->2 paced to {args.rate}; "
          f"load {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores")  # fmt: skip
    healthy, _ = run(args.ranks, count, args.calls, {})
    slow, _ = run(args.ranks, count, args.calls, pace)
    replanned, changes = run(args.ranks, count, args.calls, {**pace, "ALLREDUCE_REPLAN": "1"})
    print(f"busbw GB/s per window of {WINDOW} calls (median call):")
    for name, times in (("healthy", healthy), ("paced", slow), ("paced, re-planning", replanned)):
        print(f"  {name:<20} " + "  ".join(f"{b:6.3f}" for b in _busbw(times, count * 4, args.ranks)))
    for change in changes:
        print(f"  re-planned {change}")
    last = _busbw(replanned, count * 4, args.ranks)[-1]
    print(f"  after re-planning: {last / _busbw(healthy, count * 4, args.ranks)[-1]:.0%} of the healthy busbw")
    straggler = {"ALLREDUCE_INJECT": f"delay:rank={args.ranks - 1}:{args.straggler}"}
    late, _ = run(args.ranks, count, args.calls, straggler)
    late_replanned, late_changes = run(args.ranks, count, args.calls, {**straggler, "ALLREDUCE_REPLAN": "1"})
    healthy_ms = float(np.median(healthy)) * 1e3
    print(f"a straggler: rank {args.ranks - 1} arrives {args.straggler} late at every call (compute, not a link):")
    for name, times in (("without re-planning", late), ("with re-planning", late_replanned)):
        print(f"  {name:<20} median call {np.median(times) * 1e3:7.2f} ms (healthy {healthy_ms:.2f} ms)")
    print(f"  re-planning made {len(late_changes)} changes: every schedule waits for every rank's data, so a late "
          f"rank costs its delay whatever the order; only its links can be routed around")  # fmt: skip
    started = time.monotonic()
    _, flaps = run(args.ranks, max(1, (64 << 10) // 4), args.healthy_calls, {"ALLREDUCE_REPLAN": "1"})
    print(f"healthy group with re-planning on: {len(flaps)} changes in {args.healthy_calls:,} calls of 64 KiB "
          f"({time.monotonic() - started:.0f} s); load {os.getloadavg()[0]:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
