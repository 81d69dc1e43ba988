"""Writing an algorithm the way the textbook does: step by step, rank by rank, in three verbs.

A :class:`Program` is an empty schedule for ``world_size`` ranks whose buffers are cut into ``num_blocks``
blocks. :meth:`Program.step` opens a step; in it, any rank may

- ``send(rank, peer, block)``: send its copy of ``block`` (an int, or a ``range`` of consecutive blocks) to
  ``peer``;
- ``recv_reduce(rank, peer, block)``: receive ``block`` from ``peer`` and add it into its own copy;
- ``recv_copy(rank, peer, block)``: receive ``block`` from ``peer`` and overwrite its own copy with it.

These are the verbs of :class:`Verb` and the semantics of :mod:`allreduce.schedules._schedule`: a step's sends
read the blocks as they were when the step began, its receives land when it ends, and the k-th send from a to b
pairs with the k-th receive at b from a, which must be in the same step and name the same blocks. An algorithm is
a plain function ``(world_size, **parameters) -> Program``; registering it compiles and verifies it.

:meth:`Program.compile` turns the program into a :class:`Schedule`: it pairs every send with its receive
(naming the rank, step and block of any that has no partner), then chains each rank's transfers over consecutive
steps whose peer and block advance by a fixed stride into one stream, so a ring written here is 2N streams,
as the built-in one is, not its 2N(N-1) transfers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from allreduce.schedules._schedule import Collective, Schedule, Streams, Verb
from allreduce.schedules._verify import ScheduleError

__all__ = ["Program", "Step"]

_VERB_CODE = {Verb.SEND: 0, Verb.RECV_REDUCE: 1, Verb.RECV_COPY: 2}


class Program:
    """A collective algorithm being written: steps of sends and receives, compiled by :meth:`compile`."""

    def __init__(
        self,
        world_size: int,
        *,
        num_blocks: int,
        collective: Collective | str = Collective.ALL_REDUCE,
        root: int = 0,
        name: str = "authored",
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int | np.integer) or world_size < 1:
            raise ValueError(f"{name}: world_size must be an int >= 1, got {world_size!r}")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int | np.integer) or num_blocks < 1:
            raise ValueError(f"{name}: num_blocks must be an int >= 1, got {num_blocks!r}")
        if not 0 <= root < world_size:
            raise ValueError(f"{name}: root {root} is not a rank of a group of {world_size}")
        self.world_size = int(world_size)
        self.num_blocks = int(num_blocks)
        self.collective = Collective(collective)
        self.root = int(root)
        self.name = name
        self.num_steps = 0
        # One column per field of the verbs issued: step, rank, peer, block_start, block_stop, verb code.
        self._ops: tuple[list[int], ...] = ([], [], [], [], [], [])

    def __repr__(self) -> str:
        return (
            f"Program({self.name!r}, {self.collective.value}, world_size={self.world_size}, "
            f"num_blocks={self.num_blocks}, steps={self.num_steps}, ops={len(self._ops[0])})"
        )

    def step(self, index: int | None = None) -> Step:
        """The step after the last one opened so far, or step ``index`` (pipelines write ahead of time)."""
        if index is None:
            index = self.num_steps
        elif isinstance(index, bool) or not isinstance(index, int | np.integer) or index < 0:
            raise ValueError(f"{self.name}: a step index is an int >= 0, got {index!r}")
        self.num_steps = max(self.num_steps, int(index) + 1)
        return Step(self, int(index))

    def _issue(self, step: int, rank: int, peer: int, block: int | range, verb: Verb) -> None:
        n = self.world_size
        where = f"{self.name}: step {step}: rank {rank} {verb.value}"
        if not 0 <= rank < n:
            raise ScheduleError(f"{where}: rank {rank} is not a rank (world size {n})")
        if not 0 <= peer < n:
            raise ScheduleError(f"{where}: peer {peer} is not a rank (world size {n})")
        if peer == rank:
            raise ScheduleError(f"{where}: a rank cannot exchange with itself")
        if isinstance(block, range):
            if block.step != 1 or len(block) == 0:
                raise ScheduleError(f"{where}: {block} is not a non-empty range of consecutive blocks")
            start, stop = block.start, block.stop
        elif isinstance(block, int | np.integer) and not isinstance(block, bool):
            start, stop = int(block), int(block) + 1
        else:
            raise ScheduleError(f"{where}: a block is an int or a range of ints, got {block!r}")
        if not 0 <= start < stop <= self.num_blocks:
            raise ScheduleError(f"{where}: blocks [{start}, {stop}) out of range (the buffer has {self.num_blocks})")
        for column, value in zip(self._ops, (step, rank, peer, start, stop, _VERB_CODE[verb]), strict=True):
            column.append(value)

    def compile(self, name: str | None = None) -> Schedule:
        """The :class:`Schedule` this program describes (not verified: :func:`verify` does that).

        Raises :class:`ScheduleError` naming the rank, step and block of a send without its receive, a receive
        without its send, or a pair in different steps or over different blocks.
        """
        name = self.name if name is None else name
        transfers = _pair(self._ops, name)
        streams = _chain(transfers, self.world_size, self.num_blocks)
        return Schedule(
            name, self.collective, self.world_size, self.num_blocks, self.num_steps, streams, root=self.root
        )


@dataclass(frozen=True)
class Step:
    """One step of a :class:`Program`: the verbs issued on it run concurrently."""

    program: Program
    index: int

    def send(self, rank: int, peer: int, block: int | range) -> None:
        """``rank`` sends its copy of ``block`` (as it was when the step began) to ``peer``."""
        self.program._issue(self.index, rank, peer, block, Verb.SEND)

    def recv_reduce(self, rank: int, peer: int, block: int | range) -> None:
        """``rank`` receives ``block`` from ``peer`` and reduces it into its own copy."""
        self.program._issue(self.index, rank, peer, block, Verb.RECV_REDUCE)

    def recv_copy(self, rank: int, peer: int, block: int | range) -> None:
        """``rank`` receives ``block`` from ``peer`` and overwrites its own copy with it."""
        self.program._issue(self.index, rank, peer, block, Verb.RECV_COPY)


@dataclass(frozen=True)
class _Transfers:
    """Matched send/receive pairs, one entry each, sorted by step."""

    step: list[int]
    src: list[int]
    dst: list[int]
    block_start: list[int]
    block_count: list[int]
    reduce: list[bool]


def _blocks(start: int, stop: int) -> str:
    return f"block {start}" if stop == start + 1 else f"blocks [{start}, {stop})"


def _pair(ops: tuple[list[int], ...], name: str) -> _Transfers:
    """Pair the k-th send a→b with the k-th receive at b from a (both in (step, block) order)."""
    if not ops[0]:
        return _Transfers([], [], [], [], [], [])
    step, rank, peer, start, stop, verb = (np.asarray(column, dtype=np.int64) for column in ops)
    is_reduce = verb == _VERB_CODE[Verb.RECV_REDUCE]
    sends = np.flatnonzero(verb == _VERB_CODE[Verb.SEND])
    recvs = np.flatnonzero(verb != _VERB_CODE[Verb.SEND])
    # Channel (src, dst), then step, then first block: the order in which Schedule.program lists them.
    s_order = sends[np.lexsort((start[sends], step[sends], peer[sends], rank[sends]))]
    r_order = recvs[np.lexsort((start[recvs], step[recvs], rank[recvs], peer[recvs]))]
    s_key = np.stack([rank[s_order], peer[s_order], step[s_order], start[s_order], stop[s_order]], axis=1)
    r_key = np.stack([peer[r_order], rank[r_order], step[r_order], start[r_order], stop[r_order]], axis=1)
    common = min(len(s_order), len(r_order))
    differs = np.flatnonzero(np.any(s_key[:common] != r_key[:common], axis=1))
    if differs.size or len(s_order) != len(r_order):
        i = int(differs[0]) if differs.size else common
        raise ScheduleError(_unpaired(s_key, r_key, i, is_reduce[r_order], name))
    # Paired; now in step order (channel order within a step), which is how _chain walks them.
    by_step = np.argsort(step[s_order], kind="stable")
    s_order, r_order = s_order[by_step], r_order[by_step]
    return _Transfers(
        step=step[s_order].tolist(),
        src=rank[s_order].tolist(),
        dst=peer[s_order].tolist(),
        block_start=start[s_order].tolist(),
        block_count=(stop[s_order] - start[s_order]).tolist(),
        reduce=is_reduce[r_order].tolist(),
    )


def _unpaired(s_key: np.ndarray, r_key: np.ndarray, i: int, reduce: np.ndarray, name: str) -> str:
    """Say why position ``i`` of the channel-sorted sends and receives do not pair."""

    def recv_text(row: int) -> str:
        src, dst, step, start, stop = (int(x) for x in r_key[row])
        verb = "recv_reduce" if reduce[row] else "recv_copy"
        return f"rank {dst} step {step}: {verb} {_blocks(start, stop)} from rank {src}"

    def send_text(row: int) -> str:
        src, dst, step, start, stop = (int(x) for x in s_key[row])
        return f"rank {src} step {step}: send {_blocks(start, stop)} to rank {dst}"

    has_send, has_recv = i < len(s_key), i < len(r_key)
    if has_send and has_recv and tuple(s_key[i, :2]) == tuple(r_key[i, :2]):
        src, dst = (int(x) for x in s_key[i, :2])
        if s_key[i, 2] < r_key[i, 2]:
            return (
                f"{name}: {send_text(i)}, but rank {dst} posts no matching receive in that step (its next "
                f"receive from rank {src} is {recv_text(i)}); a receive happens in the step of its send"
            )
        if s_key[i, 2] > r_key[i, 2]:
            return (
                f"{name}: {recv_text(i)}, but rank {src} sends nothing to rank {dst} in that step (its next send "
                f"to rank {dst} is {send_text(i)}); a receive happens in the step of its send"
            )
        return f"{name}: {recv_text(i)}, but the matching send is {send_text(i)}: they name different blocks"
    if has_send and (not has_recv or tuple(s_key[i, :2]) < tuple(r_key[i, :2])):
        src, dst = (int(x) for x in s_key[i, :2])
        return f"{name}: {send_text(i)}, but rank {dst} posts no matching receive from rank {src}"
    src, dst = (int(x) for x in r_key[i, :2])
    return f"{name}: {recv_text(i)}, but rank {src} never sends it"


def _chain(t: _Transfers, world_size: int, num_blocks: int) -> Streams:
    """Join each rank's transfers over consecutive steps whose peer and block advance by fixed strides.

    Greedy, step by step: a transfer first continues a chain that predicted exactly it, then a one-transfer
    chain of the same rank, kind and size (one to the same peer first), else it starts a chain.
    """
    n = world_size
    # Per chain: src, peer, peer_stride, start, steps, block_base, block_count, k0, k_stride, period, reduce.
    chains: list[list[int]] = []
    last: list[tuple[int, int]] = []  # per chain: (peer, k) of its last transfer
    expect: dict[tuple[int, int, int, int, int, int, int], int] = {}
    singles: dict[tuple[int, int, int, int], list[int]] = {}
    i, total, previous_step = 0, len(t.step), -1
    while i < total:
        step = t.step[i]
        if step != previous_step + 1:
            expect, singles = {}, {}  # an empty step in between: no chain continues across it
        previous_step = step
        j = i
        while j < total and t.step[j] == step:
            j += 1
        next_expect: dict[tuple[int, int, int, int, int, int, int], int] = {}
        next_singles: dict[tuple[int, int, int, int], list[int]] = {}
        pending: list[tuple[int, tuple[int, int, int, int], int, int]] = []
        for x in range(i, j):
            count = t.block_count[x]
            base = t.block_start[x] % count
            k = (t.block_start[x] - base) // count
            kind = (t.src[x], int(t.reduce[x]), count, base)
            c = expect.pop((*kind, t.dst[x], k, step), -1)
            if c < 0:
                pending.append((x, kind, t.dst[x], k))
                continue
            chains[c][4] += 1
            last[c] = (t.dst[x], k)
            ch = chains[c]
            next_expect[(*kind, (t.dst[x] + ch[2]) % n, (k + ch[8]) % ch[9], step + 1)] = c
        # One-transfer chains take a second transfer: one to the same peer first, then any.
        for same_peer in (True, False):
            rest = []
            for x, kind, dst, k in pending:
                candidates = singles.get(kind, [])
                pick = next(
                    (pos for pos, c in enumerate(candidates) if not same_peer or last[c][0] == dst),
                    -1,
                )
                if pick < 0:
                    rest.append((x, kind, dst, k))
                    continue
                c = candidates.pop(pick)
                ch = chains[c]
                ch[2] = (dst - ch[1]) % n
                ch[8] = (k - ch[7]) % ch[9]
                ch[4] = 2
                last[c] = (dst, k)
                next_expect[(*kind, (dst + ch[2]) % n, (k + ch[8]) % ch[9], step + 1)] = c
            pending = rest
        for _, kind, dst, k in pending:
            src, reduce, count, base = kind
            period = (num_blocks - base) // count
            chains.append([src, dst, 0, step, 1, base, count, k, 0, period, reduce])
            last.append((dst, k))
            next_singles.setdefault(kind, []).append(len(chains) - 1)
        expect, singles = next_expect, next_singles
        i = j
    # A two-transfer chain whose peer moves saves one stream but makes every step of it a flow pattern of its
    # own (the cost model and the simulator walk patterns): two fixed-peer streams are the better form.
    for c in range(len(chains)):
        ch = chains[c]
        if ch[4] == 2 and ch[2] != 0:
            second = [
                ch[0],
                (ch[1] + ch[2]) % n,
                0,
                ch[3] + 1,
                1,
                ch[5],
                ch[6],
                (ch[7] + ch[8]) % ch[9],
                0,
                ch[9],
                ch[10],
            ]
            ch[2], ch[4], ch[8] = 0, 1, 0
            chains.append(second)
    if not chains:
        return Streams.empty()
    table = np.asarray(chains, dtype=np.int64)
    return Streams.build(
        src=table[:, 0],
        peer=table[:, 1],
        peer_stride=table[:, 2],
        start=table[:, 3],
        steps=table[:, 4],
        block_base=table[:, 5],
        block_count=table[:, 6],
        block_offset=table[:, 7],
        block_stride=table[:, 8],
        block_period=table[:, 9],
        reduce=table[:, 10].astype(bool),
    )
