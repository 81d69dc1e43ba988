"""``group.empty()`` buffers take the plain-call path plain numpy arrays take, over shm on real rank processes: the
group's prepared plain call (never the general path's preparation), the small-call pass at 4 KiB, and at 1 MiB a
home peers read in place, without the staging copy in and out."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from pipeline_paths import general_path_entries

from allreduce.runtime.launcher._spawn import spawn

SMALL, LARGE = 4 << 10, 1 << 20
IN_PLACE = frozenset(("executes_shared", "executes_adopted", "executes_cross_memory"))
"""The homes peers read where the buffer is (a ``group.empty()`` array, an adopted or a huge-page plain one)."""


def _paths(group: Any) -> dict[tuple[str, int], tuple[int, dict[str, int]]]:
    """Per buffer kind and size: general-path entries and the transport's counters that moved, of the third call
    on the same buffer (the first prepares the plain call, the second may adopt a plain array)."""
    out = {}
    for size in (SMALL, LARGE):
        for kind in ("plain", "empty"):
            x = np.ones(size // 4, np.float32) if kind == "plain" else group.empty(size // 4, np.float32)
            x[...] = 1
            group.all_reduce(x)
            group.all_reduce(x)
            before = dict(group.transport.statistics())
            entries = general_path_entries(lambda x=x: group.all_reduce(x))
            after = group.transport.statistics()
            out[kind, size] = (entries, {k: after[k] - before[k] for k in after if after[k] != before[k]})
            assert float(x[0]) == group.world_size**3  # three sums in place
    return out


@pytest.fixture(scope="module")
def paths() -> list[dict[tuple[str, int], tuple[int, dict[str, int]]]]:
    return spawn(2, _paths, init_options={"transport": "shm"}, env={"ALLREDUCE_STATS": "0"}, timeout_s=120)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["plain", "empty"])
@pytest.mark.parametrize("size", [SMALL, LARGE])
def test_neither_buffer_enters_the_general_path(paths: list[Any], kind: str, size: int) -> None:
    assert [rank[kind, size][0] for rank in paths] == [0, 0]


@pytest.mark.slow
def test_a_small_group_buffer_takes_the_small_call_pass_as_a_plain_array_does(paths: list[Any]) -> None:
    for rank in paths:
        assert rank["empty", SMALL][1] == rank["plain", SMALL][1] == {"executes_eager": 1, "small_calls": 1}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["plain", "empty"])
def test_a_1_mib_buffer_is_read_in_place_without_staging(paths: list[Any], kind: str) -> None:
    for rank in paths:
        moved = rank[kind, LARGE][1]
        assert sum(moved.values()) == 1  # one execute
        assert moved.keys() <= IN_PLACE, moved
