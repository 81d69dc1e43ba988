"""all_to_all, gather and scatter on the in-process transport: results, and the errors of bad calls."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allreduce.runtime import MismatchError, ProcessGroup, local_groups
from allreduce.runtime.pipeline._personalized import WorkBuffers
from allreduce.schedules import Collective, algorithms, binomial_gather, make_schedule

WORLD_SIZES = (1, 2, 3, 4, 5)


def _part(src: int, dst: int, count: int) -> np.ndarray[Any, Any]:
    return np.arange(count, dtype=np.int64) + 1000 * src + 100 * dst


@pytest.mark.parametrize("algorithm", algorithms(Collective.ALL_TO_ALL))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_to_all_delivers_part_d_to_rank_d(ranks: Any, on_ranks: Any, algorithm: str, world_size: int) -> None:
    def body(group: ProcessGroup) -> bool:
        n, r = group.world_size, group.rank
        x = np.concatenate([_part(r, d, 7) for d in range(n)])
        out = np.empty_like(x)
        assert group.all_to_all(x, out, algorithm=algorithm) is out
        return bool(np.array_equal(out, np.concatenate([_part(s, r, 7) for s in range(n)])))

    assert on_ranks(ranks(world_size), body) == [True] * world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gather_and_scatter_from_every_root(ranks: Any, on_ranks: Any, world_size: int) -> None:
    def body(group: ProcessGroup) -> list[bool]:
        n, r = group.world_size, group.rank
        exact = []
        for algorithm in algorithms(Collective.GATHER):
            for root in range(n):
                x = np.zeros(3 * n, dtype=np.int64)
                x[3 * r : 3 * r + 3] = _part(r, root, 3)
                assert group.gather(x, root=root, algorithm=algorithm) is x
                if r == root:
                    exact.append(bool(np.array_equal(x, np.concatenate([_part(s, root, 3) for s in range(n)]))))
                y = np.concatenate([_part(root, d, 3) for d in range(n)]) if r == root else np.zeros(3 * n, np.int64)
                mine = group.scatter(y, root=root, algorithm=algorithm)
                exact.append(bool(np.array_equal(mine, _part(root, r, 3))))
        return exact

    results = on_ranks(ranks(world_size), body)
    assert all(all(r) and r for r in results), results


def test_uneven_splits_pad_to_the_largest_part_and_land_exactly(ranks: Any, on_ranks: Any) -> None:
    def sizes(src: int, dst: int) -> int:
        return [[0, 5, 1], [2, 0, 9], [3, 4, 0]][src][dst]

    def body(group: ProcessGroup) -> bool:
        r = group.rank
        ins, outs = [sizes(r, d) for d in range(3)], [sizes(s, r) for s in range(3)]
        x = np.concatenate([_part(r, d, ins[d]) for d in range(3)])
        out = group.all_to_all(x, input_splits=ins, output_splits=outs)
        return out.shape == (sum(outs),) and bool(
            np.array_equal(out, np.concatenate([_part(s, r, outs[s]) for s in range(3)]))
        )

    assert on_ranks(ranks(3), body) == [True] * 3


def test_splits_that_disagree_raise_on_every_rank_naming_both_ranks(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> Any:
        # rank 1 sends rank 0 two elements; rank 0 expects three
        ins = [[1, 1], [2, 1]][group.rank]
        outs = [[1, 3], [1, 1]][group.rank]
        return group.all_to_all(np.zeros(sum(ins)), input_splits=ins, output_splits=outs)

    results = on_ranks(ranks(2), body)
    for result in results:
        assert isinstance(result, ValueError)
        assert "rank 1 sends 2 elements to rank 0, which expects 3" in str(result)


def test_equal_parts_need_a_count_divisible_by_the_world_size(ranks: Any, on_ranks: Any) -> None:
    results = on_ranks(ranks(2), lambda group: group.all_to_all(np.zeros(5)))
    for result in results:
        assert isinstance(result, ValueError)
        assert "5 elements do not split into 2 equal parts" in str(result)


def test_ranks_that_send_different_amounts_raise_a_mismatch(ranks: Any, on_ranks: Any) -> None:
    results = on_ranks(ranks(2), lambda group: group.all_to_all(np.zeros(4 + 2 * group.rank)))
    for result in results:
        assert isinstance(result, MismatchError)
        # the count compared is the schedule's buffer's, N times the send buffer
        assert "different count (rank 0: 8, rank 1: 12)" in str(result)


def test_out_of_another_dtype_is_refused_before_anything_moves(ranks: Any) -> None:
    group = ranks(1)[0]
    with pytest.raises(TypeError, match="out is int64, x is float64"):
        group.all_to_all(np.zeros(4), np.zeros(4, np.int64))


def test_a_gather_schedule_rooted_elsewhere_is_refused(ranks: Any, on_ranks: Any) -> None:
    schedule = binomial_gather(2, 1)
    results = on_ranks(ranks(2), lambda group: group.gather(np.zeros(4), root=0, algorithm=schedule))
    for result in results:
        assert isinstance(result, ValueError)
        assert "rooted at rank 1, but root=0" in str(result)


def test_a_scatter_schedule_object_runs(ranks: Any, on_ranks: Any) -> None:
    schedule = make_schedule("scatter", "binomial", 3, root=2)

    def body(group: ProcessGroup) -> list[float]:
        x = np.arange(6, dtype=np.float64) if group.rank == 2 else np.zeros(6)
        return np.asarray(group.scatter(x, root=2, algorithm=schedule)).tolist()

    assert on_ranks(ranks(3), body) == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_all_to_alls_in_flight_at_once_keep_their_own_buffers(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> bool:
        n, r = group.world_size, group.rank
        sends = [np.concatenate([_part(r, d, 5) + 10_000 * k for d in range(n)]) for k in range(4)]
        works = [group.all_to_all(x, async_op=True) for x in sends]
        results = [w.wait() for w in works]
        return all(
            np.array_equal(got, np.concatenate([_part(s, r, 5) + 10_000 * k for s in range(n)]))
            for k, got in enumerate(results)
        )

    assert on_ranks(ranks(3), body) == [True] * 3


def test_out_may_be_x_itself(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> bool:
        n, r = group.world_size, group.rank
        x = np.concatenate([_part(r, d, 4) for d in range(n)])
        group.all_to_all(x, x)
        return bool(np.array_equal(x, np.concatenate([_part(s, r, 4) for s in range(n)])))

    assert on_ranks(ranks(3), body) == [True] * 3


def test_work_buffers_are_reused_by_size_class_and_never_shared_in_flight() -> None:
    made: list[int] = []

    def allocate(size_bytes: int) -> np.ndarray[Any, Any]:
        made.append(size_bytes)
        return np.zeros(size_bytes, np.uint8)

    buffers = WorkBuffers(allocate)
    first, give_back = buffers.take(np.dtype(np.float32), 100)
    second, _ = buffers.take(np.dtype(np.float32), 100)  # the first is still in use
    assert first.shape == (100,)
    assert not np.shares_memory(first, second)
    give_back()
    again, _ = buffers.take(np.dtype(np.float64), 60)  # 480 bytes: the same 512-byte class
    assert np.shares_memory(again, first)
    assert made == [512, 512]


def test_auto_picks_among_the_automatic_algorithms_of_each_collective(ranks: Any) -> None:
    group = ranks(4)[0]
    assert group.choose_algorithm(4 * 4096, collective="all_to_all") == "pairwise"
    for collective in ("gather", "scatter"):
        assert group.choose_algorithm(4096, collective=collective) in algorithms(collective, automatic=True)


# on_ranks is a pure function: sharing it between examples is safe
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world_size=st.integers(1, 5), segments=st.integers(1, 3), data=st.data())
@pytest.mark.slow
def test_any_split_matrix_lands_every_part_exactly(
    on_ranks: Any, world_size: int, segments: int, data: st.DataObject
) -> None:
    algorithm = data.draw(st.sampled_from(algorithms(Collective.ALL_TO_ALL)), label="algorithm")
    sizes = data.draw(
        st.lists(st.lists(st.integers(0, 9), min_size=world_size, max_size=world_size), min_size=world_size,
                 max_size=world_size),
        label="sizes[src][dst]",
    )  # fmt: skip

    def body(group: ProcessGroup) -> bool:
        r = group.rank
        ins, outs = sizes[r], [sizes[s][r] for s in range(world_size)]
        x = np.concatenate([_part(r, d, ins[d]) for d in range(world_size)])
        out = group.all_to_all(x, algorithm=algorithm, input_splits=ins, output_splits=outs, segments=segments)
        return bool(np.array_equal(out, np.concatenate([_part(s, r, outs[s]) for s in range(world_size)])))

    groups = local_groups(world_size, timeout_s=10.0)
    try:
        assert on_ranks(groups, body) == [True] * world_size
    finally:
        for group in groups:
            group.close()
