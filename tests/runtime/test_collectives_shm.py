"""Every collective × algorithm × dtype × op on the shared-memory transport, real processes, exact references.

The same matrix runs over TCP in test_tcp_group.py (the worker is shared).

One set of processes per world size runs all combinations (so the suite stays fast); each rank returns the
combinations it got wrong, and the test asserts there are none — and that every combination actually ran.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_group_harness import contribution, reference, report, run_ranks

import allreduce
from allreduce.runtime import ALGORITHMS, DTYPES, OPS
from allreduce.runtime._shm import _S_BUF_SEG, _SEG_EAGER, _SEG_PRIVATE
from allreduce.schedules import Collective, block_bounds

INT_KINDS = "iu"


def _sizes(world_size: int) -> list[int]:
    # 0, 1, primes, and sizes that leave remainders against N blocks × 3 segments
    return [0, 1, 13, world_size * 3 + 1, 1031]


def _tolerance(dtype: np.dtype[Any]) -> float:
    return {2: 1e-2, 4: 1e-6, 8: 1e-12}.get(dtype.itemsize, 0.0) if dtype.kind == "f" or dtype.itemsize == 2 else 0.0


def _close(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any], op: str) -> bool:
    if op != "avg" or got.dtype.kind in INT_KINDS:
        return bool(np.array_equal(got.view(np.uint8), want.view(np.uint8))) or bool(np.array_equal(got, want))
    return bool(np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=2e-2, atol=1e-2))


def _run_matrix(group: allreduce.ProcessGroup, transport: str) -> dict[str, Any]:
    n, rank = group.world_size, group.rank
    failures: list[str] = []
    ran = 0
    # this machine lets ranks read each other's memory: the probe at start-up must have found that
    cross_memory = bool(getattr(group._transport, "_cross_memory", False))
    paths: set[tuple[str, int]] = set()
    combos = [(dname, dt, op) for dname, dt in DTYPES.items() for op in OPS if not (op == "avg" and dt.kind in "iu")]
    for algorithm in ALGORITHMS[Collective.ALL_REDUCE]:
        if algorithm == "hierarchical":
            group.group_size = 2 if n % 2 == 0 else n
        else:
            group.group_size = n
        for k, (dname, dt, op) in enumerate(combos):
            sizes = _sizes(n)
            # every size for one dtype per algorithm, a rotating size for the rest of the matrix
            for count in sizes if dname == "int32" else [sizes[k % len(sizes)], 1031]:
                # small plain arrays through per-step snapshots (eager), plain arrays read in place by peers
                # (process_vm_readv), plain arrays staged through shared memory on odd ranks, group.empty()
                # arrays next to eager ranks: each rank picks its own path, readers follow the data's owner
                for mode in ("eager", "cross", "staged", "shm"):
                    x = contribution(dt, count, rank, op)
                    if mode == "shm":
                        y = group.empty(count, dt)
                        y[...] = x
                        x = y
                    if transport == "shm":
                        shm = group._transport
                        shm._cross_memory = not (mode == "staged" and rank % 2)  # type: ignore[attr-defined]
                        shm._cross_memory_min_bytes = 0  # type: ignore[attr-defined]
                        eager = mode == "eager" or (mode == "shm" and rank % 2 == 0)
                        shm._eager_bytes = 64 << 10 if eager else 0  # type: ignore[attr-defined]
                    group.all_reduce(x, op=op, algorithm=algorithm, segments=1 + count % 3)
                    ran += 1
                    if transport == "shm" and n > 1 and count > 0:
                        # what this rank published as its data's home (eager snapshot, private memory, ...)
                        paths.add((mode, int(group._transport._views[rank][_S_BUF_SEG])))  # type: ignore[attr-defined]
                    if not _close(x, reference(dt, count, n, op), op):
                        failures.append(f"all_reduce {algorithm} {dname} {op} count={count} {mode}")
    group.group_size = n
    for algorithm in ALGORITHMS[Collective.REDUCE_SCATTER]:
        for dname, dt, op in combos:
            for count in _sizes(n):
                x = contribution(dt, count, rank, op)
                block = group.reduce_scatter(x, op=op, algorithm=algorithm)
                lo, hi = (int(v) for v in block_bounds(count, n)[rank : rank + 2])
                ran += 1
                if block.shape != (hi - lo,) or not _close(block, reference(dt, count, n, op)[lo:hi], op):
                    failures.append(f"reduce_scatter {algorithm} {dname} {op} count={count}")
    for algorithm in ALGORITHMS[Collective.ALL_GATHER]:
        for dname, dt in DTYPES.items():
            for count in _sizes(n):
                bounds = block_bounds(count, n)
                want = np.concatenate(
                    [contribution(dt, count, r, "sum")[bounds[r] : bounds[r + 1]] for r in range(n)]
                ).astype(dt)
                x = np.zeros(count, dtype=dt)
                x[bounds[rank] : bounds[rank + 1]] = want[bounds[rank] : bounds[rank + 1]]
                group.all_gather(x, algorithm=algorithm)
                ran += 1
                if not np.array_equal(x.view(np.uint8), want.view(np.uint8)):
                    failures.append(f"all_gather {algorithm} {dname} count={count}")
    for algorithm in ALGORITHMS[Collective.BROADCAST]:
        for root in sorted({0, n - 1, n // 2}):
            for dname, dt in DTYPES.items():
                for count in _sizes(n):
                    want = contribution(dt, count, root, "sum")
                    x = contribution(dt, count, rank, "sum") if rank == root else np.zeros(count, dt)
                    group.broadcast(x, root=root, algorithm=algorithm)
                    ran += 1
                    if not np.array_equal(x.view(np.uint8), want.view(np.uint8)):
                        failures.append(f"broadcast {algorithm} root={root} {dname} count={count}")
    for algorithm in ALGORITHMS[Collective.REDUCE]:
        for root in sorted({0, n - 1}):
            for k, (dname, dt, op) in enumerate(combos):
                count = _sizes(n)[k % 5]
                mine = contribution(dt, count, rank, op)
                x = mine.copy()
                group.reduce(x, root=root, op=op, algorithm=algorithm)
                ran += 1
                want = reference(dt, count, n, op) if rank == root else mine
                if not _close(x, want, op):
                    failures.append(f"reduce {algorithm} root={root} {dname} {op} count={count}")
    return {
        "failures": failures,
        "ran": ran,
        "transport": group.transport_name,
        "cross_memory": cross_memory,
        "paths": paths,
    }


def _matrix_worker(rank: int, n: int, port: int, out: Any, transport: str) -> None:
    def body() -> dict[str, Any]:
        with allreduce.init(rank, n, master_port=port, transport=transport, timeout_s=120) as group:
            return _run_matrix(group, transport)

    report(out, rank, body)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_every_collective_algorithm_dtype_and_op_is_exact_over_shm(world_size: int) -> None:
    results = run_ranks(world_size, _matrix_worker, "shm")
    for rank, result in enumerate(results):
        assert isinstance(result, dict), result
        assert result["transport"] == "shm"
        assert result["cross_memory"]
        if world_size > 1:
            paths = result["paths"]
            assert ("eager", _SEG_EAGER) in paths
            assert ("cross", _SEG_PRIVATE) in paths
            assert {home for mode, home in paths if mode == "cross"} == {_SEG_PRIVATE}
            assert any(mode == "staged" and home > 0 for mode, home in paths) == (rank % 2 == 1)
            assert any(mode == "shm" and home > 0 for mode, home in paths)
        assert result["failures"] == [], f"rank {rank}: {result['failures'][:10]}"
        assert result["ran"] > 500
