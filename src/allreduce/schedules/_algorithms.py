"""Collective algorithms, each a plain function from parameters to a :class:`Schedule`.

Every generator works for any world size N >= 1. Each stream comment says which textbook step it is.
Compound algorithms are built from the simple ones (hierarchical = ring reduce-scatter inside groups, an
all-reduce across groups, ring all-gather inside groups), never rewritten.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from allreduce.schedules._schedule import Collective, Schedule, Streams, concat_streams

__all__ = [
    "NAIVE_MAX_RANKS",
    "binary_tree_broadcast",
    "binary_tree_reduce",
    "binomial_broadcast",
    "binomial_reduce",
    "direct_all_gather",
    "direct_all_reduce",
    "direct_reduce_scatter",
    "double_binary_tree_all_reduce",
    "halving_doubling_all_reduce",
    "hierarchical_all_reduce",
    "naive_all_reduce",
    "recursive_doubling_all_reduce",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
]

IntArray = npt.NDArray[np.int64]


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int | np.integer):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


def _sequence(parts: Sequence[tuple[Streams, int]]) -> tuple[Streams, int]:
    """Run parts one after another: each part's steps start when the previous part's last step is done."""
    shifted = []
    offset = 0
    for streams, num_steps in parts:
        shifted.append(streams.replace(start=streams.start + offset))
        offset += num_steps
    return concat_streams(shifted), offset


def _embed(sub: Schedule, rank_maps: IntArray, block_offsets: IntArray, block_scale: int) -> Streams:
    """Copies of ``sub`` running side by side, copy i on ranks ``rank_maps[i]`` and blocks shifted by
    ``block_offsets[i]``, each block of ``sub`` standing for ``block_scale`` blocks."""
    s = sub.streams
    if np.any(s.peer_stride != 0):
        raise ValueError(f"{sub.name}: a schedule whose peers move cannot be embedded in a rank subset")
    copies = rank_maps.shape[0]
    n = len(s)

    def tile(a: IntArray) -> IntArray:
        return np.tile(a, copies)

    return Streams(
        src=rank_maps[:, s.src].reshape(-1),
        peer=rank_maps[:, s.peer].reshape(-1),
        peer_stride=tile(s.peer_stride),
        start=tile(s.start),
        steps=tile(s.steps),
        block_base=(block_offsets[:, None] + s.block_base[None, :] * block_scale).reshape(-1),
        block_count=tile(s.block_count) * block_scale,
        block_offset=tile(s.block_offset),
        block_stride=tile(s.block_stride),
        block_period=tile(s.block_period),
        reduce=np.tile(s.reduce, copies) if n else s.reduce,
    )


# --------------------------------------------------------------------------------------------------------
# Ring and direct: N-1 steps of one block each, the peer fixed (ring) or moving one rank on per step (direct)
# --------------------------------------------------------------------------------------------------------
def _block_per_step(
    name: str,
    collective: Collective,
    world_size: int,
    *,
    peer_stride: int,
    block_shift: int,
    block_stride: int,
    reduce: bool,
    rows: bool = False,
) -> Schedule:
    """N-1 steps: at step j rank r sends block ``r + block_shift + j·block_stride`` to rank
    ``r + 1 + j·peer_stride``, which reduces it into its copy (``reduce``) or copies it. With ``rows`` the buffer
    is N rows of N blocks and rank r sends from its own row r (all-to-all's layout)."""
    _check_world_size(world_size)
    n = world_size
    ranks = np.arange(n if n > 1 else 0, dtype=np.int64)
    streams = Streams.build(
        src=ranks,
        peer=(ranks + 1) % n,
        peer_stride=peer_stride,
        start=0,
        steps=n - 1,
        block_base=ranks * n if rows else 0,
        block_offset=(ranks + block_shift) % n,
        block_stride=block_stride,
        block_period=n,
        reduce=reduce,
    )
    return Schedule(name, collective, n, n * n if rows else n, n - 1, streams)


def _reduce_scatter_then_all_gather(reduce_scatter: Schedule, all_gather: Schedule) -> Schedule:
    """The all-reduce that runs ``reduce_scatter``, then ``all_gather`` (same name, ranks and blocks)."""
    parts = [(reduce_scatter.streams, reduce_scatter.num_steps), (all_gather.streams, all_gather.num_steps)]
    streams, steps = _sequence(parts)
    n = reduce_scatter.world_size
    return Schedule(reduce_scatter.name, Collective.ALL_REDUCE, n, reduce_scatter.num_blocks, steps, streams)


def ring_reduce_scatter(world_size: int) -> Schedule:
    """Ring reduce-scatter: N-1 steps; afterwards rank r holds block r reduced over all ranks."""
    # reduce-scatter: step j of N-1, rank r sends block r-j-1 to r+1, which reduces it into its copy.
    return _block_per_step(
        "ring", Collective.REDUCE_SCATTER, world_size, peer_stride=0, block_shift=-1, block_stride=-1, reduce=True
    )


def ring_all_gather(world_size: int) -> Schedule:
    """Ring all-gather: N-1 steps; rank r starts with block r, ends with all of them."""
    # all-gather: step j of N-1, rank r forwards block r-j to r+1, which copies it.
    return _block_per_step(
        "ring", Collective.ALL_GATHER, world_size, peer_stride=0, block_shift=0, block_stride=-1, reduce=False
    )


def ring_all_reduce(world_size: int) -> Schedule:
    """Ring all-reduce: reduce-scatter then all-gather, 2(N-1) steps of 1/N of the buffer each."""
    return _reduce_scatter_then_all_gather(ring_reduce_scatter(world_size), ring_all_gather(world_size))


def direct_reduce_scatter(world_size: int) -> Schedule:
    """Each rank gathers and reduces its own block from every other rank, one peer per step (no incast)."""
    # step j of N-1: rank r sends block r+j+1 to its owner, rank r+j+1, which reduces it.
    return _block_per_step(
        "direct", Collective.REDUCE_SCATTER, world_size, peer_stride=1, block_shift=1, block_stride=1, reduce=True
    )


def direct_all_gather(world_size: int) -> Schedule:
    """Each rank sends its block straight to every other rank, one peer per step."""
    # step j of N-1: rank r sends its own block r to rank r+j+1, which copies it.
    return _block_per_step(
        "direct", Collective.ALL_GATHER, world_size, peer_stride=1, block_shift=0, block_stride=0, reduce=False
    )


def direct_all_reduce(world_size: int) -> Schedule:
    """Direct reduce-scatter, then direct all-gather: every rank talks to every other rank."""
    return _reduce_scatter_then_all_gather(direct_reduce_scatter(world_size), direct_all_gather(world_size))


# --------------------------------------------------------------------------------------------------------
# Recursive halving-doubling (Rabenseifner) and recursive doubling, with the fold for non-powers of two
# --------------------------------------------------------------------------------------------------------
def _fold(world_size: int) -> tuple[int, IntArray]:
    """The power-of-two core: its size P and, for each core index, the rank that plays it.

    The first 2(N-P) ranks pair up; the even one of each pair hands its whole buffer to the odd one, which
    plays in the core, and gets the result back at the end (the standard MPICH fold)."""
    p = 1 << (world_size.bit_length() - 1)
    extra = world_size - p
    core = np.concatenate([np.arange(1, 2 * extra, 2), np.arange(2 * extra, world_size)]).astype(np.int64)
    return p, core


def _fold_streams(world_size: int, num_blocks: int, *, unfold: bool) -> Streams:
    extra = world_size - (1 << (world_size.bit_length() - 1))
    evens = np.arange(0, 2 * extra, 2, dtype=np.int64)
    if unfold:
        # unfold: the odd partner returns the finished buffer to the even rank that sat out.
        return Streams.build(src=evens + 1, peer=evens, start=0, block_base=0, block_count=num_blocks, reduce=False)
    # fold: the even rank hands its whole buffer to its odd partner, which reduces it.
    return Streams.build(src=evens, peer=evens + 1, start=0, block_base=0, block_count=num_blocks, reduce=True)


def halving_doubling_all_reduce(world_size: int) -> Schedule:
    """Rabenseifner: recursive-halving reduce-scatter, then recursive-doubling all-gather.

    2·log2(P) steps on the core of P = 2^floor(log2 N) ranks, plus a fold and an unfold step when N is not a
    power of two. Block c ends up owned by core index c."""
    _check_world_size(world_size)
    p, core = _fold(world_size)
    c = np.arange(p, dtype=np.int64)
    parts: list[tuple[Streams, int]] = []
    if world_size > p:
        parts.append((_fold_streams(world_size, p, unfold=False), 1))
    d = p // 2
    while d >= 1:
        # reduce-scatter by halving: swap halves with the partner at distance d, keep the half holding c.
        lo = c - c % (2 * d)
        send_base = np.where(c & d, lo, lo + d)
        parts.append(
            (
                Streams.build(src=core[c], peer=core[c ^ d], start=0, block_base=send_base, block_count=d, reduce=True),
                1,
            )
        )
        d //= 2
    d = 1
    while d < p:
        # all-gather by doubling: send everything held (the aligned range of d blocks around c) to c^d.
        parts.append(
            (
                Streams.build(
                    src=core[c], peer=core[c ^ d], start=0, block_base=c - c % d, block_count=d, reduce=False
                ),
                1,
            )
        )
        d *= 2
    if world_size > p:
        parts.append((_fold_streams(world_size, p, unfold=True), 1))
    streams, steps = _sequence(parts)
    return Schedule("halving_doubling", Collective.ALL_REDUCE, world_size, p, steps, streams)


def recursive_doubling_all_reduce(world_size: int) -> Schedule:
    """Recursive doubling: log2(P) exchanges of the whole buffer (the small-message algorithm)."""
    _check_world_size(world_size)
    p, core = _fold(world_size)
    c = np.arange(p, dtype=np.int64)
    parts: list[tuple[Streams, int]] = []
    if world_size > p:
        parts.append((_fold_streams(world_size, 1, unfold=False), 1))
    d = 1
    while d < p:
        # exchange: partners at distance d swap whole buffers and both reduce.
        parts.append((Streams.build(src=core[c], peer=core[c ^ d], start=0, block_base=0, reduce=True), 1))
        d *= 2
    if world_size > p:
        parts.append((_fold_streams(world_size, 1, unfold=True), 1))
    streams, steps = _sequence(parts)
    return Schedule("recursive_doubling", Collective.ALL_REDUCE, world_size, 1, steps, streams)


# --------------------------------------------------------------------------------------------------------
# Trees
# --------------------------------------------------------------------------------------------------------
def _inorder_tree(n: int) -> IntArray:
    """Parent position of each of n positions in a balanced in-order binary tree (root: -1).

    Position i has label q = i+1; the lowest set bit b of q gives its level. Labels with b = 1 (even
    positions) are leaves; q's children are q - b/2 and the largest q + c (c < b a power of two) that is <= n.
    About half of the positions are leaves, which is what makes the mirror tree complementary."""
    parent = np.full(n, -1, dtype=np.int64)
    q = np.arange(1, n + 1, dtype=np.int64)
    half = (q & -q) >> 1
    inner = q[half > 0]
    half = half[half > 0]
    parent[inner - half - 1] = inner - 1  # left child
    # Right child: halve c until q + c fits (the subtree to the right is truncated at n).
    c = half.copy()
    while True:
        too_far = (c > 0) & (inner + c > n)
        if not too_far.any():
            break
        c[too_far] >>= 1
    has_right = c > 0
    parent[inner[has_right] + c[has_right] - 1] = inner[has_right] - 1
    return parent


def _heights_depths(parent: IntArray) -> tuple[IntArray, IntArray]:
    """Depth (edges from the root) and height (edges to the deepest leaf below) of every node."""
    n = parent.size
    depth = np.zeros(n, dtype=np.int64)
    ancestor = parent.copy()
    while (ancestor >= 0).any():
        up = ancestor >= 0
        depth[up] += 1
        ancestor[up] = parent[ancestor[up]]
    height = np.zeros(n, dtype=np.int64)
    for level in range(int(depth.max()) if n else 0, 0, -1):
        nodes = np.flatnonzero(depth == level)
        np.maximum.at(height, parent[nodes], height[nodes] + 1)
    return height, depth


def _tree_streams(
    parent: IntArray, chunks: int, block_base: int, *, up: bool, down: bool, down_delay: int | None = None
) -> tuple[Streams, int]:
    """Pipelined reduce up and/or broadcast down one tree, chunk k of ``chunks`` one step behind chunk k-1."""
    height, depth = _heights_depths(parent)
    child = np.flatnonzero(parent >= 0).astype(np.int64)
    top = int(height.max()) if parent.size else 0
    parts = []
    steps = 0
    if up:
        # reduce: a node at height h sends chunk k to its parent at step h+k, after its subtree's chunks came.
        parts.append(
            Streams.build(
                src=child,
                peer=parent[child],
                start=height[child],
                steps=chunks,
                block_base=block_base,
                block_stride=1,
                block_period=chunks,
                reduce=True,
            )
        )
        steps = top + chunks - 1
    if down:
        # broadcast: the root sends chunk k at step delay+k; a node at depth d forwards it d steps later.
        delay = top if down_delay is None else down_delay
        parts.append(
            Streams.build(
                src=parent[child],
                peer=child,
                start=delay + depth[child] - 1,
                steps=chunks,
                block_base=block_base,
                block_stride=1,
                block_period=chunks,
                reduce=False,
            )
        )
        steps = max(steps, delay + int(depth.max()) + chunks - 1) if child.size else steps
    return concat_streams(parts), steps


def _check_chunks(chunks: int) -> None:
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")


def double_binary_tree_all_reduce(world_size: int, chunks: int = 8) -> Schedule:
    """NCCL's double binary tree: two complementary binary trees each reduce and broadcast half the
    buffer, pipelined in ``chunks`` chunks; a rank that is a leaf of one tree is an inner node of the
    other, so every rank's link carries about the same load. O(log N + chunks) steps."""
    _check_world_size(world_size)
    _check_chunks(chunks)
    n = world_size
    tree = _inorder_tree(n)
    positions = np.arange(n, dtype=np.int64)
    # The second tree: mirrored (even N) or shifted by one (odd N), so the leaves of one are inner nodes of
    # the other.
    relabel = n - 1 - positions if n % 2 == 0 else (positions + 1) % n
    tree_b = np.full(n, -1, dtype=np.int64)
    has_parent = tree >= 0
    tree_b[relabel[has_parent]] = relabel[tree[has_parent]]
    first, steps_a = _tree_streams(tree, chunks, 0, up=True, down=True)
    second, steps_b = _tree_streams(tree_b, chunks, chunks, up=True, down=True)
    return Schedule(
        "double_binary_tree",
        Collective.ALL_REDUCE,
        n,
        2 * chunks,
        max(steps_a, steps_b),
        concat_streams([first, second]),
    )


def _rooted_tree(world_size: int, root: int) -> IntArray:
    """The in-order tree relabelled so that its root is rank ``root``."""
    tree = _inorder_tree(world_size)
    old_root = int(np.flatnonzero(tree < 0)[0])
    shift = (root - old_root) % world_size
    out = np.full(world_size, -1, dtype=np.int64)
    has_parent = tree >= 0
    idx = np.flatnonzero(has_parent)
    out[(idx + shift) % world_size] = (tree[idx] + shift) % world_size
    return out


def _check_root(world_size: int, root: int) -> None:
    if not 0 <= root < world_size:
        raise ValueError(f"root {root} is not a rank of a group of {world_size}")


def binary_tree_broadcast(world_size: int, root: int = 0, chunks: int = 8) -> Schedule:
    """Pipelined binary-tree broadcast from ``root``."""
    _check_world_size(world_size)
    _check_root(world_size, root)
    _check_chunks(chunks)
    streams, steps = _tree_streams(_rooted_tree(world_size, root), chunks, 0, up=False, down=True, down_delay=0)
    return Schedule(
        "binary_tree",
        Collective.BROADCAST,
        world_size,
        chunks,
        steps if len(streams) else 0,
        streams,
        root=root,
    )


def binary_tree_reduce(world_size: int, root: int = 0, chunks: int = 8) -> Schedule:
    """Pipelined binary-tree reduce to ``root``."""
    _check_world_size(world_size)
    _check_root(world_size, root)
    _check_chunks(chunks)
    streams, steps = _tree_streams(_rooted_tree(world_size, root), chunks, 0, up=True, down=False)
    return Schedule(
        "binary_tree", Collective.REDUCE, world_size, chunks, steps if len(streams) else 0, streams, root=root
    )


def _binomial_rounds(world_size: int) -> int:
    return (world_size - 1).bit_length()


def _binomial_tree(collective: Collective, world_size: int, root: int, *, reduce: bool) -> Schedule:
    """ceil(log2 N) steps of whole buffers between ranks 2^k apart (counted from ``root``): a broadcast sends
    away from the root, doubling the ranks that hold the data; a reduce halves the ranks that hold partial sums."""
    _check_world_size(world_size)
    _check_root(world_size, root)
    parts = []
    for k in range(_binomial_rounds(world_size)):
        d = 1 << k
        if reduce:
            # step k: relative index v with v mod 2^(k+1) == 2^k sends its partial sum to v - 2^k.
            src = np.arange(d, world_size, 2 * d, dtype=np.int64)
            dst = src - d
        else:
            # step k: every rank that has the data (relative index < 2^k) sends it 2^k further.
            src = np.arange(min(d, world_size - d), dtype=np.int64)
            dst = src + d
        step = Streams.build(
            src=(src + root) % world_size, peer=(dst + root) % world_size, start=0, block_base=0, reduce=reduce
        )
        parts.append((step, 1))
    streams, steps = _sequence(parts)
    return Schedule("binomial", collective, world_size, 1, steps, streams, root=root)


def binomial_broadcast(world_size: int, root: int = 0) -> Schedule:
    """Binomial-tree broadcast: ceil(log2 N) steps, the number of ranks holding the data doubles each step."""
    return _binomial_tree(Collective.BROADCAST, world_size, root, reduce=False)


def binomial_reduce(world_size: int, root: int = 0) -> Schedule:
    """Binomial-tree reduce: ceil(log2 N) steps, half of the remaining ranks hand their partial sums in."""
    return _binomial_tree(Collective.REDUCE, world_size, root, reduce=True)


# --------------------------------------------------------------------------------------------------------
# Hierarchical
# --------------------------------------------------------------------------------------------------------
def hierarchical_all_reduce(world_size: int, group_size: int, inter: str = "ring") -> Schedule:
    """Two-level all-reduce for N = G × M ranks in M groups (nodes) of G consecutive ranks.

    1. ring reduce-scatter inside each group: local rank l ends with part l of the group's sum;
    2. all-reduce of part l across the M ranks with local rank l (``inter``: ring or halving_doubling);
    3. ring all-gather inside each group.
    Only 1/G of the buffer crosses between groups, and the slow inter-group latency is paid 2(M-1) times
    instead of 2(N-1)."""
    _check_world_size(world_size)
    if isinstance(group_size, bool) or not isinstance(group_size, int | np.integer) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if world_size % group_size:
        raise ValueError(f"world_size {world_size} is not divisible by group_size {group_size}")
    g = int(group_size)
    m = world_size // g
    inter_builders: dict[str, Callable[[int], Schedule]] = {
        "ring": ring_all_reduce,
        "halving_doubling": halving_doubling_all_reduce,
    }
    if inter not in inter_builders:
        raise ValueError(f"inter must be one of {sorted(inter_builders)}, got {inter!r}")
    across = inter_builders[inter](m)
    part_blocks = across.num_blocks
    in_groups = np.arange(m, dtype=np.int64)[:, None] * g + np.arange(g, dtype=np.int64)[None, :]
    no_offset = np.zeros(m, dtype=np.int64)
    rs = _embed(ring_reduce_scatter(g), in_groups, no_offset, part_blocks)
    mid = _embed(across, in_groups.T.copy(), np.arange(g, dtype=np.int64) * part_blocks, 1)
    ag = _embed(ring_all_gather(g), in_groups, no_offset, part_blocks)
    streams, steps = _sequence([(rs, g - 1), (mid, across.num_steps), (ag, g - 1)])
    return Schedule("hierarchical", Collective.ALL_REDUCE, world_size, g * part_blocks, steps, streams)


# --------------------------------------------------------------------------------------------------------
# Naive (the strawman)
# --------------------------------------------------------------------------------------------------------
NAIVE_MAX_RANKS = 2048
"""Naive all-reduce is N(N-1) transfers, each its own stream of 81 bytes: at 2,048 ranks that is 4.2 million
streams (340 MB). Larger groups are refused rather than exhausting memory; ring shows the point at any size."""


def naive_all_reduce(world_size: int) -> Schedule:
    """The strawman: in one step every rank sends its whole buffer to every other rank, which reduces it.

    (N-1)·S bytes leave every rank and N(N-1) transfers cross the network; under the α–β–γ model it takes
    α + (N-1)·S·β + (N-1)·S·γ, against ring's 2(N-1)·α + 2(N-1)/N·S·β + (N-1)/N·S·γ. One step is the only
    correct way to do it in place: a rank that sent in a later step would pass on partial sums."""
    _check_world_size(world_size)
    n = world_size
    if n > NAIVE_MAX_RANKS:
        raise ValueError(
            f"naive all-reduce on {n} ranks is {n * (n - 1):,} transfers; it is refused above "
            f"{NAIVE_MAX_RANKS} ranks (ring shows the point at any size)"
        )
    src = np.repeat(np.arange(n, dtype=np.int64), n - 1)
    distance = np.tile(np.arange(1, n, dtype=np.int64), n)
    # step 0, the only one: rank r sends all of its buffer to rank r+d for every d in 1..N-1; each reduces it.
    streams = Streams.build(src=src, peer=(src + distance) % n, start=0, block_base=0, reduce=True)
    return Schedule("naive", Collective.ALL_REDUCE, n, 1, 1 if n > 1 else 0, streams)
