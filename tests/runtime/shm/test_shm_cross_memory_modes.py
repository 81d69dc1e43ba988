"""How peers read plain arrays in place: the start-up probe's modes, and the ptracer discipline of stock Ubuntu.

This machine may have no Yama, so the ptracer discipline (``ALLREDUCE_SHM_CROSS_MEMORY=ptracer``) runs here with
``prctl`` refused: a reader then checks, before every ``process_vm_readv``, that the owner has named it its
ptracer, which is the permission the kernel checks under ``ptrace_scope = 1``. Real rank processes throughout.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import numpy as np
import pytest

from allreduce.runtime.launcher._spawn import spawn
from allreduce.runtime.shm import ADOPT_ENV, CROSS_MEMORY_ENV, CROSS_MEMORY_MIN_BYTES, ShmTransport
from allreduce.runtime.shm._huge_pages import (
    COLLAPSE_ENV,
    COLLAPSE_MIN_BYTES,
    NUMPY_HUGEPAGE_MIN_BYTES,
    HugePageMemo,
    huge_pages_likely,
)
from allreduce.runtime.shm._linux import HUGE_PAGE_BYTES, TRANSPARENT_HUGEPAGES

ELEMENTS = 100_003
"""Plain float32 arrays of this many elements (not a multiple of any block count; above the eager area)."""


def _sum_of_ranks(world_size: int) -> float:
    return world_size * (world_size + 1) / 2


def _all_reduce_in_place(group: Any, algorithm: str) -> dict[str, Any]:
    """All-reduce one plain array with every size read in place; the result's exactness and the counters."""
    shm = group.transport
    shm.cross_memory_min_bytes = 0
    x = np.full(ELEMENTS, group.rank + 1.0, np.float32)
    group.all_reduce(x, algorithm=algorithm)
    return {"exact": bool((x == _sum_of_ranks(group.world_size)).all()), **shm.statistics()}


def _run(world_size: int, algorithm: str, mode: str) -> list[dict[str, Any]]:
    return spawn(world_size, _all_reduce_in_place, algorithm, timeout_s=120, env={CROSS_MEMORY_ENV: mode})


# ----------------------------------------------------------------------------------------------- choosing a mode
def test_an_unknown_mode_in_the_environment_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CROSS_MEMORY_ENV, "sometimes")
    with pytest.raises(ValueError, match=f"{CROSS_MEMORY_ENV}: 'sometimes' is not one of auto, open, ptracer, off"):
        ShmTransport(0, 1, f"mode-{uuid.uuid4().hex}", timeout_s=30)


def test_an_unknown_mode_argument_is_refused_naming_the_argument() -> None:
    with pytest.raises(ValueError, match="cross_memory_mode: 'yes' is not one of"):
        ShmTransport(0, 1, f"mode-{uuid.uuid4().hex}", timeout_s=30, cross_memory_mode="yes")


def test_the_argument_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CROSS_MEMORY_ENV, "sometimes")
    with ShmTransport(0, 1, f"mode-{uuid.uuid4().hex}", timeout_s=30, cross_memory_mode="off") as transport:
        assert transport.statistics()["cross_memory_available"] == 0


# ----------------------------------------------------------------------------------------------- the ptracer way
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling", "recursive_doubling"])
def test_forced_ptracer_reads_plain_arrays_in_place_and_exactly(world_size: int, algorithm: str) -> None:
    for rank, result in enumerate(_run(world_size, algorithm, "ptracer")):
        assert result["exact"], rank
        assert result["cross_memory_ptracer"] == 1, rank
        assert result["executes_cross_memory"] == 1, rank


@pytest.mark.slow
def test_a_reader_per_step_that_changes_is_admitted_anew_each_time() -> None:
    # halving-doubling on 4 ranks: a different partner reads each rank at each of its 4 steps
    for rank, result in enumerate(_run(4, "halving_doubling", "ptracer")):
        assert result["exact"], rank
        assert result["ptracer_switches"] >= 2, rank


@pytest.mark.slow
def test_a_plan_with_two_readers_in_one_step_stages_under_ptracer() -> None:
    # naive all-reduce: every peer reads a rank's buffer in the same step, more than one ptracer can admit
    for rank, result in enumerate(_run(3, "naive", "ptracer")):
        assert result["exact"], rank
        assert result["executes_staged"] == 1, rank
        assert result["executes_cross_memory"] == 0, rank


@pytest.mark.slow
def test_mode_off_stages_plain_arrays() -> None:
    for rank, result in enumerate(_run(2, "ring", "off")):
        assert result["exact"], rank
        assert result["cross_memory_available"] == 0, rank
        assert result["executes_staged"] == 1, rank


@pytest.mark.slow
def test_mode_open_never_uses_the_ptracer_discipline() -> None:
    for rank, result in enumerate(_run(2, "ring", "open")):
        assert result["exact"], rank
        assert result["cross_memory_ptracer"] == 0, rank
        expected = "executes_cross_memory" if result["cross_memory_available"] else "executes_staged"
        assert result[expected] == 1, rank


def _torch_all_reduce(group: Any) -> dict[str, Any]:
    import torch

    shm = group.transport
    shm.cross_memory_min_bytes = 0
    x = torch.full((ELEMENTS,), group.rank + 1.0, dtype=torch.float32)
    group.all_reduce(x, algorithm="ring")
    return {"exact": bool((x == _sum_of_ranks(group.world_size)).all()), **shm.statistics()}


@pytest.mark.slow
def test_torch_tensors_are_read_in_place_under_ptracer() -> None:
    pytest.importorskip("torch")
    results = spawn(2, _torch_all_reduce, timeout_s=120, env={CROSS_MEMORY_ENV: "ptracer"})
    for rank, result in enumerate(results):
        assert result["exact"], rank
        assert result["executes_cross_memory"] == 1, rank


def _two_groups(world_size: int, job: str) -> tuple[int, int, int]:
    """Two transports of one job alive at once in each process, then a third after the first closed."""
    rank = int(os.environ["RANK"])
    first = ShmTransport(rank, world_size, f"{job}-a", timeout_s=60, cross_memory_mode="ptracer")
    second = ShmTransport(rank, world_size, f"{job}-b", timeout_s=60, cross_memory_mode="ptracer")
    held = (first.statistics()["cross_memory_ptracer"], second.statistics()["cross_memory_ptracer"])
    second.close()
    first.close()
    with ShmTransport(rank, world_size, f"{job}-c", timeout_s=60, cross_memory_mode="ptracer") as third:
        return (*held, third.statistics()["cross_memory_ptracer"])


@pytest.mark.slow
def test_only_one_group_per_process_holds_the_ptracer_slot() -> None:
    # Yama keeps one declared tracer per process: a second live group must not take it from the first.
    job = f"slot-{uuid.uuid4().hex[:8]}"
    for rank, result in enumerate(spawn(2, _two_groups, 2, job, group=False, timeout_s=120)):
        assert result == (1, 0, 1), rank


# ----------------------------------------------------------------------------------------------- whose pages
def test_memory_that_is_not_numpys_is_not_taken_for_huge_pages_unless_the_kernel_gives_them_to_all() -> None:
    foreign = np.frombuffer(bytearray(2 * NUMPY_HUGEPAGE_MIN_BYTES), np.uint8)
    assert huge_pages_likely(foreign) == (TRANSPARENT_HUGEPAGES == "always")


def test_a_small_numpy_array_is_not_taken_for_huge_pages_unless_the_kernel_gives_them_to_all() -> None:
    assert huge_pages_likely(np.ones(1024, np.float32)) == (TRANSPARENT_HUGEPAGES == "always")


def test_a_view_into_a_large_numpy_array_counts_as_the_array() -> None:
    array = np.ones(NUMPY_HUGEPAGE_MIN_BYTES, np.uint8)
    assert huge_pages_likely(array[100:]) == huge_pages_likely(array)


def _torch_default_threshold(group: Any) -> dict[str, Any]:
    import torch

    x = torch.full((CROSS_MEMORY_MIN_BYTES // 4,), group.rank + 1.0, dtype=torch.float32)
    group.all_reduce(x, algorithm="ring")
    return {"exact": bool((x == _sum_of_ranks(group.world_size)).all()), **group.transport.statistics()}


@pytest.mark.slow
def test_a_large_torch_tensor_is_staged_unless_the_kernel_backs_it_with_huge_pages() -> None:
    # torch's allocator does not ask for huge pages: pinning its 4 KiB pages one by one costs more than staging
    pytest.importorskip("torch")
    for rank, result in enumerate(spawn(2, _torch_default_threshold, timeout_s=120, env={CROSS_MEMORY_ENV: "auto"})):
        assert result["exact"], rank
        in_place = result["cross_memory_available"] and TRANSPARENT_HUGEPAGES == "always"
        assert result["executes_cross_memory" if in_place else "executes_staged"] == 1, rank


# ----------------------------------------------------------------------------------------------- buffers used again
def _huge_bytes_in(address: int, nbytes: int) -> int:
    """AnonHugePages (bytes) of this process's mappings that overlap ``[address, address + nbytes)``."""
    total, overlaps = 0, False
    with open("/proc/self/smaps", encoding="ascii") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                overlaps = lo < address + nbytes and address < hi
            elif overlaps and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def _foreign_buffer(nbytes: int) -> np.ndarray:
    """Memory numpy did not allocate (a bytearray's: 4 KiB pages), filled with a pattern."""
    array = np.frombuffer(bytearray(nbytes), np.uint32)
    array[...] = np.arange(array.size, dtype=np.uint32)
    return array


def _collapsing_memo() -> HugePageMemo:
    memo = HugePageMemo(enabled=True)
    if not memo.enabled:
        pytest.skip("transparent huge pages are off on this kernel ('never')")
    return memo


def test_a_buffer_used_again_is_moved_onto_huge_pages_with_its_contents_unchanged() -> None:
    memo = _collapsing_memo()
    buffer = _foreign_buffer(COLLAPSE_MIN_BYTES)
    assert not memo.in_place(buffer)  # first use: staged, nothing asked of the kernel
    in_place = memo.in_place(buffer)
    if memo.refused:
        pytest.skip(f"the kernel refused MADV_COLLAPSE (errno {memo.last_errno}; it needs Linux 6.1)")
    assert in_place
    assert memo.collapsed == 1
    assert _huge_bytes_in(int(buffer.ctypes.data), buffer.nbytes) >= COLLAPSE_MIN_BYTES - 2 * HUGE_PAGE_BYTES
    assert (buffer == np.arange(buffer.size, dtype=np.uint32)).all()


def test_a_collapsed_buffer_stays_read_in_place_without_asking_the_kernel_again() -> None:
    memo = _collapsing_memo()
    buffer = _foreign_buffer(COLLAPSE_MIN_BYTES)
    first = [memo.in_place(buffer) for _ in range(2)]
    if memo.refused:
        pytest.skip(f"the kernel refused MADV_COLLAPSE (errno {memo.last_errno}; it needs Linux 6.1)")
    assert first == [False, True]
    assert [memo.in_place(buffer) for _ in range(3)] == [True, True, True]
    assert memo.collapsed == 1


def test_fresh_buffers_each_call_are_never_collapsed() -> None:
    memo = _collapsing_memo()
    buffers = [_foreign_buffer(COLLAPSE_MIN_BYTES) for _ in range(3)]  # all alive: three addresses
    assert [memo.in_place(b) for b in buffers] == [False, False, False]
    assert memo.collapsed == 0
    assert memo.refused == 0


def test_a_buffer_below_the_collapse_size_is_never_collapsed() -> None:
    memo = _collapsing_memo()
    buffer = _foreign_buffer(COLLAPSE_MIN_BYTES - 4)
    assert [memo.in_place(buffer) for _ in range(3)] == [False, False, False]
    assert memo.collapsed == 0


def test_an_unreadable_collapse_setting_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COLLAPSE_ENV, "yes")
    with pytest.raises(ValueError, match=f"{COLLAPSE_ENV}: 'yes' is not 0 or 1"):
        ShmTransport(0, 1, f"collapse-{uuid.uuid4().hex}", timeout_s=30)


def _torch_used_again(group: Any, calls: int) -> dict[str, Any]:
    import torch

    x = torch.full((COLLAPSE_MIN_BYTES // 4,), group.rank + 1.0, dtype=torch.float32)
    exact = True
    for _ in range(calls):
        x.fill_(group.rank + 1.0)
        group.all_reduce(x, algorithm="ring")
        exact = exact and bool((x == _sum_of_ranks(group.world_size)).all())
    return {"exact": exact, **group.transport.statistics()}


@pytest.mark.slow
def test_a_torch_tensor_used_again_is_read_in_place_under_ptracer() -> None:
    pytest.importorskip("torch")
    if TRANSPARENT_HUGEPAGES == "never":
        pytest.skip("transparent huge pages are off on this kernel ('never')")
    env = {CROSS_MEMORY_ENV: "ptracer", ADOPT_ENV: "0"}  # adopted, it would be read from shared memory instead
    results = spawn(2, _torch_used_again, 3, timeout_s=180, env=env)
    for rank, result in enumerate(results):
        assert result["exact"], rank
        if result["huge_page_refusals"]:
            pytest.skip("the kernel refused MADV_COLLAPSE (it needs Linux 6.1)")
        assert (result["executes_staged"], result["executes_cross_memory"], result["huge_page_collapses"]) == (
            1,
            2,
            1,
        ), rank


@pytest.mark.slow
def test_a_torch_tensor_used_again_stays_staged_with_collapsing_off() -> None:
    pytest.importorskip("torch")
    env = {CROSS_MEMORY_ENV: "ptracer", COLLAPSE_ENV: "0", ADOPT_ENV: "0"}
    for rank, result in enumerate(spawn(2, _torch_used_again, 2, timeout_s=180, env=env)):
        assert result["exact"], rank
        assert (result["executes_staged"], result["huge_page_collapses"]) == (2, 0), rank
