"""Agreement: ranks that call differently all raise MismatchError naming the field, before any data moves."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from allreduce.runtime import MismatchError, ProcessGroup
from allreduce.schedules import ring_all_reduce

WORLD_SIZE = 3

# Each case: the field named in the error, and what rank r calls (rank 2 differs from ranks 0 and 1).
Call = Callable[[ProcessGroup, np.ndarray[Any, Any]], Any]
CASES: dict[str, Call] = {
    "count": lambda g, x: g.all_reduce(x[: 10 + (g.rank == 2)]),
    "collective": lambda g, x: g.broadcast(x) if g.rank == 2 else g.all_reduce(x),
    "dtype": lambda g, x: g.all_reduce(x.view(np.int64) if g.rank == 2 else x.view(np.float64)),
    "op": lambda g, x: g.all_reduce(x, op="max" if g.rank == 2 else "sum"),
    "root": lambda g, x: g.broadcast(x, root=1 if g.rank == 2 else 0),
    "algorithm": lambda g, x: g.all_reduce(x, algorithm="direct" if g.rank == 2 else "ring"),
    "flags": lambda g, x: g.all_reduce(x, checksum=g.rank == 2),
    "segments": lambda g, x: g.all_reduce(x, segments=2 if g.rank == 2 else 1),
    "group_size": lambda g, x: (setattr(g, "group_size", 1 if g.rank == 2 else 3), g.all_reduce(x)),
    "schedule": lambda g, x: g.all_reduce(x, algorithm=ring_all_reduce(3) if g.rank == 2 else "ring"),
}


@pytest.mark.parametrize("field", list(CASES))
def test_a_mismatch_names_the_field_on_every_rank(ranks: Any, on_ranks: Any, field: str) -> None:
    def body(group: ProcessGroup) -> Any:
        return CASES[field](group, np.zeros(12, np.float64))

    results = on_ranks(ranks(WORLD_SIZE), body)
    for rank, result in enumerate(results):
        assert isinstance(result, MismatchError), (rank, result)
        assert f"different {field} (" in str(result), (rank, result)
        assert f"rank {rank}:" in str(result)


def test_a_count_mismatch_quotes_each_ranks_value(ranks: Any, on_ranks: Any) -> None:
    results = on_ranks(ranks(WORLD_SIZE), lambda g: CASES["count"](g, np.zeros(12)))
    assert all("rank 0: 10, rank 1: 10, rank 2: 11" in str(r) for r in results), results


@pytest.mark.parametrize("field", list(CASES))
def test_a_mismatch_leaves_every_buffer_untouched(ranks: Any, on_ranks: Any, field: str) -> None:
    def body(group: ProcessGroup) -> bool:
        x = np.arange(12, dtype=np.float64) + 100 * group.rank
        before = x.copy()
        with contextlib.suppress(MismatchError):
            CASES[field](group, x)
        return bool(np.array_equal(x, before))

    assert on_ranks(ranks(WORLD_SIZE), body) == [True] * WORLD_SIZE


def test_the_group_stays_usable_after_a_mismatch(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> list[int]:
        with contextlib.suppress(MismatchError):
            CASES["op"](group, np.zeros(4))
        y = np.full(5, group.rank + 1, dtype=np.int64)
        group.all_reduce(y)
        return y.tolist()

    assert on_ranks(ranks(WORLD_SIZE), body) == [[6] * 5] * WORLD_SIZE


def test_auto_runs_rank_0s_choice_when_cost_models_disagree(ranks: Any, on_ranks: Any) -> None:
    from allreduce.schedules import CostModel

    groups = ranks(WORLD_SIZE)
    # rank 1 believes latency is free and bandwidth precious; the others the opposite
    groups[1].cost_model = CostModel(latency_s=1e-12, bandwidth_Bps=1e3, reduce_bandwidth_Bps=1e3)
    for g in (groups[0], groups[2]):
        g.cost_model = CostModel(latency_s=1.0, bandwidth_Bps=1e15, reduce_bandwidth_Bps=1e15)
    assert groups[0].choose_algorithm(1 << 20) != groups[1].choose_algorithm(1 << 20)

    def body(group: ProcessGroup) -> list[float]:
        x = np.full(1 << 18, float(group.rank), dtype=np.float32)
        group.all_reduce(x)
        return [float(x.min()), float(x.max())]

    assert on_ranks(groups, body) == [[3.0, 3.0]] * WORLD_SIZE
