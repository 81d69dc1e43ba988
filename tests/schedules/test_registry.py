"""The algorithm registry: lookups, verification on registration, and the naive strawman."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from allreduce.schedules import (
    MAX_ALGORITHM_NAME_BYTES,
    Collective,
    CostModel,
    Program,
    Schedule,
    ScheduleError,
    algorithms,
    all_reduce,
    get_algorithm,
    make_schedule,
    naive_all_reduce,
    predict,
    register_algorithm,
    ring_all_reduce,
    unregister_algorithm,
    verify,
)

RTOL = 1e-9


@pytest.fixture
def registered() -> Iterator[list[str]]:
    """Names a test registers for all-reduce; removed afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        if name in algorithms():
            unregister_algorithm("all_reduce", name)


def ring_missing_last_step(world_size: int) -> Schedule:
    ring = ring_all_reduce(world_size)
    keep = ring.streams.replace(steps=np.maximum(ring.streams.steps - (ring.streams.start > 0), 0))
    return Schedule("x", Collective.ALL_REDUCE, world_size, world_size, max(ring.num_steps - 1, 0), keep)


BUILT_IN_ALL_REDUCE = (
    "ring",
    "halving_doubling",
    "recursive_doubling",
    "double_binary_tree",
    "direct",
    "hierarchical",
    "naive",
)


def test_builtins_are_registered_in_order() -> None:
    assert algorithms()[: len(BUILT_IN_ALL_REDUCE)] == BUILT_IN_ALL_REDUCE


def test_automatic_lists_every_builtin_but_the_strawman() -> None:
    assert algorithms(automatic=True)[: len(BUILT_IN_ALL_REDUCE) - 1] == BUILT_IN_ALL_REDUCE[:-1]
    assert "naive" not in algorithms(automatic=True)


def test_the_registry_holds_each_builtins_limits() -> None:
    quadratic = {name for name in BUILT_IN_ALL_REDUCE if get_algorithm("all_reduce", name).quadratic}
    grouped = {name for name in BUILT_IN_ALL_REDUCE if get_algorithm("all_reduce", name).needs_group_size}
    assert (quadratic, grouped) == ({"direct", "naive"}, {"hierarchical"})
    assert get_algorithm("all_reduce", "naive").max_ranks == 2048


def test_make_schedule_refuses_more_ranks_than_a_registered_limit(registered: list[str]) -> None:
    register_algorithm("all_reduce", "small_ring", ring_all_reduce, max_ranks=16)
    registered.append("small_ring")
    assert make_schedule("all_reduce", "small_ring", 16).world_size == 16
    with pytest.raises(ValueError, match=r"'small_ring' is built for at most 16 ranks"):
        make_schedule("all_reduce", "small_ring", 17)


def test_a_limit_that_is_not_a_positive_int_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_ranks must be an int >= 1"):
        register_algorithm("all_reduce", "no_ring", ring_all_reduce, max_ranks=0)


def test_a_wrong_algorithm_is_refused_naming_world_size_rank_step_and_block(registered: list[str]) -> None:
    with pytest.raises(
        ScheduleError, match=r"'short_ring' \(python\) is wrong at world_size=2: .*rank 0 block 1 holds"
    ):
        register_algorithm("all_reduce", "short_ring", ring_missing_last_step)
    assert "short_ring" not in algorithms()


def test_a_correct_user_algorithm_is_registered_and_built_by_name(registered: list[str]) -> None:
    registered.append("my_ring")
    register_algorithm("all_reduce", "my_ring", ring_all_reduce, description="the ring again")
    schedule = make_schedule("all_reduce", "my_ring", 6, segments=2)
    assert schedule.name == "my_ring"
    assert schedule.segments == 2
    assert schedule.program(3) == ring_all_reduce(6).program(3)
    assert get_algorithm("all_reduce", "my_ring").origin == "python"


def test_a_generator_returning_a_program_is_compiled(registered: list[str]) -> None:
    def exchange(world_size: int) -> Program:
        p = Program(world_size, num_blocks=1)
        if world_size > 2:
            raise ValueError("two ranks only")
        if world_size == 2:
            step = p.step()
            for r in (0, 1):
                step.send(r, 1 - r, 0)
                step.recv_reduce(1 - r, r, 0)
        return p

    registered.append("pair_exchange")
    register_algorithm("all_reduce", "pair_exchange", exchange)
    schedule = make_schedule("all_reduce", "pair_exchange", 2)
    assert isinstance(schedule, Schedule)
    assert schedule.name == "pair_exchange"
    verify(schedule)


def test_an_algorithm_that_declines_every_world_size_is_refused() -> None:
    def nothing(world_size: int) -> Schedule:
        raise ValueError(f"no group of {world_size} ranks suits me")

    with pytest.raises(ScheduleError, match=r"declined every world size.*no group of 1 ranks"):
        register_algorithm("all_reduce", "nothing", nothing)


def test_declared_parameters_are_verified_with_representative_values(registered: list[str]) -> None:
    def wrong_with_three_chunks(world_size: int, chunks: int = 8) -> Schedule:
        return ring_missing_last_step(world_size) if chunks == 3 and world_size > 1 else ring_all_reduce(world_size)

    with pytest.raises(ScheduleError, match=r"world_size=2, chunks=3"):
        register_algorithm("all_reduce", "chunky", wrong_with_three_chunks)


def test_a_generator_returning_something_else_is_refused() -> None:
    with pytest.raises(ScheduleError, match="returned int, not a Schedule or a Program"):
        register_algorithm("all_reduce", "number", lambda world_size: 42)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("x" * (MAX_ALGORITHM_NAME_BYTES + 1), "may have at most"),
        ("auto", "reserved"),
        ("my-ring", "identifier"),
        ("ring", "already registered"),
    ],
)
def test_bad_names_are_refused(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        register_algorithm("all_reduce", name, ring_all_reduce)


def test_all_reduce_is_make_schedule_for_all_reduce() -> None:
    for name in ("ring", "double_binary_tree", "naive"):
        assert all_reduce(name, 5, chunks=2).program(1) == make_schedule("all_reduce", name, 5, chunks=2).program(1)
    with pytest.raises(ValueError, match="unknown all-reduce algorithm 'bogus'; choose one of ring,"):
        all_reduce("bogus", 4)


@pytest.mark.parametrize("n", range(1, 65))
@pytest.mark.slow
def test_naive_verifies(n: int) -> None:
    verify(naive_all_reduce(n))


@pytest.mark.parametrize("n", [1, 2, 5, 64, 1024])
def test_naive_sends_the_whole_buffer_to_every_other_rank(n: int) -> None:
    schedule = naive_all_reduce(n)
    size = 3.0 * 2**20
    assert np.allclose(schedule.bytes_sent_per_rank(size), (n - 1) * size)
    assert int(schedule.streams.steps.sum()) == n * (n - 1)
    assert schedule.num_steps == (1 if n > 1 else 0)


def naive_closed_form(n: int, s: float, alpha: float, beta: float, gamma: float) -> float:
    """One step: α, then (N-1)·S through each rank's port, then (N-1)·S reduced at each rank."""
    return 0.0 if n == 1 else alpha + (n - 1) * s * beta + (n - 1) * s * gamma


@pytest.mark.parametrize(
    "model",
    [
        CostModel(latency_s=5e-6, bandwidth_Bps=50e9),
        CostModel(latency_s=1e-6, bandwidth_Bps=12.5e9, reduce_bandwidth_Bps=100e9),
        CostModel(latency_s=0.0, bandwidth_Bps=1e9, reduce_bandwidth_Bps=7.6e9),
    ],
)
@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1024])
@pytest.mark.parametrize("size", [1.0, 4096.0, 2.0**30])
@pytest.mark.slow
def test_naive_matches_its_closed_form(model: CostModel, n: int, size: float) -> None:
    got = predict(naive_all_reduce(n), size, model).seconds
    want = naive_closed_form(n, size, model.latency_s, model.seconds_per_byte, model.reduce_seconds_per_byte)
    assert got == pytest.approx(want, rel=RTOL, abs=1e-18)


def test_naive_is_refused_beyond_its_bound() -> None:
    limit = get_algorithm("all_reduce", "naive").max_ranks
    assert limit is not None
    with pytest.raises(ValueError, match=f"refused above {limit} ranks"):
        naive_all_reduce(limit + 1)


def test_a_wrong_authored_algorithm_is_refused_naming_the_step(registered: list[str]) -> None:
    def ring_that_reduces_twice(world_size: int) -> Program:
        n = world_size
        p = Program(n, num_blocks=n)
        for j in range(2 * (n - 1)):  # the all-gather half reduces where it must copy
            step = p.step()
            for r in range(n):
                block = (r - j - 1) % n
                step.send(r, (r + 1) % n, block)
                step.recv_reduce((r + 1) % n, r, block)
        return p

    with pytest.raises(ScheduleError, match=r"world_size=2: .*rank \d step 1 reduces block \d from rank \d and counts"):
        register_algorithm("all_reduce", "twice", ring_that_reduces_twice)


def powers_of_two_by_lookup(world_size: int) -> Schedule:
    rounds = {1: 0, 2: 1, 4: 2, 8: 3}[world_size]  # a user's table: a KeyError, not a ValueError, elsewhere
    return ring_all_reduce(world_size) if rounds >= 0 else ring_missing_last_step(world_size)


def test_a_generator_that_raises_is_refused_naming_the_world_size_and_its_line() -> None:
    with pytest.raises(ScheduleError) as caught:
        register_algorithm("all_reduce", "pow2_table", powers_of_two_by_lookup)
    line = powers_of_two_by_lookup.__code__.co_firstlineno + 1
    assert str(caught.value) == (
        f"all_reduce algorithm 'pow2_table' (python) failed at world_size=3: KeyError at {__file__}:{line}: 3"
    )
    assert "pow2_table" not in algorithms()


def test_a_generator_that_raises_when_built_later_is_named_not_an_internal_error(registered: list[str]) -> None:
    registered.append("pow2_late")
    register_algorithm("all_reduce", "pow2_late", powers_of_two_by_lookup, verify_on=(2, 4))
    with pytest.raises(ScheduleError, match=r"'pow2_late' \(python\) failed at world_size=6: KeyError at "):
        make_schedule("all_reduce", "pow2_late", 6)
