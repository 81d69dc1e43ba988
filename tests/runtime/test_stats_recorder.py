"""The recorder: marks written on the hot path, transfer records rebuilt from the call's layout when read.

The marks are written here exactly as the transports write them (a store into ``recorder.tsv``), with chosen
values, so every rebuilt wait and transfer is checked exactly; the transports' own marks are checked end to end
on real processes in ``test_stats.py``.
"""

from __future__ import annotations

import sys

import numpy as np

from allreduce.runtime._stats import CALL_CAPACITY, MARK_CAPACITY, MARK_MASK, Layout, Recorder

SEQ, STEP, PEER, START, WAIT, MOVE, SIZE = range(7)  # the fields of a transfer record


def _call(recorder: Recorder, seq: int, layout: Layout, marks: list[int], *, unit: int = 1, end: bool = True) -> None:
    """One collective as a transport runs it: call_begin, the layout, the marks, call_end (unless it failed)."""
    recorder.call_begin(marks[0] if marks else 0)
    recorder.layout, recorder.unit = layout, unit
    tsv, k = recorder.tsv, recorder.marks
    for value in marks:
        tsv[k & MARK_MASK] = value
        k += 1
    recorder.marks = k
    if end:
        recorder.call_end(seq, 8)


def test_a_one_receive_step_waits_from_its_start_and_moves_until_the_next_mark() -> None:
    recorder = Recorder(enabled=True)
    ring = Layout([(0, [(1, 16)]), (1, [(1, 16)])], concurrent=False)
    assert ring.marks == 4  # two clock reads per one-receive step
    _call(recorder, 7, ring, [100, 130, 200, 260], unit=4)
    first, second = recorder.transfers(0)
    assert tuple(first) == (7, 0, 1, 100, 30, 70, 64)  # waited 100 -> 130, moved until step 1 began at 200
    assert tuple(second[[SEQ, STEP, PEER, START, WAIT, SIZE]]) == (7, 1, 1, 200, 60, 64)
    (call,) = recorder.calls(1)
    assert second[MOVE] == call[2] - 260  # the last move ends at the call's end


def test_receives_of_one_step_wait_one_after_another() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(2, [(1, 100), (3, 300)])], concurrent=False)
    assert layout.marks == 4  # start, arrived 1, moved 1, arrived 3
    _call(recorder, 5, layout, [1000, 1010, 1050, 1090])
    first, second = recorder.transfers(0)
    assert tuple(first) == (5, 2, 1, 1000, 10, 40, 100)
    # the second wait starts where the first move ended: nothing counted twice, nothing lost
    assert tuple(second[[PEER, START, WAIT, SIZE]]) == (3, 1000, 40, 300)


def test_a_step_without_receives_takes_one_mark_and_records_nothing() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, []), (1, [(2, 8)])], concurrent=False)
    assert layout.marks == 3
    _call(recorder, 1, layout, [10, 20, 25])
    (record,) = recorder.transfers(0)
    assert tuple(record[[STEP, PEER, START, WAIT]]) == (1, 2, 20, 5)


def test_concurrent_receives_wait_from_the_step_start_to_each_first_byte() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 512), (2, 256)])], concurrent=True)
    assert layout.marks == 5  # start, (first, last) per peer
    _call(recorder, 3, layout, [0, 40, 90, 10, 70])
    first, second = recorder.transfers(0)
    assert tuple(first) == (3, 0, 1, 0, 40, 50, 512)
    assert tuple(second) == (3, 0, 2, 0, 10, 60, 256)


def test_a_failed_call_leaves_no_records_and_the_next_call_is_read_right() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 8)]), (1, [(1, 8)])], concurrent=False)
    _call(recorder, 0, layout, [1, 2], end=False)  # failed after two of its four marks
    _call(recorder, 1, layout, [10, 11, 20, 22])
    records = recorder.transfers(0)
    assert list(records[:, SEQ]) == [1, 1]
    assert list(records[:, WAIT]) == [1, 2]
    assert len(recorder.calls(10)) == 1


def test_a_call_that_wrote_fewer_marks_than_its_layout_is_not_read() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 8)]), (1, [(1, 8)])], concurrent=False)
    _call(recorder, 0, layout, [1, 2, 3])  # a transport bug: one mark short
    assert len(recorder.transfers(0)) == 0
    assert len(recorder.calls(1)) == 1  # the call itself is still counted


def test_calls_whose_marks_the_ring_overwrote_are_dropped_and_the_rest_kept() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 8)])], concurrent=False)  # two marks per call
    calls = MARK_CAPACITY // 2 + 3
    for seq in range(calls):
        _call(recorder, seq, layout, [10 * seq, 10 * seq + 1])
    records = recorder.transfers(0)
    kept = min(MARK_CAPACITY // 2, CALL_CAPACITY)
    assert len(records) == kept
    assert records[-1][SEQ] == calls - 1
    assert np.all(records[:, WAIT] == 1)


def test_whole_records_and_rebuilt_ones_come_out_by_seq_then_step() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 8)])], concurrent=False)
    recorder.transfer(2, 0, 3, 0, 1, 1, 8)
    _call(recorder, 1, layout, [5, 6])
    recorder.transfer(0, 1, 3, 0, 1, 1, 8)
    records = recorder.transfers(0)
    assert [(int(r[SEQ]), int(r[STEP])) for r in records] == [(0, 1), (1, 0), (2, 0)]


def test_transfers_from_a_seq_on_leave_out_the_earlier_calls() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 8)])], concurrent=False)
    for seq in range(5):
        _call(recorder, seq, layout, [seq, seq + 1])
    assert list(recorder.transfers(3)[:, SEQ]) == [3, 4]


def test_the_hot_path_keeps_no_memory_per_call() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 8)]), (1, [(1, 8)])], concurrent=False)
    marks = [1, 2, 3, 4]
    for seq in range(2000):  # warm up: every page of the rings this test touches, every cached int
        _call(recorder, seq, layout, marks)
    blocks = sys.getallocatedblocks()
    for seq in range(2000, 12_000):
        _call(recorder, seq, layout, marks)
    assert sys.getallocatedblocks() - blocks < 10
