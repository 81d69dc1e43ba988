"""Re-planning over real TCP on an emulated Clos (``allreduce.emulate``): one spine cable at a twentieth of the others,
the ranks interleaved so that every ring hop crosses a spine. The switches' hash puts some rank pairs' connections
on the slow cable, a different set in each run; after one probe of every pair the ring uses none of them, which
the kernel's own routing of the connections (``kernel_paths``) confirms.

Needs root and iproute2 (skipped otherwise); the cluster has a name of its own and its state under tmp_path.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from allreduce.emulate import Layout
from allreduce.runtime.launcher import die_with_parent

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
        reason="needs root and iproute2 (ip, tc) to build network namespaces",
    ),
    pytest.mark.serial,  # shaped links and measured rates
    pytest.mark.slow,
]

CLOS = "clos:leaves=2,spines=2,hosts_per_leaf=4"
INTERLEAVED = (0, 4, 1, 5, 2, 6, 3, 7)  # ring neighbours sit on different leaves: every hop crosses a spine
# A twentieth, not the benchmark's tenth, and 60 calls, not 40: at a tenth, beside six busy loops (load 13), one run
# of two re-planned nothing in 40 calls. Its windows (the senders' counters) read the two ring hops that the hash
# sent over the slow cable at 6-12 MB/s, intervals up to 16 MB/s, although the cable carries 2.5 MB/s: senders short
# of CPU are not network-limited for part of a transfer, which the kernel's count leaves out. The other hops read
# 45-80 MB/s (95-1,150 at load 4: their receivers short of CPU), so a quarter of their lows (6-9 MB/s) stayed below
# the slow hops' highs and nothing was confirmed; at load 4 the same cable's hops read 1.7-2.2 MB/s. At a twentieth,
# 3 of 3 runs beside the same loops (load 10-16) read them at 1.4-2.1 MB/s and re-planned after call 20. Later runs
# at a twentieth that re-planned nothing (3 of 9 beside eight loops, load 14-15; none counted a microsecond as
# sndbuf-limited) were those whose hash put six of the eight hops on the cable: read at 0.8-1.0 MB/s beside 60-290
# MB/s for the two others, named by the gap only since the kernel's counts above a gap need not be three.
SLOW_CABLE = ("leaf0<->spine0", 0.05)
CALLS = 60
CONFIRMED_AFTER = (20, 30, 40, 50)
"""The second window of 10 calls, or a later one where a window's counters leave the cable's rate unresolved."""
COUNT = 1 << 16  # 256 KiB of float32
STORE_PORT = 29_537


def _worker() -> None:
    """One rank inside a host namespace: ring all-reduces under ALLREDUCE_REPLAN, each checked; one JSON line."""
    import allreduce
    from allreduce.emulate._rank import established_connections

    group = allreduce.init(transport="tcp", timeout_s=120.0)
    try:
        n, rank = group.world_size, group.rank
        base = (np.arange(COUNT, dtype=np.int64) % 251).astype(np.float32)  # sums exact in float32
        expected, exact = base * (n * (n + 1) // 2), True
        for _ in range(CALLS):
            x = base * (rank + 1)
            group.all_reduce(x, algorithm="ring")
            exact = exact and bool(np.array_equal(x, expected))
        replans = list(group.stats().replans)
        print(json.dumps({"exact": exact, "replans": replans, "connections": established_connections()}))
    finally:
        group.close()


def _run_ranks(built: Layout) -> list[dict[str, Any]]:
    env = dict(
        os.environ, WORLD_SIZE=str(len(INTERLEAVED)), MASTER_ADDR=built.host_address[INTERLEAVED[0]],
        MASTER_PORT=str(STORE_PORT), ALLREDUCE_TOKEN=secrets.token_hex(16), ALLREDUCE_REPLAN="window=10,confirm=2",
    )  # fmt: skip
    in_child = die_with_parent(os.getpid())  # no rank outlives the test
    procs = []
    for rank, host in enumerate(INTERLEAVED):
        cmd = ["ip", "netns", "exec", built.host_namespace(host), sys.executable, __file__, "--worker"]
        procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, preexec_fn=in_child))  # fmt: skip  # noqa: PLW1509
    try:
        deadline = time.monotonic() + 300
        outs = [proc.communicate(timeout=max(1.0, deadline - time.monotonic())) for proc in procs]
    finally:
        running = [proc for proc in procs if proc.poll() is None]
        for proc in running:
            proc.kill()
        for proc in running:
            proc.wait()
    reports = []
    for rank, (proc, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert proc.returncode == 0, f"rank {rank}: {err.strip().splitlines()[-3:]}"
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def test_one_probe_and_the_ring_crosses_the_slow_cable_nowhere(tmp_path: Path) -> None:
    from allreduce.emulate import Connection, EmulationSpec, kernel_paths, running

    spec = EmulationSpec(CLOS, name=f"rp{uuid.uuid4().hex[:4]}", rate_bps=200e6, degrade=(SLOW_CABLE,))
    with running(spec, state_dir=tmp_path) as built:
        reports = _run_ranks(built)
        seen = [Connection(INTERLEAVED[rank], *c) for rank, r in enumerate(reports) for c in r["connections"]]
        paths = kernel_paths(built, seen, ignore_ports=frozenset({STORE_PORT}))
        ends = SLOW_CABLE[0].split("<->")
        slow = {built.topology.find_link("->".join(ends)), built.topology.find_link("->".join(ends[::-1]))}
    crossing = {
        (INTERLEAVED.index(a), INTERLEAVED.index(b)) for (a, b), hops in paths.paths.items() if slow & set(hops)
    }
    assert all(r["exact"] for r in reports)
    assert len({tuple(r["replans"]) for r in reports}) == 1  # every rank decided the same
    replans = reports[0]["replans"]
    hops = {(i, (i + 1) % 8) for i in range(8)}
    if not crossing & hops:
        # The switches' hash kept every ring hop off the slow cable (CI run 27 found no crossing among the
        # connections the ranks held at the end): there is nothing to route around, and nothing may change.
        assert replans == [], (replans, sorted(paths.paths), len(seen))
        return
    if hops <= crossing:
        # The hash put every hop on the cable (1 run in 256): each is as slow as the others, and the rule compares
        # a window's links with each other, so there is no slow link to name (docs/reliability.md says so).
        return
    assert len(replans) == 1, replans
    change = replans[0]
    assert int(change.partition(":")[0].removeprefix("after call ")) in CONFIRMED_AFTER, change
    assert "; probed 56 pairs with " in change, change
    order = [int(r) for r in change.split("ring reordered ")[1].split(";")[0].split(",")]
    ring = {(order[i], order[(i + 1) % 8]) for i in range(8)}
    assert not ring & crossing, (sorted(crossing), order)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
