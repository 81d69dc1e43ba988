"""Every generator verifies for every N in 1..64, and its two views (programs, phases) describe the same transfers."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from allreduce.schedules import (
    Collective,
    Schedule,
    Verb,
    algorithms,
    all_reduce,
    binary_tree_broadcast,
    binary_tree_reduce,
    binomial_broadcast,
    binomial_reduce,
    block_bounds,
    direct_all_gather,
    direct_reduce_scatter,
    double_binary_tree_all_reduce,
    halving_doubling_all_reduce,
    hierarchical_all_reduce,
    recursive_doubling_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    verify,
)

WORLD_SIZES = range(1, 65)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [a for a in algorithms(automatic=True) if a != "hierarchical"])
def test_every_all_reduce_verifies_for_n_1_to_64(algorithm: str) -> None:
    for n in WORLD_SIZES:
        schedule = all_reduce(algorithm, n)
        assert schedule.collective is Collective.ALL_REDUCE
        verify(schedule)


@pytest.mark.slow
def test_hierarchical_verifies_for_every_group_size_n_1_to_64() -> None:
    for n in WORLD_SIZES:
        for g in _divisors(n):
            verify(hierarchical_all_reduce(n, g))
    for n in (4, 8, 12, 16, 24, 32):
        verify(hierarchical_all_reduce(n, 2, inter="halving_doubling"))


@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_double_binary_tree_verifies_for_chunk_counts(chunks: int) -> None:
    for n in (1, 2, 3, 5, 8, 13, 31, 32, 33):
        verify(double_binary_tree_all_reduce(n, chunks))


@pytest.mark.slow
@pytest.mark.parametrize("generator", [ring_reduce_scatter, ring_all_gather, direct_reduce_scatter, direct_all_gather])
def test_reduce_scatter_and_all_gather_verify_for_n_1_to_64(generator: Callable[[int], Schedule]) -> None:
    for n in WORLD_SIZES:
        verify(generator(n))


@pytest.mark.slow
@pytest.mark.parametrize("generator", [binomial_broadcast, binomial_reduce, binary_tree_broadcast, binary_tree_reduce])
def test_rooted_collectives_verify_for_n_1_to_64_and_roots(generator: Callable[[int, int], Schedule]) -> None:
    for n in WORLD_SIZES:
        for root in {0, n // 2, n - 1}:
            verify(generator(n, root))


@pytest.mark.parametrize("algorithm", algorithms(automatic=True))
def test_segments_do_not_change_the_data_movement(algorithm: str) -> None:
    group = {"group_size": 2} if algorithm == "hierarchical" else {}
    plain = all_reduce(algorithm, 6, **group)
    cut = all_reduce(algorithm, 6, segments=4, **group)
    assert cut.segments == 4
    verify(cut)
    assert [plain.program(r) for r in range(6)] == [cut.program(r) for r in range(6)]


# ---- the two views agree -----------------------------------------------------------------------------------
def _transfers_from_programs(schedule: Schedule) -> Counter[tuple[int, int, int, float, bool]]:
    """(step, src, dst, fraction, reduce) of every transfer, read from the per-rank programs."""
    out: Counter[tuple[int, int, int, float, bool]] = Counter()
    for rank in range(schedule.world_size):
        for op in schedule.program(rank):
            if op.verb is not Verb.SEND:
                continue
            peer_ops = [
                o
                for o in schedule.program(op.peer)
                if o.step == op.step and o.peer == rank and o.verb is not Verb.SEND and o.block_start == op.block_start
            ]
            assert peer_ops, f"rank {rank} {op} has no receive at rank {op.peer} in the same step"
            fraction = (op.block_stop - op.block_start) / schedule.num_blocks
            out[(op.step, rank, op.peer, fraction, peer_ops[0].verb is Verb.RECV_REDUCE)] += 1
    return out


def _transfers_from_phases(schedule: Schedule) -> Counter[tuple[int, int, int, float, bool]]:
    out: Counter[tuple[int, int, int, float, bool]] = Counter()
    for phase in schedule.phases():
        for step in range(phase.first_step, phase.first_step + phase.repeat):
            for s, d, f, r in zip(phase.src, phase.dst, phase.fraction, phase.reduce, strict=True):
                out[(step, int(s), int(d), float(f), bool(r))] += 1
    return out


@given(
    algorithm=st.sampled_from(algorithms(automatic=True)),
    world_size=st.integers(min_value=1, max_value=24),
)
@pytest.mark.slow
def test_phases_and_programs_describe_the_same_transfers(algorithm: str, world_size: int) -> None:
    group = (
        {"group_size": _divisors(world_size)[len(_divisors(world_size)) // 2]} if algorithm == "hierarchical" else {}
    )
    schedule = all_reduce(algorithm, world_size, **group)
    assert _transfers_from_programs(schedule) == _transfers_from_phases(schedule)


def test_phases_never_overlap_and_cover_the_steps() -> None:
    schedule = hierarchical_all_reduce(24, 4)
    phases = list(schedule.phases())
    for before, after in itertools.pairwise(phases):
        assert before.first_step + before.repeat <= after.first_step
    assert phases[-1].first_step + phases[-1].repeat == schedule.num_steps


# ---- the textbook shapes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 64, 1000])
def test_ring_shape(n: int) -> None:
    s = ring_all_reduce(n)
    assert s.num_steps == 2 * (n - 1)
    # Each rank sends 2(N-1)/N of the buffer, nearly independent of N.
    np.testing.assert_allclose(s.bytes_sent_per_rank(1.0), 2 * (n - 1) / n, rtol=1e-12)
    phases = list(s.phases())
    if n > 1:
        assert [p.repeat for p in phases] == [n - 1, n - 1]  # reduce-scatter, all-gather: one pattern each
        assert np.array_equal(phases[0].dst, (phases[0].src + 1) % n)


@pytest.mark.parametrize(("n", "steps"), [(1, 0), (2, 2), (3, 4), (4, 4), (5, 6), (8, 6), (12, 8), (64, 12)])
def test_halving_doubling_steps_including_the_fold(n: int, steps: int) -> None:
    assert halving_doubling_all_reduce(n).num_steps == steps


@pytest.mark.parametrize(("n", "steps"), [(1, 0), (2, 1), (3, 3), (4, 2), (6, 4), (8, 3), (64, 6)])
def test_recursive_doubling_steps(n: int, steps: int) -> None:
    s = recursive_doubling_all_reduce(n)
    assert s.num_steps == steps
    assert s.num_blocks == 1  # whole buffer every step


def test_hierarchical_moves_only_one_group_share_between_groups() -> None:
    n, g = 32, 8
    s = hierarchical_all_reduce(n, g)
    assert s.num_steps == 2 * (g - 1) + 2 * (n // g - 1)
    cross = 0.0
    for phase in s.phases():
        between = (phase.src // g) != (phase.dst // g)
        cross += float(phase.fraction[between].sum()) * phase.repeat
    # Across groups each rank sends what a ring all-reduce of 1/G of the buffer among M = N/G ranks sends.
    m = n // g
    assert cross / n == pytest.approx(2 * (m - 1) / m / g)


def test_double_binary_tree_leaves_of_one_tree_are_inner_nodes_of_the_other() -> None:
    n = 16
    s = double_binary_tree_all_reduce(n, chunks=2)
    senders_up = [set(), set()]  # ranks that have children (receive reductions) in each tree
    for rank in range(n):
        for op in s.program(rank):
            if op.verb is Verb.RECV_REDUCE:
                senders_up[op.block_start // 2].add(rank)
    inner_a, inner_b = senders_up
    assert not (inner_a & inner_b), "a rank is an inner node of both trees"


@pytest.mark.slow
def test_ring_for_131072_ranks_stays_compact() -> None:
    n = 131_072
    s = ring_all_reduce(n)
    assert len(s.streams) == 2 * n  # never N * 2(N-1) transfers
    phases = list(s.phases())
    assert len(phases) == 2
    assert sum(p.repeat for p in phases) == 2 * (n - 1)
    program = s.program(12345)
    assert len(program) == 4 * (n - 1)


def test_block_bounds_cover_the_buffer_evenly() -> None:
    for count in (0, 1, 7, 100, 1001):
        for blocks in (1, 3, 8, 64):
            b = block_bounds(count, blocks)
            assert b[0] == 0
            assert b[-1] == count
            sizes = np.diff(b)
            assert sizes.min() >= 0
            assert sizes.max() - sizes.min() <= 1


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: ring_all_reduce(0), "world_size must be >= 1"),
        (lambda: hierarchical_all_reduce(10, 4), "not divisible by group_size 4"),
        (lambda: all_reduce("bogus", 4), "unknown all-reduce algorithm 'bogus'"),
        (lambda: all_reduce("hierarchical", 8), "needs group_size"),
        (lambda: binomial_broadcast(4, root=4), "root 4 is not a rank"),
        (lambda: double_binary_tree_all_reduce(4, chunks=0), "chunks must be >= 1"),
        (lambda: ring_all_reduce(4).with_segments(0), "segments must be >= 1"),
        (lambda: ring_all_reduce(4).program(4), "rank 4 is not in a group of 4"),
    ],
)
def test_bad_parameters_are_named(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
