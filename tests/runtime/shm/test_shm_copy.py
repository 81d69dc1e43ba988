"""copy_into: the same bytes as ``dst[...] = src`` at every relative offset, on either side of the checked sizes."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.runtime.shm._copy import CHECKED_MAX_BYTES, CHECKED_MIN_BYTES, copy_into, slow_memcpy_offsets


def _at(block: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of ``block`` starting ``offset`` bytes past a page boundary."""
    start = (offset - block.ctypes.data) % 4096
    return block[start : start + nbytes]


@settings(max_examples=60, deadline=None)
@given(
    src_offset=st.integers(0, 63),
    dst_offset=st.integers(0, 63),
    nbytes=st.sampled_from([0, 1, 4096, CHECKED_MIN_BYTES - 1, CHECKED_MIN_BYTES, 100_001, CHECKED_MAX_BYTES]),
)
def test_every_offset_and_size_copies_exactly(src_offset: int, dst_offset: int, nbytes: int) -> None:
    rng = np.random.default_rng(nbytes + src_offset)
    src = _at(rng.integers(0, 256, CHECKED_MAX_BYTES + 8192, dtype=np.uint8), src_offset, nbytes)
    dst = _at(np.zeros(CHECKED_MAX_BYTES + 8192, np.uint8), dst_offset, nbytes)
    copy_into(dst, src)
    assert np.array_equal(dst, src)


def test_float_arrays_copy_bit_for_bit_on_the_slow_offsets() -> None:
    block = np.zeros(1 << 20, np.uint8)
    values = np.array([np.nan, -0.0, np.inf, 1e-45, -3.5], np.float32)
    src = _at(np.zeros(1 << 20, np.uint8), 0, 64 << 10).view(np.float32)
    src[:] = np.resize(values, src.size)
    dst = _at(block, 16, 64 << 10).view(np.float32)
    assert slow_memcpy_offsets(dst.ctypes.data, src.ctypes.data)
    copy_into(dst, src)
    assert dst.view(np.uint32).tobytes() == src.view(np.uint32).tobytes()


def test_a_read_only_source_copies() -> None:
    area = mmap.mmap(-1, 1 << 20)
    area[:] = bytes(range(256)) * 4096
    src = np.frombuffer(area, np.uint8, count=64 << 10)  # page-aligned, as a peer's snapshot is
    src.flags.writeable = False
    dst = _at(np.zeros(1 << 20, np.uint8), 16, 64 << 10)
    copy_into(dst, src)
    assert np.array_equal(dst, src)
    del src
    area.close()


@pytest.mark.parametrize(
    ("dst_minus_src", "slow"), [(0, False), (4, True), (16, True), (31, True), (32, False), (48, False)]
)
def test_the_slow_case_is_the_destination_just_past_the_source(dst_minus_src: int, slow: bool) -> None:
    assert slow_memcpy_offsets(4096 + dst_minus_src, 4096) is slow
