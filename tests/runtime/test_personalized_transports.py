"""all_to_all, gather and scatter over shm and tcp, real processes: every registered algorithm, root, dtype and a
range of sizes, equal and uneven parts, blocking and asynchronous, against exact references.

One set of processes per transport and world size (a module-scoped fixture) runs the matrix; each rank reports the
combinations it got wrong; one test per collective reads the report.
"""

from __future__ import annotations

import itertools
import os
import signal
from typing import Any

import numpy as np
import pytest
from test_group_harness import report, run_ranks

import allreduce
from allreduce.runtime import DTYPES, spawn
from allreduce.schedules import Collective, algorithms, block_bounds

COLLECTIVES = ("all_to_all", "all_to_all_splits", "gather", "scatter", "async")
PART_SIZES = (0, 1, 13, 257)


def part(dtype: np.dtype[Any], src: int, dst: int, count: int, world_size: int) -> np.ndarray[Any, Any]:
    """What rank ``src`` sends rank ``dst``: small non-negative integers (exact in every dtype), different for
    every (src, dst) pair, so a part delivered to the wrong rank or from the wrong rank is seen."""
    return ((np.arange(count, dtype=np.int64) + (src * world_size + dst) * 31) % 97).astype(dtype)


def _uneven(src: int, dst: int) -> int:
    return (src * 7 + dst * 3) % 5 * 4


def _run(group: allreduce.ProcessGroup) -> dict[str, Any]:
    n, rank = group.world_size, group.rank
    failures: dict[str, list[str]] = {c: [] for c in COLLECTIVES}
    ran = dict.fromkeys(COLLECTIVES, 0)
    roots = sorted({0, n // 2, n - 1})
    for algorithm in algorithms(Collective.ALL_TO_ALL):
        for dname, dt in DTYPES.items():
            for count in PART_SIZES:
                x = np.concatenate([part(dt, rank, d, count, n) for d in range(n)])
                want = np.concatenate([part(dt, s, rank, count, n) for s in range(n)])
                got = group.all_to_all(x, algorithm=algorithm)
                ran["all_to_all"] += 1
                if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
                    failures["all_to_all"].append(f"{algorithm} {dname} part={count}")
        ins = [_uneven(rank, d) for d in range(n)]
        outs = [_uneven(s, rank) for s in range(n)]
        x = np.concatenate([part(np.dtype(np.int32), rank, d, ins[d], n) for d in range(n)])
        want = np.concatenate([part(np.dtype(np.int32), s, rank, outs[s], n) for s in range(n)])
        got = group.all_to_all(x, algorithm=algorithm, input_splits=ins, output_splits=outs)
        ran["all_to_all_splits"] += 1
        if not np.array_equal(got, want):
            failures["all_to_all_splits"].append(algorithm)
    for algorithm in algorithms(Collective.GATHER):
        for root in roots:
            for dname, dt in DTYPES.items():
                for count in PART_SIZES:
                    total = count * n
                    bounds = block_bounds(total, n)
                    want = np.concatenate([part(dt, r, root, count, n) for r in range(n)])
                    x = np.zeros(total, dtype=dt)
                    x[bounds[rank] : bounds[rank + 1]] = part(dt, rank, root, count, n)
                    group.gather(x, root=root, algorithm=algorithm)
                    ran["gather"] += 1
                    if rank == root and not np.array_equal(x.view(np.uint8), want.view(np.uint8)):
                        failures["gather"].append(f"{algorithm} root={root} {dname} part={count}")
    for algorithm in algorithms(Collective.SCATTER):
        for root in roots:
            for dname, dt in DTYPES.items():
                for count in PART_SIZES:
                    x = np.zeros(count * n, dtype=dt)
                    if rank == root:
                        x[...] = np.concatenate([part(dt, root, r, count, n) for r in range(n)])
                    mine = group.scatter(x, root=root, algorithm=algorithm)
                    ran["scatter"] += 1
                    if not np.array_equal(np.asarray(mine), part(dt, root, rank, count, n)):
                        failures["scatter"].append(f"{algorithm} root={root} {dname} part={count}")
    # the asynchronous forms, three in flight at once, completing in call order
    dt = np.dtype(np.float32)
    x = np.concatenate([part(dt, rank, d, 5, n) for d in range(n)])
    gathered = np.zeros(5 * n, dtype=dt)
    gathered[rank * 5 : rank * 5 + 5] = part(dt, rank, 0, 5, n)
    scattered = np.concatenate([part(dt, 0, r, 5, n) for r in range(n)]) if rank == 0 else np.zeros(5 * n, dt)
    works = [
        group.all_to_all(x, async_op=True),
        group.gather(gathered, root=0, async_op=True),
        group.scatter(scattered, root=0, async_op=True),
    ]
    results = [w.wait() for w in works]
    ran["async"] += 1
    if not (
        np.array_equal(results[0], np.concatenate([part(dt, s, rank, 5, n) for s in range(n)]))
        and (rank != 0 or np.array_equal(gathered, np.concatenate([part(dt, r, 0, 5, n) for r in range(n)])))
        and np.array_equal(results[2], part(dt, 0, rank, 5, n))
    ):
        failures["async"].append("all_to_all, gather, scatter with async_op=True")
    return {"failures": failures, "ran": ran, "transport": group.transport_name}


@pytest.fixture(
    scope="module",
    params=[("shm", 1), ("shm", 2), ("shm", 3), ("shm", 5), ("tcp", 2), ("tcp", 3), ("tcp", 4)],
    ids=lambda p: f"{p[0]}-world{p[1]}",
)
def matrix(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    transport, n = request.param
    return transport, spawn(n, _run, init_options={"transport": transport, "timeout_s": 120}, timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_every_algorithm_root_and_dtype_is_exact(matrix: tuple[str, list[dict[str, Any]]], collective: str) -> None:
    transport, results = matrix
    for rank, result in enumerate(results):
        assert result["transport"] == transport
        assert result["ran"][collective] > 0
        assert result["failures"][collective] == [], f"rank {rank}: {result['failures'][collective][:10]}"


def _all_to_all_until_a_rank_dies(rank: int, n: int, port: int, out: Any, victim: int) -> None:
    def body() -> None:
        with allreduce.init(rank, n, master_port=port, transport="shm", timeout_s=60) as group:
            x = np.ones(n << 16, np.float32)
            for call in itertools.count():
                if rank == victim and call == 3:
                    os.kill(os.getpid(), signal.SIGKILL)  # mid-loop: its peers are in call 3, waiting for it
                group.all_to_all(x)

    report(out, rank, body)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1, 2])
def test_a_rank_sigkilled_between_all_to_alls_makes_every_other_rank_raise_naming_it(victim: int) -> None:
    # a 60 s collective timeout: a PeerFailureError proves the death was seen by the peer watch, not the clock
    survivors = [r for r in range(3) if r != victim]
    results = run_ranks(3, _all_to_all_until_a_rank_dies, victim, needed=survivors, timeout_s=120)
    for rank in survivors:
        assert f"rank {rank} raised PeerFailureError" in results[rank], results[rank]
        assert f"rank {victim}" in results[rank]
