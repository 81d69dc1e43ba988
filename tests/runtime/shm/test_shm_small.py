"""The small-call path (``all_reduce(x)`` of a small numpy array, in one pass through the shared-memory transport),
on real rank processes: exact results for every dtype and op, the path taken, and its pairing with ranks on the
general path, mismatches, rank 0's pick, asynchronous calls and failures.

One set of processes per world size runs every case (a module-scoped fixture); each test reads one behaviour out
of the ranks' reports.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_group_harness import contribution, count_mismatch, reference

from allreduce.runtime import DTYPES, OPS
from allreduce.runtime.launcher._spawn import spawn
from allreduce.schedules import CostModel

SIZES = (1, 13, 1031)


def _exact(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any], op: str) -> bool:
    if op == "avg" and got.dtype.kind == "f":
        return bool(np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=2e-2, atol=1e-2))
    return bool(np.array_equal(got.view(np.uint8), want.view(np.uint8)))


def _small_calls(group: Any) -> int:
    return int(group.transport.statistics()["small_calls"])


def _cases(group: Any) -> dict[str, Any]:
    n, rank = group.world_size, group.rank
    out: dict[str, Any] = {"wrong": [], "general": []}
    # every dtype x op x size on the small path, 1-D and 2-D in turns (the shape is the view's, not the dtype's)
    turn = 0
    for dname, dt in DTYPES.items():
        for op in OPS:
            if op == "avg" and dt.kind in "iu":
                continue
            for count in SIZES:
                turn += 1
                for shape in ((count,) if turn % 2 else (1, count),):
                    x = contribution(dt, count, rank, op).reshape(shape)
                    before = _small_calls(group)
                    assert group.all_reduce(x, op=op) is x
                    if _small_calls(group) != before + 1:
                        out["general"].append(f"{dname} {op} {shape}")
                    if not _exact(x.reshape(-1), reference(dt, count, n, op), op):
                        out["wrong"].append(f"{dname} {op} {shape}")
    count, dt = 1031, np.dtype(np.float32)
    want = reference(dt, count, n, "sum")
    # ranks on different paths in one collective: rank 1 a non-contiguous view (general path, snapshots), rank 2
    # with snapshots off (general path, its data in shared memory); the others on the small path
    shm = group.transport
    backing = np.zeros(2 * count, dt)
    x = backing[::2] if rank == 1 else np.empty(count, dt)
    x[...] = contribution(dt, count, rank, "sum")
    if rank == 2:
        shm.eager_bytes = 0
    before = _small_calls(group)
    group.all_reduce(x)
    shm.eager_bytes = 256 << 10
    out["mixed_exact"] = _exact(np.ascontiguousarray(x), want, "sum")
    out["mixed_small"] = _small_calls(group) - before
    # a mismatch (rank 0 passes one element more) is raised before anything moves
    out["mismatch"], out["mismatch_untouched"] = count_mismatch(group, dt, count)
    out["torch"] = _torch_cases(group, count)
    return out


def _torch_cases(group: Any, count: int) -> dict[str, Any]:
    """CPU tensors, float32 and bfloat16, on the small path (through their numpy views), and a strided one."""
    import torch

    n, rank, bf16 = group.world_size, group.rank, DTYPES["bfloat16"]
    f32 = torch.from_numpy(contribution(np.dtype(np.float32), count, rank, "sum"))
    b16 = torch.from_numpy(contribution(bf16, count, rank, "sum").view(np.int16)).view(torch.bfloat16)
    strided = torch.from_numpy(np.repeat(contribution(np.dtype(np.float32), count, rank, "sum"), 2))[::2]
    before = _small_calls(group)
    same = [group.all_reduce(t) is t for t in (f32, b16)]
    small = _small_calls(group) - before
    group.all_reduce(strided)
    return {
        "same": same,
        "small": small,
        "f32": _exact(f32.numpy(), reference(np.dtype(np.float32), count, n, "sum"), "sum"),
        "b16": _exact(b16.view(torch.int16).numpy().view(bf16), reference(bf16, count, n, "sum"), "sum"),
        "strided": _exact(strided.contiguous().numpy(), reference(np.dtype(np.float32), count, n, "sum"), "sum"),
        "general": _small_calls(group) - before - small,
    }


def _picks(group: Any) -> dict[str, Any]:
    """Odd ranks' cost model picks another algorithm than rank 0's: every rank runs rank 0's, exactly."""
    count, dt = 1031, np.dtype(np.float32)
    default = group.choose_algorithm(count)
    if group.rank % 2:
        group.cost_model = CostModel(latency_s=0.0, bandwidth_Bps=1e6)
    x = contribution(dt, count, group.rank, "sum")
    group.all_reduce(x)
    return {
        "default": default,
        "mine": group.choose_algorithm(count),
        "exact": _exact(x, reference(dt, count, group.world_size, "sum"), "sum"),
    }


def _async_then_small(group: Any) -> dict[str, Any]:
    """An asynchronous call still pending when a small one is made: they run in call order, both exact."""
    dt = np.dtype(np.float64)
    big = contribution(dt, 1 << 16, group.rank, "sum")
    small = contribution(dt, 13, group.rank, "sum")
    work = group.all_reduce(big, async_op=True)
    group.all_reduce(small)
    work.wait()
    n = group.world_size
    return {
        "big": _exact(big, reference(dt, 1 << 16, n, "sum"), "sum"),
        "small": _exact(small, reference(dt, 13, n, "sum"), "sum"),
    }


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"world{n}")
def reports(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return spawn(request.param, _cases, timeout_s=240, init_options={"transport": "shm"})


@pytest.mark.slow
def test_every_dtype_and_op_is_exact_on_the_small_path(reports: list[dict[str, Any]]) -> None:
    assert [r["wrong"] for r in reports] == [[] for _ in reports]


@pytest.mark.slow
def test_small_contiguous_arrays_take_the_small_path(reports: list[dict[str, Any]]) -> None:
    assert [r["general"] for r in reports] == [[] for _ in reports]


@pytest.mark.slow
def test_ranks_on_the_general_path_pair_with_ranks_on_the_small_path(reports: list[dict[str, Any]]) -> None:
    assert all(r["mixed_exact"] for r in reports)
    # rank 1 (a strided view) and rank 2 (snapshots off) took the general path, the rest the small one
    assert [r["mixed_small"] for r in reports] == [0 if rank in (1, 2) else 1 for rank in range(len(reports))]


@pytest.mark.slow
def test_a_mismatch_on_the_small_path_is_raised_on_every_rank_before_data_moves(
    reports: list[dict[str, Any]],
) -> None:
    for rank, r in enumerate(reports):
        assert "mismatch before any data moved" in r["mismatch"], (rank, r["mismatch"])
        assert "different count" in r["mismatch"]
        assert r["mismatch_untouched"], rank


@pytest.mark.slow
def test_when_the_ranks_pick_different_algorithms_they_run_rank_0s() -> None:
    results = spawn(2, _picks, timeout_s=120, init_options={"transport": "shm"})
    assert results[1]["mine"] != results[0]["default"]  # the case this test is about
    assert all(r["exact"] for r in results)


@pytest.mark.slow
def test_a_pending_asynchronous_call_runs_before_a_small_one() -> None:
    results = spawn(2, _async_then_small, timeout_s=120, init_options={"transport": "shm"})
    assert results == [{"big": True, "small": True}] * 2


@pytest.mark.slow
def test_cpu_tensors_take_the_small_path_exactly(reports: list[dict[str, Any]]) -> None:
    for r in reports:
        t = r["torch"]
        assert t["same"] == [True, True]  # the caller's tensors come back, reduced in place
        assert (t["small"], t["f32"], t["b16"]) == (2, True, True)


@pytest.mark.slow
def test_a_strided_tensor_takes_the_general_path_exactly(reports: list[dict[str, Any]]) -> None:
    assert [(r["torch"]["strided"], r["torch"]["general"]) for r in reports] == [(True, 0)] * len(reports)
