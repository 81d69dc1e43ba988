"""Every collective × algorithm × dtype × op on one group, against the exact references of test_group_harness: the
matrix the shm and tcp suites both run (one set of rank processes per world size, started by ``runtime.spawn``).
No tests of its own.

Each rank reports, per (collective, algorithm), how many combinations it ran and the ones it got wrong; the suites
turn :func:`cases` into one parametrised test each, so a failure names its collective and algorithm. Algorithms
come from the registry, so a newly registered one is held to the same references.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from test_group_harness import contribution, reference

from allreduce.runtime import DTYPES, OPS, ProcessGroup
from allreduce.schedules import Collective, algorithms, block_bounds

WORLD_SIZES = (1, 2, 3, 4, 5, 8)
INT_KINDS = "iu"

Buffers = Callable[[np.ndarray[Any, Any]], Iterator[tuple[str, np.ndarray[Any, Any]]]]
"""For an all-reduce input, the buffers to all-reduce (a label each; the generator resumes after each call)."""


def cases() -> list[tuple[str, str]]:
    """(collective, algorithm) for every registered algorithm: the suites' test parameters."""
    return [(c.value, name) for c in Collective for name in algorithms(c)]


def case_id(case: tuple[str, str]) -> str:
    return f"{case[0]}-{case[1]}"


def assert_ran(reports: list[dict[str, Any]], transport: str) -> None:
    """Every rank ran the whole matrix over ``transport``."""
    for rank, report in enumerate(reports):
        assert report["transport"] == transport, f"rank {rank}"
        assert sum(report["ran"].values()) > 500, f"rank {rank}: {report['ran']}"


def assert_exact(reports: list[dict[str, Any]], case: tuple[str, str]) -> None:
    """Every rank ran ``case`` (collective, algorithm) and got every combination of it right."""
    key = " ".join(case)
    for rank, report in enumerate(reports):
        assert report["ran"][key] > 0, f"rank {rank}: {key} never ran"
        assert report["failures"][key] == [], f"rank {rank}: {report['failures'][key][:10]}"


def sizes(world_size: int) -> list[int]:
    # 0, 1, primes, and sizes that leave remainders against N blocks × 3 segments
    return [0, 1, 13, world_size * 3 + 1, 1031]


def close(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any], op: str) -> bool:
    if op != "avg" or got.dtype.kind in INT_KINDS:
        return bool(np.array_equal(got.view(np.uint8), want.view(np.uint8))) or bool(np.array_equal(got, want))
    return bool(np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=2e-2, atol=1e-2))


def _as_is(x: np.ndarray[Any, Any]) -> Iterator[tuple[str, np.ndarray[Any, Any]]]:
    yield "plain", x


def _rooted(n: int) -> Iterator[tuple[int, str, np.dtype[Any], int, Any]]:
    """(root, dtype name, dtype, count, block bounds) of a rooted gather or scatter: roots 0 and N-1, every dtype,
    a rotating size."""
    for root in sorted({0, n - 1}):
        for k, (dname, dt) in enumerate(DTYPES.items()):
            count = sizes(n)[k % 5]
            yield root, dname, dt, count, block_bounds(count, n)


def run_matrix(group: ProcessGroup, buffers: Buffers = _as_is) -> dict[str, Any]:
    """This rank's report: ``ran`` and ``failures`` by ``"collective algorithm"``, and the transport's name."""
    n, rank = group.world_size, group.rank
    ran = {f"{c} {a}": 0 for c, a in cases()}
    failures: dict[str, list[str]] = {key: [] for key in ran}

    def check(collective: Collective, algorithm: str, ok: bool, what: str) -> None:
        key = f"{collective.value} {algorithm}"
        ran[key] += 1
        if not ok:
            failures[key].append(what)

    combos = [(dname, dt, op) for dname, dt in DTYPES.items() for op in OPS if not (op == "avg" and dt.kind in "iu")]
    for algorithm in algorithms(Collective.ALL_REDUCE):
        group.group_size = (2 if n % 2 == 0 else n) if algorithm == "hierarchical" else n
        for k, (dname, dt, op) in enumerate(combos):
            # every size for one dtype per algorithm, a rotating size for the rest of the matrix
            for count in sizes(n) if dname == "int32" else [sizes(n)[k % 5], 1031]:
                for label, x in buffers(contribution(dt, count, rank, op)):
                    group.all_reduce(x, op=op, algorithm=algorithm, segments=1 + count % 3)
                    ok = close(x, reference(dt, count, n, op), op)
                    check(Collective.ALL_REDUCE, algorithm, ok, f"{dname} {op} count={count} {label}")
    group.group_size = n
    for algorithm in algorithms(Collective.REDUCE_SCATTER):
        for dname, dt, op in combos:
            for count in sizes(n):
                block = group.reduce_scatter(contribution(dt, count, rank, op), op=op, algorithm=algorithm)
                lo, hi = (int(v) for v in block_bounds(count, n)[rank : rank + 2])
                ok = block.shape == (hi - lo,) and close(block, reference(dt, count, n, op)[lo:hi], op)
                check(Collective.REDUCE_SCATTER, algorithm, ok, f"{dname} {op} count={count}")
    for algorithm in algorithms(Collective.ALL_GATHER):
        for dname, dt in DTYPES.items():
            for count in sizes(n):
                bounds = block_bounds(count, n)
                want = np.concatenate(
                    [contribution(dt, count, r, "sum")[bounds[r] : bounds[r + 1]] for r in range(n)]
                ).astype(dt)
                x = np.zeros(count, dtype=dt)
                x[bounds[rank] : bounds[rank + 1]] = want[bounds[rank] : bounds[rank + 1]]
                group.all_gather(x, algorithm=algorithm)
                ok = bool(np.array_equal(x.view(np.uint8), want.view(np.uint8)))
                check(Collective.ALL_GATHER, algorithm, ok, f"{dname} count={count}")
    for algorithm in algorithms(Collective.BROADCAST):
        for root in sorted({0, n - 1, n // 2}):
            for dname, dt in DTYPES.items():
                for count in sizes(n):
                    want = contribution(dt, count, root, "sum")
                    x = contribution(dt, count, rank, "sum") if rank == root else np.zeros(count, dt)
                    group.broadcast(x, root=root, algorithm=algorithm)
                    ok = bool(np.array_equal(x.view(np.uint8), want.view(np.uint8)))
                    check(Collective.BROADCAST, algorithm, ok, f"root={root} {dname} count={count}")
    for algorithm in algorithms(Collective.REDUCE):
        for root in sorted({0, n - 1}):
            for k, (dname, dt, op) in enumerate(combos):
                count = sizes(n)[k % 5]
                mine = contribution(dt, count, rank, op)
                x = mine.copy()
                group.reduce(x, root=root, op=op, algorithm=algorithm)
                ok = close(x, reference(dt, count, n, op) if rank == root else mine, op)
                check(Collective.REDUCE, algorithm, ok, f"root={root} {dname} {op} count={count}")
    for algorithm in algorithms(Collective.GATHER):
        for root, dname, dt, count, bounds in _rooted(n):
            mine = contribution(dt, count, rank, "sum")
            want = np.concatenate([contribution(dt, count, r, "sum")[bounds[r] : bounds[r + 1]] for r in range(n)])
            x = mine.copy()
            group.gather(x, root=root, algorithm=algorithm)
            got = x if rank == root else x[bounds[rank] : bounds[rank + 1]]
            expect = want.astype(dt) if rank == root else mine[bounds[rank] : bounds[rank + 1]]
            ok = bool(np.array_equal(got.view(np.uint8), expect.view(np.uint8)))
            check(Collective.GATHER, algorithm, ok, f"root={root} {dname} count={count}")
    for algorithm in algorithms(Collective.SCATTER):
        for root, dname, dt, count, bounds in _rooted(n):
            sent = contribution(dt, count, root, "sum")
            x = sent.copy() if rank == root else np.zeros(count, dt)
            block = group.scatter(x, root=root, algorithm=algorithm)
            want = sent[bounds[rank] : bounds[rank + 1]]
            ok = block.shape == want.shape and bool(np.array_equal(block.view(np.uint8), want.view(np.uint8)))
            check(Collective.SCATTER, algorithm, ok, f"root={root} {dname} count={count}")
    for algorithm in algorithms(Collective.ALL_TO_ALL):
        for k, (dname, dt) in enumerate(DTYPES.items()):
            part = (0, 1, 7, 1031)[k % 4]
            # part d of rank s's input is contribution(s)'s slice d: rank d receives slice d of every rank's input
            inputs = [contribution(dt, n * part, r, "sum") for r in range(n)]
            out = group.all_to_all(inputs[rank], algorithm=algorithm)
            want = np.concatenate([inputs[s][rank * part : (rank + 1) * part] for s in range(n)]).astype(dt)
            ok = out.shape == want.shape and bool(np.array_equal(out.view(np.uint8), want.view(np.uint8)))
            check(Collective.ALL_TO_ALL, algorithm, ok, f"{dname} part={part}")
    return {"ran": ran, "failures": failures, "transport": group.transport_name}
