"""Personalized collectives: all-to-all, gather and scatter, each a plain function to a :class:`Schedule`.

In these collectives every block has one source and one destination, and a transfer keeps a block's index (the
block model of :mod:`._schedule`), so the index says where the block came from and where it goes:

- gather and scatter cut the buffer into N blocks; block ``b`` is rank ``b``'s (gather: rank b's contribution,
  which the root collects; scatter: the root's part for rank b);
- all-to-all cuts the buffer into N² blocks; block ``s·N + d`` carries rank ``s``'s part for rank ``d``. Rank r
  starts with row r (blocks ``r·N .. r·N + N-1``: what it sends) and ends with column r (blocks ``s·N + r``: what
  it received), so a rank's buffer is N times what it sends; the runtime packs and unpacks around it.
"""

from __future__ import annotations

import numpy as np

from allreduce.schedules._algorithms import _block_per_step, _check_root, _check_world_size, _sequence
from allreduce.schedules._schedule import Collective, Schedule, Streams

__all__ = [
    "BRUCK_MAX_RANKS",
    "binomial_gather",
    "binomial_scatter",
    "bruck_all_to_all",
    "direct_all_to_all",
    "direct_gather",
    "direct_scatter",
    "pairwise_all_to_all",
]

BRUCK_MAX_RANKS = 256
"""The most ranks Bruck is built for: every block it forwards is a stream of its own (N²/2 · log2 N of them, a
quarter of a million at 256 ranks)."""


def pairwise_all_to_all(world_size: int) -> Schedule:
    """Pairwise exchange: N-1 steps; at step k (1..N-1) rank r sends its block for rank r+k and receives rank r-k's
    block for it. Each rank sends (N-1)/N of its part, once, and talks to one peer per step."""
    # step k-1 of N-1: rank r sends block (r, r+k) = r·N + (r+k mod N) to rank r+k, which copies it.
    return _block_per_step(
        "pairwise", Collective.ALL_TO_ALL, world_size, peer_stride=1, block_shift=1, block_stride=1, reduce=False,
        rows=True,
    )  # fmt: skip


def direct_all_to_all(world_size: int) -> Schedule:
    """Every rank sends each other rank its block at once, one step (as Gloo and MPI's linear all-to-all post every
    send and receive together): the fewest steps and bytes, every rank receiving from N-1 at once."""
    _check_world_size(world_size)
    n = world_size
    src, offset = np.divmod(np.arange(n * (n - 1), dtype=np.int64), max(n - 1, 1))
    dst = (src + offset + 1) % n
    # step 0: rank r sends block (r, d) = r·N + d to every rank d != r, which copies it.
    streams = Streams.build(src=src, peer=dst, start=0, block_base=src * n + dst, reduce=False)
    return Schedule("direct", Collective.ALL_TO_ALL, n, n * n, 1 if n > 1 else 0, streams)


def _rounds(world_size: int) -> int:
    """ceil(log2 N): the rounds of Bruck and of the binomial trees."""
    return (world_size - 1).bit_length()


def bruck_all_to_all(world_size: int) -> Schedule:
    """Bruck's algorithm: ceil(log2 N) steps; at step k every rank sends to rank r + 2^k every block whose
    distance to its destination has bit k set. Fewer steps than pairwise (latency), each block forwarded up to
    log2 N times (bandwidth): for small messages."""
    _check_world_size(world_size)
    n = world_size
    if n > BRUCK_MAX_RANKS:
        raise ValueError(f"bruck is built for at most {BRUCK_MAX_RANKS} ranks (one stream per forwarded block)")
    parts = []
    ranks = np.arange(n, dtype=np.int64)
    for k in range(_rounds(n)):
        d = 1 << k
        # step k: block (s, s+δ) with bit k of δ set has moved δ mod 2^k ranks on from s, so it is at rank r when
        # s = r - (δ mod 2^k); rank r forwards it 2^k further.
        delta = np.asarray([v for v in range(1, n) if v & d], dtype=np.int64)
        src = np.repeat(ranks, delta.size)
        deltas = np.tile(delta, n)
        origin = (src - (deltas & (d - 1))) % n
        block = origin * n + (origin + deltas) % n
        parts.append((Streams.build(src=src, peer=(src + d) % n, start=0, block_base=block, reduce=False), 1))
    streams, steps = _sequence(parts)
    return Schedule("bruck", Collective.ALL_TO_ALL, n, n * n, steps, streams)


def _direct(collective: Collective, world_size: int, root: int) -> Schedule:
    """One step between the root and every other rank r, carrying block r: to the root (gather), or from it."""
    _check_world_size(world_size)
    _check_root(world_size, root)
    n = world_size
    others = np.asarray([r for r in range(n) if r != root], dtype=np.int64)
    to_root = collective is Collective.GATHER
    streams = Streams.build(
        src=others if to_root else root, peer=root if to_root else others, start=0, block_base=others, reduce=False
    )
    return Schedule("direct", collective, n, n, 1 if n > 1 else 0, streams, root=root)


def direct_gather(world_size: int, root: int = 0) -> Schedule:
    """Every rank sends its block straight to the root, all in one step (linear gather)."""
    # step 0: rank r sends its own block r to the root, which copies it.
    return _direct(Collective.GATHER, world_size, root)


def direct_scatter(world_size: int, root: int = 0) -> Schedule:
    """The root sends every rank its block, all in one step (linear scatter)."""
    # step 0: the root sends block r to rank r, which copies it.
    return _direct(Collective.SCATTER, world_size, root)


def _subtree_streams(world_size: int, root: int, moves: list[tuple[int, int, int, int]]) -> Streams:
    """One step's streams: for each (sender, receiver, first, stop) of relative ranks, the sender sends relative
    blocks ``[first, stop)``; a range that wraps past rank N-1 when counted from the root is two streams."""
    n = world_size
    src, dst, base, count = [], [], [], []
    for s, t, first, stop in moves:
        start = (first + root) % n
        length = stop - first
        head = min(length, n - start)
        for block, blocks in ((start, head), (0, length - head)):
            if blocks:
                src.append((s + root) % n)
                dst.append((t + root) % n)
                base.append(block)
                count.append(blocks)
    return Streams.build(src=src, peer=dst, start=0, block_base=base, block_count=count, reduce=False)


def binomial_gather(world_size: int, root: int = 0) -> Schedule:
    """Binomial-tree gather: ceil(log2 N) steps; at step k the ranks 2^k past a multiple of 2^(k+1) (counted from
    the root) hand the 2^k blocks of their subtree to the rank 2^k before them."""
    _check_world_size(world_size)
    _check_root(world_size, root)
    n = world_size
    parts = []
    for k in range(_rounds(n)):
        d = 1 << k
        # step k: relative rank v with v mod 2^(k+1) == 2^k sends blocks [v, v + 2^k) to v - 2^k.
        moves = [(v, v - d, v, min(v + d, n)) for v in range(d, n, 2 * d)]
        parts.append((_subtree_streams(n, root, moves), 1))
    streams, steps = _sequence(parts)
    return Schedule("binomial", Collective.GATHER, n, n, steps, streams, root=root)


def binomial_scatter(world_size: int, root: int = 0) -> Schedule:
    """Binomial-tree scatter, the gather run backwards: at step j (k = ceil(log2 N)-1-j) every rank that holds a
    subtree of 2^(k+1) blocks passes its upper half to the rank 2^k after it."""
    _check_world_size(world_size)
    _check_root(world_size, root)
    n = world_size
    parts = []
    for k in reversed(range(_rounds(n))):
        d = 1 << k
        # relative rank v with v mod 2^(k+1) == 0 sends blocks [v + 2^k, v + 2^(k+1)) to v + 2^k.
        moves = [(v - d, v, v, min(v + d, n)) for v in range(d, n, 2 * d)]
        parts.append((_subtree_streams(n, root, moves), 1))
    streams, steps = _sequence(parts)
    return Schedule("binomial", Collective.SCATTER, n, n, steps, streams, root=root)
