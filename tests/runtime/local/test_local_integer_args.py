"""Ranks, roots and counts accept integer-likes (numpy integers, anything with ``__index__``), never bools or floats."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import allreduce
import torch

WORLD_SIZE = 3


@pytest.mark.parametrize("root", [np.int64(2), np.int32(2), np.uint8(2), torch.tensor(2)], ids=repr)
def test_broadcast_takes_an_integer_like_root(ranks: Any, on_ranks: Any, root: Any) -> None:
    results = on_ranks(ranks(WORLD_SIZE), lambda g: g.broadcast(np.full(4, float(g.rank)), root=root))
    for result in results:
        assert np.array_equal(result, np.full(4, 2.0)), result


def test_reduce_takes_a_numpy_root(ranks: Any, on_ranks: Any) -> None:
    results = on_ranks(ranks(WORLD_SIZE), lambda g: g.reduce(np.ones(4), root=np.int64(1)))
    assert np.array_equal(results[1], np.full(4, 3.0))


def test_segments_and_stats_take_numpy_integers(ranks: Any, on_ranks: Any) -> None:
    results = on_ranks(
        ranks(WORLD_SIZE), lambda g: (g.all_reduce(np.ones(6), segments=np.int64(2)), g.stats(np.int64(3)))
    )
    for summed, _ in results:
        assert np.array_equal(summed, np.full(6, 3.0))


def test_block_range_takes_a_numpy_rank(ranks: Any) -> None:
    assert ranks(WORLD_SIZE)[0].block_range(9, np.int64(2)) == (6, 9)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda g: g.broadcast(np.zeros(2), root=np.float64(1.0)),
            TypeError,
            r"root: expected an integer, got float64",
        ),
        (lambda g: g.reduce(np.zeros(2), root=False), TypeError, r"root: expected an integer, got the bool False"),
        (lambda g: g.broadcast(np.zeros(2), root=np.int64(3)), ValueError, r"root: 3 is not a rank of this group of 3"),
        (lambda g: g.block_range(9, rank=True), TypeError, r"rank: expected an integer, got the bool True"),
        (lambda g: g.stats(last=2.0), TypeError, r"last: expected an integer, got float 2.0"),
    ],
    ids=["float root", "bool root", "root out of range", "bool rank", "float last"],
)
def test_bools_floats_and_out_of_range_ranks_are_refused_naming_the_argument(
    ranks: Any, call: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        call(ranks(WORLD_SIZE)[0])


def test_init_takes_numpy_rank_and_world_size() -> None:
    with allreduce.init(np.int64(0), np.int64(1)) as group:
        assert (group.rank, group.world_size) == (0, 1)


@pytest.mark.parametrize(("rank", "world_size"), [(True, 1), (0, 1.0)], ids=["bool rank", "float world_size"])
def test_init_refuses_bool_and_float_ranks(rank: Any, world_size: Any) -> None:
    with pytest.raises(TypeError, match=r"(rank|world_size): expected an integer"):
        allreduce.init(rank, world_size)
