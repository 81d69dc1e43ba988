"""The authoring API: textbook programs compile to the built-in schedules, and mistakes are named."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.schedules import (
    CostModel,
    Program,
    Schedule,
    ScheduleError,
    Step,
    Verb,
    algorithms,
    all_reduce,
    binomial_broadcast,
    predict,
    ring_all_reduce,
    verify,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "algorithms"
MODELS = [
    CostModel(latency_s=5e-6, bandwidth_Bps=50e9),
    CostModel(latency_s=1e-6, bandwidth_Bps=12.5e9, reduce_bandwidth_Bps=100e9),
]


def load_example(stem: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{stem}", EXAMPLES / f"{stem}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


textbook = load_example("textbook")


def flows_by_step(schedule: Schedule) -> dict[int, list[tuple[int, int, float, bool]]]:
    """Every step's (src, dst, fraction, reduce) transfers, however the phases are cut."""
    steps: dict[int, list[tuple[int, int, float, bool]]] = {}
    for phase in schedule.phases():
        flows = sorted(
            zip(phase.src.tolist(), phase.dst.tolist(), phase.fraction.tolist(), phase.reduce.tolist(), strict=True)
        )
        for step in range(phase.first_step, phase.first_step + phase.repeat):
            steps[step] = flows
    return steps


def assert_same(authored: Schedule, builtin: Schedule) -> None:
    assert (authored.world_size, authored.num_blocks, authored.num_steps) == (
        builtin.world_size,
        builtin.num_blocks,
        builtin.num_steps,
    )
    assert authored.collective is builtin.collective
    assert authored.root == builtin.root
    for rank in range(builtin.world_size):
        assert authored.program(rank) == builtin.program(rank), f"rank {rank}"
    assert flows_by_step(authored) == flows_by_step(builtin)
    for model in MODELS:
        for size in (1.0, 2.0**20, 2.0**30):
            assert predict(authored, size, model).seconds == pytest.approx(
                predict(builtin, size, model).seconds, rel=1e-12, abs=1e-18
            )


@pytest.mark.parametrize("n", [*range(1, 13), 17, 64, 100])
def test_authored_ring_compiles_to_the_builtin_ring(n: int) -> None:
    assert_same(textbook.authored_ring(n).compile("ring"), ring_all_reduce(n))


@pytest.mark.parametrize("n", [1, 2, 5, 64, 300])
@pytest.mark.slow
def test_authored_ring_is_two_streams_per_rank_not_one_per_transfer(n: int) -> None:
    assert len(textbook.authored_ring(n).compile().streams) == (2 * n if n > 1 else 0)


@pytest.mark.parametrize("n", [*range(1, 13), 31, 64])
def test_authored_binomial_broadcast_compiles_to_the_builtin_one(n: int) -> None:
    for root in sorted({0, 1 % n, n - 1}):
        assert_same(textbook.authored_binomial(n, root).compile("binomial"), binomial_broadcast(n, root))


@pytest.mark.parametrize("n", [2, 3, 8, 9])
def test_bidirectional_ring_example_verifies(n: int) -> None:
    verify(load_example("my_ring").bidirectional_ring(n).compile())


def pipelined_chain(n: int, chunks: int) -> Program:
    """Chunks flow down the chain 0 → 1 → ... → n-1, chunk k leaving rank r at step r + k (written rank-major)."""
    p = Program(n, num_blocks=chunks, collective="broadcast")
    for r in range(n - 1):
        for k in range(chunks):
            step = p.step(r + k)
            step.send(r, r + 1, k)
            step.recv_copy(r + 1, r, k)
    return p


def test_steps_can_be_written_ahead_and_chain_into_one_stream_per_link() -> None:
    schedule = pipelined_chain(6, 4).compile()
    verify(schedule)
    assert schedule.num_steps == 5 + 4 - 1
    assert len(schedule.streams) == 5
    assert np.all(schedule.streams.steps == 4)


def broken(mutate: Callable[[int, int, int, Program], bool]) -> Program:
    """The ring, with ``mutate(step, rank, block, program)`` replacing the receive where it returns True."""
    n = 4
    p = Program(n, num_blocks=n, name="broken")
    for j in range(2 * (n - 1)):
        step = p.step()
        for r in range(n):
            right = (r + 1) % n
            block = (r - j - 1) % n if j < n - 1 else (r - j + n - 1) % n
            step.send(r, right, block)
            if mutate(j, r, block, p):
                continue
            if j < n - 1:
                step.recv_reduce(right, r, block)
            else:
                step.recv_copy(right, r, block)
    return p


def test_a_send_without_its_receive_names_rank_step_and_block() -> None:
    program = broken(lambda j, r, block, p: j == 1 and r == 2)
    with pytest.raises(ScheduleError, match=r"rank 2 step 1: send block 0 to rank 3, but rank 3 posts no matching"):
        program.compile()


def test_a_receive_in_another_step_than_its_send_is_named() -> None:
    def late(j: int, r: int, block: int, p: Program) -> bool:
        if j == 0 and r == 0:
            p.step(1).recv_reduce(1, 0, block)
            return True
        return False

    with pytest.raises(
        ScheduleError, match=r"rank 0 step 0: send block 3 to rank 1, but rank 1 posts no matching receive in that step"
    ):
        broken(late).compile()


def test_a_receive_of_other_blocks_than_were_sent_is_named() -> None:
    def other(j: int, r: int, block: int, p: Program) -> bool:
        if j == 0 and r == 0:
            p.step(0).recv_reduce(1, 0, (block + 1) % 4)
            return True
        return False

    with pytest.raises(ScheduleError, match=r"rank 1 step 0: recv_reduce block 0 from rank 0, but the matching send"):
        broken(other).compile()


def test_reducing_where_the_ring_must_copy_is_caught_by_the_verifier() -> None:
    def reduce_instead(j: int, r: int, block: int, p: Program) -> bool:
        if j == 3 and r == 1:
            p.step(3).recv_reduce(2, 1, block)
            return True
        return False

    schedule = broken(reduce_instead).compile()
    with pytest.raises(ScheduleError, match=r"rank 2 step 3 reduces block 1 from rank 1 and counts .* twice"):
        verify(schedule)


@pytest.mark.parametrize(
    ("issue", "message"),
    [
        (lambda s: s.send(0, 0, 0), "cannot exchange with itself"),
        (lambda s: s.send(0, 4, 0), "peer 4 is not a rank"),
        (lambda s: s.recv_copy(5, 0, 0), "rank 5 is not a rank"),
        (lambda s: s.send(0, 1, 4), r"blocks \[4, 5\) out of range"),
        (lambda s: s.send(0, 1, range(2, 2)), "non-empty range"),
        (lambda s: s.send(0, 1, 1.5), "a block is an int or a range"),
    ],
)
def test_a_bad_verb_is_refused_where_it_is_issued(issue: Callable[..., None], message: str) -> None:
    p = Program(4, num_blocks=4, name="bad")
    with pytest.raises(ScheduleError, match=rf"bad: step 2: .*{message}"):
        issue(p.step(2))


def test_a_range_of_blocks_moves_together() -> None:
    p = Program(2, num_blocks=4)
    step = p.step()
    step.send(0, 1, range(4))
    step.recv_reduce(1, 0, range(4))
    step = p.step()
    step.send(1, 0, range(4))
    step.recv_copy(0, 1, range(4))
    schedule = p.compile()
    verify(schedule)
    assert [(op.block_start, op.block_stop) for op in schedule.program(0)] == [(0, 4), (0, 4)]


def reauthored(schedule: Schedule) -> Program:
    """``schedule`` written again verb by verb from its per-rank programs."""
    p = Program(
        schedule.world_size,
        num_blocks=schedule.num_blocks,
        collective=schedule.collective,
        root=schedule.root,
        name=schedule.name,
    )
    if schedule.num_steps:
        p.step(schedule.num_steps - 1)  # a schedule may end in steps where no rank moves data
    verbs = {Verb.SEND: Step.send, Verb.RECV_REDUCE: Step.recv_reduce, Verb.RECV_COPY: Step.recv_copy}
    for rank in range(schedule.world_size):
        for op in schedule.program(rank):
            verbs[op.verb](p.step(op.step), rank, op.peer, range(op.block_start, op.block_stop))
    return p


@settings(max_examples=60, deadline=None)
@given(
    algorithm=st.sampled_from((*algorithms(automatic=True), "naive")), n=st.integers(1, 24), chunks=st.integers(1, 5)
)
@pytest.mark.slow
def test_any_builtin_written_verb_by_verb_compiles_back_to_itself(algorithm: str, n: int, chunks: int) -> None:
    group_size = next(g for g in (4, 3, 2, 1) if n % g == 0)
    builtin = all_reduce(algorithm, n, chunks=chunks, group_size=group_size)
    assert_same(reauthored(builtin).compile(builtin.name), builtin)
