"""Per-step wait records of the collectives a rank runs, and the group-wide summary built from them.

What a rank records while a collective runs goes into one Python list, one ``list.append`` per entry
(:attr:`Recorder.log`): clock reads (``time.perf_counter_ns``, a vDSO call, no syscall), wait lengths, and a few
markers, all ints. Every few thousand entries the group sets the list aside as a *chunk* and starts a new one
(:meth:`Recorder.flush`, between calls: no conversion on the hot path; the oldest chunks are dropped once the newer
ones hold :data:`MARK_CAPACITY` entries); readers convert what is kept to one int64 array when they ask. Which
peer, step and byte count each mark belongs to is not written at all: it is fixed by the call's compiled plan,
whose :class:`Layout` rebuilds the records when they are read (:meth:`Recorder.calls`,
:meth:`Recorder.transfers`, nothing aggregated before :func:`summary_row` asks).

One collective in ``log``::

    ~seq, arrival_ns, size_bytes | tag, marks (Layout.marks of them) | end_ns      (or VOID instead of end_ns)
    the group, as the call starts  | its transport, if it marks       | the group, as the call returns

The group writes the header once the call has its sequence number, while what it writes is still in the caches,
and the end when the call returns (:data:`VOID` if it failed). Every value a transport marks is >= 0; the header's
first entry, ``~seq`` (= -seq - 1), is a negative number above :data:`TAG_BASE`, so a reader finds every call's
start without reading the calls before it; a tag (:attr:`Layout.tag`), at or below :data:`TAG_BASE`, names the
layout and how many marks follow. A transport that writes no marks (the in-process transport, which writes whole
records with :meth:`Recorder.transfer`) writes no tag either. A call whose entries are not exactly what its tag
says (a transport that marked too few or too many, or a layout whose plan is gone) keeps its call record and
loses its transfer records only; a call that failed (``VOID``) leaves neither; the calls after either are read
right. Nothing on the hot path allocates a container: the entries are ints, which the garbage collector does not
track, appended to a list that stays in the caches for the whole call.

Measured on this machine (``benchmarks/bench_stats.py``): what recording costs is mostly the cache lines it
touches after the payload streamed through the caches, not the interpreter's operations (a clock read ~45 ns, an
append ~15 ns with hot caches): in one process with a megabyte streamed through the caches before each write, one
tuple per call kept in a second list, as this recorder first did (a GC-tracked object and two more cold lists),
cost 388 ns, the same values appended to this list 250 ns. docs/tail.md has the on/off ratios and the ablations.

Two kinds of layout, by how a transport receives:

- *sequential* (shm: one receive after another): per receive a mark when this rank started waiting for it and
  how long it waited until the peer's data was there, both clocks the wait read while this rank was idle (0, no
  clock read and no new int object, when the data was there already); a receive's move ends at the next clock
  mark (the next receive's wait, or the next step's); a step without receives marks where it starts; after the
  last step, one mark where the steps end. A receive whose data was there marks the clock (then) if it is the
  call's first, or the first after a step without receives, and otherwise ``(0, 0)``: no boundary. Its move is
  then measured together with the moves before it back to the last receive with a boundary, and that time is
  shared among them by units (in a ring every receive is from the same peer, so per-link totals stay exact). A
  call reads at most two clocks for its marks, however many steps it has. Waits a step makes before its first
  receive's (for the readers of an earlier step, or, under the ptracer discipline, for its previous reader to
  finish) end up in the previous move.
- *concurrent* (tcp: receives from several peers interleave in one poll loop): per step a mark when it begins
  (its one clock read when no wait was needed), then per peer the first and the last byte's arrival. The first
  is the clock the poll loop read when it woke with the peer's data readable after a wait, or 0 when it never
  waited for it (the data was there from the step's start, or came while this rank was busy sending): the step's
  start. The last is read when the peer's frames complete in a step with several receiving peers (or an injected
  pacing); in a step with one it is 0: the step's end, the next step's start mark or the call's end.

Rebuilt (or written), each received transfer is one record ``(seq, step, peer, step_start_ns, wait_ns,
transfer_ns, size_bytes)``: ``wait_ns`` is how long this rank waited for ``peer``'s data to become available (shm:
blocked on the peer's progress counter; tcp: from the step's start until the poll that found the peer's first
bytes readable returned;
local: until the message was in the hub); ``transfer_ns`` how long moving it took once it was there (a paced link
shows here). Each collective is one call record ``(seq, arrival_ns, end_ns, size_bytes)``: when this rank called
it and when it returned.

How a rank that arrived late is found without comparing clocks across hosts: every rank leaves a collective at
about the same time (it is a barrier), so a rank that arrived late spends less time in it; its lateness in call
k is ``max_r(duration_r,k) − duration_rank,k``. The slowest link is the one with the largest transfer time.
"""

from __future__ import annotations

import collections
import itertools
import json
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import numpy.typing as npt

from allreduce.runtime.stats._spare import SpareInts

__all__ = [
    "CALL_CAPACITY",
    "MARK_CAPACITY",
    "SPILL_ENTRIES",
    "STANDOUT_RATIO",
    "TAG_BASE",
    "TRANSFER_CAPACITY",
    "VOID",
    "GroupStats",
    "Layout",
    "LinkStats",
    "RankStats",
    "Recorder",
    "merge_summaries",
    "summary_row",
    "summary_row_length",
]

TRANSFER_CAPACITY = 1 << 16
"""Whole records kept (a ring, for :meth:`Recorder.transfer`): 65,536 × 7 int64 = 3.5 MiB."""

MARK_CAPACITY = 1 << 18
"""Entries of :attr:`Recorder.log` kept (the newest chunks): the last 1,000 ring all-reduces of 64 ranks (2 marks
per step, and 5 entries per call). Kept as the Python ints the hot path appended, about 28 bytes each: 7 MiB at
most."""

SPILL_ENTRIES = 1 << 12
"""Entries the hot path appends to :attr:`Recorder.log` before the group, as the next call starts, sets the list
aside as a chunk and starts a new one (nothing converted: readers do that when they ask)."""

CALL_CAPACITY = 1 << 14
"""Collectives kept (the newest, fewer when their entries exceed :data:`MARK_CAPACITY`): the most
``stats(last=K)`` can look back."""

TAG_BASE = -(1 << 62) - 2
"""The largest tag: a call's header starts with ``~seq``, between -2**62 and -1; :data:`VOID` and every tag lie
below, every mark at or above 0."""

VOID = TAG_BASE + 1
"""What the group writes instead of a call's end when the call failed: its entries are not read."""

_SPARE = SpareInts(MARK_CAPACITY, SPILL_ENTRIES, base=1 << 40)
"""What every recorder of this process grows into (see :meth:`Recorder.reserve`)."""
_MARKS_BITS = 24  # a tag is TAG_BASE - (layout key << _MARKS_BITS | the layout's marks)
_HEADER_MIN = -(1 << 62)  # the smallest ~seq
_CALL_FIELDS = 5  # seq, arrival_ns, end_ns, size_bytes, the tag's position (-1: no transfer records)

STANDOUT_RATIO = 2.0
"""A rank (link) is named the slowest only if its median lateness (total transfer time) is at least this many
times the runner-up's: in a healthy run the argmax is noise, and naming it would send users after nothing."""

_clock = time.perf_counter_ns

_TRANSFER_FIELDS = 7  # seq, step, peer, step_start_ns, wait_ns, transfer_ns, size_bytes
_LAYOUTS: weakref.WeakValueDictionary[int, Layout] = weakref.WeakValueDictionary()
"""Every live layout by its key (a layout lives as long as the compiled plan that holds it)."""
_LAYOUT_KEYS = itertools.count()


class Layout:
    """What the marks of one call of a compiled plan mean (see the module docstring).

    ``steps``: per step, its index and its receives in the order the transport marks them, each ``(peer,
    units)``; ``count``: the units of the whole buffer (shm: the plan's elements; tcp, whose units are bytes: its
    bytes), so that a record's size is ``units`` × the call's size in bytes / ``count``. Built once per compiled
    plan, so nothing of it is computed on the hot path."""

    __slots__ = (
        "__weakref__",
        "after",
        "arrive",
        "begin",
        "concurrent",
        "count",
        "end",
        "first_recv",
        "key",
        "marks",
        "peer",
        "start",
        "step",
        "tag",
        "units",
    )

    def __init__(
        self, steps: Iterable[tuple[int, Sequence[tuple[int, int]]]], *, concurrent: bool, count: int = 1
    ) -> None:
        if count < 1:
            raise ValueError(f"count must be positive, got {count}")
        self.concurrent = concurrent
        self.count = count
        step_of: list[int] = []
        peer: list[int] = []
        units: list[int] = []
        start: list[int] = []
        begin: list[int] = []
        arrive: list[int] = []
        end: list[int] = []
        first_recv: list[int] = []
        after: list[int] = []
        pos = 0
        for index, recvs in steps:
            first = pos
            for i, (p, u) in enumerate(recvs):
                after.append(first + 1 + 2 * len(recvs))  # concurrent: the next step's start, or the call's end
                first_recv.append(len(step_of) - i)
                step_of.append(index)
                peer.append(p)
                units.append(u)
                start.append(first)
                if concurrent:  # start, then (first byte, last byte) per peer
                    begin.append(first)
                    arrive.append(first + 1 + 2 * i)
                    end.append(first + 2 + 2 * i)
                else:  # waiting_1, waited_1, waiting_2 (= moved_1), ..., waited_R (moved_R is the next mark)
                    begin.append(first if i == 0 else first + 2 * i)
                    arrive.append(first + 1 + 2 * i)
                    end.append(first + 2 + 2 * i)
            pos += 1 + 2 * len(recvs) if concurrent else max(1, 2 * len(recvs))
        if not concurrent:
            pos += 1  # the steps' end: the last step's last move ends there (not at the call's end, after the
            # final waits for this rank's readers, which are theirs to account for)
        self.marks = pos
        """Marks one call writes."""

        def column(values: list[int]) -> npt.NDArray[np.int64]:
            return np.array(values, dtype=np.int64)

        self.step, self.peer, self.units = column(step_of), column(peer), column(units)
        self.start, self.begin, self.arrive, self.end = column(start), column(begin), column(arrive), column(end)
        self.after = column(after)
        """Per receive (concurrent), the mark after its step's: where a last byte marked 0 arrived."""
        self.first_recv = column(first_recv)
        """Per receive, the index of its step's first receive."""
        if self.marks >= 1 << _MARKS_BITS:
            raise ValueError(f"a layout of {self.marks} marks: at most {(1 << _MARKS_BITS) - 1}")
        self.key = next(_LAYOUT_KEYS)
        """What a call's tag stores to name this layout."""
        self.tag = TAG_BASE - (self.key << _MARKS_BITS | self.marks)
        """What the transport appends before its marks: this layout's key and how many marks follow."""
        _LAYOUTS[self.key] = self

    def records(
        self, calls: npt.NDArray[np.int64], units: npt.NDArray[np.int64], marks: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """The transfer records of ``calls`` (call records of this layout), each with its unit's bytes and its
        ``marks`` (one row each, ``self.marks`` wide); the call's end is the mark after the last."""
        n, r = len(calls), len(self.step)
        if n == 0 or r == 0:
            return np.zeros((0, _TRANSFER_FIELDS), np.int64)
        m = np.concatenate([marks, calls[:, 2:3]], axis=1)
        out = np.empty((n, r, _TRANSFER_FIELDS), np.int64)
        out[:, :, 0] = calls[:, 0:1]
        out[:, :, 1] = self.step
        out[:, :, 2] = self.peer
        out[:, :, 6] = self.units * units[:, None]
        if self.concurrent:
            started = m[:, self.start]
            out[:, :, 3] = started
            first, last = m[:, self.arrive], m[:, self.end]
            arrived = np.where(first == 0, started, first)  # 0: there from the step's start (no wait)
            ended = np.where(last == 0, m[:, self.after], last)  # 0: at the step's end
            out[:, :, 4] = np.maximum(arrived - m[:, self.begin], 0)
            out[:, :, 5] = np.maximum(ended - arrived, 0)
            return out.reshape(n * r, _TRANSFER_FIELDS)
        began, waited, end = m[:, self.begin], m[:, self.arrive], m[:, self.end]
        whole = began[:, 0] != 0  # a call's first receive always reads the clock: else its marks are not this layout's
        began, waited, end, out = began[whole], waited[whole], end[whole], out[whole]
        # A receive that found its data there and follows another receive marks no clock (0, 0): its move is measured
        # with the moves before it back to the last receive that did (its *leader*), and the group's time is shared
        # by units. Leaders' arrivals only grow within a call, so a running maximum carries each to its group.
        leader = began != 0
        index = np.arange(r)
        arrived = np.maximum.accumulate(np.where(leader, began + waited, 0), axis=1)
        head = np.maximum.accumulate(np.where(leader, index, 0), axis=1)  # the leader's index
        last = np.ones_like(leader)
        last[:, :-1] = leader[:, 1:]  # the group's last receive: the next one leads a group of its own
        tail = np.minimum.accumulate(np.where(last, index, r)[:, ::-1], axis=1)[:, ::-1]
        group_end = np.take_along_axis(end, tail, axis=1)  # a clock: the next leader's, a step's or the steps' end
        units_after = np.cumsum(self.units)  # units up to and including each receive
        units_before = units_after - self.units
        total = np.maximum(units_after[tail] - units_before[head], 1)
        before = units_before[index] - units_before[head]
        span = np.maximum(group_end - arrived, 0)
        moved_from = arrived + span * before // total
        out[:, :, 4] = np.where(leader, np.maximum(waited, 0), 0)
        out[:, :, 5] = span * self.units // total
        starts = np.where(leader, began, moved_from)
        out[:, :, 3] = starts[:, self.first_recv]
        records: npt.NDArray[np.int64] = out.reshape(len(out) * r, _TRANSFER_FIELDS)
        return records


_Kept = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]
"""What :meth:`Recorder._kept` returns: the call rows (:data:`_CALL_FIELDS` wide) and the entries they index."""


class Recorder:
    """The entries of one rank's recorded collectives, and the chunks they are set aside in (see the module
    docstring).

    ``enabled`` False makes the group and the transports skip it. Who appends what to ``log``:

    - the group, once a call has its sequence number, through :meth:`begin`: ``~seq, arrival_ns, size_bytes``;
      past :data:`SPILL_ENTRIES`, the list is set aside first (:meth:`flush`);
    - the transport, if it marks: the layout's tag, then its marks (its hot loop calls nothing but ``list.append``,
      cached as ``append``; what the marks mean is the :class:`Layout` the tag names);
    - the group, when the call returns: ``end_ns`` (:meth:`end`); when it failed, :data:`VOID` (:meth:`void`).

    Readers flush first, and run between collectives (the group's summaries are collectives of their own).
    """

    __slots__ = (
        "_chunk_entries",
        "_chunks",
        "_drawn",
        "_kept_cache",
        "_set_aside",
        "_t",
        "_transfers",
        "append",
        "enabled",
        "log",
        "transfers_recorded",
    )

    def __init__(self, *, enabled: bool = False) -> None:
        self.enabled = enabled
        self._transfers: npt.NDArray[np.int64] | None = None
        """The ring of whole records, taken by the first :meth:`transfer` (only the in-process transport writes
        them)."""
        self._t: memoryview | None = None
        self.transfers_recorded = 0
        self.log: list[int] = []
        """Entries appended since the last :meth:`flush` (``append`` is its bound method, replaced with it)."""
        self.append = self.log.append
        self._chunks: collections.deque[list[int]] = collections.deque()
        """Earlier lists, oldest first; a call's entries always share a chunk (lists are set aside between calls)."""
        self._chunk_entries = 0
        self._set_aside = 0
        """Chunks set aside so far (only grows: what a reader's cached conversion is keyed by)."""
        self._kept_cache: tuple[int, _Kept] | None = None
        self._drawn = 0
        """Entries' worth of the process's spare chunks this recorder has dropped as it grew (see :meth:`reserve`)."""
        if enabled:
            self.reserve()

    def reserve(self) -> None:
        """Make sure the process holds the memory recording grows into (:mod:`allreduce.runtime.stats._spare`):
        :data:`MARK_CAPACITY` placeholder ints, taken once per process, shared by its recorders; a growing recorder
        drops as many as it adds, and once full drops its own oldest chunks instead. A process with one busy group
        holds ~10 MiB, as its entries would after about 26,000 calls, and each further group only what it recorded
        (the group calls this when recording is turned on)."""
        _SPARE.fill_once()

    def release(self) -> None:
        """Stop recording and let go of everything recorded (the transport's ``close``): the entries go back to
        the process's spare chunks, up to their :data:`MARK_CAPACITY`, the rest and the whole records are freed."""
        self.enabled = False
        # new containers rather than emptied ones: a reader still converting the old ones is not disturbed
        log, self.log = self.log, []
        self.append = self.log.append
        chunks, self._chunks = self._chunks, collections.deque()
        self._chunk_entries = 0
        self._drawn = 0
        self._set_aside += 1
        self._kept_cache = None
        self._transfers = None
        self._t = None
        self.transfers_recorded = 0
        _SPARE.give(itertools.chain(chunks, [log] if log else []))

    def transfer(  # noqa: PLR0917 (the hot path: keyword arguments cost time on every receive)
        self, seq: int, step: int, peer: int, step_start_ns: int, wait_ns: int, transfer_ns: int, size_bytes: int
    ) -> None:
        """Record one received transfer whole (for a transport whose receives no :class:`Layout` describes)."""
        n = self.transfers_recorded
        i = (n & (TRANSFER_CAPACITY - 1)) * _TRANSFER_FIELDS
        t = self._t
        if t is None:
            self._transfers = np.zeros((TRANSFER_CAPACITY, _TRANSFER_FIELDS), np.int64)
            t = self._t = memoryview(self._transfers.data).cast("B").cast("q")
        t[i] = seq
        t[i + 1] = step
        t[i + 2] = peer
        t[i + 3] = step_start_ns
        t[i + 4] = wait_ns
        t[i + 5] = transfer_ns
        t[i + 6] = size_bytes
        self.transfers_recorded = n + 1

    def begin(self, seq: int, arrival_ns: int, size_bytes: int) -> None:
        """A collective starts: its header."""
        log = self.log
        if len(log) >= SPILL_ENTRIES:
            self.flush()
            log = self.log
        log += (~seq, arrival_ns, size_bytes)

    def end(self, end_ns: int | None = None) -> None:
        """The collective returned (at ``end_ns``, else now): its end."""
        self.log.append(_clock() if end_ns is None else end_ns)

    def void(self) -> None:
        """The collective failed: its entries are not read (the group's ``except`` does this)."""
        self.log.append(VOID)

    def flush(self) -> None:
        """Set ``log`` aside as a chunk and start a new list (between calls only): no conversion on the hot path,
        which readers do when they ask. Chunks no reader can reach any more are dropped: the oldest, once the newer
        ones hold :data:`MARK_CAPACITY` entries."""
        log = self.log
        if not log:
            return
        self._chunks.append(log)
        self._chunk_entries += len(log)
        self._set_aside += 1
        self.log = []
        self.append = self.log.append
        chunks = self._chunks
        while len(chunks) > 1 and self._chunk_entries - len(chunks[0]) >= MARK_CAPACITY:
            self._chunk_entries -= len(chunks.popleft())
        # growing: drop the process's placeholders as fast as this recorder grows, whose next ints take their blocks
        while self._drawn < self._chunk_entries and _SPARE.drop():
            self._drawn += SPILL_ENTRIES

    def _kept(self) -> _Kept:
        """The last :data:`CALL_CAPACITY` call rows, oldest first: ``seq, arrival_ns, end_ns, size_bytes`` and
        where the call's tag is in the entries (-1: no transfer records to rebuild), and the entries. Converted
        once per state: the readers of one summary (calls, then transfers) share it; they must not write to it."""
        self.flush()
        if self._kept_cache is not None and self._kept_cache[0] == self._set_aside:
            return self._kept_cache[1]
        kept = self._convert()
        self._kept_cache = (self._set_aside, kept)
        return kept

    def _convert(self) -> _Kept:
        entries = np.fromiter(itertools.chain.from_iterable(self._chunks), np.int64, count=self._chunk_entries)
        starts = np.flatnonzero((entries < 0) & (entries >= _HEADER_MIN))  # every call's ~seq
        ends = np.append(starts[1:], len(entries))  # where the next call starts
        starts, ends = starts[-CALL_CAPACITY:], ends[-CALL_CAPACITY:]
        # a whole call: its header, its end (not VOID); the end is the last entry before the next call's header
        whole = ends - starts >= 4
        starts, ends = starts[whole], ends[whole]
        last = entries[ends - 1]
        done = last >= 0  # not VOID, nor a tag or a header's entry
        starts, ends, last = starts[done], ends[done], last[done]
        rows = np.empty((len(starts), _CALL_FIELDS), np.int64)
        rows[:, 0] = ~entries[starts]
        rows[:, 1] = entries[starts + 1]
        rows[:, 2] = last
        rows[:, 3] = entries[starts + 2]
        # its transfers: a tag right after the header, and exactly as many marks as the tag says
        tag_at = starts + 3
        tags = np.where(tag_at < ends - 1, entries[np.minimum(tag_at, len(entries) - 1)], 0)
        code = TAG_BASE - tags
        marks = code & ((1 << _MARKS_BITS) - 1)
        rows[:, 4] = np.where((tags <= TAG_BASE) & (ends - tag_at - 2 == marks), tag_at, -1)
        return rows, entries

    @property
    def calls_recorded(self) -> int:
        """Collectives whose call records are still kept (at most :data:`CALL_CAPACITY`)."""
        rows, _ = self._kept()
        return len(rows)

    def calls(self, last: int) -> npt.NDArray[np.int64]:
        """The last ``last`` call records, oldest first (rows of seq, arrival_ns, end_ns, size_bytes)."""
        rows, _ = self._kept()
        out: npt.NDArray[np.int64] = rows[len(rows) - min(last, len(rows)) :, :4].copy()
        return out

    def transfers(self, first_seq: int) -> npt.NDArray[np.int64]:
        """The transfer records kept of collectives ``first_seq`` and later, oldest first (by seq, then step)."""
        parts = [self._written_transfers(first_seq)]
        rows, entries = self._kept()
        tag_at = rows[:, 4]
        wanted = (rows[:, 0] >= first_seq) & (rows[:, 1] <= rows[:, 2]) & (tag_at >= 0)
        keys = np.where(wanted, (TAG_BASE - entries[np.maximum(tag_at, 0)]) >> _MARKS_BITS, -1) if len(rows) else tag_at
        for key in np.unique(keys[wanted]).tolist():
            layout = _LAYOUTS.get(key)
            if layout is None:  # its plan is gone: what its marks mean is unknown
                continue
            picked = wanted & (keys == key)
            at = tag_at[picked][:, None] + 1 + np.arange(layout.marks)
            units = rows[picked, 3] // layout.count
            parts.append(layout.records(rows[picked, :4], units, entries[at]))
        records = np.concatenate(parts)
        order = np.lexsort((records[:, 1], records[:, 0]))
        out: npt.NDArray[np.int64] = records[order]
        return out

    def _written_transfers(self, first_seq: int) -> npt.NDArray[np.int64]:
        if self._transfers is None:
            return np.zeros((0, _TRANSFER_FIELDS), np.int64)
        n = min(self.transfers_recorded, TRANSFER_CAPACITY)
        rows = np.arange(self.transfers_recorded - n, self.transfers_recorded) & (TRANSFER_CAPACITY - 1)
        records = self._transfers[rows]
        kept: npt.NDArray[np.int64] = records[records[:, 0] >= first_seq]
        return kept


# ------------------------------------------------------------------------------------------------------------
# The per-rank summary exchanged between ranks: one fixed-size float64 row
# ------------------------------------------------------------------------------------------------------------
_HEADER = 4  # first_seq, last_seq, calls, this rank
_PER_PEER = 9  # size_bytes, wait total/p50/p99/max, transfer total/p50/p99/max


def summary_row_length(world_size: int, last: int) -> int:
    """Elements of one rank's summary row: a header, ``last`` durations, ``last`` waits, and 9 per peer."""
    return _HEADER + 2 * last + _PER_PEER * world_size


def _percentiles(values: npt.NDArray[np.float64]) -> tuple[float, float, float]:
    if values.size == 0:
        return 0.0, 0.0, 0.0
    p50, p99 = np.percentile(values, [50.0, 99.0])
    return float(p50), float(p99), float(values.max())


def summary_row(recorder: Recorder, rank: int, world_size: int, last: int) -> npt.NDArray[np.float64]:
    """This rank's summary of its last ``last`` recorded collectives (NaN where it recorded fewer)."""
    row = np.full(summary_row_length(world_size, last), np.nan)
    calls = recorder.calls(last)
    k = len(calls)
    row[3] = rank
    row[2] = k
    if k == 0:
        return row
    seqs = calls[:, 0]
    row[0], row[1] = seqs[0], seqs[-1]
    row[_HEADER : _HEADER + k] = (calls[:, 2] - calls[:, 1]) * 1e-9
    transfers = recorder.transfers(int(seqs[0]))
    transfers = transfers[np.isin(transfers[:, 0], seqs)]
    call_index = np.searchsorted(seqs, transfers[:, 0])
    waits = np.zeros(k)
    np.add.at(waits, call_index, transfers[:, 4] * 1e-9)
    row[_HEADER + last : _HEADER + last + k] = waits
    base = _HEADER + 2 * last
    for peer in range(world_size):
        mine = transfers[:, 2] == peer
        if peer == rank or not mine.any():
            row[base + _PER_PEER * peer : base + _PER_PEER * (peer + 1)] = 0.0
            continue
        wait = np.zeros(k)
        moved = np.zeros(k)
        np.add.at(wait, call_index[mine], transfers[mine, 4] * 1e-9)
        np.add.at(moved, call_index[mine], transfers[mine, 5] * 1e-9)
        row[base + _PER_PEER * peer : base + _PER_PEER * (peer + 1)] = (
            float(transfers[mine, 6].sum()),
            float(wait.sum()),
            *_percentiles(wait),
            float(moved.sum()),
            *_percentiles(moved),
        )
    return row


@dataclass(frozen=True)
class RankStats:
    """One rank over the collectives summarised: its time in them, its waits on peers, how late it arrived."""

    rank: int
    time_p50_s: float
    time_p99_s: float
    time_max_s: float
    wait_total_s: float
    wait_p50_s: float
    wait_p99_s: float
    wait_max_s: float
    late_mean_s: float
    """``max over ranks(duration) − own duration``, averaged: how long the others waited for this rank."""
    late_p50_s: float
    late_p99_s: float
    late_max_s: float


@dataclass(frozen=True)
class LinkStats:
    """The link ``src -> dst`` as its receiver saw it: bytes, time waiting for the data, time moving it."""

    src: int
    dst: int
    size_bytes: int
    wait_total_s: float
    wait_p50_s: float
    wait_p99_s: float
    wait_max_s: float
    transfer_total_s: float
    transfer_p50_s: float
    transfer_p99_s: float
    transfer_max_s: float


@dataclass(frozen=True)
class GroupStats:
    """The last ``calls`` collectives of a group: per rank, per link, and who held them back."""

    world_size: int
    calls: int
    first_seq: int
    last_seq: int
    ranks: tuple[RankStats, ...]
    links: tuple[LinkStats, ...]
    slowest_rank: int | None
    """The rank with the largest median lateness (the others waited for it), if it stands out (``STANDOUT_RATIO``
    times the runner-up); None otherwise, with no calls, or with one rank."""
    slowest_link: tuple[int, int] | None
    """``(src, dst)`` of the link with the largest total transfer time, if it stands out (``STANDOUT_RATIO`` times
    the runner-up); None otherwise or if no data moved."""
    replans: tuple[str, ...] = ()
    """What re-planning (``ALLREDUCE_REPLAN``) changed in this group, and why, in order."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def table(self) -> str:
        """The summary as text: one line per rank, one per link, the slowest of each named."""
        if self.calls == 0:
            return (
                "allreduce stats: no collectives recorded (none ran, or recording was off: ALLREDUCE_STATS=0 or "
                "group.recording = False)"
            )
        lines = [
            f"allreduce stats: {self.world_size} ranks, last {self.calls} collectives (seq {self.first_seq}-"
            f"{self.last_seq})",
            f"{'rank':>6} {'time p50':>10} {'p99':>10} {'max':>10} {'waited':>10} {'late p50':>10} {'late p99':>10}"
            f" {'late mean':>10}",
        ]
        for r in self.ranks:
            mark = "  <- slowest rank" if r.rank == self.slowest_rank else ""
            lines.append(
                f"{r.rank:>6} {_ms(r.time_p50_s)} {_ms(r.time_p99_s)} {_ms(r.time_max_s)} {_ms(r.wait_total_s)} "
                f"{_ms(r.late_p50_s)} {_ms(r.late_p99_s)} {_ms(r.late_mean_s)}{mark}"
            )
        if self.links:
            lines.append(
                f"{'link':>8} {'bytes':>12} {'wait p50':>10} {'p99':>10} {'move total':>10} {'p50':>10} {'p99':>10}"
            )
            for link in self.links:
                mark = "  <- slowest link" if (link.src, link.dst) == self.slowest_link else ""
                lines.append(
                    f"{f'{link.src}->{link.dst}':>8} {link.size_bytes:>12,} {_ms(link.wait_p50_s)} "
                    f"{_ms(link.wait_p99_s)} {_ms(link.transfer_total_s)} {_ms(link.transfer_p50_s)} "
                    f"{_ms(link.transfer_p99_s)}{mark}"
                )
        lines.extend(f"re-planned {change}" for change in self.replans)
        if self.slowest_rank is None:
            lines.append(f"no rank stands out ({STANDOUT_RATIO:g}x the runner-up's median lateness)")
        if self.slowest_link is None and self.links:
            lines.append(f"no link stands out ({STANDOUT_RATIO:g}x the runner-up's transfer time)")
        lines.append("(ms; late = how much later than the earliest rank it reached the collective, estimated from "
                     "time spent in it)")  # fmt: skip
        return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:>10.3f}"


def merge_summaries(rows: npt.NDArray[np.float64], last: int) -> GroupStats:
    """Every rank's :func:`summary_row` (one row per rank, in rank order) as one :class:`GroupStats`."""
    world_size = rows.shape[0]
    calls = int(rows[:, 2].min()) if world_size else 0
    if calls == 0:
        return GroupStats(world_size, 0, -1, -1, (), (), None, None)
    first = {int(v) for v in rows[:, 0]}
    last_seqs = {int(v) for v in rows[:, 1]}
    if len(first) != 1 or len(last_seqs) != 1 or len({int(v) for v in rows[:, 2]}) != 1:
        raise ValueError(
            "stats: the ranks recorded different collectives (first seq per rank "
            f"{[int(v) for v in rows[:, 0]]}, last {[int(v) for v in rows[:, 1]]})"
        )
    durations = rows[:, _HEADER : _HEADER + calls]
    waits = rows[:, _HEADER + last : _HEADER + last + calls]
    late = durations.max(axis=0, keepdims=True) - durations
    ranks = [
        RankStats(
            r,
            *_percentiles(durations[r]),
            float(waits[r].sum()),
            *_percentiles(waits[r]),
            float(late[r].mean()),
            *_percentiles(late[r]),
        )
        for r in range(world_size)
    ]
    links = []
    base = _HEADER + 2 * last
    for dst in range(world_size):
        for src in range(world_size):
            values = rows[dst, base + _PER_PEER * src : base + _PER_PEER * (src + 1)]
            if src == dst or values[0] <= 0:
                continue
            links.append(LinkStats(src, dst, int(values[0]), *(float(v) for v in values[1:])))
    # the median, not the mean: one call's setup (connections, first-touch pages) must not outvote the rest
    lateness = sorted(((r.late_p50_s, r.rank) for r in ranks), reverse=True)
    slowest_rank = None
    if world_size > 1 and lateness[0][0] > STANDOUT_RATIO * lateness[1][0]:
        slowest_rank = lateness[0][1]
    moving = sorted(((link.transfer_total_s, (link.src, link.dst)) for link in links), reverse=True)
    slowest_link = None
    if moving and (len(moving) == 1 or moving[0][0] > STANDOUT_RATIO * moving[1][0]):
        slowest_link = moving[0][1]
    return GroupStats(
        world_size,
        calls,
        int(rows[0, 0]),
        int(rows[0, 1]),
        tuple(ranks),
        tuple(sorted(links, key=lambda link: (link.src, link.dst))),
        slowest_rank,
        slowest_link,
    )
