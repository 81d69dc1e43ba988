"""What ``algorithm="auto"`` picks over shared memory for the buffer it is given, on real rank processes.

A plain array in a group of two is staged: its sent ranges are copied into shared memory and every received range
is reduced straight out of the peer's into a different array, one pass per step, so the cost model counts
α + max(T, R) per step at any size below the cross-memory threshold and recursive doubling (one step) beats the
ring (two). A ``group.empty()`` buffer beyond the eager snapshots reduces recursive doubling's receives through
scratch, and keeps the ring. Ranks that pass different kinds of buffer still run rank 0's pick, exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from allreduce.runtime.launcher._spawn import spawn
from allreduce.runtime.shm import CROSS_MEMORY_MIN_BYTES

MIB = 1 << 20
COUNT = MIB // 4  # 1 MiB of float32: beyond the eager snapshots, below the cross-memory threshold


def _picks(group: Any) -> dict[str, Any]:
    plain = np.full(COUNT, group.rank + 1, np.float32)
    shared = group.empty(COUNT, np.float32)
    shared[...] = group.rank + 1
    big = CROSS_MEMORY_MIN_BYTES // 4
    out = {
        "none": group.choose_algorithm(COUNT),
        "plain": group.choose_algorithm(COUNT, like=plain),
        "empty": group.choose_algorithm(COUNT, like=shared),
        "big_plain": group.choose_algorithm(big, like=np.empty(big, np.float32)),
        "big_none": group.choose_algorithm(big),
    }
    group.all_reduce(plain)  # auto, staged, recursive doubling at N=2
    mixed = plain if group.rank == 0 else shared  # rank 0 plain, the others group.empty()
    mixed[...] = group.rank + 1
    group.all_reduce(mixed)
    total = group.world_size * (group.world_size + 1) / 2
    out["plain_exact"] = bool((plain == total).all()) if group.rank != 0 else None
    out["mixed_exact"] = bool((mixed == total).all())
    return out


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return spawn(2, _picks, timeout_s=120, init_options={"transport": "shm"})


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return spawn(4, _picks, timeout_s=240, init_options={"transport": "shm"})


def test_a_plain_array_of_a_group_of_two_takes_recursive_doubling(two: list[dict[str, Any]]) -> None:
    assert [r["plain"] for r in two] == ["recursive_doubling"] * 2


def test_without_the_buffer_the_size_rule_keeps_the_ring(two: list[dict[str, Any]]) -> None:
    assert [r["none"] for r in two] == ["ring"] * 2


def test_a_shared_memory_buffer_beyond_the_snapshots_keeps_the_ring(two: list[dict[str, Any]]) -> None:
    assert [r["empty"] for r in two] == ["ring"] * 2


def test_a_plain_array_read_in_place_is_left_to_the_size_rule(two: list[dict[str, Any]]) -> None:
    assert [r["big_plain"] for r in two] == [r["big_none"] for r in two]


def test_larger_groups_are_left_to_the_size_rule(four: list[dict[str, Any]]) -> None:
    assert [r["plain"] for r in four] == [r["none"] for r in four]


def test_auto_on_a_plain_array_is_exact(two: list[dict[str, Any]]) -> None:
    assert two[1]["plain_exact"] is True


@pytest.mark.parametrize("world", ["two", "four"])
def test_ranks_passing_plain_and_shared_buffers_run_one_pick_exactly(world: str, request: Any) -> None:
    assert [r["mixed_exact"] for r in request.getfixturevalue(world)] == [True] * (2 if world == "two" else 4)
