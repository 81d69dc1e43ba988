"""The control block's declared layout: word indices derived from it, areas that never overlap."""

from __future__ import annotations

import ctypes

import pytest

from allreduce.runtime.shm import _layout as layout


def test_every_counter_is_an_aligned_word_of_the_declared_header() -> None:
    for name, _ in layout.ControlHeader._fields_:
        field = getattr(layout.ControlHeader, name)
        assert field.offset % 8 == 0, name
    assert layout.ControlHeader.progress.offset == layout.PROGRESS_WORD * 8
    assert layout.ControlHeader.read_done.offset == layout.READ_DONE_WORD * 8
    assert layout.ControlHeader.sleepers.offset == layout.SLEEPERS_WORD * 8


def test_words_written_through_the_word_view_read_back_through_the_structure() -> None:
    raw = bytearray(ctypes.sizeof(layout.ControlHeader))
    words = memoryview(raw).cast("q")
    words[layout.PROGRESS_WORD] = layout.stamp(7, 3)
    words[layout.ABORTED_WORD] = 4
    words[layout.SLEEPERS_WORD + layout.MAX_RANKS - 1] = 1
    words[layout.descriptor_word(1) + 1] = 5
    payload = layout.descriptor_payload_offset(1)
    raw[payload : payload + 5] = b"hello"
    words.release()
    header = layout.ControlHeader.from_buffer(raw)
    assert header.progress == 7 << layout.STEP_BITS | 3
    assert header.aborted == 4
    assert header.sleepers[layout.MAX_RANKS - 1] == 1
    assert header.descriptors[1].length == 5
    assert header.descriptors[1].payload == b"hello"
    del header


@pytest.mark.parametrize("world_size", [1, 2, 7, layout.MAX_RANKS])
def test_the_group_sized_areas_follow_the_header_without_overlap(world_size: int) -> None:
    control = layout.ControlLayout(world_size)
    assert control.crc_offset >= ctypes.sizeof(layout.ControlHeader)
    assert control.eager_offset >= control.crc_offset + 4 * world_size * layout.CRC_SLOTS_PER_PEER
    assert control.eager_offset % layout.PAGE_BYTES == 0
    assert control.eager_area_offset(0) + layout.EAGER_BYTES == control.eager_area_offset(1)
    assert control.size_bytes == control.eager_area_offset(1) + layout.EAGER_BYTES


def test_a_finished_collective_orders_after_every_step_and_before_the_next_collective() -> None:
    assert layout.stamp(3, layout.DONE_STEP) > layout.stamp(3, 10_000)
    assert layout.stamp(3, layout.DONE_STEP) < layout.stamp(4, 0)
