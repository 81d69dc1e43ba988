"""The shared-memory transport in one process (a group of one): knobs, errors, closing. Groups of several
ranks run in tests/runtime/shm/test_collectives_shm.py."""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Iterator

import pytest

from allreduce.runtime import CollectiveError, Transport
from allreduce.runtime.shm import EAGER_BYTES, MAX_RANKS, SHM_DIR, ShmTransport, shm_prefix


@pytest.fixture
def solo() -> Iterator[ShmTransport]:
    transport = ShmTransport(0, 1, f"solo-{uuid.uuid4().hex}", timeout_s=30)
    yield transport
    transport.close()


def test_it_is_a_transport_named_shm(solo: ShmTransport) -> None:
    assert isinstance(solo, Transport)
    assert solo.name == "shm"


def test_more_ranks_than_the_control_block_holds_are_refused() -> None:
    with pytest.raises(ValueError, match=f"up to {MAX_RANKS} ranks"):
        ShmTransport(0, MAX_RANKS + 1, f"big-{uuid.uuid4().hex}", timeout_s=1)


@pytest.mark.parametrize("eager_bytes", [-1, EAGER_BYTES + 1])
def test_eager_bytes_outside_the_snapshot_area_are_refused(eager_bytes: int) -> None:
    with pytest.raises(ValueError, match="eager_bytes"):
        ShmTransport(0, 1, f"eager-{uuid.uuid4().hex}", timeout_s=1, eager_bytes=eager_bytes)


def test_a_negative_cross_memory_threshold_is_refused(solo: ShmTransport) -> None:
    with pytest.raises(ValueError, match="cross_memory_min_bytes"):
        solo.cross_memory_min_bytes = -1


def test_corruption_can_only_be_injected_towards_another_rank(solo: ShmTransport) -> None:
    with pytest.raises(ValueError, match="peer 0"):
        solo.inject_corruption(peer=0)


def test_statistics_start_at_zero_and_report_the_probe(solo: ShmTransport) -> None:
    stats = solo.statistics()
    assert {k: v for k, v in stats.items() if k.startswith("executes_")} == {
        "executes_eager": 0,
        "executes_shared": 0,
        "executes_adopted": 0,
        "executes_cross_memory": 0,
        "executes_staged": 0,
    }
    assert stats["cross_memory_available"] in (0, 1)


def test_cross_memory_stays_off_when_the_probe_did_not_allow_it() -> None:
    transport = ShmTransport(0, 1, f"nocma-{uuid.uuid4().hex}", timeout_s=30, cross_memory=False)
    try:
        transport.cross_memory = True
        assert not transport.cross_memory
        assert transport.statistics()["cross_memory_available"] == 0
    finally:
        transport.close()


def test_allocated_memory_is_zeroed_and_writable(solo: ShmTransport) -> None:
    raw = solo.allocate(4096)
    assert raw.nbytes == 4096
    assert not raw.any()
    raw[:] = 7
    assert int(raw.sum()) == 7 * 4096


def test_a_closed_transport_raises_a_collective_error(solo: ShmTransport) -> None:
    solo.close()
    with pytest.raises(CollectiveError, match="closed"):
        solo.agree(0, b"x", timeout_s=1)
    with pytest.raises(CollectiveError, match="closed"):
        solo.allocate(16)
    solo.close()  # idempotent


def test_a_transport_dropped_unclosed_removes_its_files_at_once() -> None:
    # its parts hold nothing that refers back to it, so no reference cycle waits for the collector
    job = f"dropped-{uuid.uuid4().hex}"
    transport = ShmTransport(0, 1, job, timeout_s=30)
    transport.allocate(4096)
    collecting = gc.isenabled()
    gc.disable()
    try:
        del transport
        assert [name for name in os.listdir(SHM_DIR) if shm_prefix(job) in name] == []
    finally:
        if collecting:
            gc.enable()
