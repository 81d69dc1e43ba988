"""algorithm=: registered names (built-in or the user's), Schedule objects, deterministic=True, the plan cache."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from allreduce.runtime import MismatchError, ProcessGroup
from allreduce.runtime.group._cost_models import SHM_SHARED_CORES_STEP_S, SHM_STEP_S, default_cost_model
from allreduce.runtime.transport._transport import PLAN_CACHE_ENTRIES, PlanCache
from allreduce.schedules import (
    MAX_ALGORITHM_NAME_BYTES,
    Collective,
    CostModel,
    Schedule,
    ScheduleError,
    algorithms,
    binomial_broadcast,
    direct_all_reduce,
    register_algorithm,
    ring_all_reduce,
    ring_reduce_scatter,
    unregister_algorithm,
)

WORLD_SIZE = 3


def _user_ring(world_size: int) -> Schedule:
    """A user's algorithm: the ring, built by the user's own generator and registered under the user's name."""
    return dataclasses.replace(ring_all_reduce(world_size), name="test_user_ring")


def _even_only(world_size: int) -> Schedule:
    if world_size % 2:
        raise ValueError(f"needs an even world size, got {world_size}")
    return dataclasses.replace(direct_all_reduce(world_size), name="test_even_only")


@pytest.fixture
def user_algorithms() -> Iterator[None]:
    register_algorithm(Collective.ALL_REDUCE, "test_user_ring", _user_ring)
    register_algorithm(Collective.ALL_REDUCE, "test_even_only", _even_only)
    yield
    unregister_algorithm(Collective.ALL_REDUCE, "test_user_ring")
    unregister_algorithm(Collective.ALL_REDUCE, "test_even_only")


def _sum_of_ranks(group: ProcessGroup, **options: Any) -> list[int]:
    x = np.full(10, group.rank + 1, dtype=np.int64)
    group.all_reduce(x, **options)
    return list(x.tolist())


SUMMED = [[6] * 10] * WORLD_SIZE


def test_a_user_registered_algorithm_runs_by_name(ranks: Any, on_ranks: Any, user_algorithms: None) -> None:
    assert on_ranks(ranks(WORLD_SIZE), lambda g: _sum_of_ranks(g, algorithm="test_user_ring")) == SUMMED


def test_auto_skips_a_registered_algorithm_that_cannot_run_on_this_world_size(
    ranks: Any, on_ranks: Any, user_algorithms: None
) -> None:
    assert "test_even_only" in algorithms(Collective.ALL_REDUCE)
    groups = ranks(WORLD_SIZE)
    assert groups[0].choose_algorithm(1 << 20) in algorithms(Collective.ALL_REDUCE)
    assert on_ranks(groups, lambda g: _sum_of_ranks(g, algorithm="auto")) == SUMMED


def test_a_registered_algorithm_that_cannot_run_is_refused_naming_it(ranks: Any, user_algorithms: None) -> None:
    (group,) = ranks(WORLD_SIZE)[:1]
    with pytest.raises(ValueError, match="algorithm: test_even_only on 3 ranks: needs an even world size"):
        group.all_reduce(np.zeros(4), algorithm="test_even_only")


def test_auto_chooses_among_the_registered_algorithms(ranks: Any) -> None:
    group = ranks(4)[0]
    chosen = {group.choose_algorithm(count) for count in (1, 1 << 10, 1 << 20, 1 << 26)}
    assert chosen <= set(algorithms(Collective.ALL_REDUCE))


def test_a_replaced_cost_model_makes_its_own_picks(ranks: Any) -> None:
    group = ranks(4)[0]
    count = 1 << 16  # 256 KiB of float32
    group.cost_model = CostModel(latency_s=1e-3, bandwidth_Bps=6e9, reduce_bandwidth_Bps=7e9)  # steps dominate
    few_steps = group.choose_algorithm(count)
    group.cost_model = CostModel(latency_s=1e-9, bandwidth_Bps=6e9, reduce_bandwidth_Bps=7e9)  # bytes dominate
    few_bytes = group.choose_algorithm(count)
    assert (few_steps, few_bytes) == ("recursive_doubling", "halving_doubling")


def test_shm_steps_cost_more_when_ranks_share_cores() -> None:
    cores = len(os.sched_getaffinity(0))
    assert default_cost_model("shm", cores).latency_s == SHM_STEP_S
    assert default_cost_model("shm", cores + 1).latency_s == SHM_SHARED_CORES_STEP_S > SHM_STEP_S


def test_with_ranks_sharing_cores_auto_takes_fewer_steps_for_a_mid_size_buffer(ranks: Any) -> None:
    group = ranks(4)[0]
    count = 1 << 14  # 64 KiB of float32: at 8 µs a step, halving-doubling's 4 steps beat recursive doubling's 2
    # (the per-step α alone: fused_bytes 0, so that both pay transfer and reduction as separate passes)
    shared = default_cost_model("shm", 4 + len(os.sched_getaffinity(0)))
    group.cost_model = dataclasses.replace(shared, fused_bytes=0.0)
    assert group.choose_algorithm(count) == "recursive_doubling"
    group.cost_model = dataclasses.replace(group.cost_model, latency_s=SHM_STEP_S)
    assert group.choose_algorithm(count) == "halving_doubling"


def test_a_schedule_object_runs_on_every_rank(ranks: Any, on_ranks: Any) -> None:
    schedule = ring_all_reduce(WORLD_SIZE)
    assert on_ranks(ranks(WORLD_SIZE), lambda g: _sum_of_ranks(g, algorithm=schedule)) == SUMMED


def test_a_schedule_object_with_segments_runs(ranks: Any, on_ranks: Any) -> None:
    schedule = ring_all_reduce(WORLD_SIZE)
    assert on_ranks(ranks(WORLD_SIZE), lambda g: _sum_of_ranks(g, algorithm=schedule, segments=3)) == SUMMED


def test_a_rooted_schedule_object_broadcasts_from_its_root(ranks: Any, on_ranks: Any) -> None:
    schedule = binomial_broadcast(WORLD_SIZE, root=2)

    def body(group: ProcessGroup) -> list[int]:
        x = np.full(4, group.rank, dtype=np.int64)
        group.broadcast(x, root=2, algorithm=schedule)
        return list(x.tolist())

    assert on_ranks(ranks(WORLD_SIZE), body) == [[2] * 4] * WORLD_SIZE


def test_ranks_passing_different_schedules_raise_a_mismatch_before_data_moves(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> Any:
        schedule = ring_all_reduce(WORLD_SIZE) if group.rank else ring_all_reduce(WORLD_SIZE).with_segments(2)
        x = np.ones(6)
        try:
            group.all_reduce(x, algorithm=schedule)
        except MismatchError as exc:
            return str(exc), x.tolist()
        return "no error"

    for result in on_ranks(ranks(WORLD_SIZE), body):
        message, x = result
        assert "different schedule" in message
        assert x == [1.0] * 6


def test_equal_schedules_built_separately_agree(ranks: Any, on_ranks: Any) -> None:
    # each rank builds its own object: equal streams, equal digest
    assert on_ranks(ranks(WORLD_SIZE), lambda g: _sum_of_ranks(g, algorithm=ring_all_reduce(WORLD_SIZE))) == SUMMED


def test_a_schedule_for_another_collective_is_refused(ranks: Any) -> None:
    (group,) = ranks(WORLD_SIZE)[:1]
    with pytest.raises(ValueError, match="is a reduce_scatter schedule; this call is all_reduce"):
        group.all_reduce(np.zeros(3), algorithm=ring_reduce_scatter(WORLD_SIZE))


def test_a_schedule_for_another_world_size_is_refused(ranks: Any) -> None:
    (group,) = ranks(WORLD_SIZE)[:1]
    with pytest.raises(ValueError, match="is for 4 ranks; this group has 3"):
        group.all_reduce(np.zeros(3), algorithm=ring_all_reduce(4))


def test_a_schedule_rooted_elsewhere_is_refused(ranks: Any) -> None:
    (group,) = ranks(WORLD_SIZE)[:1]
    with pytest.raises(ValueError, match="rooted at rank 1, but root=0"):
        group.broadcast(np.zeros(3), root=0, algorithm=binomial_broadcast(WORLD_SIZE, root=1))


def test_a_wrong_schedule_is_refused_by_the_verifier(ranks: Any) -> None:
    (group,) = ranks(WORLD_SIZE)[:1]
    # a reduce-scatter labelled all-reduce: blocks end on one rank only
    wrong = dataclasses.replace(ring_reduce_scatter(WORLD_SIZE), collective=Collective.ALL_REDUCE)
    with pytest.raises(ScheduleError, match="rank"):
        group.all_reduce(np.zeros(3), algorithm=wrong)


def test_a_schedule_name_longer_than_the_descriptor_field_is_refused_not_cut(ranks: Any) -> None:
    (group,) = ranks(WORLD_SIZE)[:1]
    long_name = "x" * (MAX_ALGORITHM_NAME_BYTES + 1)
    schedule = dataclasses.replace(ring_all_reduce(WORLD_SIZE), name=long_name)
    with pytest.raises(ValueError, match=f"{long_name}.* 25 bytes.* at most 24"):
        group.all_reduce(np.zeros(3), algorithm=schedule)


def test_deterministic_gives_the_same_bits_whatever_the_algorithm(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> list[str]:
        data = np.random.default_rng(group.rank).standard_normal(4099).astype(np.float32)
        digests = []
        for algorithm in ("auto", *algorithms(Collective.ALL_REDUCE)):
            if algorithm == "hierarchical":
                continue
            w = data.copy()
            group.all_reduce(w, algorithm=algorithm, deterministic=True)
            digests.append(hashlib.sha256(w.tobytes()).hexdigest())
        return digests

    results = on_ranks(ranks(WORLD_SIZE), body)
    assert len({d for digests in results for d in digests}) == 1


def test_the_group_and_its_transport_share_one_plan_cache(ranks: Any, on_ranks: Any) -> None:
    groups = ranks(WORLD_SIZE)
    on_ranks(groups, lambda g: _sum_of_ranks(g, algorithm="ring"))
    plans = groups[0].transport.plans
    assert isinstance(plans, PlanCache)
    assert plans.capacity == PLAN_CACHE_ENTRIES
    assert len(plans) > 0


def test_repeating_a_call_adds_nothing_to_the_plan_cache(ranks: Any, on_ranks: Any) -> None:
    groups = ranks(WORLD_SIZE)
    on_ranks(groups, lambda g: _sum_of_ranks(g, algorithm="ring"))
    cached = len(groups[0].transport.plans)
    on_ranks(groups, lambda g: [_sum_of_ranks(g, algorithm="ring") for _ in range(5)])
    assert len(groups[0].transport.plans) == cached
