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

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.runtime._buffers import Buffer, as_buffer

__all__ = ["PackedAllToAll", "check_splits", "pack_all_to_all", "split_table"]


class PackedAllToAll(Buffer):
    """The schedule's buffer (``flat``, N² blocks of ``block`` elements) standing for the caller's ``out``: once
    the collective is done, :meth:`write_back` copies column ``rank`` into ``out``'s parts."""

    __slots__ = ("_out", "_out_offsets", "_out_splits", "_rank", "_world_size", "block_size")

    def __init__(  # noqa: PLR0917 (the layout, in its order)
        self, out: Buffer, flat: npt.NDArray[Any], rank: int, world_size: int, block_size: int,
        out_splits: Sequence[int],
    ) -> None:  # fmt: skip
        super().__init__(out.original, flat, flat, copied=True)
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
            first = (src * n + r) * b
            target[start : start + size] = self.flat[first : first + size]
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
    block_size: int,
) -> PackedAllToAll:  # fmt: skip
    """``x``'s parts copied into row ``rank`` of a new N²-block buffer of ``block_size``-element blocks."""
    source = as_buffer(x, "all_to_all(x)", writable=False).flat
    target = as_buffer(out, "all_to_all(out)")
    if target.flat.dtype != source.dtype:
        raise TypeError(f"all_to_all: out is {target.flat.dtype}, x is {source.dtype}; they must match")
    n = world_size
    flat = np.empty(n * n * block_size, dtype=source.dtype)
    start = 0
    for dst, size in enumerate(in_splits):
        first = (rank * n + dst) * block_size
        flat[first : first + size] = source[start : start + size]
        start += size
    return PackedAllToAll(target, flat, rank, n, block_size, out_splits)
