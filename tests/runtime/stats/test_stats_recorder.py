"""The recorder's stream: what the group and the transports write on the hot path, and the call and transfer
records rebuilt from it with the call's layout when read.

The stream is written here exactly as the transports write it (``recorder.append``), with chosen clock
values, so every rebuilt wait and transfer is checked exactly; the group's and the transports' own writes are
checked end to end on real processes in ``test_stats.py``.
"""

from __future__ import annotations

import gc
import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.runtime.stats._stats import CALL_CAPACITY, MARK_CAPACITY, SPILL_ENTRIES, TAG_BASE, VOID, Layout, Recorder

SEQ, STEP, PEER, START, WAIT, MOVE, SIZE = range(7)  # the fields of a transfer record


def _call(
    recorder: Recorder,
    seq: int,
    layout: Layout | None,
    marks: list[int],
    *,
    unit: int = 1,
    end: int | None = None,
    commit: bool = True,
) -> None:
    """One collective as the group and a transport run it: the header (its size ``unit`` x the layout's count, 8
    bytes without a layout), the tag and the marks (with a layout), then the end, or VOID if it failed. The
    arrival is the first mark's clock (0 without marks); the end defaults to the last mark + 100."""
    recorder.begin(seq, marks[0] if marks else 0, unit * layout.count if layout is not None else 8)
    if layout is not None:
        recorder.append(layout.tag)
        for value in marks:
            recorder.append(value)
    if commit:
        recorder.end((marks[-1] if marks else 0) + 100 if end is None else end)
    else:
        recorder.void()


def test_a_one_receive_step_waits_from_its_start_and_moves_until_the_next_mark() -> None:
    recorder = Recorder(enabled=True)
    ring = Layout([(0, [(1, 16)]), (1, [(1, 16)])], concurrent=False)
    assert ring.marks == 5  # a clock and a wait per one-receive step, and a clock where the steps end
    _call(recorder, 7, ring, [100, 30, 200, 60, 280], unit=4, end=300)  # (clock, wait) per receive
    first, second = recorder.transfers(0)
    assert tuple(first) == (7, 0, 1, 100, 30, 70, 64)  # waited 100 -> 130, moved until step 1 began at 200
    # the last move ends where the steps end (280), not at the call's end (300: after the final waits)
    assert tuple(second) == (7, 1, 1, 200, 60, 20, 64)


def test_receives_of_one_step_wait_one_after_another() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(2, [(1, 100), (3, 300)])], concurrent=False)
    assert layout.marks == 5  # waiting for 1, its wait, waiting for 3 (= moved 1), its wait, the steps' end
    _call(recorder, 5, layout, [1000, 10, 1050, 40, 1100])
    first, second = recorder.transfers(0)
    assert tuple(first) == (5, 2, 1, 1000, 10, 40, 100)
    # the second wait starts where the first move ended: nothing counted twice, nothing lost
    assert tuple(second[[PEER, START, WAIT, SIZE]]) == (3, 1000, 40, 300)


def test_receives_that_marked_no_clock_share_their_leaders_move_by_units() -> None:
    recorder = Recorder(enabled=True)
    ring = Layout([(0, [(1, 10)]), (1, [(1, 30)]), (2, [(1, 20)])], concurrent=False)
    # step 0 read the clock (1000) and waited 20; steps 1 and 2 found their data there and marked (0, 0);
    # the steps ended at 1420: 400 ns of moves from the arrival at 1020, shared 10:30:20
    _call(recorder, 1, ring, [1000, 20, 0, 0, 0, 0, 1420], end=1500)
    records = recorder.transfers(0)
    assert list(records[:, WAIT]) == [20, 0, 0]
    assert list(records[:, MOVE]) == [66, 200, 133]  # 400 x 10/60, 30/60, 20/60 (floored)
    assert list(records[:, START]) == [1000, 1086, 1286]  # where each share of the group's move begins


def test_a_receive_that_waited_without_a_clock_before_it_leads_a_group_of_its_own() -> None:
    recorder = Recorder(enabled=True)
    ring = Layout([(0, [(1, 8)]), (1, [(1, 8)]), (2, [(1, 8)])], concurrent=False)
    # step 1 had to wait: it marks when its wait began (2000, read while waiting) and how long (50)
    _call(recorder, 1, ring, [1000, 0, 2000, 50, 0, 0, 2250])
    records = recorder.transfers(0)
    assert list(records[:, WAIT]) == [0, 50, 0]
    assert list(records[:, MOVE]) == [1000, 100, 100]  # step 0 moved until step 1 began; 1 and 2 share 2050-2250
    assert list(records[:, START]) == [1000, 2000, 2150]


def test_a_step_without_receives_takes_one_mark_and_records_nothing() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, []), (1, [(2, 8)])], concurrent=False)
    assert layout.marks == 4
    _call(recorder, 1, layout, [10, 20, 5, 30])
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


def test_a_concurrent_first_byte_marked_zero_was_there_at_the_step_start() -> None:
    """tcp reads no clock for data it did not wait for: no wait, the move runs from the step's start."""
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 512), (2, 256)])], concurrent=True)
    _call(recorder, 1, layout, [1000, 0, 1090, 1030, 1070])
    first, second = recorder.transfers(0)
    assert (first[WAIT], first[MOVE]) == (0, 90)
    assert (second[WAIT], second[MOVE]) == (30, 40)


def test_a_concurrent_last_byte_marked_zero_arrived_at_the_next_steps_start() -> None:
    """A one-peer step reads no clock for its last byte: the step ended when the next one started."""
    recorder = Recorder(enabled=True)
    ring = Layout([(0, [(1, 8)]), (1, [(1, 8)])], concurrent=True)
    _call(recorder, 1, ring, [1000, 1010, 0, 1200, 0, 0], end=1350)
    first, second = recorder.transfers(0)
    assert (first[START], first[WAIT], first[MOVE]) == (1000, 10, 190)
    assert (second[START], second[WAIT], second[MOVE]) == (1200, 0, 150)  # the last step ends with the call


def test_a_concurrent_step_with_no_clock_but_its_start_moved_for_the_whole_step() -> None:
    recorder = Recorder(enabled=True)
    ring = Layout([(0, [(1, 8)]), (1, [(2, 8)]), (2, [(1, 8)])], concurrent=True)
    _call(recorder, 1, ring, [500, 0, 0, 620, 0, 0, 700, 0, 0], end=730)
    moves = [(int(t[STEP]), int(t[WAIT]), int(t[MOVE])) for t in recorder.transfers(0)]
    assert moves == [(0, 0, 120), (1, 0, 80), (2, 0, 30)]


def test_a_failed_call_leaves_no_records_and_the_next_call_is_read_right() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 8)]), (1, [(1, 8)])], concurrent=False)
    _call(recorder, 0, layout, [1, 2], commit=False)  # failed after two of its five marks: the group discards
    _call(recorder, 1, layout, [10, 1, 20, 2, 25])
    records = recorder.transfers(0)
    assert list(records[:, SEQ]) == [1, 1]
    assert list(records[:, WAIT]) == [1, 2]
    assert len(recorder.calls(10)) == 1


def test_a_transport_that_wrote_fewer_marks_cannot_shift_the_calls_after_it() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 8)]), (1, [(1, 8)])], concurrent=False)
    _call(recorder, 0, layout, [1, 2, 3])  # a transport bug: two marks short
    _call(recorder, 1, layout, [10, 1, 20, 2, 25])
    assert [int(c[0]) for c in recorder.calls(10)] == [0, 1]
    assert list(recorder.transfers(1)[:, WAIT]) == [1, 2]


def test_the_call_records_carry_seq_arrival_end_and_size() -> None:
    recorder = Recorder(enabled=True)
    _call(recorder, 4, None, [], end=50)  # a transport that writes no marks (whole records instead)
    _call(recorder, 5, Layout([(0, [(1, 8)])], concurrent=False, count=8), [60, 10, 80], end=90)
    assert recorder.calls(10).tolist() == [[4, 0, 50, 8], [5, 60, 90, 8]]


def test_the_oldest_calls_are_dropped_whole_once_the_entries_pass_the_capacity() -> None:
    recorder = Recorder(enabled=True)
    steps = 64
    layout = Layout([(s, [(1, 8)]) for s in range(steps)], concurrent=False)  # a clock and a wait per step, the end
    per_call = 3 + 1 + layout.marks + 1  # the header, the tag, the marks, the end
    calls = 2 * MARK_CAPACITY // per_call
    for seq in range(calls):
        _call(recorder, seq, layout, [seq + 1, 1] * steps + [seq + 1])
    kept = recorder.calls(calls)
    chunk = -(-SPILL_ENTRIES // per_call)  # calls per chunk: the group sets the list aside at a call's start
    assert MARK_CAPACITY // per_call <= len(kept) <= MARK_CAPACITY // per_call + chunk
    assert kept[:, 0].tolist() == list(range(calls - len(kept), calls))  # the newest, none missing
    records = recorder.transfers(0)
    assert len(records) == len(kept) * steps  # a call kept keeps its transfers
    assert np.all(records[:, WAIT] == 1)


def test_the_call_ring_keeps_the_newest_calls() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 8)])], concurrent=False)
    for seq in range(CALL_CAPACITY + 5):
        _call(recorder, seq, layout, [seq, 1, seq + 2])
    calls = recorder.calls(CALL_CAPACITY + 5)
    assert len(calls) == CALL_CAPACITY
    assert calls[-1, 0] == CALL_CAPACITY + 4
    assert calls[0, 0] == 5


def test_a_call_whose_layout_is_gone_keeps_its_call_record_but_no_transfers() -> None:
    recorder = Recorder(enabled=True)
    gone = Layout([(0, [(1, 8)])], concurrent=False)
    _call(recorder, 0, gone, [1, 2, 3])
    del gone  # its plan was dropped from the cache: what its marks mean is unknown
    gc.collect()
    kept = Layout([(0, [(2, 8)])], concurrent=False)
    _call(recorder, 1, kept, [5, 7, 9])
    assert [int(c[0]) for c in recorder.calls(10)] == [0, 1]
    assert list(recorder.transfers(0)[:, SEQ]) == [1]


def test_whole_records_and_rebuilt_ones_come_out_by_seq_then_step() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 8)])], concurrent=False)
    recorder.transfer(2, 0, 3, 0, 1, 1, 8)
    _call(recorder, 1, layout, [5, 6, 7])
    recorder.transfer(0, 1, 3, 0, 1, 1, 8)
    records = recorder.transfers(0)
    assert [(int(r[SEQ]), int(r[STEP])) for r in records] == [(0, 1), (1, 0), (2, 0)]


def test_transfers_from_a_seq_on_leave_out_the_earlier_calls() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 8)])], concurrent=False)
    for seq in range(5):
        _call(recorder, seq, layout, [seq, seq + 1, seq + 2])
    assert list(recorder.transfers(3)[:, SEQ]) == [3, 4]


def test_what_the_recorder_keeps_stops_growing_at_its_capacity() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 8)]), (1, [(1, 8)])], concurrent=False)
    marks = [1_000_000_007, 0, 1_000_000_009, 0, 1_000_000_011]  # clocks are new int objects, as on the hot path
    per_call = 3 + 1 + len(marks) + 1

    def calls(first: int, count: int) -> None:
        for seq in range(first, first + count):
            _call(recorder, seq, layout, [m + seq for m in marks])

    full = MARK_CAPACITY // per_call + 2 * SPILL_ENTRIES // per_call
    calls(0, full)  # full: every later chunk set aside drops the oldest
    recorder.flush()
    blocks = sys.getallocatedblocks()
    calls(full, full)  # unbounded, this would keep ~5 int objects per call
    recorder.flush()
    assert abs(sys.getallocatedblocks() - blocks) < 2 * SPILL_ENTRIES  # a chunk's worth, not the calls'
    assert len(recorder.calls(CALL_CAPACITY)) == min(CALL_CAPACITY, MARK_CAPACITY // per_call)


def test_the_entries_are_set_aside_every_few_thousand() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 8)])], concurrent=False)
    per_call = 3 + 1 + layout.marks + 1
    calls = SPILL_ENTRIES // per_call + 3
    for seq in range(calls):
        _call(recorder, seq, layout, [seq + 1, seq + 2, seq + 3])
    assert len(recorder.log) <= 3 * per_call  # set aside as a call started past SPILL_ENTRIES
    assert recorder.calls(3)[:, 0].tolist() == [calls - 3, calls - 2, calls - 1]
    assert len(recorder.transfers(0)) == calls


def test_entries_are_told_apart_by_sign_and_range() -> None:
    """Every mark is >= 0; a call's header starts with ~seq (negative, above TAG_BASE); tags and VOID lie below."""
    layout = Layout([(0, [(1, 8)])], concurrent=False)
    assert layout.tag <= TAG_BASE < VOID < ~(2**62 - 1) < 0
    assert Layout([(0, [(1, 8)])], concurrent=False).tag != layout.tag  # each layout its own key


def test_a_call_without_marks_after_one_with_them_has_no_transfers() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 8)])], concurrent=False)
    _call(recorder, 0, layout, [1, 2, 3])
    _call(recorder, 1, None, [])  # its transport wrote nothing: call 0's tag is not read as its own
    assert list(recorder.transfers(0)[:, SEQ]) == [0]


def test_a_transport_that_wrote_more_marks_cannot_shift_the_calls_after_it() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 8)])], concurrent=False)
    _call(recorder, 0, layout, [1, 2, 3, 4, 5])  # a transport bug: two marks too many
    _call(recorder, 1, layout, [10, 1, 20])
    assert [int(c[0]) for c in recorder.calls(10)] == [0, 1]
    assert list(recorder.transfers(1)[:, WAIT]) == [1]


def test_a_read_sees_every_call_made_since_the_last_read() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 8)])], concurrent=False)
    _call(recorder, 0, layout, [1, 2, 3])
    assert [int(c[0]) for c in recorder.calls(10)] == [0]
    _call(recorder, 1, None, [])  # no marks at all (a transport that writes whole records): still a new state
    assert [int(c[0]) for c in recorder.calls(10)] == [0, 1]
    _call(recorder, 2, layout, [4, 5, 6])
    assert list(recorder.transfers(0)[:, SEQ]) == [0, 2]
    assert [int(c[0]) for c in recorder.calls(10)] == [0, 1, 2]


_LAYOUTS_FOR_PROPERTY = (
    Layout([(0, [(1, 8)]), (1, [(1, 8)])], concurrent=False),
    Layout([(0, [(1, 4), (2, 4)])], concurrent=True),
)


@given(
    st.lists(
        st.tuples(
            st.sampled_from([None, 0, 1]),  # no marks, or one of the layouts
            st.integers(-2, 2),  # marks written beyond (or short of) what the layout says
            st.booleans(),  # the call failed
            st.integers(1, 10**15),  # its clocks (a first receive always marks one)
        ),
        max_size=40,
    )
)
@settings(max_examples=200, deadline=None)
def test_every_call_that_returned_is_read_back_whatever_the_calls_around_it_wrote(
    calls: list[tuple[int | None, int, bool, int]],
) -> None:
    """The reader finds each call by its header: a failed call, or a transport that marked too much or too little,
    costs nothing but that call's own records."""
    recorder = Recorder()  # not reserved: the placeholders would only slow each example
    returned, whole = [], []
    for seq, (which, extra, failed, clock) in enumerate(calls):
        layout = None if which is None else _LAYOUTS_FOR_PROPERTY[which]
        count = 0 if layout is None else max(layout.marks + extra, 0)
        marks = [clock + i for i in range(count)]
        recorder.begin(seq, clock, 8 * (seq + 1))
        if layout is not None:
            recorder.append(layout.tag)
            for value in marks:
                recorder.append(value)
        if failed:
            recorder.void()
            continue
        recorder.end(clock + 10**6)
        returned.append([seq, clock, clock + 10**6, 8 * (seq + 1)])
        if layout is not None and extra == 0:
            whole.append(seq)
    assert recorder.calls(len(calls)).tolist() == returned
    assert sorted(set(recorder.transfers(0)[:, SEQ].tolist())) == whole


def test_reserving_the_capacity_shows_no_calls_and_happens_once() -> None:
    recorder = Recorder()
    recorder.reserve()
    assert len(recorder.calls(10)) == 0
    assert len(recorder.transfers(0)) == 0
    blocks = sys.getallocatedblocks()
    recorder.reserve()  # turned on again: nothing more taken
    assert sys.getallocatedblocks() - blocks < 100
    layout = Layout([(0, [(1, 8)])], concurrent=False)
    _call(recorder, 3, layout, [10, 1, 20])
    assert recorder.calls(10)[:, 0].tolist() == [3]
    assert recorder.transfers(0)[:, SEQ].tolist() == [3]


def test_a_reserved_recorder_keeps_what_an_unreserved_one_keeps_once_full() -> None:
    layout = Layout([(0, [(1, 8)])], concurrent=False)
    per_call = 3 + 1 + layout.marks + 1
    kept = []
    for reserved in (False, True):
        recorder = Recorder()
        if reserved:
            recorder.reserve()
        for seq in range(2 * MARK_CAPACITY // per_call):
            _call(recorder, seq, layout, [seq + 1, 1, seq + 2])
        kept.append(recorder.calls(CALL_CAPACITY)[:, 0].tolist())
    assert kept[0] == kept[1]


def test_every_recorder_of_a_process_grows_into_one_shared_reserve() -> None:
    Recorder().reserve()
    blocks = sys.getallocatedblocks()
    others = [Recorder(enabled=True) for _ in range(8)]  # as eight more groups turning recording on
    assert sys.getallocatedblocks() - blocks < 100 * len(others)


def test_a_released_recorder_stops_and_keeps_nothing() -> None:
    recorder = Recorder(enabled=True)
    layout = Layout([(0, [(1, 8)])], concurrent=False)
    for seq in range(3):
        _call(recorder, seq, layout, [seq + 1, 1, seq + 2])
    recorder.transfer(3, 0, 1, 10, 1, 2, 8)
    assert len(recorder.calls(10)) == 3
    recorder.release()
    assert not recorder.enabled
    assert len(recorder.calls(10)) == 0
    assert len(recorder.transfers(0)) == 0
