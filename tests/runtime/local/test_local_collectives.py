"""Every collective and registered algorithm on the in-process transport, against closed-form references."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allreduce.runtime import ProcessGroup, local_groups
from allreduce.schedules import Collective, algorithms, block_bounds

WORLD_SIZES = (1, 2, 3, 4, 5)
COUNTS = (0, 1, 13, 100)


def _contribution(rank: int, count: int) -> np.ndarray[Any, Any]:
    """Rank-dependent integers: every reduction of them is exact."""
    return (np.arange(count, dtype=np.int64) * 7 + rank * 3) % 11 - 5


def _total(world_size: int, count: int) -> np.ndarray[Any, Any]:
    return np.sum([_contribution(r, count) for r in range(world_size)], axis=0, dtype=np.int64).reshape(count)


def _options(name: str, world_size: int) -> dict[str, Any]:
    # hierarchical needs hosts of equal size: two ranks per host where the world size allows it
    return {"group_size": 2 if world_size % 2 == 0 else 1} if name == "hierarchical" else {}


def _cases(collective: Collective) -> list[Any]:
    return [pytest.param(name, n, id=f"{name}-n{n}") for name in algorithms(collective) for n in WORLD_SIZES]


@pytest.mark.parametrize(("algorithm", "world_size"), _cases(Collective.ALL_REDUCE))
def test_all_reduce_sums_every_rank_in_place(ranks: Any, on_ranks: Any, algorithm: str, world_size: int) -> None:
    groups = ranks(world_size, **_options(algorithm, world_size))

    def body(group: ProcessGroup) -> list[bool]:
        exact = []
        for count in COUNTS:
            x = _contribution(group.rank, count)
            assert group.all_reduce(x, algorithm=algorithm, segments=1 + count % 3) is x
            exact.append(bool(np.array_equal(x, _total(world_size, count))))
        return exact

    assert on_ranks(groups, body) == [[True] * len(COUNTS)] * world_size


@pytest.mark.parametrize(("algorithm", "world_size"), _cases(Collective.REDUCE_SCATTER))
def test_reduce_scatter_returns_this_ranks_block_of_the_sum(
    ranks: Any, on_ranks: Any, algorithm: str, world_size: int
) -> None:
    def body(group: ProcessGroup) -> list[bool]:
        exact = []
        for count in COUNTS:
            lo, hi = (int(v) for v in block_bounds(count, world_size)[group.rank : group.rank + 2])
            block = group.reduce_scatter(_contribution(group.rank, count), algorithm=algorithm)
            exact.append(block.shape == (hi - lo,) and bool(np.array_equal(block, _total(world_size, count)[lo:hi])))
        return exact

    assert on_ranks(ranks(world_size), body) == [[True] * len(COUNTS)] * world_size


@pytest.mark.parametrize(("algorithm", "world_size"), _cases(Collective.ALL_GATHER))
def test_all_gather_fills_every_block_from_its_owner(
    ranks: Any, on_ranks: Any, algorithm: str, world_size: int
) -> None:
    def body(group: ProcessGroup) -> list[bool]:
        exact = []
        for count in COUNTS:
            bounds = block_bounds(count, world_size)
            want = np.concatenate(
                [_contribution(r, count)[bounds[r] : bounds[r + 1]] for r in range(world_size)]
            ).astype(np.int64)
            x = np.zeros(count, np.int64)
            lo, hi = bounds[group.rank], bounds[group.rank + 1]
            x[lo:hi] = want[lo:hi]
            group.all_gather(x, algorithm=algorithm)
            exact.append(bool(np.array_equal(x, want)))
        return exact

    assert on_ranks(ranks(world_size), body) == [[True] * len(COUNTS)] * world_size


@pytest.mark.parametrize(("algorithm", "world_size"), _cases(Collective.BROADCAST))
def test_broadcast_copies_the_roots_buffer_to_every_rank(
    ranks: Any, on_ranks: Any, algorithm: str, world_size: int
) -> None:
    root = world_size - 1

    def body(group: ProcessGroup) -> bool:
        x = _contribution(group.rank, 100)
        group.broadcast(x, root=root, algorithm=algorithm)
        return bool(np.array_equal(x, _contribution(root, 100)))

    assert on_ranks(ranks(world_size), body) == [True] * world_size


@pytest.mark.parametrize(("algorithm", "world_size"), _cases(Collective.REDUCE))
def test_reduce_sums_into_the_root(ranks: Any, on_ranks: Any, algorithm: str, world_size: int) -> None:
    root = world_size // 2

    def body(group: ProcessGroup) -> bool:
        x = _contribution(group.rank, 100)
        group.reduce(x, root=root, algorithm=algorithm)
        return group.rank != root or bool(np.array_equal(x, _total(world_size, 100)))

    assert on_ranks(ranks(world_size), body) == [True] * world_size


@pytest.mark.parametrize("algorithm", algorithms(Collective.REDUCE))
def test_reduce_leaves_the_input_of_non_root_ranks_untouched(ranks: Any, on_ranks: Any, algorithm: str) -> None:
    def body(group: ProcessGroup) -> bool:
        x = _contribution(group.rank, 50)
        group.reduce(x, root=1, algorithm=algorithm)
        return group.rank == 1 or bool(np.array_equal(x, _contribution(group.rank, 50)))

    assert on_ranks(ranks(4), body) == [True] * 4


def test_avg_divides_the_sum_by_the_world_size(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> list[float]:
        x = np.full(6, float(group.rank), dtype=np.float64)
        group.all_reduce(x, op="avg")
        return x.tolist()

    assert on_ranks(ranks(4), body) == [[1.5] * 6] * 4


def test_reduce_with_avg_divides_only_at_the_root(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> list[float]:
        x = np.full(3, float(group.rank + 1), dtype=np.float32)
        group.reduce(x, root=0, op="avg")
        return x.tolist()

    assert on_ranks(ranks(3), body) == [[2.0] * 3, [2.0] * 3, [3.0] * 3]


@pytest.mark.parametrize(("op", "want"), [("min", 1.0), ("max", 4.0), ("prod", 24.0), ("sum", 10.0)])
def test_each_op_reduces_with_its_own_function(ranks: Any, on_ranks: Any, op: str, want: float) -> None:
    def body(group: ProcessGroup) -> list[float]:
        x = np.full(5, float(group.rank + 1), dtype=np.float32)
        group.all_reduce(x, op=op)
        return x.tolist()

    assert on_ranks(ranks(4), body) == [[want] * 5] * 4


def test_all_gather_of_reduce_scatters_buffer_is_an_all_reduce(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> bool:
        x = _contribution(group.rank, 31)
        group.reduce_scatter(x)
        group.all_gather(x)
        return bool(np.array_equal(x, _total(3, 31)))

    assert on_ranks(ranks(3), body) == [True] * 3


def test_barrier_returns_on_every_rank(ranks: Any, on_ranks: Any) -> None:
    assert on_ranks(ranks(3), lambda g: g.barrier()) == [None] * 3


# on_ranks is a pure function: sharing it between examples is safe
@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world_size=st.integers(min_value=1, max_value=6),
    count=st.integers(min_value=0, max_value=300),
    segments=st.integers(min_value=1, max_value=4),
    data=st.data(),
)
@pytest.mark.slow
def test_any_registered_all_reduce_equals_the_sum_of_the_inputs(
    on_ranks: Any, world_size: int, count: int, segments: int, data: st.DataObject
) -> None:
    algorithm = data.draw(st.sampled_from(algorithms(Collective.ALL_REDUCE)), label="algorithm")
    rng = np.random.default_rng(count * 31 + world_size)
    inputs = rng.integers(-1000, 1000, size=(world_size, count), dtype=np.int64)
    groups = local_groups(world_size, timeout_s=10.0, **_options(algorithm, world_size))
    try:
        results = on_ranks(
            groups, lambda g: g.all_reduce(inputs[g.rank].copy(), algorithm=algorithm, segments=segments)
        )
    finally:
        for g in groups:
            g.close()
    for result in results:
        assert np.array_equal(result, inputs.sum(axis=0)), result
