"""The event engine at scale: the compiled core (sim/_kernel.py, what engine="event" runs where numba is
installed) and the numpy cores (sim/_window.py's windowed core, sim/_event.py's per-event _Run), wall and CPU
time, peak memory, and agreement.

    .venv/bin/python benchmarks/bench_engines.py                   # the 1,024-rank cases, compiled core
    .venv/bin/python benchmarks/bench_engines.py --reference       # ... and the numpy cores (many minutes)
    .venv/bin/python benchmarks/bench_engines.py --ranks 256 512   # the same networks with fewer ranks
    .venv/bin/python benchmarks/bench_engines.py --grid            # agreement of the two cores on a grid
    .venv/bin/python benchmarks/bench_engines.py --cores 256       # both cores, CPU time, on four networks
    .venv/bin/python benchmarks/bench_engines.py --snapshot a.npz  # every array the compiled core fills ...
    .venv/bin/python benchmarks/bench_engines.py --against a.npz   # ... equal bit for bit after a change?
                                                   # (--with-large: and the 1,024-rank cases;
                                                   # --rtol 1e-9: times and rates to 1e-9 relative)
    .venv/bin/python benchmarks/bench_engines.py --one fat-tree:k=26 4096 ring streamed   # one run, as JSON
                                                   # (core: kernel as engine="event" runs it, whole or
                                                   # streamed layout, windowed, per-event; --stop 0.05:
                                                   # stopped after 5% of its transfers, CPU-s up to there,
                                                   # and at each hundredth of them: share, CPU-s by part,
                                                   # solves, in play, changed, nodes visited, instants,
                                                   # heap size, steps in the buffers)

Cases (64 MiB per rank, random placement, seed 0, as `allreduce sim --placement random`): ring on a k=16
fat-tree (ECMP); ring and double binary tree (8 chunks) on a 32x8x32 Clos with 4:1 oversubscription. Each run is
a fresh process, so "peak MB" is that process's maximum resident set (interpreter and numpy included: about
50 MB before any work). Times are of simulate(engine=...) alone; the machine is shared, so CPU seconds are the
figure to compare and the load average is printed.

--grid compares the two cores transfer by transfer on small and medium cases (all delivery times, rank end
times; relative), and the compiled core with the per-event one. Where either differs beyond 1e-9, the per-event
core is run once more with every start NUDGE_S later (rounding-sized): that column is how far the reference
itself moves under rounding-sized changes. The "numpy runs" column says which core engine="event" runs without
numba (the windowed one gives way where its passes cost more).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

SIZE_BYTES = 64 * 2**20
FAT_TREE = "fat-tree:k=16"
CLOS = "clos:leaves=32,spines=8,hosts_per_leaf=32,oversub=4"
CASES = ((FAT_TREE, "ring"), (CLOS, "ring"), (CLOS, "double_binary_tree"))
# A nudge of every start time by this much (seconds, rounding-sized against runs of milliseconds) says how far a
# run moves under rounding: where it moves more than 1e-9, no change of summation order can agree to 1e-9.
NUDGE_S = 1e-15


class _StoppedError(Exception):
    """Raised by --one's progress callback to stop a run after --stop of its transfers."""


def one(spec: str, ranks: int, algorithm: str, core: str, stop: float = 1.0) -> dict[str, object]:
    """One simulation in this process: engine="event" with the given core; stopped (through the progress
    callback) once ``stop`` of its transfers are delivered, where ``stop`` < 1 (then "seconds" and "rank_end"
    are null, and the CPU times are those up to the stop)."""
    import numpy as np

    from allreduce.schedules import Collective, make_schedule
    from allreduce.sim import _event, _kernel, simulate
    from allreduce.topology import parse_topology

    stats: list[list[int]] = []
    parts: dict[str, float] = {}  # a streamed run's CPU seconds by part
    # A streamed run's CPU seconds by part so far, at each hundredth of its transfers (with --stop).
    slices: list[list[float]] = []
    streamed_runs: list[object] = []
    queues: list[object] = []
    if core in ("kernel", "streamed"):
        # The compiled core on a streamed layout (sim/_stream.py): where run_event takes it ("kernel": beyond 2^22
        # transfers), or whatever the schedule's size ("streamed"); its counts and CPU seconds by part.
        from allreduce.sim import _stream

        if core == "streamed":
            _event.STREAM_TRANSFERS = -1
        compiled_stream = _stream.StreamRun.run
        made_queue = _stream.Queue

        class _Queue(made_queue):  # type: ignore[misc,valid-type]
            """The run's queue, kept so that the progress callback can read its size and counts."""

            def __init__(self, *args: object, **kwargs: object) -> None:
                super().__init__(*args, **kwargs)
                queues.append(self)

        _stream.Queue = _Queue  # type: ignore[misc]

        def counted_stream(run: _stream.StreamRun, progress: object = None) -> None:
            streamed_runs.append(run)
            try:
                compiled_stream(run, progress)  # type: ignore[arg-type]
            finally:
                stats.append(run.kernel_stats.tolist())
                parts.update(run.cpu_s)

        _stream.StreamRun.run = counted_stream  # type: ignore[method-assign]
    elif core == "whole":
        _event.STREAM_TRANSFERS = 2**62
    if core in ("kernel", "whole", "streamed"):
        # The compiled core's counts (rate solves, transfers in play, rates changed, levels filled, list nodes
        # visited): what its time goes into. run_core imports run_kernel when it runs.
        compiled = _kernel.run_kernel

        def counted(run: object, progress: object = None) -> None:
            compiled(run, progress)  # type: ignore[arg-type]
            stats.append(run.kernel_stats.tolist())  # type: ignore[attr-defined]

        _kernel.run_kernel = counted  # type: ignore[assignment]
    else:
        os.environ["ALLREDUCE_SIM_KERNEL"] = "numpy"
    if core == "per-event":
        # The per-event core in place of the windowed one: run_event falls back to it when the windowed core is
        # not usable.
        class _Unusable(_event.WindowRun):
            def __init__(self, *args: object, **kwargs: object) -> None:
                self.usable = False

        _event.WindowRun = _Unusable  # type: ignore[misc]
    topo = parse_topology(spec)
    sched = make_schedule(Collective.ALL_REDUCE, algorithm, ranks, chunks=8)
    delivered = [0.0]

    def progress(fraction: float) -> None:
        delivered[0] = fraction
        if streamed_runs and int(100 * fraction) > len(slices):
            run: Any = streamed_runs[0]
            # CPU-s by part; the kernel's counts so far (rate solves, transfers in play, rates changed, list nodes
            # visited by re-solves), instants with a re-solve, events queued on the heap, steps laid out and not
            # released (the band of steps under way and ahead).
            counts, counters, state = run.kernel_stats, run._work[8][-1], queues[0].state  # type: ignore[attr-defined]
            slices.append(
                [
                    round(fraction, 4),
                    *(round(run.cpu_s[part], 2) for part in ("lay out", "kernel", "fold")),
                    *(int(v) for v in counts[:3]),
                    int(counters[4]),
                    int(state[3]),
                    int(state[0]),
                    run.high - run.low,
                ]
            )
        if fraction >= stop:
            raise _StoppedError

    wall, cpu = time.perf_counter(), time.process_time()
    try:
        result = simulate(
            sched,
            topo,
            size_bytes=SIZE_BYTES,
            placement="random",
            seed=0,
            engine="event",
            progress=progress if stop < 1 else None,
        )
    except _StoppedError:
        result = None
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "seconds": None if result is None else result.seconds,
        "rank_end": None if result is None else np.asarray(result.rank_end_s).tolist(),
        "delivered": 1.0 if result is not None else delivered[0],
        "wall": wall,
        "cpu": cpu,
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "kernel_stats": stats[0] if stats else [],
        "cpu_parts": parts,
        "cpu_parts_by_hundredth": slices,
    }


def spawn(spec: str, ranks: int, algorithm: str, core: str, timeout_s: float) -> dict[str, object] | None:
    cmd = [sys.executable, __file__, "--one", spec, str(ranks), algorithm, core]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _counts(row: dict[str, object]) -> str:
    """The compiled core's work per rate solve: transfers in play (re-solved), rates changed, levels filled,
    link-list nodes visited."""
    stats = row.get("kernel_stats")
    if not isinstance(stats, list) or not stats or not stats[0]:
        return ""
    solves, flows, moved, levels, visited = (*stats, 0)[:5]
    return (
        f"{solves:,} solves x {flows / solves:.1f} in play, {moved / solves:.1f} changed, "
        f"{levels / solves:.1f} levels, {visited / solves:.1f} nodes"
    )


def scale(ranks_list: list[int], reference: bool, timeout_s: float) -> None:
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(
        f"{'case':<66} {'ranks':>6} {'core':<9} {'wall s':>8} {'cpu s':>8} {'peak MB':>8} {'time ms':>10} "
        f"{'vs ref':>9} work"
    )
    for ranks in ranks_list:
        for spec, algorithm in CASES:
            rows = {}
            for core in ("kernel", "windowed") if reference else ("kernel",):
                rows[core] = row = spawn(spec, ranks, algorithm, core, timeout_s)
                label = f"{spec} {algorithm}"
                if row is None:
                    print(f"{label:<66} {ranks:>6} {core:<9} {'> ' + str(int(timeout_s)):>8}", flush=True)
                    continue
                agree = ""
                ref = rows.get("kernel") if core != "kernel" else None
                if ref is not None:
                    import numpy as np

                    a, b = np.asarray(ref["rank_end"]), np.asarray(row["rank_end"])
                    agree = f"{float(np.max(np.abs(a - b) / b)):.1e}"
                print(
                    f"{label:<66} {ranks:>6} {core:<9} {row['wall']:>8.1f} {row['cpu']:>8.1f} {row['peak_mb']:>8.0f} "
                    f"{float(row['seconds']) * 1e3:>10.4f} {agree:>9} {_counts(row)}",
                    flush=True,
                )
    print(f"load average {os.getloadavg()[0]:.1f}")


GRID_NETWORKS = (
    ("fat-tree:k=4", 16),
    ("fat-tree:k=8", 64),
    ("fat-tree:k=8", 128),
    ("clos:leaves=4,spines=2,hosts_per_leaf=8,oversub=4", 32),
    ("clos:leaves=8,spines=4,hosts_per_leaf=16,oversub=4", 128),
    ("torus:4x4", 16),
    ("torus:8x8", 64),
    ("rail:nodes=4,gpus=8", 32),
    ("switch:16", 16),
    ("dragonfly:groups=5,routers=4,hosts=2", 40),
)
GRID_ALGORITHMS = ("ring", "halving_doubling", "double_binary_tree", "hierarchical", "recursive_doubling")


def grid() -> None:
    import numpy as np

    from allreduce.schedules import Collective, make_schedule
    from allreduce.sim import match_transfers
    from allreduce.sim._event import _Run
    from allreduce.sim._kernel import run_kernel
    from allreduce.sim._layout import Layout
    from allreduce.sim._routing import Router
    from allreduce.sim._window import WindowRun
    from allreduce.topology import parse_topology, place

    print(f"load average {os.getloadavg()[0]:.1f}")
    print(
        f"{'network':<52} {'ranks':>5} {'algorithm':<19} {'placement':<9} {'per-event s':>11} {'windowed s':>10} "
        f"{'differs':>9} {'ref moves':>9} {'numpy runs':>9} {'compiled':>9}"
    )
    cases = worst = worst_event = worst_kernel = 0.0
    beyond = unexplained = 0
    for spec, ranks in GRID_NETWORKS:
        topo = parse_topology(spec)
        for algorithm in GRID_ALGORITHMS:
            if algorithm in ("halving_doubling", "recursive_doubling") and ranks & (ranks - 1):
                continue
            sched = make_schedule(Collective.ALL_REDUCE, algorithm, ranks, chunks=8, group_size=8)
            for placement in ("linear", "random"):
                rank_gpu = np.asarray(place(ranks, topo, placement, seed=1), dtype=np.int64)
                transfers = match_transfers(sched)
                cpu = []
                runs = []
                for core in (_Run, WindowRun):
                    start = time.process_time()
                    run = core(sched, Router(topo, rank_gpu, None, 1), transfers, 2.0**24, None)
                    if isinstance(run, WindowRun):
                        run.run(may_give_up=False)
                    else:
                        run.run()
                    cpu.append(time.process_time() - start)
                    runs.append(run)
                ref, new = runs
                compiled = Layout(sched, Router(topo, rank_gpu, None, 1), transfers, 2.0**24, None)
                run_kernel(compiled)
                kernel_differs = max(
                    float(np.max(np.abs(compiled.delivered_s - ref.delivered_s) / ref.delivered_s)),
                    float(np.max(np.abs(compiled.rank_end - ref.rank_end) / ref.rank_end)),
                )
                worst_kernel = max(worst_kernel, kernel_differs)
                # What engine="event" runs: the windowed core unless it gives way to the per-event core.
                kept = WindowRun(sched, Router(topo, rank_gpu, None, 1), transfers, 2.0**24, None).run()
                differs = max(
                    float(np.max(np.abs(new.delivered_s - ref.delivered_s) / ref.delivered_s)),
                    float(np.max(np.abs(new.rank_end - ref.rank_end) / ref.rank_end)),
                )
                moves = ""
                if differs > 1e-9:
                    beyond += 1
                if max(differs, kernel_differs) > 1e-9:
                    router = Router(topo, rank_gpu, None, 1)
                    nudged = _Run(sched, router, transfers, 2.0**24, None, start_s=np.full(ranks, NUDGE_S))
                    nudged.run()
                    moved = max(
                        float(np.max(np.abs(nudged.delivered_s - ref.delivered_s) / ref.delivered_s)),
                        float(np.max(np.abs(nudged.rank_end - ref.rank_end) / ref.rank_end)),
                    )
                    moves = f"{moved:.1e}"
                    unexplained += kernel_differs > 1e-9 >= moved
                cases += 1
                worst = max(worst, differs)
                if kept:
                    worst_event = max(worst_event, differs)
                print(
                    f"{spec:<52} {ranks:>5} {algorithm:<19} {placement:<9} {cpu[0]:>11.2f} {cpu[1]:>10.2f} "
                    f"{differs:>9.1e} {moves:>9} {'windowed' if kept else 'per-event':>9} {kernel_differs:>9.1e}",
                    flush=True,
                )
    print(
        f"{int(cases)} cases; the windowed core differs beyond 1e-9 in {beyond} (worst {worst:.1e}); engine=event "
        f"without numba (windowed where it keeps it) worst {worst_event:.1e}; the compiled core worst "
        f"{worst_kernel:.1e}, beyond 1e-9 where a {NUDGE_S:.0e} s nudge moves the reference less in "
        f"{unexplained}; load average {os.getloadavg()[0]:.1f}"
    )


# What a run of the compiled core fills in: every array --snapshot saves and --against compares bit for bit.
KERNEL_FIELDS = (
    "slot_start",
    "slot_end",
    "slot_last",
    "trigger",
    "start_s",
    "drained_s",
    "delivered_s",
    "rank_end",
    "slowest_rate",
    "bottleneck",
)
# Beyond the grid: the 1,024-rank cases the kernel is timed on, and the exact tail's schedule.
SNAPSHOT_LARGE = (
    (FAT_TREE, 1024, "ring"),
    (CLOS, 1024, "double_binary_tree"),
    (FAT_TREE, 1024, "halving_doubling"),
)


def _snapshot_runs(large: bool) -> object:
    """Each grid case (and with ``large`` the 1,024-rank ones) run by the compiled core twice: as it is, and
    with slow ranks, late starts and extra delays, then replayed on the same layout with other ones (the
    tail's re-runs); yields (name, arrays, nudged): ``nudged()`` runs it again with every start NUDGE_S later
    and returns its arrays."""
    import numpy as np

    from allreduce.schedules import Collective, make_schedule
    from allreduce.sim import match_transfers
    from allreduce.sim._kernel import run_kernel
    from allreduce.sim._layout import Layout
    from allreduce.sim._routing import Router
    from allreduce.topology import parse_topology, place

    cases = [
        (spec, ranks, algorithm, placement, 2.0**24)
        for spec, ranks in GRID_NETWORKS
        for algorithm in GRID_ALGORITHMS
        if not (algorithm in ("halving_doubling", "recursive_doubling") and ranks & (ranks - 1))
        for placement in ("linear", "random")
    ]
    if large:
        cases += [(spec, ranks, algorithm, "random", float(SIZE_BYTES)) for spec, ranks, algorithm in SNAPSHOT_LARGE]

    def arrays(run: Layout) -> dict[str, object]:
        return {field: np.asarray(getattr(run, field)).copy() for field in KERNEL_FIELDS}

    def nudge(run: Layout, start_s: object, extra_s: object) -> object:
        def nudged() -> dict[str, object]:
            run.replay(np.asarray(start_s) + NUDGE_S, np.asarray(extra_s))
            run_kernel(run)
            return arrays(run)

        return nudged

    for spec, ranks, algorithm, placement, size in cases:
        topo = parse_topology(spec)
        sched = make_schedule(Collective.ALL_REDUCE, algorithm, ranks, chunks=8, group_size=8)
        rank_gpu = np.asarray(place(ranks, topo, placement, seed=1), dtype=np.int64)
        transfers = match_transfers(sched)
        count = len(transfers)
        for noisy in (False, True):
            name = f"{spec} {ranks} {algorithm} {placement}{' noisy' if noisy else ''}"
            rng = np.random.default_rng(ranks + count)
            delay = np.where(rng.random(ranks) < 0.2, rng.uniform(0, 3e-5, ranks), 0.0) if noisy else None
            start, extra = np.zeros(ranks), np.zeros(count)
            if noisy:
                extra = np.where(rng.random(count) < 0.1, rng.uniform(0, 1e-5, count), 0.0)
                start = rng.uniform(0, 2e-5, ranks)
            run = Layout(sched, Router(topo, rank_gpu, None, 1), transfers, size, delay, start_s=start, extra_s=extra)
            run_kernel(run)
            yield name, arrays(run), nudge(run, start, extra)
            if noisy:
                replay = np.random.default_rng(7)
                start, extra = replay.uniform(0, 1e-5, ranks), np.where(replay.random(count) < 0.05, 2e-5, 0.0)
                run.replay(start, extra)
                run_kernel(run)
                yield name + " replayed", arrays(run), nudge(run, start, extra)


def _relative(new: object, old: object) -> float:
    """The largest relative difference of two float arrays (equal entries, NaNs and infinities included,
    count 0; an entry finite in one and not the other, infinity)."""
    import numpy as np

    a, b = np.asarray(new), np.asarray(old)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    if same.all():
        return 0.0
    if not (np.isfinite(a[~same]).all() and np.isfinite(b[~same]).all()):
        return float("inf")
    return float(np.max(np.abs(a[~same] - b[~same]) / np.maximum(np.abs(a[~same]), np.abs(b[~same]))))


def snapshot(path: str, against: bool, large: bool, rtol: float = 0.0) -> int:
    """Save every array the compiled core fills on the grid to ``path`` (an .npz), or compare with one saved
    before: bit for bit (NaNs included), what "the same results" means for a change that keeps every sum; or
    (``rtol`` > 0) every time and rate to ``rtol`` relative, for a change of the re-solve. Then a run beyond
    ``rtol`` is run once more with every start NUDGE_S later: if that moves it beyond ``rtol`` too, the run is
    one that rounding moves (its sums in another order would too), and is counted apart; the integer arrays
    (the transfer that ended each step, the step that let each start, the bottleneck named) are counted where
    they differ, not failed: two transfers delivered within rounding of each other may swap."""
    import numpy as np

    saved = np.load(path) if against else None
    arrays: dict[str, object] = {}
    runs = differ = swapped = moved = 0
    worst = 0.0
    cpu = time.process_time()
    for name, fields, nudged in _snapshot_runs(large):  # type: ignore[attr-defined]
        runs += 1
        error = 0.0
        for field, array in fields.items():
            key = f"{name} | {field}"
            if saved is None:
                arrays[key] = array
                continue
            before = saved[key]
            if array.dtype == before.dtype and array.tobytes() == before.tobytes():
                continue
            if not rtol or array.shape != before.shape:
                differ += 1
                print(f"differs: {key}", flush=True)
            elif array.dtype.kind == "f":
                error = max(error, _relative(array, before))
            else:
                swapped += int(np.count_nonzero(array != before))
        if error <= rtol:
            worst = max(worst, error)
            continue
        moves = max(_relative(array, fields[field]) for field, array in nudged().items() if array.dtype.kind == "f")
        if moves > rtol:
            moved += 1
            print(f"moves under rounding: {name}: differs {error:.1e}, a {NUDGE_S:.0e} s nudge moves it {moves:.1e}")
        else:
            differ += 1
            print(f"differs: {name}: {error:.1e} (a {NUDGE_S:.0e} s nudge moves it {moves:.1e})", flush=True)
    if saved is None:
        np.savez(path, **arrays)  # type: ignore[arg-type]
        verdict = "saved to " + path
    elif rtol:
        verdict = (
            f"{differ} differ from {path} beyond {rtol:.0e} (the rest: worst {worst:.1e}); {moved} beyond it move "
            f"beyond it under a {NUDGE_S:.0e} s nudge too; {swapped} integer entries differ"
        )
    else:
        verdict = f"{differ} arrays differ from {path}"
    print(f"{runs} runs, {verdict}; {time.process_time() - cpu:.1f} CPU-s, load average {os.getloadavg()[0]:.1f}")
    return 1 if differ else 0


CORE_CASES = (
    ("fat-tree:k=16", "ring"),
    ("clos:leaves=8,spines=8,hosts_per_leaf=32,oversub=4", "ring"),
    ("clos:leaves=8,spines=8,hosts_per_leaf=32,oversub=4", "double_binary_tree"),
    ("torus:16x16", "ring"),
)


def cores(ranks: int) -> None:
    """Both cores on the same transfers, CPU seconds, and the windowed core's passes and filling levels per
    transfer (what run_event's choice between them counts)."""
    import numpy as np

    from allreduce.schedules import Collective, make_schedule
    from allreduce.sim import match_transfers
    from allreduce.sim._event import _Run
    from allreduce.sim._routing import Router
    from allreduce.sim._window import WindowRun
    from allreduce.topology import parse_topology, place

    print(f"load average {os.getloadavg()[0]:.1f}")
    print(
        f"{'network':<52} {'ranks':>5} {'algorithm':<19} {'transfers':>9} {'work/xfer':>9} {'windowed s':>10} "
        f"{'per-event s':>11}"
    )
    for spec, algorithm in CORE_CASES:
        topo = parse_topology(spec)
        sched = make_schedule(Collective.ALL_REDUCE, algorithm, ranks, chunks=8)
        rank_gpu = np.asarray(place(ranks, topo, "random", seed=0), dtype=np.int64)
        transfers = match_transfers(sched)
        start = time.process_time()
        windowed = WindowRun(sched, Router(topo, rank_gpu, None, 0), transfers, SIZE_BYTES, None)
        windowed.run(may_give_up=False)
        windowed_s = time.process_time() - start
        start = time.process_time()
        _Run(sched, Router(topo, rank_gpu, None, 0), transfers, SIZE_BYTES, None).run()
        per_event_s = time.process_time() - start
        work = (windowed.passes + windowed.levels) / len(transfers)
        print(
            f"{spec:<52} {ranks:>5} {algorithm:<19} {len(transfers):>9} {work:>9.2f} {windowed_s:>10.1f} "
            f"{per_event_s:>11.1f}",
            flush=True,
        )
    print(f"load average {os.getloadavg()[0]:.1f}")


# The smallest k=2j fat-tree (k^3/4 GPUs) that holds each group.
LARGE_FAT_TREES = {2048: "fat-tree:k=22", 4096: "fat-tree:k=26", 16384: "fat-tree:k=42"}


def large(ranks_list: list[int], max_transfers: int, timeout_s: float) -> None:
    """The event engine (compiled core) on large fat-trees, random placement, ring and double binary tree:
    wall and CPU seconds, peak memory; groups of more than ``max_transfers`` transfers are not run (beyond 2^22
    transfers the engine streams the layout, so memory is no longer what bounds them, but time is: a 4,096-rank
    ring's 33.5 M transfers take about a minute of CPU, a 16,384-rank ring's 537 M about 25 minutes)."""
    from allreduce.schedules import Collective, make_schedule

    print(f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'case':<36} {'ranks':>6} {'transfers':>11} {'wall s':>8} {'cpu s':>8} {'peak MB':>8} {'time ms':>10} work")
    for ranks in ranks_list:
        spec = LARGE_FAT_TREES[ranks]
        for algorithm in ("ring", "double_binary_tree"):
            count = int(make_schedule(Collective.ALL_REDUCE, algorithm, ranks, chunks=8).streams.steps.sum())
            label = f"{spec} {algorithm}"
            if count > max_transfers:
                print(f"{label:<36} {ranks:>6} {count:>11} {'(not run: over --max-transfers)':>30}", flush=True)
                continue
            row = spawn(spec, ranks, algorithm, "kernel", timeout_s)
            if row is None:
                print(f"{label:<36} {ranks:>6} {count:>11} {'> ' + str(int(timeout_s)):>8}", flush=True)
                continue
            print(
                f"{label:<36} {ranks:>6} {count:>11} {row['wall']:>8.1f} {row['cpu']:>8.1f} {row['peak_mb']:>8.0f} "
                f"{float(row['seconds']) * 1e3:>10.4f} {_counts(row)}",
                flush=True,
            )
    print(f"load average {os.getloadavg()[0]:.1f}")


ERROR_NETWORKS = (
    ("fat-tree", {256: "fat-tree:k=12", 1024: "fat-tree:k=16", 4096: "fat-tree:k=26"}),
    ("clos 1:1", {n: f"clos:leaves={n // 32},spines=16,hosts_per_leaf=32,oversub=1" for n in (256, 1024, 4096)}),
    ("clos 4:1", {n: f"clos:leaves={n // 32},spines=8,hosts_per_leaf=32,oversub=4" for n in (256, 1024, 4096)}),
    ("rail", {n: f"rail:nodes={n // 8},gpus=8" for n in (256, 1024, 4096)}),
    ("torus", {256: "torus:16x16", 1024: "torus:32x32", 4096: "torus:64x64"}),
    (
        "dragonfly",
        {
            256: "dragonfly:groups=16,routers=8,hosts=2",
            1024: "dragonfly:groups=32,routers=8,hosts=4",
            4096: "dragonfly:groups=64,routers=16,hosts=4",
        },
    ),
)
ERROR_ALGORITHMS = ("ring", "halving_doubling", "double_binary_tree", "hierarchical")


def errors(ranks_list: list[int], max_transfers: int) -> None:
    """The fast engine against the event engine (the compiled core) on a grid: the fast engine's relative
    error per case, and whether it certified its result; cases of more than ``max_transfers`` transfers are
    left out (the event engine's memory grows with them)."""
    from allreduce.schedules import Collective, make_schedule
    from allreduce.sim import simulate
    from allreduce.topology import parse_topology

    print(f"load average {os.getloadavg()[0]:.1f}")
    print(
        f"{'network':<10} {'ranks':>5} {'algorithm':<19} {'placement':<9} {'transfers':>10} {'fast ms':>10} "
        f"{'event ms':>10} {'fast err':>9} {'certified':>9} {'event s':>8}"
    )
    worst: dict[str, float] = {}
    for ranks in ranks_list:
        for label, specs in ERROR_NETWORKS:
            topo = parse_topology(specs[ranks])
            for algorithm in ERROR_ALGORITHMS:
                sched = make_schedule(Collective.ALL_REDUCE, algorithm, ranks, chunks=8, group_size=8)
                count = int(sched.streams.steps.sum())
                for placement in ("linear", "random"):
                    kwargs = {"size_bytes": SIZE_BYTES, "placement": placement, "seed": 0}
                    fast = simulate(sched, topo, engine="fast", **kwargs)  # type: ignore[arg-type]
                    if count > max_transfers:
                        print(
                            f"{label:<10} {ranks:>5} {algorithm:<19} {placement:<9} {count:>10} "
                            f"{fast.seconds * 1e3:>10.3f} {'(skipped)':>10}",
                            flush=True,
                        )
                        continue
                    cpu = time.process_time()
                    event = simulate(sched, topo, engine="event", **kwargs)  # type: ignore[arg-type]
                    cpu = time.process_time() - cpu
                    err = fast.seconds / event.seconds - 1
                    if not fast.exact:
                        worst[algorithm] = max(worst.get(algorithm, 0.0), abs(err))
                    print(
                        f"{label:<10} {ranks:>5} {algorithm:<19} {placement:<9} {count:>10} "
                        f"{fast.seconds * 1e3:>10.3f} {event.seconds * 1e3:>10.3f} {err:>+9.2%} "
                        f"{'yes' if fast.exact else 'no':>9} {cpu:>8.1f}",
                        flush=True,
                    )
    print(
        "worst |error| where the fast engine did not certify: "
        + ", ".join(f"{a} {e:.1%}" for a, e in sorted(worst.items()))
    )
    print(f"load average {os.getloadavg()[0]:.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024])
    parser.add_argument("--reference", action="store_true", help="also run the numpy cores (slow)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run before giving up")
    parser.add_argument("--grid", action="store_true", help="instead: agreement of the two cores on a grid")
    parser.add_argument("--cores", type=int, metavar="RANKS", help="instead: both cores' CPU time on four networks")
    parser.add_argument("--large", action="store_true", help="instead: 2,048-16,384 ranks on fat-trees")
    parser.add_argument("--errors", action="store_true", help="instead: the fast engine's error on a grid")
    parser.add_argument("--max-transfers", type=int, default=2**22, help="--errors: larger cases are left out")
    parser.add_argument("--snapshot", metavar="NPZ", help="instead: save every array the kernel fills on the grid")
    parser.add_argument("--against", metavar="NPZ", help="instead: compare those arrays with a snapshot, bit for bit")
    parser.add_argument("--with-large", action="store_true", help="--snapshot/--against: also the 1,024-rank cases")
    parser.add_argument(
        "--rtol", type=float, default=0.0, help="--against: times and rates to this relative tolerance, not bit for bit"
    )
    parser.add_argument("--one", nargs=4, metavar=("SPEC", "RANKS", "ALGORITHM", "CORE"), help=argparse.SUPPRESS)
    parser.add_argument("--stop", type=float, default=1.0, help="--one: stop after this share of the transfers")
    args = parser.parse_args()
    if args.one:
        spec, ranks, algorithm, core = args.one
        print(json.dumps(one(spec, int(ranks), algorithm, core, args.stop)))
        return 0
    if args.snapshot or args.against:
        return snapshot(args.snapshot or args.against, bool(args.against), args.with_large, args.rtol)
    if args.large:
        large(args.ranks if args.ranks != [1024] else [4096, 16384], args.max_transfers, args.timeout)
        return 0
    if args.errors:
        errors(args.ranks if args.ranks != [1024] else [256, 1024, 4096], args.max_transfers)
        return 0
    if args.grid:
        grid()
        return 0
    if args.cores:
        cores(args.cores)
        return 0
    scale(args.ranks, args.reference, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
