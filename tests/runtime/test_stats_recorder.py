"""The recorder's step API: two clock reads per one-receive step, records equal to what the old API would write.

The clock is real (``time.perf_counter_ns``); the tests bracket each event with their own clock reads, so every
derived wait and transfer is checked against bounds, never against a wall-clock expectation.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from allreduce.runtime._stats import TRANSFER_CAPACITY, Recorder

SEQ, STEP, PEER, START, WAIT, MOVE, SIZE = range(7)  # the fields of a transfer record


def _records(recorder: Recorder) -> np.ndarray:
    return recorder.transfers(0)


def test_a_one_receive_step_is_recorded_when_the_next_step_begins() -> None:
    recorder = Recorder(enabled=True)
    before_step = time.perf_counter_ns()
    recorder.step(3, 0)
    between = time.perf_counter_ns()
    recorder.arrived(1, 4096)
    assert len(_records(recorder)) == 0  # still open: the move is not over
    after_arrival = time.perf_counter_ns()
    recorder.step(3, 1)
    after_next_step = time.perf_counter_ns()
    (record,) = _records(recorder)
    assert tuple(record[[SEQ, STEP, PEER, SIZE]]) == (3, 0, 1, 4096)
    assert before_step <= record[START] <= between
    assert 0 <= record[WAIT] <= after_arrival - before_step
    assert 0 <= record[MOVE] <= after_next_step - between


def test_wait_and_move_add_up_to_the_time_between_the_step_and_the_close() -> None:
    recorder = Recorder(enabled=True)
    recorder.call_begin()
    recorder.step(0, 0)
    recorder.arrived(1, 8)
    recorder.call_end(0, 8)
    (record,) = _records(recorder)
    (call,) = recorder.calls(1)
    # the receive closes at the call's end: start + wait + move is exactly that clock read
    assert record[START] + record[WAIT] + record[MOVE] == call[2]


def test_moved_separates_the_receives_of_one_step() -> None:
    recorder = Recorder(enabled=True)
    recorder.step(5, 2)
    recorder.arrived(1, 100)
    t0 = time.perf_counter_ns()
    recorder.moved()
    t1 = time.perf_counter_ns()
    recorder.arrived(3, 300)
    t2 = time.perf_counter_ns()
    recorder.moved()
    first, second = _records(recorder)
    assert (first[PEER], first[SIZE], second[PEER], second[SIZE]) == (1, 100, 3, 300)
    assert first[START] == second[START]
    first_closed = first[START] + first[WAIT] + first[MOVE]
    assert t0 <= first_closed <= t1
    # the second wait starts where the first move ended: nothing counted twice, nothing lost
    assert t1 <= first_closed + second[WAIT] <= t2


def test_call_begin_drops_a_receive_left_open_by_a_failed_collective() -> None:
    recorder = Recorder(enabled=True)
    recorder.call_begin()
    recorder.step(0, 0)
    recorder.arrived(1, 8)  # the collective fails here: no step and no call_end follow
    recorder.call_begin()
    recorder.step(1, 0)
    recorder.arrived(2, 8)
    recorder.call_end(1, 8)
    (record,) = _records(recorder)
    assert (record[SEQ], record[PEER]) == (1, 2)


def test_the_ring_keeps_the_last_records_when_it_wraps() -> None:
    recorder = Recorder(enabled=True)
    total = TRANSFER_CAPACITY + 5
    for step in range(total):
        recorder.step(step, 0)
        recorder.arrived(1, 8)
    recorder.step(total, 0)
    records = _records(recorder)
    assert len(records) == TRANSFER_CAPACITY
    assert records[-1][SEQ] == total - 1
    assert records[0][SEQ] == total - TRANSFER_CAPACITY


def test_the_step_api_keeps_no_memory_per_step() -> None:
    recorder = Recorder(enabled=True)
    step, arrived = recorder.step, recorder.arrived
    for i in range(1000):  # warm up: every page of the rings this test touches, every cached int
        step(0, i)
        arrived(1, 8)
    blocks = sys.getallocatedblocks()
    for i in range(10_000):
        step(0, i)
        arrived(1, 8)
    assert sys.getallocatedblocks() - blocks < 10
