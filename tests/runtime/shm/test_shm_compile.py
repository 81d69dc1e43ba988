"""The plan → shared-memory program compiler, without processes: what is staged, copied, waited for.

A program is correct when (1) every range a rank sends is in the working buffer ``W`` when it publishes the
step, (2) every write into ``W`` waits for each peer that reads the overwritten range at that step or before,
(3) every element whose final value is only in ``W`` is copied back to the user's array, and (4) a receive that
lands on a range sent in the same step is staged. The property tests check these on every registered algorithm
of every collective; the examples pin the textbook cases.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from allreduce.runtime import RankPlan, compile_plan
from allreduce.runtime.shm._compile import IN_BOTH, IN_USER, IN_WORK, RankProgram, compile_program
from allreduce.schedules import Collective, algorithms, make_schedule


def _plan(collective: Collective, name: str, world_size: int, rank: int, count: int, *, segments: int = 1) -> RankPlan:
    group_size = 2 if world_size % 2 == 0 else world_size
    schedule = make_schedule(collective, name, world_size, root=world_size - 1, segments=segments,
                             group_size=group_size)  # fmt: skip
    return compile_plan(schedule, rank, count)


def _overlaps(a: int, b: int, c: int, d: int) -> bool:
    return a < d and c < b


# ------------------------------------------------------------------------------------------- textbook cases
def test_a_ring_in_shared_memory_copies_nothing_and_stages_nothing() -> None:
    plan = _plan(Collective.ALL_REDUCE, "ring", 4, 1, 400)
    program = compile_program(plan, in_shm=True)
    assert program.copyouts == ()
    for step in program.steps:
        assert step.copyins == ()
        for receive in step.recvs:
            assert all(pc.src == IN_WORK and pc.dst == IN_WORK and not pc.staged for pc in receive.pieces)


def test_a_staged_ring_copies_in_only_what_it_sends_first() -> None:
    plan = _plan(Collective.ALL_REDUCE, "ring", 4, 1, 400)
    program = compile_program(plan, in_shm=False)
    first_sends = [(t.start, t.stop) for t in plan.steps[0].sends]
    assert list(program.steps[0].copyins) == first_sends
    assert program.steps[0].copyin_waits == ()  # nobody has read anything yet


def test_a_staged_ring_writes_a_received_block_to_the_user_array_unless_it_is_sent_again() -> None:
    plan = _plan(Collective.ALL_REDUCE, "ring", 4, 0, 400)
    program = compile_program(plan, in_shm=False)
    last = program.steps[-1]
    # the ring's last receive completes a block that is never sent again: straight into the user's array
    assert all(pc.dst == IN_USER for receive in last.recvs for pc in receive.pieces)
    # the reduce-scatter's receives are forwarded at the next step: they go to the working buffer
    assert all(pc.dst == IN_WORK for receive in program.steps[0].recvs for pc in receive.pieces)


def test_recursive_doubling_in_shared_memory_stages_the_whole_exchange() -> None:
    plan = _plan(Collective.ALL_REDUCE, "recursive_doubling", 2, 0, 100)
    program = compile_program(plan, in_shm=True)
    (step,) = program.steps
    (receive,) = step.recvs
    (piece,) = receive.pieces
    assert (piece.start, piece.stop, piece.staged) == (0, 100, True)
    assert piece.waits == ((1, 1),)  # until the peer has read this rank's step-0 data
    assert program.final_waits == ((1, 1),)


def test_naive_receives_of_one_range_from_every_peer_name_the_same_staged_pieces() -> None:
    # every peer's whole buffer is reduced into this rank's in one step: the executor accumulates the staged
    # results by piece, so each receive must cut the range into the same pieces
    plan = _plan(Collective.ALL_REDUCE, "naive", 4, 0, 100)
    program = compile_program(plan, in_shm=True)
    (step,) = program.steps
    assert len(step.recvs) == 3
    cuts = [[(pc.start, pc.stop) for pc in receive.pieces] for receive in step.recvs]
    assert cuts[0] == cuts[1] == cuts[2]
    assert all(pc.staged for receive in step.recvs for pc in receive.pieces)


def test_recursive_doubling_from_a_user_array_reduces_straight_into_it() -> None:
    plan = _plan(Collective.ALL_REDUCE, "recursive_doubling", 2, 0, 100)
    program = compile_program(plan, in_shm=False)
    (step,) = program.steps
    assert step.copyins == ((0, 100),)
    (piece,) = step.recvs[0].pieces
    assert (piece.src, piece.dst, piece.staged, piece.waits) == (IN_USER, IN_USER, False, ())
    assert program.copyouts == ()


def test_a_broadcast_leaf_waits_for_nobody() -> None:
    plan = _plan(Collective.BROADCAST, "binomial", 4, 1, 64)
    program = compile_program(plan, in_shm=True)
    # rank 1 receives the root's data once and sends it on: nobody reads it before it is written
    first_receive = next(step for step in program.steps if step.recvs)
    assert all(pc.waits == () for receive in first_receive.recvs for pc in receive.pieces)


def test_crc_slots_count_the_transfers_to_the_busiest_peer() -> None:
    plan = _plan(Collective.ALL_REDUCE, "ring", 3, 0, 90, segments=4)
    program = compile_program(plan, in_shm=True)
    per_peer: dict[int, int] = {}
    for step in plan.steps:
        for t in step.sends:
            per_peer[t.peer] = per_peer.get(t.peer, 0) + 1
    assert program.max_crc_slots == max(per_peer.values())
    slots = [(dst, slot) for step in program.steps for dst, slot, _, _ in step.send_crcs]
    assert len(slots) == len(set(slots))


# ------------------------------------------------------------------------------------------- properties
_ALGORITHMS = [(c, name) for c in Collective for name in algorithms(c)]


@st.composite
def _plans(draw: st.DrawFn) -> RankPlan:
    collective, name = draw(st.sampled_from(_ALGORITHMS))
    world_size = draw(st.integers(1, 9))
    rank = draw(st.integers(0, world_size - 1))
    count = draw(st.integers(0, 200))
    segments = draw(st.integers(1, 3))
    return _plan(collective, name, world_size, rank, count, segments=segments)


def _replay_locations(plan: RankPlan, program: RankProgram, in_shm: bool) -> None:
    """Walk the program element by element: sends must read W, and the final value must reach the user array."""
    where = [IN_WORK if in_shm else IN_USER] * plan.count
    for step, compiled in zip(plan.steps, program.steps, strict=True):
        for a, b in compiled.copyins:
            for i in range(a, b):
                assert where[i] == IN_USER, (step.index, i)
                where[i] = IN_BOTH
        for t in step.sends:
            assert all(where[i] in (IN_WORK, IN_BOTH) for i in range(t.start, t.stop)), (step.index, t)
        for receive in compiled.recvs:
            for pc in receive.pieces:
                for i in range(pc.start, pc.stop):
                    # a reduce reads the current value from where it is
                    assert pc.src == (IN_WORK if where[i] == IN_WORK else IN_USER), (step.index, i)
                    where[i] = pc.dst
    copied_out = {i for a, b in program.copyouts for i in range(a, b)}
    for i, place in enumerate(where):
        assert (place == IN_WORK and not in_shm) == (i in copied_out), i


@given(_plans(), st.booleans())
def test_sends_read_the_working_buffer_and_results_reach_the_user_array(plan: RankPlan, in_shm: bool) -> None:
    _replay_locations(plan, compile_program(plan, in_shm), in_shm)


def _check_waits(plan: RankPlan, program: RankProgram) -> None:
    """Every write into W waits for each reader of the overwritten range at that step or before."""
    sends = [(s.index, t.peer, t.start, t.stop) for s in plan.steps for t in s.sends]
    for step, compiled in zip(plan.steps, program.steps, strict=True):
        waits = dict(compiled.copyin_waits)
        for a, b in compiled.copyins:
            for s, reader, c, d in sends:
                if s < step.index and _overlaps(a, b, c, d):
                    assert waits.get(reader, 0) >= s + 1, (step.index, reader, s)
        for receive in compiled.recvs:
            for pc in receive.pieces:
                if pc.dst != IN_WORK:
                    assert pc.waits == ()
                    continue
                piece_waits = dict(pc.waits)
                for s, reader, c, d in sends:
                    if s <= step.index and _overlaps(pc.start, pc.stop, c, d):
                        assert piece_waits.get(reader, 0) >= s + 1, (step.index, reader, s)


@given(_plans(), st.booleans())
def test_every_write_into_the_working_buffer_waits_for_its_readers(plan: RankPlan, in_shm: bool) -> None:
    _check_waits(plan, compile_program(plan, in_shm))


@pytest.mark.parametrize(("collective", "name"), _ALGORITHMS, ids=[f"{c.value}-{n}" for c, n in _ALGORITHMS])
@pytest.mark.slow
def test_every_registered_algorithm_compiles_to_a_safe_program_for_every_rank(
    collective: Collective, name: str
) -> None:
    # exhaustive over small groups, so that rare shapes (a whole-buffer exchange) are never left to chance
    for world_size in range(1, 9):
        for rank in range(world_size):
            for count in (0, 1, 3 * world_size + 1):
                plan = _plan(collective, name, world_size, rank, count, segments=1 + count % 2)
                for in_shm in (False, True):
                    program = compile_program(plan, in_shm)
                    _replay_locations(plan, program, in_shm)
                    _check_waits(plan, program)


@given(_plans(), st.booleans())
def test_a_receive_onto_a_range_sent_in_the_same_step_is_staged(plan: RankPlan, in_shm: bool) -> None:
    program = compile_program(plan, in_shm)
    for step, compiled in zip(plan.steps, program.steps, strict=True):
        for receive in compiled.recvs:
            for pc in receive.pieces:
                sent_now = any(_overlaps(pc.start, pc.stop, t.start, t.stop) for t in step.sends)
                assert pc.staged == (pc.dst == IN_WORK and sent_now)


@given(_plans())
def test_in_shared_memory_nothing_is_copied(plan: RankPlan) -> None:
    program = compile_program(plan, in_shm=True)
    assert program.copyouts == ()
    assert all(step.copyins == () for step in program.steps)


@given(_plans(), st.booleans())
def test_the_final_waits_cover_every_reader(plan: RankPlan, in_shm: bool) -> None:
    program = compile_program(plan, in_shm)
    last_read: dict[int, int] = {}
    for step in plan.steps:
        for t in step.sends:
            last_read[t.peer] = step.index + 1
    assert dict(program.final_waits) == last_read
