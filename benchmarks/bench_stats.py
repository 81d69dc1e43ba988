"""Runtime statistics: the cost of recording, on vs off in one run, at 4 KiB, 1 MiB and 64 MiB, N = 2 and 4.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_stats.py [--transports shm,tcp] [--world-sizes 2,4]
                                                          [--sizes 4KiB,1MiB,64MiB] [--rounds 30] [--algorithm ring]

Every rank switches recording on and off (``transport.recorder.enabled``) in runs of ``--run`` calls (32), so load
from other jobs hurts both alike, and the median of each run is what is compared. Why runs, not call by call: what
a recorded call does last delays its rank's arrival at the next call, which the next call's clock measures; with
calls alternating, half of that went to the off calls, and 1 MiB with two ranks measured 1.007 call by call against
1.013-1.015 in runs of 32 (2026-12-04): only runs measure what recording costs a job that has it on. The table
shows rank 0's median time per call with recording on and off and their ratio; "paired" is the median over
adjacent (on, off) pairs of runs of the ratio of their medians, which a preempted call moves far less on a loaded
machine, and "95% CI" a bootstrap interval for that median (whether "under 1%" holds is whether its upper end is
below 1.010); "A/A" is the ratio of medians between two sets of off runs in balanced positions: the noise floor of
the comparison. The runs follow ``_BLOCK``, so neither mode owns a position.

"all CPU" is the same paired ratio, its interval and its A/A for the CPU time of every rank together (each rank's
``time.process_time()`` around each call, summed over the ranks call by call): with more ranks than cores (N = 4
here) the cores must run all of it, and it is far less noisy than the wall clock, which the scheduler's choices
move by a few percent from call to call.

The header's "in situ" lines replay the same writes in one process with the data streamed through the caches
between them, as in a real call (the recorder's code and data are cold then). A lower bound only: timed section by
section inside real 1 MiB calls of two ranks, the same code took about six times as long (docs/tail.md, "The C
recorder, tried"), which is what the on/off ratio shows.

The last column is the CPU cost of what a ring all-reduce records per call (2(N-1) steps of one receive: two
marks each, and one clock read for the first, none for a later one whose data was there; the call's own record),
measured in-process as the minimum over short repeats
(what the code costs with hot caches and no preemption), over the median all-reduce time. In a real call the
recorder's code and data are cold after the payload streamed through the caches, so the on/off ratio can exceed it.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

from allreduce.runtime import spawn
from allreduce.runtime.stats._stats import SPILL_ENTRIES, Layout, Recorder
from allreduce.units import format_bytes, parse_size_range

_BLOCK = np.array([1, 0, 0, 1, 0, 1, 1, 0], dtype=bool)
"""Recording on (1) or off (0), run by run (``--run`` calls each), repeated: each mode takes every position in a
block of 4 equally often and comes first in half of the adjacent pairs, so a bias by position (on a loaded
machine, calls at even positions ran several percent slower than odd ones even with recording doing nothing)
cancels."""

_BATCH_S = 0.05
"""Target length of one batch: long enough to average many calls, short enough for many alternations."""


_BOOTSTRAP = 2_000
"""Resamples for the confidence interval of the paired ratio."""


def _median_interval(ratios: Any, seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval (percentile method) for the median of ``ratios``."""
    rng = np.random.default_rng(seed)
    flat = np.asarray(ratios, np.float64).ravel()
    medians = np.median(rng.choice(flat, size=(_BOOTSTRAP, flat.size), replace=True), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(low), float(high)


def _paired(times: Any, run: int) -> tuple[float, tuple[float, float], float]:
    """Of per-call ``times`` in :data:`_BLOCK` order: the paired on/off ratio, its 95% interval, and the A/A ratio."""
    # adjacent (on, off) pairs of each block: (0, 1), (3, 2), (5, 4), (6, 7), on first in half of them
    blocks = np.median(times.reshape(-1, run), axis=1).reshape(-1, _BLOCK.size)  # runs' medians
    pair_ratios = blocks[:, [0, 3, 5, 6]] / blocks[:, [1, 2, 4, 7]]
    off_a, off_b = blocks[:, [1, 2]], blocks[:, [4, 7]]
    return float(np.median(pair_ratios)), _median_interval(pair_ratios), float(np.median(off_a) / np.median(off_b))


def _rank(group: Any, sizes: list[int], rounds: int, run: int, algorithm: str) -> list[tuple[Any, Any, Any]]:
    """Per size: every call's wall time and this process's CPU time, and which calls recorded."""
    recorder = group.transport.recorder  # toggled per call: the group's setter would add a queue round trip
    recorder.reserve()  # what the group's setter does when recording is turned on
    out = []
    for size in sizes:
        x = np.zeros(size // 4, np.float32)
        for _ in range(3):
            group.all_reduce(x, algorithm=algorithm)
        start = time.perf_counter()
        group.all_reduce(x, algorithm=algorithm)
        # every rank must run the same number of calls: rank 0 decides and tells the others
        iters_arr = np.array([max(4, int(_BATCH_S / max(time.perf_counter() - start, 1e-6)))], np.float64)
        group.broadcast(iters_arr)
        calls = _BLOCK.size * run * max(1, int(iters_arr[0]) * rounds // (_BLOCK.size * run))
        recording = np.repeat(np.tile(_BLOCK, calls // (_BLOCK.size * run)), run)
        times = np.empty(calls)
        cpu = np.empty(calls)
        clock, cpu_clock = time.perf_counter, time.process_time
        for i in range(calls):
            recorder.enabled = bool(recording[i])
            c0 = cpu_clock()
            t0 = clock()
            group.all_reduce(x, algorithm=algorithm)
            times[i] = clock() - t0
            cpu[i] = cpu_clock() - c0
        recorder.enabled = False
        out.append((times, cpu, recording))
    return out


_COST_STEPS = 2_000
_COST_REPEATS = 100


def _min_time_s(fn: Any) -> float:
    """The fastest of several runs of ``fn()``, per step: the code's cost when the machine did not preempt it."""
    best = float("inf")
    for _ in range(_COST_REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best / _COST_STEPS


def _mark_step_cost_s() -> float:
    """One step with one receive as the shm transport records the call's first: a clock read before the wait, and
    two appends (the wait's own measure is free: 0 when the data was there, else clocks read while waiting); a
    later receive whose data was there appends two values and reads no clock."""
    recorder = Recorder(enabled=True)
    clock = time.perf_counter_ns

    def steps() -> None:
        mark = recorder.append
        waited = 0
        for _ in range(_COST_STEPS):
            began = clock()
            mark(began)
            mark(waited)
        recorder.log.clear()

    return _min_time_s(steps)


def _later_step_cost_s() -> float:
    """A later receive whose data was there: two appends, no clock read."""
    recorder = Recorder(enabled=True)

    def steps() -> None:
        mark = recorder.append
        waited = 0
        for _ in range(_COST_STEPS):
            mark(0)
            mark(waited)
        recorder.log.clear()

    return _min_time_s(steps)


def _call_cost_s() -> float:
    """The call's own part: the header (the group), the tag and the steps' end (the transport), the call's end
    (the group writes header and end inline; here the header through :meth:`Recorder.begin`, a little dearer)."""
    recorder = Recorder(enabled=True)
    layout = Layout([], concurrent=False)
    begin = recorder.begin
    clock = time.perf_counter_ns

    def calls() -> None:
        for i in range(_COST_STEPS):
            started = clock()  # the group reads this clock whether recording or not
            begin(i, started, 4096)
            mark = recorder.append
            mark(layout.tag)
            mark(clock())
            mark(clock())

    return _min_time_s(calls)


_IN_SITU_MAX_BYTES = 1 << 20
"""Beyond this the timing noise of streaming the data is larger than the recording's whole cost."""


def _in_situ_cost_ns(size_bytes: int, steps: int, repeats: int = 3000) -> float:
    """What recording adds to one call when its code and data are cold: one process runs a ring all-reduce's
    shape (``steps`` steps, each reducing half of ``size_bytes`` in place, streaming it through the caches) with and
    without the appends of the group and the shm transport, alternately; the difference of the medians."""
    recorder = Recorder(enabled=True)
    layout = Layout([(s, [(1, size_bytes // 8)]) for s in range(steps)], concurrent=False)
    a = np.ones(size_bytes // 8, np.float32)
    b = np.ones(size_bytes // 8, np.float32)
    clock = time.perf_counter_ns

    def call(rec: bool) -> None:  # the appends exactly as _group.py and shm/_transport.py make them
        started = clock()
        recorder.enabled = rec
        recording = recorder.enabled
        if recording:
            log = recorder.log
            if len(log) >= SPILL_ENTRIES:
                recorder.flush()
                log = recorder.log
            log.append(~1)
            log.append(started)
            log.append(size_bytes)
        mark = recorder.append if recorder.enabled else None
        if mark is not None:
            mark(layout.tag)
        began = 0
        boundary = True
        for _ in range(steps):
            if mark is not None and boundary:
                began = clock()
            waited = 0  # the data was there (a wait that waits measures itself while it waits)
            if mark is not None:
                if boundary:
                    mark(began)
                    boundary = False
                else:
                    mark(0)  # no boundary: the data was there (one that waited marks the clock its wait read)
                mark(waited)
            np.add(a, b, out=a)
        if mark is not None:
            mark(clock())
        if recording:
            log.append(clock())

    times: dict[bool, list[int]] = {True: [], False: []}
    for i in range(repeats):
        rec = bool(i & 1)
        t0 = clock()
        call(rec)
        times[rec].append(clock() - t0)
    return float(np.median(times[True]) - np.median(times[False]))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--sizes", default="4KiB,1MiB,64MiB")
    parser.add_argument("--rounds", type=int, default=30, help="batches of ~50 ms worth of calls, per mode")
    parser.add_argument(
        "--run",
        type=int,
        default=32,
        help="calls in a row in one mode; each run's median is compared (1: alternate call by call, which "
        "charges the off calls with what a recorded call's end delays the next call by)",
    )
    parser.add_argument(
        "--algorithm",
        default="ring",
        help="what every call runs (auto: small arrays take the one-pass small-call path; the CPU column still "
        "counts a ring's marks)",
    )
    args = parser.parse_args()
    sizes = parse_size_range(args.sizes)
    step_s, later_s, call_s = _mark_step_cost_s(), _later_step_cost_s(), _call_cost_s()
    print(
        f"CPU per recorded step: {step_s * 1e9:.0f} ns for a call's first (two marks, one clock read), "
        f"{later_s * 1e9:.0f} ns for a later one whose data was there (two marks); per call (header, tag, "
        f"the steps' end and the call's) {call_s * 1e9:.0f} ns (with its share of setting the list aside)"
    )
    for size in (s for s in sizes if s <= _IN_SITU_MAX_BYTES):
        print(
            f"in situ, {format_bytes(size)} ring of 2 (2 steps, the data streamed through the caches between marks; "
            f"a replay in one process, a lower bound): {_in_situ_cost_ns(size, 2):.0f} ns per call"
        )
    print(
        f"{'transport':>9} {'N':>3} {'size':>9} {'on':>11} {'off':>11} {'on/off':>7} {'paired':>7} "
        f"{'95% CI':>13} {'A/A':>7} {'steps':>6} {'CPU':>8} {'all CPU':>7} {'95% CI':>13} {'A/A':>7}"
    )
    for transport in args.transports.split(","):
        for world_size in (int(w) for w in args.world_sizes.split(",")):
            results = spawn(
                world_size, _rank, sizes, args.rounds, args.run, args.algorithm, init_options={"transport": transport}
            )
            for i, size in enumerate(sizes):
                times, _, recording = results[0][i]  # rank 0's clock
                on_s, off_s = float(np.median(times[recording])), float(np.median(times[~recording]))
                paired, (low, high), same = _paired(times, args.run)
                # every rank's CPU time, call by call: what a group with more ranks than cores waits for
                all_cpu = np.sum([r[i][1] for r in results], axis=0)
                cpu_paired, (cpu_low, cpu_high), cpu_same = _paired(all_cpu, args.run)
                steps = 2 * (world_size - 1)
                cpu = (step_s + (steps - 1) * later_s + call_s) / off_s
                print(
                    f"{transport:>9} {world_size:>3} {format_bytes(size):>9} {on_s * 1e6:>9.1f}us "
                    f"{off_s * 1e6:>9.1f}us {on_s / off_s:>7.3f} {paired:>7.3f} {f'{low:.3f}-{high:.3f}':>13} "
                    f"{same:>7.3f} {steps:>6} {cpu * 100:>7.3f}% {cpu_paired:>7.3f} "
                    f"{f'{cpu_low:.3f}-{cpu_high:.3f}':>13} {cpu_same:>7.3f}"
                )
    print(f"load average (1, 5, 15 min): {os.getloadavg()}")


if __name__ == "__main__":
    main()
