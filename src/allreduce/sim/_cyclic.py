"""The Monte Carlo's step for cyclic-shift phases: rings, the rings of hierarchical all-reduce, the pairwise
exchanges of halving-doubling — every rank sends one flow, to the rank a fixed distance ahead in its block.
Two slices replace :func:`allreduce.schedules.timing.step_samples`' index gathers, with the same arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from allreduce.schedules import Phase
from allreduce.schedules.timing import Blame, add_flow_delays

__all__ = ["Cyclic", "step_cyclic"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class Cyclic:
    """A phase in which every rank sends one flow, to the rank ``shift`` places ahead of it in its block of
    ``block`` consecutive ranks (cyclically): a ring is one block of every rank, shift 1; the inter-node ring of
    hierarchical all-reduce one block, shift ranks-per-node; its intra-node rings blocks of a node.

    Then a step's gathers are two slices of the clocks seen as ``(ranks / block, block, samples)``, and its
    scatter is one maximum with the ends shifted back: no index arrays, about a third of the passes of
    :func:`allreduce.schedules.timing.step_samples`, whose arithmetic it repeats operation for operation (so the
    clocks are the same bit for bit, and so are the blames: the same strict comparisons pick them)."""

    block: int
    shift: int
    order: IntArray  # order[r]: the flow whose sender is rank r (flow-ordered arrays -> rank order)

    @classmethod
    def of(cls, world_size: int, phase: Phase) -> Cyclic | None:
        n = world_size
        if n < 2 or len(phase) != n:
            return None
        src, dst = phase.src.astype(np.int64), phase.dst.astype(np.int64)
        if not np.array_equal(np.bincount(src, minlength=n), np.ones(n, dtype=np.int64)):
            return None
        offsets = np.unique(dst - src)
        if offsets.size == 1:
            block, shift = n, int(offsets[0]) % n
        elif offsets.size == 2:
            block, shift = int(offsets[1] - offsets[0]), int(offsets[1])
        else:
            return None
        if not (0 < shift < block <= n and n % block == 0):
            return None
        base = src - src % block
        if not np.array_equal(dst, base + (src % block + shift) % block):
            return None
        order = np.empty(n, dtype=np.int64)
        order[src] = np.arange(n, dtype=np.int64)
        return cls(block, shift, order)

    def max_ahead(self, values: FloatArray) -> FloatArray:
        """``max(values[r], values[r + shift])`` per row, without materialising the shifted copy."""
        b, s = self.block, self.shift
        v = values.reshape(-1, b, values.shape[-1])
        out = np.empty_like(v)
        np.maximum(v[:, : b - s], v[:, s:], out=out[:, : b - s])
        np.maximum(v[:, b - s :], v[:, :s], out=out[:, b - s :])
        return out.reshape(values.shape)

    def max_behind(self, values: FloatArray) -> FloatArray:
        """``max(values[r], values[r - shift])`` per row."""
        b, s = self.block, self.shift
        v = values.reshape(-1, b, values.shape[-1])
        out = np.empty_like(v)
        np.maximum(v[:, s:], v[:, : b - s], out=out[:, s:])
        np.maximum(v[:, :s], v[:, b - s :], out=out[:, :s])
        return out.reshape(values.shape)

    def ahead_is_later(self, values: FloatArray) -> npt.NDArray[np.bool_]:
        """``values[r + shift] > values[r]`` per row (strictly: a tie keeps row r's own)."""
        b, s = self.block, self.shift
        v = values.reshape(-1, b, values.shape[-1])
        out = np.empty(v.shape, dtype=np.bool_)
        np.greater(v[:, s:], v[:, : b - s], out=out[:, : b - s])
        np.greater(v[:, :s], v[:, b - s :], out=out[:, b - s :])
        return out.reshape(values.shape)

    def behind_is_later(self, values: FloatArray) -> npt.NDArray[np.bool_]:
        """``values[r - shift] > values[r]`` per row."""
        b, s = self.block, self.shift
        v = values.reshape(-1, b, values.shape[-1])
        out = np.empty(v.shape, dtype=np.bool_)
        np.greater(v[:, : b - s], v[:, s:], out=out[:, s:])
        np.greater(v[:, b - s :], v[:, :s], out=out[:, :s])
        return out.reshape(values.shape)

    def take_where(self, keys: IntArray, mask: npt.NDArray[np.bool_], *, ahead: bool) -> IntArray:
        """``keys``, where rows for which ``mask`` holds take the key of rank ``r + shift`` (``ahead``) or
        ``r - shift``, as arithmetic: ``keys + ((shifted − keys) & −mask)``, the difference taken between the
        shifted slices (no shifted copy is made). A masked copy or ``np.where`` costs several times more with a
        mask that changes from element to element (branch mispredictions), a multiply by the mask widened to
        int64 about a pass more. Keys are non-negative int64, so the difference cannot overflow."""
        b, s = self.block, self.shift
        shape = keys.shape
        k = keys.reshape(-1, b, shape[-1])
        out = np.empty_like(k)
        if ahead:
            np.subtract(k[:, s:], k[:, : b - s], out=out[:, : b - s])
            np.subtract(k[:, :s], k[:, b - s :], out=out[:, b - s :])
        else:
            np.subtract(k[:, : b - s], k[:, s:], out=out[:, s:])
            np.subtract(k[:, b - s :], k[:, :s], out=out[:, :s])
        # the difference where the mask holds, else 0: an AND with the mask as 0 / -1 (its bytes as int8, negated,
        # sign-extended by the AND)
        np.bitwise_and(out, np.negative(mask.reshape(k.shape).view(np.int8)), out=out)
        out += k
        return out.reshape(shape)


def step_cyclic(
    clock: FloatArray,
    cyclic: Cyclic,
    flow_seconds: FloatArray,
    rank_seconds: FloatArray | None,
    *,
    extra_s: FloatArray | None,
    extra_blame: IntArray | None,
    rank_blame: IntArray | None,
    sparse: tuple[IntArray, IntArray, FloatArray, IntArray | None] | None,
    blame: Blame | None,
) -> FloatArray:
    """:func:`allreduce.schedules.timing.step_samples` for a cyclic phase, with every per-flow array in rank order
    (row r: the flow rank r sends; ``sparse`` rows likewise). Rank r's flow starts at
    ``max(clock[r], clock[r + shift])``; rank r's clock becomes the later of its own flow's end and the end of
    the flow it receives, rank ``r − shift``'s; then its own delay."""
    base = flow_seconds if flow_seconds.ndim == 2 else flow_seconds[:, None]
    end_blame: IntArray | None = None
    end = cyclic.max_ahead(clock)
    if blame is not None:
        # the flow starts with the later of its ranks' clocks, and takes the receiver's blame when that was later
        end_blame = cyclic.take_where(blame.key, cyclic.ahead_is_later(clock), ahead=True)
        if extra_blame is not None:
            np.maximum(end_blame, extra_blame, out=end_blame)
    add_flow_delays(end, end_blame, base, extra_s, sparse)
    done = cyclic.max_behind(end)
    if blame is not None and end_blame is not None:
        # the rank's clock takes the received flow's blame when that flow ended later than its own
        blame.key = cyclic.take_where(end_blame, cyclic.behind_is_later(end), ahead=False)
    if rank_seconds is not None:
        done += rank_seconds[:, None]
        if blame is not None and rank_blame is not None:
            np.maximum(blame.key, rank_blame[:, None], out=blame.key)
    return done
