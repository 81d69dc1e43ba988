"""What collectives accept as buffers: numpy arrays of any shape and strides, CPU torch tensors, group.empty()."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import torch
from allreduce.runtime import DTYPES, ProcessGroup

WORLD_SIZE = 3
RANK_SUM = WORLD_SIZE * (WORLD_SIZE + 1) // 2  # sum of (rank + 1) over the ranks


def test_a_strided_numpy_view_is_reduced_in_place_and_the_rest_kept(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> list[Any]:
        m = np.arange(24, dtype=np.float64).reshape(4, 6) * (group.rank + 1)
        group.all_reduce(m[:, ::2])
        return list(m.tolist())

    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    for rank, got in enumerate(on_ranks(ranks(WORLD_SIZE), body)):
        want = base * (rank + 1)
        want[:, ::2] = base[:, ::2] * RANK_SUM
        assert got == want.tolist()


def test_a_multidimensional_array_keeps_its_shape(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> tuple[tuple[int, ...], float]:
        x = np.ones((2, 3, 4), np.float32)
        group.all_reduce(x)
        return x.shape, float(x.sum())

    assert on_ranks(ranks(WORLD_SIZE), body) == [((2, 3, 4), 24.0 * WORLD_SIZE)] * WORLD_SIZE


def test_a_strided_torch_view_is_reduced_in_place_and_returned(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> tuple[list[Any], bool]:
        t = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (group.rank + 1)
        tv = t[:, 1::2]
        same = group.all_reduce(tv) is tv
        return t.tolist(), same

    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    for rank, (got, same) in enumerate(on_ranks(ranks(WORLD_SIZE), body)):
        want = base * (rank + 1)
        want[:, 1::2] = base[:, 1::2] * RANK_SUM
        assert got == want.tolist()
        assert same


def test_a_bfloat16_tensor_is_reduced_through_its_bits(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> list[float]:
        tb = torch.ones(33, dtype=torch.bfloat16) * (group.rank + 1)
        group.all_reduce(tb)
        return list(tb.float().tolist())

    assert on_ranks(ranks(WORLD_SIZE), body) == [[float(RANK_SUM)] * 33] * WORLD_SIZE


def test_an_integer_tensor_takes_the_max(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> list[int]:
        ti = torch.arange(10, dtype=torch.int64) * (group.rank == 1)
        group.all_reduce(ti, op="max")
        return list(ti.tolist())

    assert on_ranks(ranks(WORLD_SIZE), body) == [list(range(10))] * WORLD_SIZE


def test_reduce_scatter_of_a_tensor_returns_a_tensor_view_of_its_block(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> tuple[bool, list[float]]:
        t = torch.ones(9, dtype=torch.float32)
        block = group.reduce_scatter(t)
        block += 1  # a view: writes through to t
        lo, _ = group.block_range(9)
        return isinstance(block, torch.Tensor), [float(t[lo])]

    assert on_ranks(ranks(WORLD_SIZE), body) == [(True, [WORLD_SIZE + 1.0])] * WORLD_SIZE


def test_reduce_scatter_of_a_strided_array_writes_the_block_back(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> list[float]:
        m = np.ones((6, 2), np.float64)
        return list(group.reduce_scatter(m[:, 0]).tolist())

    assert on_ranks(ranks(WORLD_SIZE), body) == [[float(WORLD_SIZE)] * 2] * WORLD_SIZE


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_supported_dtype_is_summed_exactly(ranks: Any, on_ranks: Any, dtype: str) -> None:
    def body(group: ProcessGroup) -> list[float]:
        x = np.full(5, group.rank + 1, dtype=DTYPES[dtype])
        group.all_reduce(x)
        return [float(v) for v in x]

    assert on_ranks(ranks(WORLD_SIZE), body) == [[float(RANK_SUM)] * 5] * WORLD_SIZE


def test_empty_and_zeros_make_arrays_of_the_given_shape_and_dtype(ranks: Any) -> None:
    (group,) = ranks(1)
    z = group.zeros((3, 4), np.int32)
    assert (z.shape, z.dtype, int(z.sum())) == ((3, 4), np.dtype(np.int32), 0)
    assert group.empty(5, "float64").shape == (5,)


def test_empty_refuses_a_negative_shape(ranks: Any) -> None:
    (group,) = ranks(1)
    with pytest.raises(ValueError, match=r"negative sizes, got \(2, -1\)"):
        group.empty((2, -1))


def test_empty_refuses_an_unsupported_dtype(ranks: Any) -> None:
    (group,) = ranks(1)
    with pytest.raises(TypeError, match="dtype: unsupported dtype complex64"):
        group.empty(3, np.complex64)
