"""Start-up alone: :class:`ControlBlocks` of ranks that meet in one process (a thread each, real /dev/shm blocks),
a rank whose peer never comes, and the ptracer slot a process has once."""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest
from shm_parts import BuildFn, MeetFn

from allreduce.runtime import CollectiveTimeoutError
from allreduce.runtime.shm._layout import (
    ATTACHED_WORD,
    MAGIC,
    MAGIC_WORD,
    PID_WORD,
    PTRACER_WORD,
    READ_DONE_WORD,
    ControlLayout,
)
from allreduce.runtime.shm._ptracer import Ptracer
from allreduce.runtime.shm._rendezvous import ControlBlocks
from allreduce.runtime.shm._segments import SHM_DIR, Segment, shm_prefix


def _job_files(prefix: str) -> list[str]:
    stem = os.path.basename(prefix)
    return [name for name in os.listdir(SHM_DIR) if name.startswith(stem + "-")]


def test_every_rank_maps_every_block_and_sees_its_peers_words(meet: MeetFn) -> None:
    blocks = meet(3)
    for b in blocks:
        assert len(b.views) == len(b.segments) == len(b.addresses) == len(b.crcs) == 3
        assert [int(v[MAGIC_WORD]) for v in b.views] == [MAGIC] * 3
        assert [int(v[ATTACHED_WORD]) for v in b.views] == [1] * 3
        assert b.peer_pids == [os.getpid()] * 3
        assert len(b.pidfds) == 2
    blocks[2].views[2][PID_WORD] = 12345  # a write to rank 2's block is what every rank reads there
    assert [int(b.views[2][PID_WORD]) for b in blocks] == [12345] * 3


def test_the_crc_areas_are_the_peers_blocks(meet: MeetFn) -> None:
    zero, one = meet(2)
    one.crcs[1][7] = 0xDEADBEEF
    assert zero.crcs[1].dtype == np.uint32
    assert int(zero.crcs[1][7]) == 0xDEADBEEF


def test_the_control_files_are_gone_once_every_rank_mapped_them(meet: MeetFn) -> None:
    blocks = meet(2)
    assert _job_files(blocks[0].prefix) == []


def test_a_peer_that_never_comes_is_named_when_the_rendezvous_times_out() -> None:
    prefix = os.path.join(SHM_DIR, shm_prefix(f"alone-{uuid.uuid4().hex[:12]}"))
    with pytest.raises(
        CollectiveTimeoutError, match=r"rendezvous timed out after 0.2 s waiting for rank\(s\) 1 to join"
    ) as caught:
        ControlBlocks(prefix, 0, 2, timeout_s=0.2, cross_memory_mode="off")
    assert caught.value.peer == 1
    assert _job_files(prefix) == []  # the rank that gave up removed its own block


def test_a_block_that_is_not_initialised_yet_is_not_joined() -> None:
    prefix = os.path.join(SHM_DIR, shm_prefix(f"early-{uuid.uuid4().hex[:12]}"))
    early = Segment(f"{prefix}-ctl-1", ControlLayout(2).size_bytes, create=True)  # created, its magic not written
    try:
        with pytest.raises(CollectiveTimeoutError, match="rank"):
            ControlBlocks(prefix, 0, 2, timeout_s=0.2, cross_memory_mode="off")
    finally:
        early.unlink()
        early.close()


def test_release_unmaps_and_is_idempotent(meet: MeetFn) -> None:
    zero, one = meet(2)
    zero.release()
    zero.release()
    assert (zero.views, zero.segments, zero.pidfds, zero.crcs) == ([], [], [], [])
    assert int(one.views[0][MAGIC_WORD]) == MAGIC  # the peer's own mapping of the block lives on


def test_mode_open_finds_reads_open_within_one_process(meet: MeetFn) -> None:
    zero, one = meet(2, "open")
    # both ranks are this process, which may always read its own memory
    assert zero.cross_memory_available
    assert one.cross_memory_available
    assert not zero.ptracer.in_force


def test_mode_off_probes_nothing(meet: MeetFn) -> None:
    assert [b.cross_memory_available for b in meet(2, "off")] == [False, False]


def test_a_process_has_one_ptracer_slot() -> None:
    own = np.zeros(64, np.int64)
    first, second = Ptracer(memoryview(own)), Ptracer(memoryview(own))
    try:
        assert first.claim()
        assert not second.claim()
        first.release()
        assert second.claim()
    finally:
        first.release()
        second.release()


def test_naming_a_reader_publishes_it_and_release_names_none() -> None:
    own = np.zeros(64, np.int64)
    ptracer = Ptracer(memoryview(own))
    assert ptracer.claim()  # so that release() lifts what name() set on this process
    ptracer.name(1, os.getpid())
    assert (ptracer.tracer, int(own[PTRACER_WORD])) == (1, 1)
    ptracer.release()
    assert (ptracer.tracer, int(own[PTRACER_WORD])) == (-1, -1)


def test_a_new_reader_is_admitted_once_the_one_before_has_read_what_it_was_admitted_for(
    meet: MeetFn, build: BuildFn
) -> None:
    zero, one, _ = meet(3)
    waiting = build(zero).waiting
    ptracer = zero.ptracer
    assert ptracer.claim()
    try:
        ptracer.admit(1, os.getpid(), 5, waiting.wait, deadline=time.monotonic() + 30, seq=0, step=0)
        ptracer.admit(1, os.getpid(), 6, waiting.wait, deadline=time.monotonic(), seq=0, step=1)  # the same: no wait
        with pytest.raises(CollectiveTimeoutError, match="before the next reader is admitted") as caught:
            ptracer.admit(2, os.getpid(), 7, waiting.wait, deadline=time.monotonic() + 0.05, seq=0, step=2)
        assert caught.value.peer == 1
        assert ptracer.tracer == 1  # not switched while rank 1 may still be reading
        one.views[1][READ_DONE_WORD] = 6
        ptracer.admit(2, os.getpid(), 7, waiting.wait, deadline=time.monotonic() + 30, seq=0, step=2)
        assert (ptracer.tracer, ptracer.switches, int(zero.views[0][PTRACER_WORD])) == (2, 2, 2)
    finally:
        ptracer.release()
