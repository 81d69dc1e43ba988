"""The schedule type: a collective algorithm as data.

A schedule moves *blocks*. The buffer of every rank is cut into ``num_blocks`` blocks of (nearly) equal size;
block ``b`` of a buffer of ``count`` elements covers elements ``[b*count//num_blocks, (b+1)*count//num_blocks)``
(see :func:`block_bounds`). A transfer moves a contiguous range of blocks from one rank to a peer, and the peer
either reduces it into its own copy (``recv_reduce``) or overwrites its copy with it (``recv_copy``).

Storage is by *stream*: one stream is one sender's sequence of transfers over consecutive steps whose peer and
block advance by a fixed stride. The ring's reduce-scatter is N streams (rank r sends block r-j-1 to rank r+1 at
step j), so ring all-reduce for 131,072 ranks is 262,144 streams, never its N·2(N-1) transfers. Two views are
derived on demand:

- :meth:`Schedule.program` — what one rank does, step by step (what the runtime executes and the verifier
  replays);
- :meth:`Schedule.phases` — the flow patterns: each a set of concurrent (src, dst, bytes) transfers plus how
  many consecutive steps repeat it (what the simulator and the cost model read).

Execution semantics, shared by the runtime, the verifier, the cost model and the simulator:

- a rank runs its steps in order; the operations of one step are concurrent;
- the sends of a step read the rank's blocks as they were when the step began, and its receives land when the
  step ends, so a block may be sent and received in the same step (recursive doubling exchanges whole buffers);
- the k-th send from rank a to rank b matches the k-th receive at b from a, and must name the same blocks.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = [
    "Collective",
    "Op",
    "Phase",
    "Schedule",
    "Streams",
    "Verb",
    "block_bounds",
    "concat_streams",
]

IntArray = npt.NDArray[np.int64]
# Phases are kept after their first full pass when they hold at most this many flows in all (about 100 MB of
# arrays, naive all-reduce at 2,048 ranks): the cost model walks them once per size it tries, and re-deriving a
# million-flow phase each time dominated `explain`. Schedules with more flow patterns (direct on thousands of
# ranks) are re-derived on demand instead of held.
_PHASE_CACHE_MAX_FLOWS = 1 << 22
BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]


def _sorted_unique(values: IntArray) -> IntArray:
    """``np.unique`` without it: its first call imports ``numpy.ma`` (hundreds of ms on a loaded machine, holding
    the GIL), and the runtime plans its first collective on the caller's thread while its worker runs another."""
    ordered = np.sort(values)
    if ordered.size == 0:
        return ordered
    keep: IntArray = ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))]
    return keep


class Collective(enum.Enum):
    """What a schedule computes; the verifier checks the matching postcondition."""

    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALL_TO_ALL = "all_to_all"
    GATHER = "gather"
    SCATTER = "scatter"


class Verb(enum.Enum):
    """The data movements a rank performs, named as NCCL names its primitives."""

    SEND = "send"
    RECV_REDUCE = "recv_reduce"
    RECV_COPY = "recv_copy"


class Op(NamedTuple):
    """One operation of one rank: at ``step``, ``verb`` blocks ``[block_start, block_stop)`` with ``peer``."""

    step: int
    verb: Verb
    peer: int
    block_start: int
    block_stop: int

    def __str__(self) -> str:
        blocks = (
            f"block {self.block_start}"
            if self.block_stop == self.block_start + 1
            else f"blocks [{self.block_start}, {self.block_stop})"
        )
        direction = "to" if self.verb is Verb.SEND else "from"
        return f"step {self.step}: {self.verb.value} {blocks} {direction} rank {self.peer}"


_STREAM_FIELDS = (
    "src",
    "peer",
    "peer_stride",
    "start",
    "steps",
    "block_base",
    "block_count",
    "block_offset",
    "block_stride",
    "block_period",
)


@dataclass(frozen=True, eq=False)
class Streams:
    """Transfers stored as arrays, one entry per stream.

    Stream ``i`` sends, at each step ``start[i] + j`` for ``0 <= j < steps[i]``, from rank ``src[i]`` to rank
    ``(peer[i] + j*peer_stride[i]) mod world_size`` the ``block_count[i]`` blocks starting at
    ``block_base[i] + ((block_offset[i] + j*block_stride[i]) mod block_period[i]) * block_count[i]``; the
    receiver reduces them into its copy when ``reduce[i]``, else overwrites its copy.
    """

    src: IntArray
    peer: IntArray
    peer_stride: IntArray
    start: IntArray
    steps: IntArray
    block_base: IntArray
    block_count: IntArray
    block_offset: IntArray
    block_stride: IntArray
    block_period: IntArray
    reduce: BoolArray

    @staticmethod
    def build(
        *,
        src: npt.ArrayLike,
        peer: npt.ArrayLike,
        start: npt.ArrayLike,
        block_base: npt.ArrayLike,
        reduce: npt.ArrayLike,
        steps: npt.ArrayLike = 1,
        peer_stride: npt.ArrayLike = 0,
        block_count: npt.ArrayLike = 1,
        block_offset: npt.ArrayLike = 0,
        block_stride: npt.ArrayLike = 0,
        block_period: npt.ArrayLike = 1,
    ) -> Streams:
        """Build streams from scalars or arrays, broadcast against each other."""
        values = {
            "src": src,
            "peer": peer,
            "peer_stride": peer_stride,
            "start": start,
            "steps": steps,
            "block_base": block_base,
            "block_count": block_count,
            "block_offset": block_offset,
            "block_stride": block_stride,
            "block_period": block_period,
        }
        arrays = np.broadcast_arrays(*(np.asarray(v, dtype=np.int64) for v in values.values()))
        shape = arrays[0].shape
        fields = {name: np.ascontiguousarray(a.reshape(-1)) for name, a in zip(values, arrays, strict=True)}
        reduce_arr = np.ascontiguousarray(np.broadcast_to(np.asarray(reduce, dtype=np.bool_), shape).reshape(-1))
        return Streams(reduce=reduce_arr, **fields)

    @staticmethod
    def empty() -> Streams:
        return Streams.build(src=[], peer=[], start=[], block_base=[], reduce=[])

    def __len__(self) -> int:
        return int(self.src.shape[0])

    def select(self, index: npt.NDArray[np.bool_] | IntArray) -> Streams:
        """The streams picked by a boolean mask or an index array."""
        return Streams(reduce=self.reduce[index], **{name: getattr(self, name)[index] for name in _STREAM_FIELDS})

    def replace(self, **changes: npt.ArrayLike) -> Streams:
        """A copy with some fields replaced (arrays broadcast to the stream count)."""
        n = len(self)
        fields: dict[str, npt.NDArray[np.int64]] = {name: getattr(self, name) for name in _STREAM_FIELDS}
        reduce = self.reduce
        for name, value in changes.items():
            if name == "reduce":
                reduce = np.ascontiguousarray(np.broadcast_to(np.asarray(value, dtype=np.bool_), (n,)))
            elif name in fields:
                fields[name] = np.ascontiguousarray(np.broadcast_to(np.asarray(value, dtype=np.int64), (n,)))
            else:
                raise TypeError(f"Streams has no field {name!r}")
        return Streams(reduce=reduce, **fields)

    def block_at(self, j: IntArray | int) -> IntArray:
        """First block each stream sends at its own step index ``j``."""
        k = np.mod(self.block_offset + np.asarray(j, dtype=np.int64) * self.block_stride, self.block_period)
        return np.asarray(self.block_base + k * self.block_count, dtype=np.int64)

    def peer_at(self, j: IntArray | int, world_size: int) -> IntArray:
        return np.asarray(
            np.mod(self.peer + np.asarray(j, dtype=np.int64) * self.peer_stride, world_size), dtype=np.int64
        )


def concat_streams(parts: Sequence[Streams]) -> Streams:
    """All streams of ``parts``, in order."""
    if not parts:
        return Streams.empty()
    return Streams(
        reduce=np.concatenate([p.reduce for p in parts]),
        **{name: np.concatenate([getattr(p, name) for p in parts]) for name in _STREAM_FIELDS},
    )


@dataclass(frozen=True, eq=False)
class Phase:
    """One flow pattern: concurrent transfers that ``repeat`` consecutive steps reuse.

    ``fraction[i]`` is the share of a rank's buffer (:attr:`Schedule.buffer_blocks`) that transfer ``i`` carries
    (so bytes = fraction × size);
    ``reduce[i]`` says whether the receiver reduces it. The blocks differ from step to step; the (src, dst,
    bytes) pattern does not.
    """

    first_step: int
    repeat: int
    src: IntArray
    dst: IntArray
    fraction: FloatArray
    reduce: BoolArray

    def __len__(self) -> int:
        return int(self.src.shape[0])


def _expand(counts: IntArray) -> tuple[IntArray, IntArray]:
    """For counts [2, 3]: item index [0, 0, 1, 1, 1] and position within item [0, 1, 0, 1, 2]."""
    total = int(counts.sum())
    item = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    return item, np.arange(total, dtype=np.int64) - np.repeat(first, counts)


def block_bounds(count: int, num_blocks: int) -> IntArray:
    """Element offsets of the ``num_blocks + 1`` block boundaries of a buffer of ``count`` elements."""
    return np.asarray((np.arange(num_blocks + 1, dtype=np.int64) * count) // num_blocks, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class Schedule:
    """A collective algorithm for ``world_size`` ranks on a buffer cut into ``num_blocks`` blocks.

    ``segments`` cuts every transfer into that many pieces that the runtime streams back to back, so receiving
    (and reducing) piece k overlaps sending piece k+1; the data movement, and so the verification, is the same
    as with one segment. ``root`` is the root rank of a broadcast, a reduce, a gather or a scatter.
    """

    name: str
    collective: Collective
    world_size: int
    num_blocks: int
    num_steps: int
    streams: Streams
    segments: int = 1
    root: int = 0

    def __post_init__(self) -> None:
        for field_name, value in (
            ("world_size", self.world_size),
            ("num_blocks", self.num_blocks),
            ("segments", self.segments),
        ):
            if value < 1:
                raise ValueError(f"{self.name}: {field_name} must be >= 1, got {value}")
        if not 0 <= self.root < self.world_size:
            raise ValueError(f"{self.name}: root {self.root} is not a rank of a group of {self.world_size}")

    def __repr__(self) -> str:
        seg = f", segments={self.segments}" if self.segments > 1 else ""
        return (
            f"Schedule({self.name!r}, {self.collective.value}, world_size={self.world_size}, "
            f"num_blocks={self.num_blocks}, steps={self.num_steps}, streams={len(self.streams)}{seg})"
        )

    @property
    def buffer_blocks(self) -> int:
        """How many blocks make what a caller calls its buffer, the size the cost model and the simulator are
        given: every block, but for all-to-all one row of the N² (its send buffer, of which every rank moves N)."""
        return self.num_blocks // self.world_size if self.collective is Collective.ALL_TO_ALL else self.num_blocks

    def with_segments(self, segments: int) -> Schedule:
        """The same schedule with every transfer cut into ``segments`` pipelined pieces."""
        return replace(self, segments=segments)

    # ----------------------------------------------------------------------------------------------------
    # Per-rank view
    # ----------------------------------------------------------------------------------------------------
    def program(self, rank: int) -> list[Op]:
        """The operations of ``rank`` in execution order: by step; within a step sends, then receives."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"{self.name}: rank {rank} is not in a group of {self.world_size}")
        s = self.streams
        send_idx = np.flatnonzero(s.src == rank)
        send_stream, send_j = _expand(s.steps[send_idx])
        send_stream = send_idx[send_stream]
        recv_stream, recv_j = self._incoming(rank)
        columns: list[tuple[IntArray, IntArray, IntArray, IntArray]] = []  # step, peer, block, stop
        verbs: list[Verb] = []
        for verb_kind, idx, js in (("send", send_stream, send_j), ("recv", recv_stream, recv_j)):
            if idx.size == 0:
                continue
            sub = s.select(idx)
            blocks = sub.block_at(js)
            if verb_kind == "send":
                peers = sub.peer_at(js, self.world_size)
                verbs.extend([Verb.SEND] * idx.size)
            else:
                peers = sub.src
                verbs.extend([Verb.RECV_REDUCE if r else Verb.RECV_COPY for r in sub.reduce.tolist()])
            columns.append((sub.start + js, peers, blocks, blocks + sub.block_count))
        if not columns:
            return []
        steps, peers, blocks, stops = (np.concatenate(column) for column in zip(*columns, strict=True))
        # By step; within a step sends, then receives; then by peer and first block; ties keep the order above.
        receives = np.arange(len(verbs)) >= send_stream.size
        order = np.lexsort((np.arange(len(verbs)), blocks, peers, receives, steps)).tolist()
        return list(
            map(
                Op,
                steps[order].tolist(),
                [verbs[i] for i in order],
                peers[order].tolist(),
                blocks[order].tolist(),
                stops[order].tolist(),
            )
        )

    def _incoming(self, rank: int) -> tuple[IntArray, IntArray]:
        """(stream index, step index) arrays of every transfer that ``rank`` receives."""
        s = self.streams
        fixed = np.flatnonzero((s.peer_stride == 0) & (s.peer == rank))
        fixed_stream, fixed_j = _expand(s.steps[fixed])
        streams = [fixed[fixed_stream]]
        steps = [fixed_j]
        strided = np.flatnonzero(s.peer_stride != 0)
        if strided.size:
            sub = s.select(strided)
            js = np.arange(int(sub.steps.max()), dtype=np.int64)
            peers = np.mod(sub.peer[:, None] + js[None, :] * sub.peer_stride[:, None], self.world_size)
            rows, cols = np.nonzero((peers == rank) & (js[None, :] < sub.steps[:, None]))
            streams.append(strided[rows])
            steps.append(cols.astype(np.int64))
        return np.concatenate(streams), np.concatenate(steps)

    def programs(self) -> list[list[Op]]:
        """Every rank's program (for verification and small-N engines; O(N) programs)."""
        return [self.program(r) for r in range(self.world_size)]

    # ----------------------------------------------------------------------------------------------------
    # Flow-pattern view
    # ----------------------------------------------------------------------------------------------------
    @cached_property
    def _phase_bounds(self) -> IntArray:
        s = self.streams
        cuts = [np.asarray([0, self.num_steps], dtype=np.int64), s.start, s.start + s.steps]
        strided = s.peer_stride != 0
        if strided.any():
            # A stream whose peer moves changes the pattern at every one of its steps.
            cuts.extend(
                np.arange(a, a + k, dtype=np.int64) for a, k in zip(s.start[strided], s.steps[strided], strict=True)
            )
        return _sorted_unique(np.concatenate(cuts))

    def phases(self) -> Iterator[Phase]:
        """The flow patterns in step order; consecutive steps with the same active streams form one phase."""
        cached: list[Phase] | None = self.__dict__.get("_phase_cache")
        if cached is not None:
            yield from cached
            return
        kept: list[Phase] | None = []
        flows = 0
        for phase in self._derive_phases():
            if kept is not None:
                flows += len(phase)
                if flows <= _PHASE_CACHE_MAX_FLOWS:
                    kept.append(phase)
                else:
                    kept = None
            yield phase
        if kept is not None:
            self.__dict__["_phase_cache"] = kept

    def _derive_phases(self) -> Iterator[Phase]:
        s = self.streams
        bounds = self._phase_bounds
        order = np.argsort(s.start, kind="stable")
        starts_sorted = s.start[order]
        ends_sorted = (s.start + s.steps)[order]
        for first, stop in itertools.pairwise(bounds.tolist()):
            first_i, stop_i = int(first), int(stop)
            # Streams that start at or before `first` — a prefix of the start-sorted order.
            upto = int(np.searchsorted(starts_sorted, first_i, side="right"))
            candidates = order[:upto][ends_sorted[:upto] > first_i]
            if candidates.size == 0:
                continue
            sub = s.select(candidates)
            j = first_i - sub.start
            dst = sub.peer_at(j, self.world_size)
            yield Phase(
                first_step=first_i,
                repeat=stop_i - first_i,
                src=sub.src,
                dst=dst,
                fraction=sub.block_count.astype(np.float64) / self.buffer_blocks,
                reduce=sub.reduce,
            )

    def bytes_sent_per_rank(self, size_bytes: float) -> FloatArray:
        """Bytes each rank sends over the whole collective, for a buffer of ``size_bytes`` (all-to-all: a send
        buffer)."""
        s = self.streams
        per_stream = s.steps.astype(np.float64) * s.block_count / self.buffer_blocks * size_bytes
        return np.bincount(s.src, weights=per_stream, minlength=self.world_size).astype(np.float64)
