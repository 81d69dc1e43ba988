"""Re-planning around a slow link, measured: busbw before, during and after, and no change on a healthy group.

    .venv/bin/python benchmarks/bench_replan.py [--ranks 8] [--size 1MiB] [--calls 200] [--rate 50MB/s]
        [--healthy-calls 10000]

Two runs of N local ranks over shared memory with ``ALLREDUCE_REPLAN=1`` (windows of 50 calls, 2 to confirm):
one with the link 1 -> 2 paced to ``--rate`` (``ALLREDUCE_INJECT``), a ring all-reduce of ``--size`` per call,
printing busbw per window and the change re-planning made; one healthy, counting the changes over
``--healthy-calls`` calls (none is the goal: no flapping). The same runs without re-planning are the reference.

    sudo .venv/bin/python benchmarks/bench_replan.py --emulated [--size 256KiB] [--calls 150] [--runs 4]
        [--replan window=10,confirm=2] [--healthy-calls 2000]

    .venv/bin/python benchmarks/bench_replan.py --tcp-healthy [--size 64KiB] [--healthy-calls 10000]
        [--replan window=10,confirm=2] [--cost-pairs 5] [--cost-calls 2000]

    .venv/bin/python benchmarks/bench_replan.py --straggler-only [--ranks 8] [--size 1MiB] [--straggler 5ms]
        [--pairs 3] [--calls 200]

A straggler (rank N-1 sleeping ``--straggler`` before every call, ``ALLREDUCE_INJECT``) in ``--pairs`` runs, each
after a healthy one, so that a ratio within a pair does not carry the load's drift from run to run (the default run
prints these pairs too). The late rank costs a call at most its delay: a ring's other ranks run ahead meanwhile (rank
k can do k+1 steps of the reduce-scatter before it needs the late rank's data), and on 2 cores the 7 others get the
CPU it leaves while it sleeps. One healthy run against one late one, minutes apart, compares two loads: 13.74 ->
36.95 ms a call (healthy first at load 3.9, late last at up to 10.2) was that.

A healthy ring of 4 ranks over loopback TCP with re-planning on: the changes it makes (none is the goal), and what
it costs: the median call with it over the median call without, in runs interleaved.

The same over real TCP on an emulated cluster (``allreduce emulate``, root and iproute2 needed): a 1:1 Clos of 2
leaves and 2 spines with 4 hosts each, links at ``--link-rate``, the cable leaf0<->spine0 at 10% of it, and the
ranks placed interleaved (rank r on host 0,4,1,5,2,6,3,7[r]) so that every hop of the ring crosses a spine and the
kernel's ECMP hash sends some of them over the slow cable. One rank per host namespace; every result checked
exactly. The healthy reference runs on the same cluster without the slow cable (built anew for each of
``--runs``; the healthy cluster with re-planning on runs once, after them, counting changes and probes). A last
run on the slow cluster asks the kernel which links each rank pair's connection crosses (its ECMP hash of the
ports) and runs the ring order whose slowest hop gets the largest share of its links, out of all 5,040: what
re-planning could reach if it knew the paths.
"""

from __future__ import annotations

import argparse
import itertools
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


def _loop(group: Any, count: int, calls: int) -> tuple[list[float], tuple[str, ...], float, tuple[float, float]]:
    """``calls`` ring all-reduces: each call's seconds, the changes re-planning made, this rank's CPU seconds, and
    when the calls began and ended (``perf_counter``: one clock for every process on the machine)."""
    times = []
    x = np.ones(count, np.float32)
    cpu_started = time.process_time()
    began = time.perf_counter()
    for _ in range(calls):
        started = time.perf_counter()
        group.all_reduce(x, algorithm="ring")
        times.append(time.perf_counter() - started)
        x[:] = 1.0
    ended = time.perf_counter()
    return times, group.stats().replans, time.process_time() - cpu_started, (began, ended)


def _busbw(times: list[float], nbytes: int, n: int) -> list[float]:
    """busbw (GB/s) per window of WINDOW calls: 2(N-1)/N x bytes / median call time (nccl-tests' definition)."""
    return [2 * (n - 1) / n * nbytes / float(np.median(times[i : i + WINDOW])) / 1e9 for i in range(0, len(times),
            WINDOW)]  # fmt: skip


def run(n: int, count: int, calls: int, env: dict[str, str]) -> tuple[list[float], tuple[str, ...]]:
    times, changes, _, _ = run_timed(n, count, calls, env)
    return times, changes


def run_timed(n: int, count: int, calls: int, env: dict[str, str]) -> tuple[list[float], tuple[str, ...], float, float]:
    """Each call's seconds (its slowest rank's), the changes, the wall seconds per call from the first rank's start
    to the last rank's end, and the ranks' CPU seconds per call."""
    results = spawn(n, _loop, count, calls, env=env, init_options={"transport": "shm"}, timeout_s=600)
    times = np.max([r[0] for r in results], axis=0).tolist()  # a call ends when its slowest rank does
    wall = (max(r[3][1] for r in results) - min(r[3][0] for r in results)) / calls
    return times, results[0][1], wall, sum(r[2] for r in results) / calls


def _worker(spec_json: str) -> int:
    """One rank inside a host namespace: join over TCP, run the loop, check every result, print one JSON line. With
    ``oracle`` it first prints its connections and reads the ring order to run from its input."""
    import allreduce
    from allreduce.emulate._rank import established_connections
    from allreduce.schedules import ordered_ring

    spec = json.loads(spec_json)
    group = allreduce.init(transport="tcp", timeout_s=120.0)
    try:
        n, rank, count = group.world_size, group.rank, int(spec["count"])
        base = (np.arange(count, dtype=np.int64) % 251).astype(np.float32)  # sums exact in float32
        expected, times, exact = base * (n * (n + 1) // 2), [], True
        algorithm: Any = "ring"
        if spec.get("oracle"):
            for order in _covering_orders(n):  # a connection between every pair, so the kernel routes them all
                group.all_reduce(base * (rank + 1), algorithm=ordered_ring(order))
            group.barrier()
            print(json.dumps({"connections": established_connections()}), flush=True)
            algorithm = ordered_ring(json.loads(sys.stdin.readline())["order"])
        for _ in range(int(spec["calls"])):
            x = base * (rank + 1)
            started = time.perf_counter()
            group.all_reduce(x, algorithm=algorithm)
            times.append(time.perf_counter() - started)
            exact = exact and bool(np.array_equal(x, expected))
        stats = group.stats()
        print(json.dumps({"times": times, "exact": exact, "replans": list(stats.replans)}), flush=True)
    finally:
        group.close()
    return 0


def _covering_orders(n: int) -> list[list[int]]:
    """Ring orders that between them make every pair of ranks neighbours (a greedy walk along pairs not yet used)."""
    uncovered = {frozenset((a, b)) for a in range(n) for b in range(a + 1, n)}
    orders = []
    while uncovered:
        order = [min(min(pair) for pair in uncovered)]
        left = set(range(n)) - set(order)
        while left:
            here = order[-1]
            step = min(left, key=lambda r: (frozenset((here, r)) not in uncovered, r))
            order.append(step)
            left.remove(step)
        uncovered -= {frozenset((order[i], order[(i + 1) % n])) for i in range(n)}
        orders.append(order)
    return orders


def _flow_rates(built: Any, order: tuple[int, ...], paths: Any) -> float:
    """The slowest ring hop's share of its most loaded link (B/s) when the ring runs in ``order``, its hops on the
    kernel's paths ``paths`` (a PathTable by host) and every link's shaped rate shared by the hops crossing it."""
    rate = {}
    for cable in built.cables:
        rate[cable.link_ab], rate[cable.link_ba] = cable.rate_ab_bps / 8, cable.rate_ba_bps / 8
    hops = [(INTERLEAVED[order[i]], INTERLEAVED[order[(i + 1) % len(order)]]) for i in range(len(order))]
    load: dict[int, int] = {}
    for hop in hops:
        for link in paths.paths[hop]:
            load[link] = load.get(link, 0) + 1
    return min(rate[link] / load[link] for link in load)


def _oracle_order(built: Any, paths: Any) -> tuple[tuple[int, ...], float, float]:
    """The ring order (rank 0 first) whose slowest hop gets the largest share of its links, with that share and
    the interleaved ring's, over every order of the 8 ranks (5,040)."""
    n = len(INTERLEAVED)
    best, best_rate = tuple(range(n)), -1.0
    for rest in itertools.permutations(range(1, n)):
        order = (0, *rest)
        share = _flow_rates(built, order, paths)
        if share > best_rate * (1 + 1e-9):
            best, best_rate = order, share
    return best, best_rate, _flow_rates(built, tuple(range(n)), paths)


def run_emulated(built: Any, count: int, calls: int, replan: str | None,
                 oracle: dict[str, Any] | None = None) -> tuple[list[float], tuple[str, ...]]:  # fmt: skip
    """The loop on one rank per host of the emulation ``built``, ranks placed :data:`INTERLEAVED`. With ``oracle``
    (a dict the order and the shares are put in), the ranks run the order :func:`_oracle_order` picks from the
    kernel's paths of their own connections."""
    from allreduce.emulate import Connection, kernel_paths

    env = dict(os.environ, WORLD_SIZE=str(len(INTERLEAVED)), MASTER_ADDR=built.host_address[INTERLEAVED[0]],
               MASTER_PORT=str(STORE_PORT), ALLREDUCE_TOKEN=secrets.token_hex(16))  # fmt: skip
    env.pop("ALLREDUCE_REPLAN", None)
    if replan:
        env["ALLREDUCE_REPLAN"] = replan
    spec = json.dumps({"count": count, "calls": calls, "oracle": oracle is not None})
    in_child = die_with_parent(os.getpid())  # a rank never outlives this process
    procs = []
    for rank, host in enumerate(INTERLEAVED):
        cmd = ["ip", "netns", "exec", built.host_namespace(host), sys.executable, __file__, "--worker", spec]
        out = subprocess.PIPE
        procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(rank)), stdin=out, stdout=out, stderr=out,
                                      text=True, preexec_fn=in_child))  # fmt: skip  # noqa: PLW1509
    reports = []
    try:
        if oracle is not None:
            seen = [json.loads(proc.stdout.readline())["connections"] for proc in procs]  # type: ignore[union-attr]
            connections = [Connection(INTERLEAVED[rank], *c) for rank, cs in enumerate(seen) for c in cs]
            paths = kernel_paths(built, connections, ignore_ports=frozenset({STORE_PORT}))
            order, share, interleaved = _oracle_order(built, paths)
            oracle.update(order=order, share=share, interleaved=interleaved, paths=paths)
            for proc in procs:
                proc.stdin.write(json.dumps({"order": order}) + "\n")  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]
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
    return times, tuple(reports[0]["replans"])


def _print_windows(rows: list[tuple[str, list[float]]], nbytes: int, n: int, window: int) -> list[list[float]]:
    out = []
    for name, times in rows:
        busbw = [2 * (n - 1) / n * nbytes / float(np.median(times[i : i + window])) / 1e9
                 for i in range(0, len(times), window)]  # fmt: skip
        print(f"  {name:<20} " + "  ".join(f"{b:6.3f}" for b in busbw))
        out.append(busbw)
    return out


def _emulated_run(args: argparse.Namespace, count: int, rate_bps: float, window: int) -> dict[str, Any]:
    """One run of the emulated comparison on clusters built for it: the healthy reference, then on the cluster
    with the slow cable the ring without re-planning, with it, and in the order the kernel's paths allow."""
    from allreduce.emulate import EmulationSpec, running

    n = len(INTERLEAVED)
    with running(EmulationSpec(CLOS, name="replan", rate_bps=rate_bps)) as built:
        healthy, _ = run_emulated(built, count, args.calls, None)
    oracle: dict[str, Any] = {}
    with running(EmulationSpec(CLOS, name="replan", rate_bps=rate_bps, degrade=(SLOW_CABLE,))) as built:
        slow, _ = run_emulated(built, count, args.calls, None)
        replanned, changes = run_emulated(built, count, args.calls, args.replan)
        best, _ = run_emulated(built, count, args.calls, None, oracle)
        ends = SLOW_CABLE[0].split("<->")
        slow_links = {built.topology.find_link("->".join(ends)), built.topology.find_link("->".join(ends[::-1]))}
        by_host = oracle["paths"].paths.items()
        crossing = sorted(
            (INTERLEAVED.index(a), INTERLEAVED.index(b)) for (a, b), hops in by_host if slow_links & set(hops)
        )
    rows = [("healthy", healthy), ("slow cable", slow), ("slow cable, re-planning", replanned),
            ("slow cable, best order", best)]  # fmt: skip
    bw = _print_windows(rows, count * 4, n, window)
    for change in changes:
        print(f"  re-planned {change}")
    reference = float(np.median(bw[0]))
    first = next((i for i, b in enumerate(bw[2]) if b >= 0.8 * reference), None)
    pairs = ", ".join(f"{a}->{b}" for a, b in crossing)
    print(f"  the kernel's ECMP paths: {len(crossing)} of {n * (n - 1)} rank pairs cross the slow cable ({pairs}); "
          f"order the paths allow: {','.join(map(str, oracle['order']))}, its slowest hop's share "
          f"{oracle['share'] / 1e6:.1f} MB/s (the interleaved ring's {oracle['interleaved'] / 1e6:.2f})")  # fmt: skip
    return {
        "without": bw[1][-1] / reference, "replanned": bw[2][-1] / reference,
        "best": float(np.median(bw[3])) / reference,
        "first": None if first is None else first * window, "crossing": len(crossing),
        "longest_s": max(replanned), "median_s": float(np.median(replanned)),
        "changes": sum("ring reordered" in c for c in changes), "probes": sum("probed" in c for c in changes),
    }  # fmt: skip


def main_emulated(args: argparse.Namespace) -> None:
    from allreduce.emulate import EmulationSpec, check_privileges, running

    check_privileges()
    nbytes = parse_bytes(args.size, what="--size")
    count, n = max(1, nbytes // 4), len(INTERLEAVED)
    rate_bps = parse_bandwidth(args.link_rate) * 8
    window = int(dict(kv.split("=") for kv in args.replan.split(",") if "=" in kv).get("window", WINDOW))
    print(f"bench_replan --emulated: {n} ranks over TCP on {CLOS} at {args.link_rate}, {SLOW_CABLE[0]} at "
          f"{SLOW_CABLE[1]:.0%}, ranks interleaved, ring all-reduce of {args.size}, ALLREDUCE_REPLAN={args.replan}; "
          f"{args.runs} runs; load {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores")  # fmt: skip
    started = time.monotonic()
    summary = []
    for number in range(args.runs):
        print(f"run {number + 1}: busbw GB/s per window of {window} calls (median call); load "
              f"{os.getloadavg()[0]:.1f}")  # fmt: skip
        summary.append((_emulated_run(args, count, rate_bps, window), os.getloadavg()[0]))
    print(f"last window's busbw, % of the healthy run's median window ({args.calls} calls, windows of {window}):")
    print(f"  {'run':>3}  {'load':>5}  {'pairs slow':>10}  {'without':>7}  {'re-planned':>10}  {'best order':>10}  "
          f"{'>= 80% from call':>16}  {'changes':>7}  {'probes':>6}  {'longest call':>12}")  # fmt: skip
    for number, (row, load) in enumerate(summary, 1):
        first = "never" if row["first"] is None else str(row["first"])
        print(f"  {number:>3}  {load:>5.1f}  {row['crossing']:>7} of {n * (n - 1)}  {row['without']:>7.0%}  "
              f"{row['replanned']:>10.0%}  {row['best']:>10.0%}  {first:>16}  {row['changes']:>7}  "
              f"{row['probes']:>6}  {row['longest_s']:>10.1f} s")  # fmt: skip
    print("  (pairs slow: those whose connection the kernel routed over the slow cable in the best-order run; every "
          "run's connections hash anew. longest call: the re-planned run's, which holds the window's gather and the "
          f"probe; its median call {np.median([row['median_s'] for row, _ in summary]) * 1e3:.0f} ms)")  # fmt: skip
    if args.healthy_calls:
        flap_started = time.monotonic()
        with running(EmulationSpec(CLOS, name="replan", rate_bps=rate_bps)) as built:
            _, flaps = run_emulated(built, max(1, (64 << 10) // 4), args.healthy_calls, args.replan)
        changes, probes = sum("ring reordered" in f for f in flaps), sum("probed" in f for f in flaps)
        print(f"healthy cluster with re-planning on: {changes} changes and {probes} probes in "
              f"{args.healthy_calls:,} calls of 64 KiB ({time.monotonic() - flap_started:.0f} s)")  # fmt: skip
    print(f"wall {time.monotonic() - started:.0f} s; load {os.getloadavg()[0]:.1f}")


def _window_share(group: Any, count: int, calls: int) -> tuple[float, float]:
    """``calls`` ring all-reduces with re-planning's per-call work (``GroupReplanning.after_call``: the count, and
    at a window's end the counters' gather and the decision) timed: its share of this rank's wall and CPU time."""
    from allreduce.runtime.elastic import _replan

    spent = [0.0, 0.0]
    plain = _replan.GroupReplanning.after_call

    def timed(self: Any, nbytes: int, group: Any) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return plain(self, nbytes, group)
        finally:
            spent[0] += time.perf_counter() - wall
            spent[1] += time.process_time() - cpu

    _replan.GroupReplanning.after_call = timed  # type: ignore[method-assign]
    x = np.ones(count, np.float32)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        group.all_reduce(x, algorithm="ring")
        x[:] = 1.0
    return spent[0] / (time.perf_counter() - wall), spent[1] / (time.process_time() - cpu)


def main_tcp_healthy(args: argparse.Namespace) -> None:
    """A healthy ring over loopback TCP: the changes re-planning makes in ``--healthy-calls`` calls, and its cost
    (median call with it over median call without, runs interleaved)."""
    ranks, count = 4, max(1, parse_bytes(args.size, what="--size") // 4)
    tcp = {"ALLREDUCE_TCP_UNIX": "0"}
    print(f"bench_replan --tcp-healthy: {ranks} ranks over loopback TCP, ring all-reduce of {args.size}, "
          f"ALLREDUCE_REPLAN={args.replan}; load {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores")  # fmt: skip
    started = time.monotonic()
    options = {"transport": "tcp"}
    env = {**tcp, "ALLREDUCE_REPLAN": args.replan}
    results = spawn(ranks, _loop, count, args.healthy_calls, env=env, init_options=options, timeout_s=7200)
    changes = max(len(r[1]) for r in results)
    print(f"  {changes} changes in {args.healthy_calls:,} calls ({time.monotonic() - started:.0f} s); "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    ratios, cpu_ratios = [], []
    for _ in range(args.cost_pairs):
        medians, cpu = [], []
        for extra in ({}, {"ALLREDUCE_REPLAN": args.replan}):
            runs = spawn(ranks, _loop, count, args.cost_calls, env={**tcp, **extra}, init_options=options)
            medians.append(float(np.median(np.max([r[0] for r in runs], axis=0))))
            cpu.append(sum(r[2] for r in runs))
        ratios.append(medians[1] / medians[0])
        cpu_ratios.append(cpu[1] / cpu[0])
    for what, values in (("median call", ratios), ("CPU seconds of the ranks", cpu_ratios)):
        print(f"  cost, {what} with re-planning over without, {args.cost_pairs} interleaved pairs of "
              f"{args.cost_calls:,} calls: median {np.median(values):.3f}, quartiles {np.percentile(values, 25):.3f}"
              f"-{np.percentile(values, 75):.3f}")  # fmt: skip
    shares = spawn(ranks, _window_share, count, args.cost_calls, env={**tcp, "ALLREDUCE_REPLAN": args.replan},
                   init_options=options)  # fmt: skip
    print(f"  re-planning's own work, timed in each rank over {args.cost_calls:,} calls: "
          + ", ".join(f"{w:.1%} of wall / {c:.1%} of CPU" for w, c in shares)
          + f"; load {os.getloadavg()[0]:.1f}")  # fmt: skip


def main_straggler(args: argparse.Namespace, count: int) -> None:
    """A straggler: rank N-1 sleeps ``--straggler`` before every call (``ALLREDUCE_INJECT`` delay), against the
    healthy group, in ``--pairs`` runs interleaved with healthy ones (the load moves between runs; a ratio within a
    pair does not carry it), and once with re-planning on."""
    n, delay = args.ranks, args.straggler
    straggler = {"ALLREDUCE_INJECT": f"delay:rank={n - 1}:{delay}"}
    print(f"a straggler: rank {n - 1} arrives {delay} late at every call (compute, not a link); {args.pairs} pairs "
          f"of runs of {args.calls} calls, healthy then late; load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"  {'pair':>4} {'healthy ms/call':>16} {'late ms/call':>13} {'added ms':>9} {'CPU ms/call h/l':>16} "
          f"{'median call h/l':>16} {'load':>5}")  # fmt: skip
    added, healthy_walls = [], []
    for pair in range(args.pairs):
        healthy, _, healthy_wall, healthy_cpu = run_timed(n, count, args.calls, {})
        late, _, late_wall, late_cpu = run_timed(n, count, args.calls, straggler)
        added.append((late_wall - healthy_wall) * 1e3)
        healthy_walls.append(healthy_wall * 1e3)
        print(f"  {pair:>4} {healthy_wall * 1e3:>16.2f} {late_wall * 1e3:>13.2f} {added[-1]:>9.2f} "
              f"{healthy_cpu * 1e3:>7.1f}/{late_cpu * 1e3:<8.1f} {np.median(healthy) * 1e3:>7.2f}/"
              f"{np.median(late) * 1e3:<8.2f} {os.getloadavg()[0]:>5.1f}")  # fmt: skip
    low, high = np.percentile(added, [25, 75])
    print(
        f"  added per call: median {np.median(added):.2f} ms, quartiles {low:.2f} to {high:.2f}, for a delay of "
        f"{delay}; the healthy runs alone spread {min(healthy_walls):.2f}-{max(healthy_walls):.2f} ms/call at this "
        f"load (ms/call: the run's wall time over its calls; median call: the slowest rank's, the late rank's own "
        f"delay included). One healthy run against one late run, measured minutes apart, compares two loads"
    )
    _, late_changes, replanned_wall, _ = run_timed(n, count, args.calls, {**straggler, "ALLREDUCE_REPLAN": "1"})
    said = [change for change in late_changes if "compute straggler" in change]
    for line in said:
        print(f"  group.stats(): {line}")
    changes = len(late_changes) - len(said)
    print(f"  with re-planning: {replanned_wall * 1e3:.2f} ms/call, {changes} changes: every schedule "
          f"waits for every rank's data, so a late rank costs up to its delay whatever the order or the algorithm "
          f"(less where the others run ahead on steps that do not need it yet); only links and ports can be routed "
          f"around; load {os.getloadavg()[0]:.1f}")  # fmt: skip


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
    parser.add_argument("--pairs", type=int, default=3, help="straggler runs, each after a healthy one")
    parser.add_argument("--straggler-only", action="store_true", help="only the straggler's pairs of runs")
    parser.add_argument("--emulated", action="store_true", help="over TCP on an emulated Clos (root)")
    parser.add_argument("--link-rate", default="200Mbps", help="with --emulated: the links' shaped rate")
    parser.add_argument("--replan", default="window=10,confirm=2", help="with --emulated: ALLREDUCE_REPLAN")
    parser.add_argument("--runs", type=int, default=1, help="with --emulated: runs, each on clusters built anew")
    parser.add_argument("--tcp-healthy", action="store_true", help="a healthy ring over loopback TCP: changes, cost")
    parser.add_argument("--cost-pairs", type=int, default=5, help="with --tcp-healthy: runs with and without")
    parser.add_argument("--cost-calls", type=int, default=2000, help="with --tcp-healthy: calls in each run")
    args = parser.parse_args()
    if args.tcp_healthy:
        main_tcp_healthy(args)
        return
    if args.emulated:
        main_emulated(args)
        return
    if not 4 <= args.ranks <= 16:
        parser.error("--ranks must be in 4..16 (re-planning needs 4 ranks)")
    nbytes = parse_bytes(args.size, what="--size")
    count = max(1, nbytes // 4)
    if args.straggler_only:
        main_straggler(args, count)
        return
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
    main_straggler(args, count)
    started = time.monotonic()
    _, flaps = run(args.ranks, max(1, (64 << 10) // 4), args.healthy_calls, {"ALLREDUCE_REPLAN": "1"})
    print(f"healthy group with re-planning on: {len(flaps)} changes in {args.healthy_calls:,} calls of 64 KiB "
          f"({time.monotonic() - started:.0f} s); load {os.getloadavg()[0]:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
