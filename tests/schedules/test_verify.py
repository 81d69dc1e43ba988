"""The verifier rejects broken schedules and names the rank, step and block."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from allreduce.schedules import (
    Collective,
    Op,
    Schedule,
    ScheduleError,
    Verb,
    algorithms,
    all_reduce,
    binomial_broadcast,
    direct_all_gather,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    verify_programs,
)

Programs = list[list[Op]]


def _check(schedule: Schedule, programs: Programs) -> None:
    verify_programs(
        programs, collective=schedule.collective, num_blocks=schedule.num_blocks, root=schedule.root, name=schedule.name
    )


def _schedule(algorithm: str, n: int) -> Schedule:
    if algorithm == "hierarchical":
        return all_reduce(algorithm, n, group_size=2 if n % 2 == 0 else 1)
    return all_reduce(algorithm, n)


def _matching_receive(programs: Programs, rank: int, index: int) -> tuple[int, int]:
    """(peer, index) of the receive that the send at programs[rank][index] matches (channel order)."""
    send = programs[rank][index]
    k = sum(1 for o in programs[rank][:index] if o.verb is Verb.SEND and o.peer == send.peer)
    seen = 0
    for j, o in enumerate(programs[send.peer]):
        if o.verb is not Verb.SEND and o.peer == rank:
            if seen == k:
                return send.peer, j
            seen += 1
    raise AssertionError("valid schedule without a matching receive")


# ---- random corruptions of valid schedules: every one must be rejected ----------------------------------------
@given(
    algorithm=st.sampled_from(algorithms(automatic=True)),
    n=st.integers(min_value=2, max_value=20),
    pick=st.integers(min_value=0, max_value=10**9),
)
@pytest.mark.slow
def test_dropping_any_operation_is_rejected(algorithm: str, n: int, pick: int) -> None:
    s = _schedule(algorithm, n)
    programs = s.programs()
    ops = [(r, i) for r, p in enumerate(programs) for i in range(len(p))]
    rank, index = ops[pick % len(ops)]
    dropped = programs[rank].pop(index)
    with pytest.raises(ScheduleError, match=rf"rank {rank}|rank {dropped.peer}"):
        _check(s, programs)


@given(
    algorithm=st.sampled_from(algorithms(automatic=True)),
    n=st.integers(min_value=3, max_value=20),
    pick=st.integers(min_value=0, max_value=10**9),
    shift=st.integers(min_value=1, max_value=10**6),
)
@pytest.mark.slow
def test_redirecting_any_send_is_rejected(algorithm: str, n: int, pick: int, shift: int) -> None:
    s = _schedule(algorithm, n)
    programs = s.programs()
    sends = [(r, i) for r, p in enumerate(programs) for i, o in enumerate(p) if o.verb is Verb.SEND]
    rank, index = sends[pick % len(sends)]
    op = programs[rank][index]
    others = [q for q in range(n) if q not in (rank, op.peer)]
    programs[rank][index] = op._replace(peer=others[shift % len(others)])
    with pytest.raises(ScheduleError):
        _check(s, programs)


@given(
    algorithm=st.sampled_from(algorithms(automatic=True)),
    n=st.integers(min_value=2, max_value=20),
    pick=st.integers(min_value=0, max_value=10**9),
)
@pytest.mark.slow
def test_reducing_any_transfer_twice_is_rejected_as_double_counting(algorithm: str, n: int, pick: int) -> None:
    s = _schedule(algorithm, n)
    programs = s.programs()
    reducing = []
    for r, p in enumerate(programs):
        for i, o in enumerate(p):
            if o.verb is Verb.SEND:
                peer, j = _matching_receive(programs, r, i)
                if programs[peer][j].verb is Verb.RECV_REDUCE:
                    reducing.append((r, i, peer, j))
    rank, i, peer, j = reducing[pick % len(reducing)]
    programs[rank].insert(i + 1, programs[rank][i])
    programs[peer].insert(j + 1, programs[peer][j])
    with pytest.raises(ScheduleError, match="twice"):
        _check(s, programs)


# ---- specific breakages, with the message checked ---------------------------------------------------------------
def test_overwriting_instead_of_reducing_loses_a_contribution() -> None:
    s = ring_all_reduce(4)
    programs = s.programs()
    first = next(i for i, o in enumerate(programs[1]) if o.verb is Verb.RECV_REDUCE)
    programs[1][first] = programs[1][first]._replace(verb=Verb.RECV_COPY)
    with pytest.raises(ScheduleError, match=r"after all_reduce, rank \d block \d holds .*missing \{1\}"):
        _check(s, programs)


def test_cycle_of_waits_is_reported_as_a_deadlock() -> None:
    # Every rank first waits to receive, and only sends in the next step: nobody ever sends.
    s = ring_all_reduce(3)
    programs: Programs = []
    for program in s.programs():
        moved = [o._replace(step=2 * o.step + (o.verb is Verb.SEND)) for o in program]
        programs.append(sorted(moved, key=lambda o: o.step))
    with pytest.raises(ScheduleError, match=r"deadlock: cycle of waits: rank \d \(step \d+: recv_reduce"):
        _check(s, programs)


def test_sending_a_block_before_it_arrived_is_rejected() -> None:
    # All-gather: rank 0 forwards at step 0 the block it only receives at step 0 (it should send its own).
    s = ring_all_gather(4)
    programs = s.programs()
    i = next(i for i, o in enumerate(programs[0]) if o.verb is Verb.SEND and o.step == 0)
    j = next(j for j, o in enumerate(programs[1]) if o.verb is Verb.RECV_COPY and o.step == 0)
    received = next(o for o in programs[0] if o.verb is Verb.RECV_COPY and o.step == 0)
    programs[0][i] = programs[0][i]._replace(block_start=received.block_start, block_stop=received.block_stop)
    programs[1][j] = programs[1][j]._replace(block_start=received.block_start, block_stop=received.block_stop)
    with pytest.raises(
        ScheduleError, match=rf"rank 0 step 0 sends block {received.block_start} .* before it has arrived"
    ):
        _check(s, programs)


def test_send_without_receive_names_both_ranks() -> None:
    s = ring_reduce_scatter(3)
    programs = s.programs()
    programs[2] = [o for o in programs[2] if not (o.verb is Verb.RECV_REDUCE and o.step == 1)]
    with pytest.raises(ScheduleError, match=r"rank 1 step 1: send block \d to rank 2, but rank 2 posts no matching"):
        _check(s, programs)


def test_mismatched_blocks_between_send_and_receive() -> None:
    s = direct_all_gather(3)
    programs = s.programs()
    k = next(i for i, o in enumerate(programs[1]) if o.verb is Verb.RECV_COPY)
    op = programs[1][k]
    programs[1][k] = op._replace(block_start=(op.block_start + 1) % 3, block_stop=(op.block_start + 1) % 3 + 1)
    with pytest.raises(ScheduleError, match="but the matching send of rank"):
        _check(s, programs)


def test_two_overwrites_of_one_block_in_one_step_are_a_race() -> None:
    s = binomial_broadcast(3)
    programs: Programs = [[], [], []]
    programs[0] = [Op(0, Verb.SEND, 2, 0, 1)]
    programs[1] = [Op(0, Verb.SEND, 2, 0, 1)]
    programs[2] = [Op(0, Verb.RECV_COPY, 0, 0, 1), Op(0, Verb.RECV_COPY, 1, 0, 1)]
    with pytest.raises(ScheduleError, match=r"rank 1 step 0 sends block 0 to rank 2 before it has arrived"):
        _check(s, programs)
    # With the data present everywhere, the race itself is named.
    with pytest.raises(ScheduleError, match="receives block 0 twice in one step"):
        verify_programs(programs, collective=Collective.ALL_REDUCE, num_blocks=1)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p[0].append(Op(9, Verb.SEND, 0, 0, 1)), "cannot exchange with itself"),
        (lambda p: p[0].append(Op(9, Verb.SEND, 7, 0, 1)), "peer 7 is not a rank"),
        (lambda p: p[0].append(Op(9, Verb.SEND, 1, 0, 99)), "blocks out of range"),
        (lambda p: p[0].append(Op(-1, Verb.SEND, 1, 0, 1)), "steps must not go backwards"),
    ],
)
def test_malformed_operations_are_named(mutate: Callable[[Programs], None], message: str) -> None:
    s = ring_all_reduce(3)
    programs = s.programs()
    mutate(programs)
    with pytest.raises(ScheduleError, match=message):
        _check(s, programs)


def test_an_empty_program_fails_the_postcondition() -> None:
    with pytest.raises(
        ScheduleError, match=r"rank 0 block 0 holds contributions of ranks \{0\}; expected ranks \{0, 1\}"
    ):
        verify_programs([[], []], collective=Collective.ALL_REDUCE, num_blocks=2)
