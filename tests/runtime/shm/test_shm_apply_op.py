"""apply_op: dst = op(mine, incoming) exactly, at every offset from a cache line, split at the line or not."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.runtime.shm._peer_data import ALIGN_MIN_BYTES, CACHE_LINE, apply_op


def _at(block: np.ndarray, offset: int, count: int) -> np.ndarray:
    """``count`` elements of ``block`` starting ``offset`` bytes past a cache line."""
    start = (offset - block.ctypes.data) % CACHE_LINE // block.itemsize
    return block[start : start + count]


def _add_into(out: np.ndarray, other: np.ndarray) -> None:
    np.add(out, other, out=out)


_SIZES = [0, 1, 15, ALIGN_MIN_BYTES // 8 - 1, ALIGN_MIN_BYTES // 8, ALIGN_MIN_BYTES // 8 + 17, 100_003]


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from([np.float32, np.float64, np.int16, np.uint8]),
    dst_offset=st.integers(0, CACHE_LINE - 1),
    src_offset=st.integers(0, CACHE_LINE - 1),
    count=st.sampled_from(_SIZES),
    in_place=st.booleans(),
)
def test_every_offset_and_size_reduces_exactly(
    dtype: type, dst_offset: int, src_offset: int, count: int, in_place: bool
) -> None:
    itemsize = np.dtype(dtype).itemsize
    dst_offset -= dst_offset % itemsize  # numpy places an element on a multiple of its size
    src_offset -= src_offset % itemsize
    rng = np.random.default_rng(count + dst_offset)
    pad = count + CACHE_LINE
    incoming = _at(rng.integers(0, 50, pad).astype(dtype), src_offset, count)
    mine_values: np.ndarray = rng.integers(0, 50, count).astype(dtype)
    dst = _at(np.full(pad, 99, dtype), dst_offset, count)
    mine = dst if in_place else mine_values.copy()
    dst[...] = mine_values if in_place else 99
    apply_op(np.add, _add_into, mine, incoming, dst, in_place=in_place)
    assert np.array_equal(dst, mine_values + incoming)


def test_a_range_past_a_cache_line_with_an_odd_lead_is_reduced_whole_and_exactly() -> None:
    # float64 values 4 bytes past a line cannot start a line after whole elements: one call, same result
    raw = np.zeros(ALIGN_MIN_BYTES + 2 * CACHE_LINE, np.uint8)
    start = (4 - raw.ctypes.data) % CACHE_LINE
    dst = raw[start : start + ALIGN_MIN_BYTES].view(np.float64)
    dst[...] = 1.5
    incoming = np.arange(dst.size, dtype=np.float64)
    apply_op(np.add, _add_into, dst, incoming, dst, in_place=True)
    assert np.array_equal(dst, incoming + 1.5)


def test_a_reducer_without_a_ufunc_reduces_into_the_destination() -> None:
    mine = np.arange(10, dtype=np.int64)
    incoming = np.full(10, 3, np.int64)
    dst = np.zeros(10, np.int64)

    def reduce_into(out: np.ndarray, other: np.ndarray) -> None:
        np.maximum(out, other, out=out)

    apply_op(None, reduce_into, mine, incoming, dst, in_place=False)
    assert np.array_equal(dst, np.maximum(mine, 3))
