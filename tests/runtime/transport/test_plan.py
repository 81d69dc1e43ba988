"""Compiled plans: element ranges that cover the buffer and that both ends of every transfer agree on."""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from allreduce.runtime import compile_plan
from allreduce.schedules import Collective, Schedule, algorithms, make_schedule, ring_all_reduce


def _schedule(algorithm: str, n: int, segments: int) -> Schedule:
    group_size = 2 if n % 2 == 0 else 1
    return make_schedule(Collective.ALL_REDUCE, algorithm, n, segments=segments, group_size=group_size)


@given(
    algorithm=st.sampled_from(algorithms(Collective.ALL_REDUCE)),
    n=st.integers(min_value=1, max_value=9),
    count=st.integers(min_value=0, max_value=200),
    segments=st.integers(min_value=1, max_value=5),
)
@pytest.mark.slow
def test_both_ends_of_every_transfer_agree_on_its_elements(algorithm: str, n: int, count: int, segments: int) -> None:
    schedule = _schedule(algorithm, n, segments)
    sent: dict[tuple[int, int], list[tuple[int, int, int, int]]] = defaultdict(list)
    received: dict[tuple[int, int], list[tuple[int, int, int, int]]] = defaultdict(list)
    for rank in range(n):
        plan = compile_plan(schedule, rank, count)
        assert plan.count == count
        for step in plan.steps:
            for t in step.sends:
                assert 0 <= t.start < t.stop <= count
                sent[(rank, t.peer)].append((t.start, t.stop, t.block, t.segment))
            for t in step.recvs:
                assert 0 <= t.start < t.stop <= count
                received[(t.peer, rank)].append((t.start, t.stop, t.block, t.segment))
    assert sent == received


def test_segments_cut_each_transfer_into_consecutive_pieces() -> None:
    plan = compile_plan(ring_all_reduce(3).with_segments(4), rank=0, count=30)
    first = plan.steps[0]
    pieces = [(t.start, t.stop) for t in first.sends]
    assert len(pieces) == 4
    assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
    assert pieces[0][0] == 20
    assert pieces[-1][1] == 30
    assert [t.segment for t in first.sends] == [0, 1, 2, 3]


def test_tiny_buffers_drop_empty_pieces_on_both_ends() -> None:
    # 2 elements, 3 ranks: one block is empty; nobody sends or expects it.
    plans = [compile_plan(ring_all_reduce(3), r, 2) for r in range(3)]
    sends = sum(len(s.sends) for p in plans for s in p.steps)
    recvs = sum(len(s.recvs) for p in plans for s in p.steps)
    assert sends == recvs
    assert sends < 3 * 4  # fewer than the 12 transfers of a ring of 3 with every block non-empty


def test_peers_are_the_ranks_a_plan_exchanges_with() -> None:
    assert compile_plan(ring_all_reduce(5), 2, 10).peers == frozenset({1, 3})


def test_a_negative_count_is_refused() -> None:
    with pytest.raises(ValueError, match="count must be >= 0"):
        compile_plan(ring_all_reduce(5), 2, -1)


def test_a_plan_refuses_a_buffer_of_another_length() -> None:
    plan = compile_plan(ring_all_reduce(3), 1, 12)
    with pytest.raises(ValueError, match="hold 12 elements"):
        plan.check_fits(1, 3, np.zeros(11))


def test_a_plan_refuses_another_rank() -> None:
    plan = compile_plan(ring_all_reduce(3), 1, 12)
    with pytest.raises(ValueError, match="is for rank 1 of 3"):
        plan.check_fits(0, 3, np.zeros(12))


def test_plans_are_keyed_by_identity_not_by_their_steps() -> None:
    schedule = ring_all_reduce(3)
    first, second = compile_plan(schedule, 0, 12), compile_plan(schedule, 0, 12)
    assert first.steps == second.steps
    assert first != second
    assert len({first, second, first}) == 2
