"""All-to-all's buffers: a rank's send buffer packed into the schedule's N²-block buffer, and unpacked from it.

An all-to-all schedule works on N² blocks, block ``s·N + d`` carrying rank s's part for rank d
(:mod:`allreduce.schedules`): rank r packs its parts into row r, the schedule runs, and r unpacks column r. Every
block has one size, so parts of different sizes (``input_splits``/``output_splits``) are padded to the largest part
of any rank: the ranks first all-gather their splits (N·2N integers), which is also where a rank that sends a part
of a size its receiver does not expect is named, on every rank, before any data moves. Padding costs traffic when
the parts are uneven (N times the largest part instead of the rank's own bytes); equal parts need no exchange and
move exactly (N-1)/N of each send buffer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.runtime.pipeline._buffers import Buffer, as_buffer

__all__ = ["PackedAllToAll", "WorkBuffers", "check_splits", "pack_all_to_all", "split_table"]

_KEPT_PER_CLASS = 2
"""Work buffers kept per size class: a blocking call reuses one; an asynchronous call beside it takes a second."""
_KEPT_MAX_BYTES = 1 << 30
"""The largest work buffer kept for reuse (larger ones are made per call and freed)."""


class WorkBuffers:
    """The N²-block buffers of a group's all-to-alls, kept for reuse by size class (powers of two bytes): a new
    buffer of tens of MiB costs its page faults on every call (half the CPU time of a 16 MiB all-to-all at 2
    ranks), and one the transport allocates (``allocate``: shared memory with shm) lets peers read it in place. A
    buffer is taken when a call is made and given back when it completes, so calls in flight never share one."""

    def __init__(self, allocate: Callable[[int], npt.NDArray[np.uint8]]) -> None:
        self._allocate = allocate
        self._free: dict[int, list[npt.NDArray[np.uint8]]] = {}
        self._lock = threading.Lock()

    def take(self, dtype: np.dtype[Any], count: int) -> tuple[npt.NDArray[Any], Callable[[], None]]:
        """A buffer of ``count`` elements of ``dtype``, and the call that gives it back."""
        size_bytes = count * dtype.itemsize
        if not 0 < size_bytes <= _KEPT_MAX_BYTES:
            return np.empty(count, dtype=dtype), _nothing
        capacity = 1 << (size_bytes - 1).bit_length()
        with self._lock:
            free = self._free.setdefault(capacity, [])
            raw = free.pop() if free else None
        if raw is None:
            raw = self._allocate(capacity)

        def give_back() -> None:
            with self._lock:
                kept = self._free.setdefault(capacity, [])
                if len(kept) < _KEPT_PER_CLASS:
                    kept.append(raw)

        return raw[:size_bytes].view(dtype), give_back


def _nothing() -> None:
    pass


class PackedAllToAll(Buffer):
    """The schedule's buffer (``flat``, N² blocks of ``block`` elements) standing for the caller's ``out``: once
    the collective is done, :meth:`write_back` copies column ``rank`` into ``out``'s parts."""

    __slots__ = ("_out", "_out_offsets", "_out_splits", "_rank", "_release", "_world_size", "block_size")

    def __init__(  # noqa: PLR0917 (the layout, in its order)
        self, out: Buffer, flat: npt.NDArray[Any], rank: int, world_size: int, block_size: int,
        out_splits: Sequence[int], release: Callable[[], None],
    ) -> None:  # fmt: skip
        super().__init__(out.original, flat, flat, copied=True)
        self._release = release
        self._out = out
        self._rank = rank
        self._world_size = world_size
        self.block_size = block_size
        self._out_splits = list(out_splits)
        self._out_offsets = np.concatenate(([0], np.cumsum(out_splits))).tolist()

    def write_back(self) -> None:
        n, b, r = self._world_size, self.block_size, self._rank
        target = self._out.flat
        for src, (start, size) in enumerate(zip(self._out_offsets, self._out_splits, strict=False)):
            if src == r:
                continue  # copied when the call was made (pack_all_to_all)
            first = (src * n + r) * b
            target[start : start + size] = self.flat[first : first + size]
        self._release()
        self._out.write_back()


def _equal_parts(count: int, world_size: int, what: str) -> list[int]:
    if count % world_size:
        raise ValueError(
            f"{what}: {count} elements do not split into {world_size} equal parts; pass input_splits and "
            "output_splits for parts of different sizes"
        )
    return [count // world_size] * world_size


def check_splits(splits: Sequence[int] | None, count: int, world_size: int, what: str) -> list[int]:
    """``splits`` (elements per rank) checked against a buffer of ``count`` elements; None: N equal parts."""
    if splits is None:
        return _equal_parts(count, world_size, what)
    parts = [int(s) for s in splits]
    if len(parts) != world_size or any(s < 0 for s in parts) or sum(parts) != count:
        raise ValueError(
            f"{what}: splits {list(splits)} must be {world_size} sizes >= 0 summing to the buffer's {count} elements"
        )
    return parts


def split_table(
    in_splits: Sequence[int], out_splits: Sequence[int], gather: Callable[[npt.NDArray[np.int64]], object], rank: int
) -> int:
    """Every rank's splits, all-gathered by ``gather`` (an all_gather of the N·2N table, filled in place): the
    size of the largest part any rank sends, or ``ValueError`` (the same on every rank) naming the first pair of
    ranks that disagree on the size of a part."""
    n = len(in_splits)
    table = np.zeros((n, 2 * n), dtype=np.int64)
    table[rank, :n] = in_splits
    table[rank, n:] = out_splits
    gather(table.reshape(-1))
    sends, expects = table[:, :n], table[:, n:].T  # expects[s, d]: what rank d expects from rank s
    wrong = np.argwhere(sends != expects)
    if wrong.size:
        s, d = (int(v) for v in wrong[0])
        raise ValueError(
            f"all_to_all: rank {s} sends {int(sends[s, d])} elements to rank {d}, which expects {int(expects[s, d])}"
        )
    return int(sends.max()) if n else 0


def pack_all_to_all(  # noqa: PLR0917 (the call's arguments, in its order)
    x: Any, out: Any, rank: int, world_size: int, in_splits: Sequence[int], out_splits: Sequence[int],
    block_size: int, buffers: WorkBuffers,
) -> PackedAllToAll:  # fmt: skip
    """``x``'s parts copied into row ``rank`` of an N²-block buffer of ``block_size``-element blocks."""
    source = as_buffer(x, "all_to_all(x)", writable=False).flat
    target = as_buffer(out, "all_to_all(out)")
    if target.flat.dtype != source.dtype:
        raise TypeError(f"all_to_all: out is {target.flat.dtype}, x is {source.dtype}; they must match")
    n = world_size
    flat, release = buffers.take(source.dtype, n * n * block_size)
    offsets = np.concatenate(([0], np.cumsum(in_splits))).tolist()
    for dst, size in enumerate(in_splits):
        if dst != rank:
            first = (rank * n + dst) * block_size
            flat[first : first + size] = source[offsets[dst] : offsets[dst] + size]
    # this rank's part for itself goes straight to out (after the others: x and out may be one array)
    mine = int(np.sum(out_splits[:rank]))
    target.flat[mine : mine + in_splits[rank]] = source[offsets[rank] : offsets[rank] + in_splits[rank]]
    return PackedAllToAll(target, flat, rank, n, block_size, out_splits, release)
