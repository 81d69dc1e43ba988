"""The group's plain-call path (``all_reduce(x)`` of a C-contiguous numpy array, every other argument at its
default) beyond the small sizes, over shm and tcp, on real rank processes: exact results at sizes and buffer kinds
that take each of the transport's homes, a mismatch raised before data moves, rank 0's pick when the ranks'
picks differ, and pairing with ranks on the general path. (The small sizes: tests/runtime/shm/test_shm_small.py.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_group_harness import contribution, count_mismatch, reference

from allreduce.runtime.launcher._spawn import spawn
from allreduce.schedules import CostModel

COUNTS = (1 << 14, (1 << 18) + 3, 1 << 20)  # 64 KiB, just over 1 MiB, 4 MiB of float32


def _exact(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> bool:
    return bool(np.array_equal(got.view(np.uint8), want.view(np.uint8)))


def _cases(group: Any) -> dict[str, Any]:
    n, rank, dt = group.world_size, group.rank, np.dtype(np.float32)
    out: dict[str, Any] = {"wrong": []}
    for count in COUNTS:
        want = reference(dt, count, n, "sum")
        plain = np.empty(count, dt)
        shared = group.empty(count, dt) if group.transport_name == "shm" else np.empty(count, dt)
        for kind, x in (("plain", plain), ("plain again", plain), ("2-D", plain.reshape(1, -1)), ("empty", shared)):
            x.reshape(-1)[...] = contribution(dt, count, rank, "sum")
            assert group.all_reduce(x) is x
            if not _exact(x.reshape(-1), want):
                out["wrong"].append(f"{kind} count={count}")
        # rank 1 passes a strided view (the general path) to the same collective
        backing = np.zeros(2 * count, dt)
        y = backing[::2] if rank == 1 else np.empty(count, dt)
        y[...] = contribution(dt, count, rank, "sum")
        group.all_reduce(y)
        if not _exact(np.ascontiguousarray(y), want):
            out["wrong"].append(f"mixed count={count}")
    out["mismatch"], out["mismatch_untouched"] = count_mismatch(group, dt, COUNTS[1])
    # odd ranks' cost model picks another algorithm: every rank runs rank 0's pick
    count = COUNTS[1]
    out["default_pick"] = group.choose_algorithm(count)
    if rank % 2:
        group.cost_model = CostModel(latency_s=1.0, bandwidth_Bps=1e12)
    out["pick"] = group.choose_algorithm(count)
    w = contribution(dt, count, rank, "sum")
    group.all_reduce(w)
    out["pick_exact"] = _exact(w, reference(dt, count, n, "sum"))
    return out


@pytest.fixture(scope="module", params=[("shm", 2), ("shm", 4), ("tcp", 3)], ids=lambda p: f"{p[0]}-world{p[1]}")
def reports(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    transport, n = request.param
    return spawn(n, _cases, timeout_s=300, init_options={"transport": transport})


@pytest.mark.slow
def test_plain_calls_are_exact_for_every_buffer_kind(reports: list[dict[str, Any]]) -> None:
    assert [r["wrong"] for r in reports] == [[] for _ in reports]


@pytest.mark.slow
def test_a_mismatch_on_the_plain_path_is_raised_on_every_rank_before_data_moves(reports: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(reports):
        assert "mismatch before any data moved" in r["mismatch"], (rank, r["mismatch"])
        assert "different count" in r["mismatch"]
        assert r["mismatch_untouched"], rank


@pytest.mark.slow
def test_ranks_whose_picks_differ_run_rank_0s_on_the_plain_path(reports: list[dict[str, Any]]) -> None:
    assert reports[1]["pick"] != reports[0]["default_pick"]  # the case this test is about
    assert all(r["pick_exact"] for r in reports)
