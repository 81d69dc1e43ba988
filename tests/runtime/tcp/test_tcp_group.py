"""The process group over the TCP transport: every collective × algorithm × dtype × op, real processes.

One set of processes per world size (a module-scoped fixture) runs every combination against the exact references
of test_group_harness; each rank reports, per collective, the combinations it got wrong. One test per collective
reads that report. Algorithms come from the registry, so a newly registered one is held to the same references.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_group_harness import contribution, reference, report, run_ranks

import allreduce
from allreduce.runtime import DTYPES, OPS
from allreduce.schedules import Collective, algorithms, block_bounds

INT_KINDS = "iu"
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")


def _sizes(world_size: int) -> list[int]:
    # 0, 1, primes, and sizes that leave remainders against N blocks × 3 segments
    return [0, 1, 13, world_size * 3 + 1, 1031]


def _close(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any], op: str) -> bool:
    if op != "avg" or got.dtype.kind in INT_KINDS:
        return bool(np.array_equal(got.view(np.uint8), want.view(np.uint8))) or bool(np.array_equal(got, want))
    return bool(np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=2e-2, atol=1e-2))


def _run_matrix(group: allreduce.ProcessGroup) -> dict[str, Any]:
    n, rank = group.world_size, group.rank
    failures: dict[str, list[str]] = {c: [] for c in COLLECTIVES}
    ran = dict.fromkeys(COLLECTIVES, 0)
    combos = [(dname, dt, op) for dname, dt in DTYPES.items() for op in OPS if not (op == "avg" and dt.kind in "iu")]
    for algorithm in algorithms(Collective.ALL_REDUCE):
        group.group_size = (2 if n % 2 == 0 else n) if algorithm == "hierarchical" else n
        for k, (dname, dt, op) in enumerate(combos):
            sizes = _sizes(n)
            # every size for one dtype per algorithm, a rotating size for the rest of the matrix
            for count in sizes if dname == "int32" else [sizes[k % len(sizes)], 1031]:
                x = contribution(dt, count, rank, op)
                group.all_reduce(x, op=op, algorithm=algorithm, segments=1 + count % 3)
                ran["all_reduce"] += 1
                if not _close(x, reference(dt, count, n, op), op):
                    failures["all_reduce"].append(f"{algorithm} {dname} {op} count={count}")
    group.group_size = n
    for algorithm in algorithms(Collective.REDUCE_SCATTER):
        for dname, dt, op in combos:
            for count in _sizes(n):
                block = group.reduce_scatter(contribution(dt, count, rank, op), op=op, algorithm=algorithm)
                lo, hi = (int(v) for v in block_bounds(count, n)[rank : rank + 2])
                ran["reduce_scatter"] += 1
                if block.shape != (hi - lo,) or not _close(block, reference(dt, count, n, op)[lo:hi], op):
                    failures["reduce_scatter"].append(f"{algorithm} {dname} {op} count={count}")
    for algorithm in algorithms(Collective.ALL_GATHER):
        for dname, dt in DTYPES.items():
            for count in _sizes(n):
                bounds = block_bounds(count, n)
                want = np.concatenate(
                    [contribution(dt, count, r, "sum")[bounds[r] : bounds[r + 1]] for r in range(n)]
                ).astype(dt)
                x = np.zeros(count, dtype=dt)
                x[bounds[rank] : bounds[rank + 1]] = want[bounds[rank] : bounds[rank + 1]]
                group.all_gather(x, algorithm=algorithm)
                ran["all_gather"] += 1
                if not np.array_equal(x.view(np.uint8), want.view(np.uint8)):
                    failures["all_gather"].append(f"{algorithm} {dname} count={count}")
    for algorithm in algorithms(Collective.BROADCAST):
        for root in sorted({0, n - 1, n // 2}):
            for dname, dt in DTYPES.items():
                for count in _sizes(n):
                    want = contribution(dt, count, root, "sum")
                    x = contribution(dt, count, rank, "sum") if rank == root else np.zeros(count, dt)
                    group.broadcast(x, root=root, algorithm=algorithm)
                    ran["broadcast"] += 1
                    if not np.array_equal(x.view(np.uint8), want.view(np.uint8)):
                        failures["broadcast"].append(f"{algorithm} root={root} {dname} count={count}")
    for algorithm in algorithms(Collective.REDUCE):
        for root in sorted({0, n - 1}):
            for k, (dname, dt, op) in enumerate(combos):
                count = _sizes(n)[k % 5]
                mine = contribution(dt, count, rank, op)
                x = mine.copy()
                group.reduce(x, root=root, op=op, algorithm=algorithm)
                ran["reduce"] += 1
                want = reference(dt, count, n, op) if rank == root else mine
                if not _close(x, want, op):
                    failures["reduce"].append(f"{algorithm} root={root} {dname} {op} count={count}")
    return {"failures": failures, "ran": ran, "transport": group.transport_name}


def _matrix_worker(rank: int, n: int, port: int, out: Any) -> None:
    def body() -> dict[str, Any]:
        with allreduce.init(rank, n, master_port=port, transport="tcp", timeout_s=120) as group:
            return _run_matrix(group)

    report(out, rank, body)


@pytest.fixture(scope="module", params=[1, 2, 3, 4, 5, 8], ids=lambda n: f"world{n}")
def tcp_matrix(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    results = run_ranks(request.param, _matrix_worker)
    for result in results:
        assert isinstance(result, dict), result
    return results


@pytest.mark.slow
def test_the_matrix_ran_over_tcp(tcp_matrix: list[dict[str, Any]]) -> None:
    for result in tcp_matrix:
        assert result["transport"] == "tcp"
        assert sum(result["ran"].values()) > 500


@pytest.mark.slow
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_every_algorithm_dtype_and_op_is_exact_over_tcp(tcp_matrix: list[dict[str, Any]], collective: str) -> None:
    for rank, result in enumerate(tcp_matrix):
        assert result["ran"][collective] > 0
        assert result["failures"][collective] == [], f"rank {rank}: {result['failures'][collective][:10]}"
