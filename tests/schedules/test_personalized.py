"""All-to-all, gather and scatter: every generator verifies over world sizes and roots, the verifier's postconditions
catch a misrouted, missing or extra block, and the schedules have their textbook shape."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import allreduce.schedules as generators
from allreduce.schedules import (
    Collective,
    CostModel,
    Op,
    Schedule,
    ScheduleError,
    Verb,
    algorithms,
    get_algorithm,
    make_schedule,
    predict,
    verify,
    verify_programs,
)

ROOTED = [generators.binomial_gather, generators.binomial_scatter, generators.direct_gather, generators.direct_scatter]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), data=st.data())
def test_gather_and_scatter_verify_for_every_root(n: int, data: st.DataObject) -> None:
    root = data.draw(st.integers(0, n - 1))
    generator = data.draw(st.sampled_from(ROOTED))
    schedule = generator(n, root)
    assert schedule.root == root
    verify(schedule)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 33),
    generator=st.sampled_from(
        [generators.pairwise_all_to_all, generators.bruck_all_to_all, generators.direct_all_to_all]
    ),
)
def test_all_to_all_verifies(n: int, generator: Callable[[int], Schedule]) -> None:
    schedule = generator(n)
    assert schedule.collective is Collective.ALL_TO_ALL
    assert schedule.num_blocks == n * n
    verify(schedule)


def _check(schedule: Schedule, programs: list[list[Op]]) -> None:
    verify_programs(
        programs, collective=schedule.collective, num_blocks=schedule.num_blocks, root=schedule.root, name="bad"
    )


def _retarget(schedule: Schedule, rank: int, index: int, block: int) -> list[list[Op]]:
    """The programs with the ``index``-th send of ``rank`` and its matching receive moved to ``block``."""
    programs = schedule.programs()
    send = programs[rank][index]
    assert send.verb is Verb.SEND
    programs[rank][index] = send._replace(block_start=block, block_stop=block + 1)
    peer = programs[send.peer]
    for j, op in enumerate(peer):
        if op.verb is Verb.RECV_COPY and op.peer == rank and op.step == send.step:
            peer[j] = op._replace(block_start=block, block_stop=block + 1)
            break
    return programs


@settings(max_examples=40, deadline=None)
@given(n=st.integers(3, 9), data=st.data())
def test_an_all_to_all_block_delivered_to_the_wrong_rank_is_caught(n: int, data: st.DataObject) -> None:
    schedule = generators.pairwise_all_to_all(n)
    rank = data.draw(st.integers(0, n - 1))
    sends = [i for i, op in enumerate(schedule.program(rank)) if op.verb is Verb.SEND]
    index = data.draw(st.sampled_from(sends))
    send = schedule.program(rank)[index]
    # the same source row, another destination: the peer receives a block meant for someone else
    wrong = rank * n + (send.block_start % n + 1) % n
    if wrong % n == rank:
        wrong = rank * n + (wrong % n + 1) % n
    with pytest.raises(ScheduleError, match=r"after all_to_all, rank \d+ block \d+ holds no data"):
        _check(schedule, _retarget(schedule, rank, index, wrong))


@pytest.mark.parametrize("collective", ["gather", "scatter"])
@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 12), data=st.data())
def test_a_dropped_gather_or_scatter_transfer_is_caught(collective: str, n: int, data: st.DataObject) -> None:
    root = data.draw(st.integers(0, n - 1))
    schedule = make_schedule(collective, "direct", n, root=root)
    programs = schedule.programs()
    victim = data.draw(st.sampled_from([r for r in range(n) if r != root]))
    # drop the transfer between the root and victim, on both sides
    programs[root] = [op for op in programs[root] if op.peer != victim]
    programs[victim] = [op for op in programs[victim] if op.peer != root]
    expect = f"rank {root} block {victim}" if collective == "gather" else f"rank {victim} block {victim}"
    with pytest.raises(ScheduleError, match=rf"after {collective}, {expect} holds no data"):
        _check(schedule, programs)


def test_a_scatter_that_sends_a_rank_the_wrong_block_is_caught() -> None:
    # rank 1 receives block 2 (the root's part for rank 2) where block 1 should be
    schedule = generators.direct_scatter(3, 0)
    with pytest.raises(ScheduleError, match=r"after scatter, rank 1 block 1 holds no data"):
        _check(schedule, _retarget(schedule, 0, 0, 2))


def test_all_to_all_needs_n_squared_blocks() -> None:
    with pytest.raises(ScheduleError, match=r"multiple of N² = 9 blocks"):
        verify_programs([[], [], []], collective=Collective.ALL_TO_ALL, num_blocks=3)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pairwise_takes_n_minus_1_steps_with_one_peer_each_and_sends_each_block_once(n: int) -> None:
    schedule = generators.pairwise_all_to_all(n)
    assert schedule.num_steps == n - 1
    for rank in range(n):
        program = schedule.program(rank)
        sends = [op for op in program if op.verb is Verb.SEND]
        assert [op.peer for op in sends] == [(rank + k) % n for k in range(1, n)]
        assert [op.peer for op in program if op.verb is Verb.RECV_COPY] == [(rank - k) % n for k in range(1, n)]
        assert sorted(op.block_start for op in sends) == [rank * n + d for d in range(n) if d != rank]
    # each rank sends (N-1)/N of its send buffer (the size the cost model is given), in N-1 flows of 1/N
    assert np.allclose(schedule.bytes_sent_per_rank(float(n)), n - 1)
    assert all(np.allclose(phase.fraction, 1 / n) for phase in schedule.phases())


@pytest.mark.parametrize(("n", "steps"), [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (16, 4), (17, 5)])
def test_bruck_takes_ceil_log2_n_steps(n: int, steps: int) -> None:
    assert generators.bruck_all_to_all(n).num_steps == steps


def test_bruck_refuses_more_than_its_rank_cap() -> None:
    assert get_algorithm("all_to_all", "bruck").max_ranks == 256
    with pytest.raises(ValueError, match="at most 256 ranks"):
        make_schedule("all_to_all", "bruck", 257)


@pytest.mark.parametrize(("n", "steps"), [(1, 0), (2, 1), (5, 3), (8, 3), (9, 4)])
def test_binomial_gather_and_scatter_take_ceil_log2_n_steps_and_the_root_handles_each_block_once(
    n: int, steps: int
) -> None:
    for generator, verb in ((generators.binomial_gather, Verb.RECV_COPY), (generators.binomial_scatter, Verb.SEND)):
        schedule = generator(n, n - 1)
        assert schedule.num_steps == steps
        blocks = [b for op in schedule.program(n - 1) if op.verb is verb for b in range(op.block_start, op.block_stop)]
        assert sorted(blocks) == [b for b in range(n) if b != n - 1]


def test_the_registry_lists_them_and_auto_runs_pairwise_all_to_all() -> None:
    assert set(algorithms("all_to_all")) == {"pairwise", "bruck", "direct"}
    assert algorithms("all_to_all", automatic=True) == ("pairwise",)
    for collective in ("gather", "scatter"):
        assert set(algorithms(collective, automatic=True)) == {"binomial", "direct"}
        assert make_schedule(collective, "binomial", 6, root=4).root == 4


def test_the_cost_model_predicts_pairwise_all_to_all_on_the_send_buffer() -> None:
    n, size, model = 8, float(1 << 20), CostModel(latency_s=1e-6, bandwidth_Bps=1e9)
    prediction = predict(generators.pairwise_all_to_all(n), size, model)
    assert prediction.seconds == pytest.approx((n - 1) * (1e-6 + size / n / 1e9))
    assert prediction.bytes_sent_per_rank == pytest.approx((n - 1) / n * size)
    assert prediction.busbw_Bps == pytest.approx(size / prediction.seconds * (n - 1) / n)


def test_direct_all_to_all_is_one_step_of_every_pair() -> None:
    schedule = generators.direct_all_to_all(5)
    assert schedule.num_steps == 1
    assert sorted(op.peer for op in schedule.program(2) if op.verb is Verb.SEND) == [0, 1, 3, 4]
