"""Adoption: a large buffer used again moves onto a shared segment at its own address (real pages, real forks,
real rank processes). What must hold: contents and address never change, only whole private allocations are
taken, a buffer replaced at the same address is noticed, fork() and close() keep private-memory semantics."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from allreduce.runtime.launcher._spawn import spawn
from allreduce.runtime.shm import ADOPT_ENV, ADOPT_MIN_BYTES, CROSS_MEMORY_ENV, ShmTransport
from allreduce.runtime.shm._adopt import (
    SUPPORTED,
    Adopted,
    Adoptions,
    _privatize,
    mapped_to,
    pages_of_its_own,
    private_anonymous,
    whole_allocation,
)
from allreduce.runtime.shm._segments import SHM_DIR, LocalSegments, shm_prefix

pytestmark = pytest.mark.skipif(not SUPPORTED, reason="the C library has no mmap/mremap through ctypes")

ELEMENTS = (32 << 20) // 4 + 1_001
"""float32 elements of a large buffer (not a whole number of pages): mapped alone in a fresh process, from the heap
where the heap's free top was larger (adopted either way)."""

HEAP_ELEMENTS = 2 * ADOPT_MIN_BYTES // 4 + 1_001
"""float32 elements of a buffer the C library puts on its heap once its mmap threshold has climbed."""


@pytest.fixture
def adoptions() -> Iterator[tuple[Adoptions, LocalSegments]]:
    segments = LocalSegments(os.path.join(SHM_DIR, shm_prefix(f"adopt-{uuid.uuid4().hex[:12]}")), 0)
    adopt = Adoptions(segments.new_segment, enabled=True)
    yield adopt, segments
    adopt.release()
    segments.release()


def _pattern(n: int = ELEMENTS) -> np.ndarray:
    return np.arange(n, dtype=np.float32) % 1021


def _pages(x: np.ndarray) -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    start = x.ctypes.data // page * page
    return start, -(-(x.ctypes.data + x.nbytes) // page) * page


def _file_of(adopt: Adoptions, x: np.ndarray) -> str:
    state = adopt._seen[(x.ctypes.data, x.nbytes)]
    return str(state.path)  # type: ignore[union-attr]


def _heap_pattern() -> np.ndarray:
    """A buffer on the C library's heap, as a program that has freed a large array gets one: freeing a mapped
    chunk raises glibc's mmap threshold to its size, so the next 2 MiB come from the heap."""
    freed = np.ones(16 << 20, np.uint8)
    del freed
    x = _pattern(HEAP_ELEMENTS)
    if pages_of_its_own(int(x.ctypes.data), x.nbytes):
        pytest.skip("the C library mapped this 2 MiB array alone (not glibc, or its threshold did not move)")
    return x


def _heap_adopted(adopt: Adoptions) -> tuple[np.ndarray, Adopted]:
    x = _heap_pattern()
    adopt.home(x)
    home = adopt.home(x)
    assert home is not None
    return x, home


def _adopted(adopt: Adoptions) -> tuple[np.ndarray, str]:
    """A fresh buffer used twice (adopted on the second use), and its segment file."""
    x = _pattern()
    adopt.home(x)
    adopt.home(x)
    return x, _file_of(adopt, x)


# ------------------------------------------------------------------------------------------------ what is adopted
def test_a_buffer_is_adopted_on_its_second_use_with_address_and_contents_unchanged(adoptions: Any) -> None:
    adopt, _ = adoptions
    x = _pattern()
    address = x.ctypes.data
    assert adopt.home(x) is None
    home = adopt.home(x)
    assert home is not None
    assert x.ctypes.data == address
    assert np.array_equal(x, _pattern())
    start, _ = _pages(x)
    assert mapped_to(home.moved, home.moved + home.moved_length, _file_of(adopt, x))
    assert home.offset == address - start


def test_the_peers_see_the_buffers_writes_through_the_file(adoptions: Any) -> None:
    adopt, _ = adoptions
    x = _pattern()
    adopt.home(x)
    home = adopt.home(x)
    assert home is not None
    offset = home.offset
    middle = x.size // 2  # on a moved page, wherever the buffer came from
    x[middle] = 12345.0
    with open(_file_of(adopt, x), "rb") as f:
        f.seek(offset + middle * 4)
        assert np.frombuffer(f.read(4), np.float32)[0] == 12345.0


def test_a_buffer_below_the_adoption_size_is_never_adopted(adoptions: Any) -> None:
    adopt, _ = adoptions
    x = _pattern(ADOPT_MIN_BYTES // 4 - 1)
    assert adopt.home(x) is None
    assert adopt.home(x) is None
    assert adopt.adopted == 0


def test_a_view_into_a_larger_array_is_never_adopted(adoptions: Any) -> None:
    adopt, _ = adoptions
    whole = _pattern(ELEMENTS + 4096)
    view = whole[1024 : 1024 + ELEMENTS]
    assert not whole_allocation(view)
    adopt.home(view)
    assert adopt.home(view) is None
    assert adopt.refused == 1
    assert private_anonymous(*_pages(view))


def test_an_array_over_a_files_mapping_is_never_adopted(adoptions: Any, tmp_path: Any) -> None:
    adopt, _ = adoptions
    mapped = np.memmap(tmp_path / "data", dtype=np.float32, mode="w+", shape=(ELEMENTS,))
    flat = np.asarray(mapped).reshape(-1)
    adopt.home(flat)
    assert adopt.home(flat) is None
    assert not private_anonymous(*_pages(flat))


def test_a_torch_tensors_whole_storage_is_a_whole_allocation_and_a_slice_of_it_is_not() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(ELEMENTS, dtype=torch.float32)
    assert whole_allocation(t.numpy().reshape(-1))
    assert not whole_allocation(t[4096:].numpy())


_FRESH_PROCESS_ADOPTION = """
import ctypes, os, sys, uuid
import numpy as np
from allreduce.runtime.shm._adopt import Adoptions, mapped_to, pages_of_its_own, private_anonymous
from allreduce.runtime.shm._segments import SHM_DIR, LocalSegments, shm_prefix
segments = LocalSegments(os.path.join(SHM_DIR, shm_prefix("adopt-" + uuid.uuid4().hex[:12])), 0)
adopt = Adoptions(segments.new_segment, enabled=True)
def adopted(x):
    adopt.home(x)
    return adopt.home(x)
def done(ok):
    adopt.release()
    segments.release()
    sys.exit(0 if ok else 1)
"""


def _in_a_fresh_process(script: str) -> None:
    """Run ``script`` after :data:`_FRESH_PROCESS_ADOPTION` in a new interpreter, whose heap is small (so glibc
    maps large arrays alone unless told otherwise); exit 3 is a skip, with the script's stdout as the reason."""
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS_ADOPTION + script], capture_output=True, text=True, check=False
    )
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-2000:]


def test_a_torch_tensors_whole_storage_mapped_alone_is_adopted() -> None:
    pytest.importorskip("torch")
    _in_a_fresh_process("""
import torch
t = torch.arange((32 << 20) // 4 + 1001, dtype=torch.float32)
view = t.numpy().reshape(-1)
if not pages_of_its_own(int(view.ctypes.data), view.nbytes):
    print("the C library served this tensor from its heap even in a fresh process")
    sys.exit(3)
home = adopted(view)
done(home is not None and not home.edges and torch.equal(t, torch.arange(t.numel(), dtype=torch.float32)))
""")


def test_a_heap_buffer_moves_only_its_inner_pages_and_keeps_its_address_and_contents(adoptions: Any) -> None:
    adopt, _ = adoptions
    x = _heap_pattern()
    address = x.ctypes.data
    adopt.home(x)
    home = adopt.home(x)
    assert home is not None
    assert home.edges
    page = os.sysconf("SC_PAGE_SIZE")
    start, stop = _pages(x)
    inner = (-(-address // page) * page, (address + x.nbytes) // page * page)  # the whole pages inside it
    assert (home.moved, home.moved + home.moved_length) == inner
    assert mapped_to(home.moved, home.moved + home.moved_length, home.path)
    assert private_anonymous(start, home.moved)  # the end pages, shared with other allocations, stay put
    assert private_anonymous(home.moved + home.moved_length, stop)
    assert x.ctypes.data == address
    assert np.array_equal(x, _pattern(HEAP_ELEMENTS))


def test_a_heap_buffers_ends_reach_the_file_through_its_work_view_and_come_back(adoptions: Any) -> None:
    adopt, _ = adoptions
    x, home = _heap_adopted(adopt)
    view = home.work_view(x)
    with open(home.path, "rb") as f:  # what a peer reads: the whole buffer, its ends included
        f.seek(home.offset)
        assert np.array_equal(np.frombuffer(f.read(x.nbytes), np.float32), x)
    view *= -1.0  # a collective's result, written where the collective works
    home.copy_ends_out(view, x)
    assert np.array_equal(x, -_pattern(HEAP_ELEMENTS))


def test_a_freed_heap_buffers_inner_pages_go_back_to_private_memory_before_it_is_freed(adoptions: Any) -> None:
    adopt, _ = adoptions
    x, home = _heap_adopted(adopt)
    moved = (home.moved, home.moved + home.moved_length)
    del x  # the weak reference's callback runs before numpy hands the memory back to the C library
    assert home.closed
    assert not mapped_to(*moved, home.path)
    assert not os.path.exists(home.path)


def test_a_32_mib_array_the_heap_served_moves_only_its_inner_pages() -> None:
    _in_a_fresh_process("""
if ctypes.CDLL(None).mallopt(-3, 64 << 20) != 1:  # M_MMAP_THRESHOLD: 32 MiB now comes from the heap
    print("this C library refused an mmap threshold of 64 MiB")
    sys.exit(3)
x = np.arange((32 << 20) // 4 + 1001, dtype=np.float32)
home = adopted(x)
start, stop = home.start, home.start + home.length
done(home.edges and mapped_to(home.moved, home.moved + home.moved_length, home.path)
     and private_anonymous(start, home.moved) and private_anonymous(home.moved + home.moved_length, stop)
     and np.array_equal(x, np.arange(x.size, dtype=np.float32)))
""")


def test_a_heap_buffer_not_owned_by_a_numpy_array_is_never_adopted(adoptions: Any) -> None:
    torch = pytest.importorskip("torch")
    adopt, _ = adoptions
    _heap_pattern()  # raises the C library's mmap threshold
    t = torch.arange(HEAP_ELEMENTS, dtype=torch.float32)
    x = t.numpy()
    if pages_of_its_own(int(x.ctypes.data), x.nbytes):
        pytest.skip("torch's allocator mapped this tensor alone")
    assert adopt.home(x) is None
    assert adopt.home(x) is None
    assert "heap" in adopt.last_error


def _chunk(prev_size: int, size_word: int, data_offset: int) -> tuple[Any, int]:
    """Three anonymous pages with a glibc-style chunk header written just before ``data_offset``."""
    import mmap

    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 3 * page)
    words = np.frombuffer(region, np.uint64)
    words[(data_offset - 16) // 8] = prev_size
    words[(data_offset - 8) // 8] = size_word
    return region, int(words.ctypes.data) + data_offset


def test_below_32_mib_a_buffer_counts_as_alone_only_if_its_chunk_header_says_the_c_library_mapped_it() -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    region, address = _chunk(0, 2 * page | 2, 16)  # malloc: the chunk starts the mapping, data 16 bytes in
    assert pages_of_its_own(address, 2 * page - 16)
    assert not pages_of_its_own(address, 2 * page)  # past the chunk's pages
    region, address = _chunk(0, 2 * page, 16)  # the same without IS_MMAPPED: from the heap
    assert not pages_of_its_own(address, 2 * page - 16)
    region, address = _chunk(48, (2 * page - 48) | 2, 64)  # posix_memalign(64): 48 bytes of lead in the mapping
    assert pages_of_its_own(address, 2 * page - 64)
    region, address = _chunk(40, (2 * page - 48) | 2, 64)  # a lead that does not end at the mapping's start
    assert not pages_of_its_own(address, 2 * page - 64)
    region, address = _chunk(0, 2 * page | 2, page + 8)  # header on the page before the data: never read
    assert not pages_of_its_own(address, page)
    assert not pages_of_its_own(address, 32 << 20)  # nor at 32 MiB: the heap's top can serve that too
    del region


def test_an_unreadable_adoption_setting_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADOPT_ENV, "maybe")
    with pytest.raises(ValueError, match=f"{ADOPT_ENV}: 'maybe' is not 0 or 1"):
        ShmTransport(0, 1, f"adopt-{uuid.uuid4().hex}", timeout_s=30)


# ------------------------------------------------------------------------------------------- lifetime and semantics
def _replace_in_place(x: np.ndarray) -> None:
    """What a free and a new allocation at the same address leave: the same range on private pages."""
    start, stop = _pages(x)
    assert _privatize(start, stop - start) == 0


def test_a_buffer_replaced_at_the_same_address_is_noticed_and_left_where_it_is(adoptions: Any) -> None:
    adopt, _ = adoptions
    x = _pattern()
    adopt.home(x)
    assert adopt.home(x) is not None
    _replace_in_place(x)
    x[3] = -1.0
    assert adopt.home(x) is None
    assert adopt.refused == 1
    assert private_anonymous(*_pages(x))
    assert x[3] == -1.0
    assert np.array_equal(np.delete(x, 3), np.delete(_pattern(), 3))


def test_after_each_replacement_the_address_waits_twice_as_long_before_it_is_adopted_again(adoptions: Any) -> None:
    adopt, _ = adoptions
    x = _pattern()
    adopt.home(x)
    waits = []
    for _ in range(3):
        assert adopt.home(x) is not None
        _replace_in_place(x)
        assert adopt.home(x) is None  # noticed
        uses = 0
        while adopt.home(x) is None:
            uses += 1
        waits.append(uses)
    assert waits == [1, 2, 4]
    assert np.array_equal(x, _pattern())


def test_release_moves_the_buffer_back_to_private_pages_and_removes_the_file(adoptions: Any) -> None:
    adopt, _ = adoptions
    x, path = _adopted(adopt)
    adopt.release()
    assert private_anonymous(*_pages(x))
    assert not os.path.exists(path)
    assert np.array_equal(x, _pattern())


@pytest.mark.parametrize("where", ["alone", "heap"])
def test_a_forked_child_gets_a_private_copy_of_an_adopted_buffer(adoptions: Any, where: str) -> None:
    adopt, _ = adoptions
    x = _pattern() if where == "alone" else _heap_pattern()
    adopt.home(x)
    assert adopt.home(x) is not None
    x[0] = 1.0
    x[-1] = 2.0
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: sees the fork's moment, writes its own copy
        os.close(read)
        ok = x[0] == 1.0 and x[-1] == 2.0 and private_anonymous(*_pages(x))
        x[:] = -7.0
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    child_saw = os.read(read, 1)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child_saw == b"1"
    assert (x[0], x[-1]) == (1.0, 2.0)
    assert np.array_equal(x[1:-1], _pattern(x.size)[1:-1])
    assert adopt.home(x) is not None  # still adopted in the parent


# ------------------------------------------------------------------------------------------------- real rank groups
def _used_again(group: Any, calls: int) -> dict[str, Any]:
    x = np.empty(ELEMENTS, np.float32)
    exact = True
    for call in range(calls):
        x[:] = _pattern() * (group.rank + 1) + call
        group.all_reduce(x)
        n = group.world_size
        exact = exact and bool(np.array_equal(x, _pattern() * (n * (n + 1) // 2) + n * call))
    return {"exact": exact, **group.transport.statistics()}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_plain_array_used_again_is_adopted_and_reduced_exactly(world_size: int) -> None:
    for rank, result in enumerate(spawn(world_size, _used_again, 3, timeout_s=180)):
        assert result["exact"], rank
        assert (result["buffers_adopted"], result["executes_adopted"]) == (1, 2), rank


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ptracer", "off"])
def test_adoption_needs_no_permission_to_read_peers_memory(mode: str) -> None:
    for rank, result in enumerate(spawn(3, _used_again, 3, timeout_s=180, env={CROSS_MEMORY_ENV: mode})):
        assert result["exact"], rank
        assert result["executes_adopted"] == 2, rank


@pytest.mark.slow
def test_adoption_off_in_the_environment_leaves_buffers_where_they_are() -> None:
    for rank, result in enumerate(spawn(2, _used_again, 3, timeout_s=180, env={ADOPT_ENV: "0"})):
        assert result["exact"], rank
        assert (result["buffers_adopted"], result["executes_adopted"]) == (0, 0), rank


def test_a_freed_buffers_file_is_removed_when_the_next_buffer_is_adopted(adoptions: Any) -> None:
    adopt, _ = adoptions
    x, path = _adopted(adopt)
    start, stop = _pages(x)
    del x  # numpy frees it: the C library unmaps the pages (an allocation this large is a mapping of its own)
    if mapped_to(start, stop, path):
        pytest.skip("the allocator kept the freed pages mapped")
    y = _pattern(ELEMENTS + 4096)
    adopt.home(y)
    assert adopt.home(y) is not None
    assert not os.path.exists(path)


def _fresh_each_call(group: Any, calls: int, elements: int = ELEMENTS) -> dict[str, Any]:
    """A new array every call: the allocator tends to put it where the last one was, so adopted pages go stale
    (at ``HEAP_ELEMENTS``, after a freed 16 MiB array, on the heap: each dies and its pages go back first)."""
    if elements == HEAP_ELEMENTS:
        freed = np.ones(16 << 20, np.uint8)
        del freed
    exact = True
    n = group.world_size
    for call in range(calls):
        x = np.full(elements, group.rank + 1.0 + call, np.float32)
        group.all_reduce(x)
        exact = exact and bool((x == n * (n + 1) / 2 + n * call).all())
        del x
    return {"exact": exact, **group.transport.statistics()}


@pytest.mark.slow
def test_a_fresh_array_every_call_is_reduced_exactly_whatever_was_adopted_at_its_address() -> None:
    results = spawn(3, _fresh_each_call, 8, timeout_s=180)
    for rank, result in enumerate(results):
        assert result["exact"], rank
    if not any(result["buffers_adopted"] for result in results):
        pytest.skip("the allocator never put two of these arrays at one address")
    assert all(result["adoption_refusals"] >= 1 for result in results if result["buffers_adopted"])


def _heap_used_again(group: Any, calls: int) -> dict[str, Any]:
    freed = np.ones(16 << 20, np.uint8)  # freeing a mapped array raises glibc's mmap threshold past 2 MiB
    del freed
    x = np.empty(HEAP_ELEMENTS, np.float32)
    alone = pages_of_its_own(int(x.ctypes.data), x.nbytes)
    exact = True
    n = group.world_size
    pattern = _pattern(HEAP_ELEMENTS)
    for call in range(calls):
        x[:] = pattern * (group.rank + 1) + call
        group.all_reduce(x)
        exact = exact and bool(np.array_equal(x, pattern * (n * (n + 1) // 2) + n * call))
    return {"exact": exact, "alone": alone, **group.transport.statistics()}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_heap_array_used_again_is_adopted_and_reduced_exactly_ends_included(world_size: int) -> None:
    for rank, result in enumerate(spawn(world_size, _heap_used_again, 3, timeout_s=180)):
        if result["alone"]:
            pytest.skip("the C library mapped this 2 MiB array alone")
        assert result["exact"], rank
        assert (result["buffers_adopted"], result["executes_adopted"]) == (1, 2), rank


@pytest.mark.slow
def test_a_fresh_heap_array_every_call_is_reduced_exactly() -> None:
    for rank, result in enumerate(spawn(3, _fresh_each_call, 8, HEAP_ELEMENTS, timeout_s=180)):
        assert result["exact"], rank


def _medium_used_again(group: Any, calls: int) -> dict[str, Any]:
    x = np.empty(2 * ADOPT_MIN_BYTES // 4, np.float32)
    alone = pages_of_its_own(int(x.ctypes.data), x.nbytes)
    exact = True
    n = group.world_size
    fuses = [group.transport.fuses(x)]
    for call in range(calls):
        x[:] = group.rank + 1.0 + call
        group.all_reduce(x)
        exact = exact and bool((x == n * (n + 1) / 2 + n * call).all())
        fuses.append(group.transport.fuses(x))
    return {"exact": exact, "alone": alone, "fuses": fuses, **group.transport.statistics()}


@pytest.mark.slow
def test_a_2_mib_array_the_c_library_mapped_alone_is_adopted_whole() -> None:
    for rank, result in enumerate(spawn(2, _medium_used_again, 3, timeout_s=180)):
        if not result["alone"]:
            pytest.skip("the C library put this 2 MiB array on its heap (its mmap threshold had moved)")
        assert result["exact"], rank
        assert result["executes_adopted"] == 2, rank


@pytest.mark.slow
def test_an_array_adopted_or_about_to_be_is_not_given_the_staged_arrays_fused_algorithm() -> None:
    # a staged array at N=2 takes an algorithm that moves and reduces in one pass through the staging copy; an
    # adopted one is read in place, where that algorithm would reduce through scratch
    for rank, result in enumerate(spawn(2, _medium_used_again, 3, timeout_s=180)):
        assert result["fuses"] == [True, False, False, False], rank
