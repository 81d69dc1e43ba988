"""Copying between a rank's arrays and shared memory without the C library's slow case.

``dst[...] = src`` on contiguous arrays is ``memcpy``, and glibc's ``memcpy`` (2.36 here) moves copies of a few KiB
to a few hundred KiB with ``rep movsb``. On this project's machine (AMD EPYC) that ran at 2.1-2.9 GB/s instead of
26-33 GB/s whenever the destination sat 4, 8 or 16 bytes past the source within a 64-byte cache line (measured:
``(dst - src) % 64`` of 4, 8, 16 slow; 0, 32, 48, 60 fast; 64 KiB and 256 KiB copies; 512 KiB and up fast at any
offset, where glibc switches strategy). It is the common case for plain arrays: numpy places a large array 16 bytes
into its pages (the allocator's header) and our shared areas start on page boundaries, so every staged copy-out and
every copy out of a peer's eager snapshot into the user's array fell in it: a 512 KiB ring all-reduce of two ranks
took 460 µs where a buffer on another offset took 150-180 µs.

:func:`copy_into` takes ``np.positive`` on the bytes (an integer loop, no ``rep movsb``: 21-24 GB/s for the same
copies) in that window, and ``memcpy`` everywhere else. Finding the two addresses costs about 0.4 µs each (about
2 µs a call in all), so it is done only for copies of at least :data:`CHECKED_MIN_BYTES`.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["CHECKED_MAX_BYTES", "CHECKED_MIN_BYTES", "copy_into", "slow_memcpy_offsets"]

CHECKED_MIN_BYTES = 64 << 10
"""Smaller copies take ``memcpy`` unchecked: looking up the two addresses costs about 2 µs a copy in place (a 64
KiB ring all-reduce of two ranks measured 8-25 µs slower checking its 32 KiB copies, none of them in the slow
case), as much as a slow copy of 4 KiB loses."""

CHECKED_MAX_BYTES = 512 << 10
"""Copies this large and larger take ``memcpy`` unchecked: glibc no longer uses ``rep movsb`` for them (measured: a
copy 16 bytes ahead ran at 2.8 GB/s at 480 KiB and at 27.9 GB/s at 512 KiB), and there the integer loop, whose
stores do not bypass the caches, made a 1 MiB ring all-reduce of two ranks 30% slower."""

_address = ctypes.addressof
_byte_at = ctypes.c_byte.from_buffer


def slow_memcpy_offsets(dst_address: int, src_address: int) -> bool:
    """Whether ``memcpy`` from ``src_address`` to ``dst_address`` falls in the slow case: the destination 1 to 31
    bytes past the source within a cache line."""
    return 0 < (dst_address - src_address) % 64 < 32


def copy_into(dst: npt.NDArray[Any], src: npt.NDArray[Any]) -> None:
    """``dst[...] = src`` for contiguous arrays of the same dtype and size, avoiding the slow ``memcpy``."""
    if CHECKED_MIN_BYTES <= dst.nbytes < CHECKED_MAX_BYTES:
        try:
            target = _address(_byte_at(dst))  # type: ignore[arg-type]  # numpy arrays export buffers
            try:
                source = _address(_byte_at(src))  # type: ignore[arg-type]
            except TypeError:  # a read-only source: the slower way to its address
                source = int(src.ctypes.data)
        except TypeError:  # not one contiguous block: numpy's own copy
            target = source = 0
        if slow_memcpy_offsets(target, source):
            np.positive(src.view(np.uint8), out=dst.view(np.uint8))
            return
    dst[...] = src
