"""The compiled event core (sim/_kernel.py) over a layout streamed from the schedule, a window of steps at a time.

A whole layout (sim/_layout.py) holds every transfer and every slot of a run in arrays, about 136 bytes a
transfer: a 16,384-rank ring's 537 million would take 73 GB. Yet at any moment only a band of steps is under
way (ranks drift apart by a few dozen steps: 27 of a 1,024-rank ring's 2,046 on a randomly placed fat-tree).
So here the transfers of a window of steps are matched from the schedule's streams (``match_transfers`` over
those steps: the same transfers, numbered as in the whole layout), laid out in ring buffers indexed by their
number modulo the buffer's size, and released once every transfer and slot of their step is done; a window is
laid out when the kernel is about to end a slot whose rank's next slot is not laid out yet (it stops before
that event, and the instant resumes where it stopped). Slots are numbered step by step rather than rank by
rank, so each names its successor. The kernel runs the same events in the same order on the same floats as
on the whole layout: the results are equal bit for bit (tests/sim/test_stream.py), except the per-link bytes,
summed window by window (rounding).

What a result needs of the released steps is folded in as they go: per phase its first start, last end,
slowest rate and the rates' median (the rates go to a temporary file, 8 bytes each, and the median is selected
from it at the end), per link its bytes, the trace of the first ranks, and the critical path's links: per
slot, the transfer that ended it and the slot before the one whose start let that transfer begin. A slot
still in the buffers reaches the released ones only through its rank's last released slot (a parent is the
slot before a slot of the same step), so those, one per rank, are the roots: each record counts its kept
children (plus one while a root) and is dropped when that count falls to zero, walking up. The records kept are
those the walk back from the last rank to finish, at the end, may need; each record is counted in and dropped
once, whatever the run's size.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from allreduce.schedules import Schedule
from allreduce.sim._kernel import DONE, MORE, UNKNOWN, Queue, make_work
from allreduce.sim._layout import ChainRecords, match_transfers, numbered, route_pairs
from allreduce.sim._records import COLLECT_MIN, PathRecords
from allreduce.sim._result import PhaseResult
from allreduce.sim._routing import Router

__all__ = ["StreamRun", "stream_pairs"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

# Transfers laid out per window (at least one step's): the buffers hold the steps under way plus one window.
WINDOW_TRANSFERS = 1 << 18


def stream_pairs(schedule: Schedule) -> IntArray:
    """The distinct rank pairs ``src * n + dst`` the schedule's transfers use, increasing, from its streams: a
    stream visits the peers ``peer + j * peer_stride`` (mod n), which repeat after n / gcd(peer_stride, n)."""
    s = schedule.streams
    n = schedule.world_size
    live = s.steps > 0
    stride = np.mod(s.peer_stride[live], n)
    period = n // np.gcd(stride, n)
    count = np.minimum(s.steps[live], period)
    stream = np.repeat(np.arange(int(live.sum()), dtype=np.int64), count)
    j = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    dst = np.mod(s.peer[live][stream] + j * stride[stream], n)
    keys, _ = numbered(s.src[live][stream] * n + dst, n * n)
    return keys


def _in_flight_bound(schedule: Schedule, total: int) -> int:
    """At most how many transfers are in flight at once: per rank, at most one per stream it sends on and one
    per stream that can send to it."""
    s = schedule.streams
    live = s.steps > 0
    fixed = live & (s.peer_stride % schedule.world_size == 0)
    strided = int(np.count_nonzero(live & ~fixed))
    bound = int(np.count_nonzero(live)) + int(np.count_nonzero(fixed)) + strided * schedule.world_size
    return min(bound, total) + 1


class _Rings:
    """Arrays indexed by a number modulo their size (a power of two), holding the numbers ``[lo, hi)``. The fields
    named together in ``records`` share one array of records (each field a strided view of it), so that an entry's
    fields the kernel reads together are one cache line, not one per field; the others are arrays of their own."""

    def __init__(self, capacity: int, records: tuple[tuple[str, ...], ...] = (), **fields: tuple[type, float]) -> None:
        self.mask = capacity - 1
        self.fields = fields
        self.records = records
        self.arrays: dict[str, Any] = self._make(capacity)

    def _make(self, capacity: int) -> dict[str, Any]:
        """The fields' arrays of ``capacity`` entries, set to their fill values."""
        arrays: dict[str, Any] = {}
        for names in self.records:
            # Widest fields first, so each is aligned; a record of 64 bytes or less fills at most one cache line
            # (numpy's buffers are 64-byte aligned), larger ones are padded to whole lines.
            ordered = sorted(names, key=lambda name: -np.dtype(self.fields[name][0]).itemsize)
            offsets = np.cumsum([0] + [np.dtype(self.fields[name][0]).itemsize for name in ordered])
            size = int(offsets[-1])
            itemsize = 1 << max(size - 1, 0).bit_length() if size <= 64 else -(-size // 64) * 64
            record = np.dtype(
                {
                    "names": ordered,
                    "formats": [self.fields[name][0] for name in ordered],
                    "offsets": [int(o) for o in offsets[:-1]],
                    "itemsize": itemsize,
                }
            )
            # Aligned to a cache line (a large buffer from malloc starts 16 bytes into a page).
            raw = np.empty(capacity * itemsize + 64, dtype=np.uint8)
            at = -raw.ctypes.data % 64
            block = raw[at : at + capacity * itemsize].view(record)
            for name in ordered:
                arrays[name] = block[name]
                arrays[name].fill(self.fields[name][1])
        for name, (dtype, fill) in self.fields.items():
            if name not in arrays:
                arrays[name] = np.full(capacity, fill, dtype=dtype)
        return arrays

    def fit(self, lo: int, hi: int) -> None:
        """Make room for the numbers ``[lo, hi)``, keeping those held."""
        capacity = self.mask + 1
        if hi - lo <= capacity:
            return
        while capacity < hi - lo:
            capacity *= 2
        old = np.arange(lo, hi, dtype=np.int64)
        arrays = self._make(capacity)
        for name, array in arrays.items():
            array[old & (capacity - 1)] = self.arrays[name][old & self.mask]
        self.arrays = arrays
        self.mask = capacity - 1

    def __getitem__(self, name: str) -> Any:
        return self.arrays[name]

    def _pieces(self, lo: int, hi: int) -> list[tuple[slice, slice]]:
        """The numbers ``[lo, hi)`` as at most two slices of the rings, each with its slice of ``[0, hi - lo)``."""
        at, count = lo & self.mask, hi - lo
        first = min(count, self.mask + 1 - at)
        pieces = [(slice(at, at + first), slice(0, first))]
        if count > first:
            pieces.append((slice(0, count - first), slice(first, count)))
        return pieces

    def span(self, lo: int, hi: int, *names: str) -> list[Any]:
        """Fields ``names`` of the numbers ``[lo, hi)``, in order: views where they do not wrap round (slices,
        not a gather through ``number & mask``)."""
        pieces = self._pieces(lo, hi)
        if len(pieces) == 1:
            return [self.arrays[name][pieces[0][0]] for name in names]
        return [np.concatenate([self.arrays[name][at] for at, _ in pieces]) for name in names]

    def put(self, name: str, lo: int, values: Any) -> None:
        """Set field ``name`` of the numbers from ``lo`` on to the array ``values``."""
        array = self.arrays[name]
        for at, part in self._pieces(lo, lo + len(values)):
            array[at] = values[part]

    def reset(self, lo: int, hi: int, names: tuple[str, ...]) -> None:
        """Set fields ``names`` of the numbers ``[lo, hi)`` to their fill values."""
        for name in names:
            for at, _ in self._pieces(lo, hi):
                self.arrays[name][at] = self.fields[name][1]

    def __setitem__(self, name: str, array: Any) -> None:
        self.arrays[name] = array


class _Median:
    """The median of many non-negative floats (``np.median``'s, exactly) in bounded memory: the floats go to a
    temporary file as they come, and the middle two are found by a radix selection over their bit patterns
    (non-negative floats order as their patterns do as integers): per pass, the count of each value of the
    next few bits among the floats whose leading bits are those found so far."""

    CHUNK = 1 << 22  # floats read back at a time
    BITS = (22, 21, 21)  # the bits each pass settles (64 in all)

    def __init__(self) -> None:
        self.file: IO[bytes] | None = None
        self.count = 0

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def add(self, values: FloatArray) -> None:
        if self.file is None:
            self.file = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close(): the run owns it)
        np.ascontiguousarray(values, dtype=np.float64).tofile(self.file)
        self.count += values.size

    def _chunks(self) -> Iterator[IntArray]:
        assert self.file is not None
        self.file.flush()
        self.file.seek(0)
        left = self.count
        while left:
            chunk = np.fromfile(self.file, dtype=np.int64, count=min(left, self.CHUNK))
            left -= chunk.size
            yield chunk

    def _select(self, ranks: tuple[int, ...]) -> list[int]:
        """The bit patterns of the floats of the given (0-based) ranks in increasing order."""
        found: list[int] = []
        for rank in ranks:
            prefix, known, k = 0, 0, rank
            for bits in self.BITS:
                shift = 64 - known - bits
                count = np.zeros(1 << bits, dtype=np.int64)
                for chunk in self._chunks():
                    part = chunk[(chunk >> (64 - known)) == prefix] if known else chunk
                    count += np.bincount((part >> shift) & ((1 << bits) - 1), minlength=1 << bits)
                below = np.cumsum(count)
                digit = int(np.searchsorted(below, k, side="right"))
                k -= int(below[digit - 1]) if digit else 0
                prefix, known = (prefix << bits) | digit, known + bits
            found.append(prefix)
        return found

    def median(self) -> float:
        """The median of the floats added (inf: none); the file is closed."""
        if not self.count:
            self.close()
            return float("inf")
        ranks = ((self.count - 1) // 2, self.count // 2)
        patterns = self._select(ranks[:1] if ranks[0] == ranks[1] else ranks)
        self.close()
        return float(np.mean(np.asarray(patterns, dtype=np.int64).view(np.float64)))


class StreamRun:
    """One run of the compiled event core on a streamed layout (the module docstring). ``run`` runs it and folds
    in what the result needs: ``rank_end``, ``phases`` (per phase of the schedule: start, end, slowest rate,
    median rate), ``pair_bytes``, ``trace_start``/``trace_end`` (the first ``trace_ranks`` ranks), and the
    critical path (:meth:`chain`)."""

    def __init__(
        self,
        schedule: Schedule,
        router: Router,
        size_bytes: float,
        rank_delay_s: FloatArray | None,
        *,
        trace_ranks: int,
        window_transfers: int = WINDOW_TRANSFERS,
        collect_min: int = COLLECT_MIN,
    ) -> None:
        """``window_transfers``: how many transfers to lay out at a time (at least a step's); ``collect_min``: the
        critical path's records are compacted when more than half of them, and more than this, were dropped."""
        self.schedule = schedule
        n = self.n = schedule.world_size
        self.size_bytes = float(size_bytes)
        self.delay = np.zeros(n) if rank_delay_s is None else np.asarray(rank_delay_s, dtype=np.float64)
        s = schedule.streams
        self.num_steps = num_steps = int((s.start + s.steps).max()) if len(s) else 0
        per_step = np.zeros(num_steps + 1, dtype=np.int64)
        np.add.at(per_step, s.start, 1)
        np.add.at(per_step, s.start + s.steps, -1)
        per_step = np.cumsum(per_step)[:num_steps]
        self.steps_with = np.flatnonzero(per_step)  # the steps with transfers (the trace's rows)
        self.step_first = np.concatenate([[0], np.cumsum(per_step)])  # transfers before each step
        self.total = int(self.step_first[-1])
        self.window_transfers = max(int(window_transfers), 1)

        self.pair_keys = stream_pairs(schedule)
        routes = route_pairs(router, self.pair_keys, n)
        self.routes = routes
        self.used_links = routes.used_links
        self.in_flight = _in_flight_bound(schedule, self.total)

        capacity = 1 << max(int(2 * self.window_transfers).bit_length(), 4)
        self.transfers = _Rings(
            capacity,
            # What the kernel reads of a transfer, in one cache line; the times it writes, in half of one.
            (
                ("fraction", "send_slot", "recv_slot", "trigger", "slowest", "pair", "holder", "bottleneck", "ready"),
                ("start_s", "drained_s", "delivered_s"),
            ),
            fraction=(np.float64, 0.0),
            pair=(np.int32, 0),
            send_slot=(np.int64, -1),
            recv_slot=(np.int64, -1),
            trigger=(np.int64, -1),
            start_s=(np.float64, np.nan),
            drained_s=(np.float64, np.nan),
            delivered_s=(np.float64, np.nan),
            slowest=(np.float64, np.inf),
            bottleneck=(np.int32, -1),
            ready=(np.int8, 0),  # how many of its two slots have begun
            holder=(np.int32, -1),  # the block it drains in
        )
        self.slots = _Rings(
            capacity,
            (
                ("m0", "m1", "succ", "pred", "parent", "slot_last", "rank", "step", "pending"),
                ("slot_start", "slot_end"),
            ),
            m0=(np.int64, 0),
            m1=(np.int64, 0),
            rank=(np.int32, 0),
            step=(np.int32, 0),
            pending=(np.int32, 0),
            slot_start=(np.float64, np.nan),
            slot_end=(np.float64, np.nan),
            slot_last=(np.int64, -1),
            succ=(np.int64, UNKNOWN),
            pred=(np.int64, -1),
            parent=(np.int64, -1),
        )
        self.members = _Rings(2 * capacity, member=(np.int64, 0))
        self.steps = _Rings(64, step_open=(np.int64, 0))
        # Per step laid out: its first slot and first member (the step after the last: where the next begin).
        self.step_slot = np.zeros(num_steps + 1, dtype=np.int64)
        self.step_member = np.zeros(num_steps + 1, dtype=np.int64)
        self.low = 0  # steps below are released
        self.high = 0  # steps below are laid out
        self.last_slot = np.full(n, -1, dtype=np.int64)  # per rank, its last slot laid out
        self.first_slot = np.full(n, -1, dtype=np.int64)
        self.rank_end = np.zeros(n)
        self.pair_bytes = np.zeros(routes.length.size)
        self.kernel_stats = np.zeros(5, dtype=np.int64)
        self.clock = np.zeros(1)  # the time of an instant the kernel stopped in (to lay out more)
        # CPU seconds laying out windows, in the kernel, folding released steps in (collections included).
        self.cpu_s = {"lay out": 0.0, "kernel": 0.0, "fold": 0.0}
        self._work: tuple[Any, ...] = ()

        self.phases = [(p.first_step, p.repeat, len(p)) for p in schedule.phases()]
        self.phase_start = np.full(len(self.phases), np.inf)
        self.phase_end = np.full(len(self.phases), -np.inf)
        self.phase_slowest = np.full(len(self.phases), np.inf)
        self.phase_rates = [_Median() for _ in self.phases]
        self.fair_share: list[float] = []
        self.trace_ranks = k = min(n, trace_ranks)
        self.trace_start = np.full((self.steps_with.size, k), np.nan)
        self.trace_end = np.full((self.steps_with.size, k), np.nan)
        self.path = PathRecords(n, collect_min)

    # -- laying out ---------------------------------------------------------------------------------
    def _lay_out(self) -> None:
        """Lay out the next window of steps."""
        clock = time.process_time()
        self._lay_out_window()
        self.cpu_s["lay out"] += time.process_time() - clock

    def _lay_out_window(self) -> None:
        a = self.high
        b = int(np.searchsorted(self.step_first, self.step_first[a] + self.window_transfers, side="right")) - 1
        b = min(max(b, a + 1), self.num_steps)
        n = self.n
        t = match_transfers(self.schedule, (a, b))
        m = len(t)
        x0 = int(self.step_first[a])
        s0 = int(self.step_slot[a])
        m0 = int(self.step_member[a])
        tr, sl, mb = self.transfers, self.slots, self.members
        tr.fit(int(self.step_first[self.low]), x0 + m)
        tr.put("fraction", x0, t.fraction)
        tr.put("pair", x0, np.searchsorted(self.pair_keys, t.src.astype(np.int64) * n + t.dst))
        tr.reset(
            x0, x0 + m, ("trigger", "start_s", "drained_s", "delivered_s", "slowest", "bottleneck", "ready", "holder")
        )

        # Slots numbered step by step: keys (step - a) * n + rank.
        keys = np.concatenate([t.src, t.dst]).astype(np.int64)
        keys[:m] += (t.step.astype(np.int64) - a) * n
        keys[m:] += (t.step.astype(np.int64) - a) * n
        slot_keys, slot_of = numbered(keys, (b - a) * n)
        del keys
        k = slot_keys.size
        sl.fit(int(self.step_slot[self.low]), s0 + k)
        ids = np.arange(s0, s0 + k, dtype=np.int64)
        tr.put("send_slot", x0, s0 + slot_of[:m])
        tr.put("recv_slot", x0, s0 + slot_of[m:])
        rank = (slot_keys % n).astype(np.int32)
        step = (a + slot_keys // n).astype(np.int32)
        counts = np.bincount(slot_of, minlength=k)
        first_member = m0 + np.cumsum(counts) - counts
        sl.put("m0", s0, first_member)
        sl.put("m1", s0, first_member + counts)
        sl.put("rank", s0, rank)
        sl.put("step", s0, step)
        sl.put("pending", s0, counts)
        sl.reset(s0, s0 + k, ("slot_start", "slot_end", "slot_last", "parent"))
        # Members: sends before receives, each in transfer order (as the whole layout has them).
        mb.fit(int(self.step_member[self.low]), m0 + 2 * m)
        order = np.argsort(slot_of, kind="stable")
        mb.put("member", m0, x0 + order % max(m, 1))
        del order, slot_of

        # Each slot's predecessor and successor (the rank's previous and next slots).
        final = b == self.num_steps
        by_rank = np.argsort(rank, kind="stable")
        same = rank[by_rank][1:] == rank[by_rank][:-1]
        pred = np.full(k, -1, dtype=np.int64)
        succ = np.full(k, -1 if final else UNKNOWN, dtype=np.int64)
        pred[by_rank[1:][same]] = ids[by_rank[:-1][same]]
        succ[by_rank[:-1][same]] = ids[by_rank[1:][same]]
        head = np.ones(k, dtype=np.bool_)
        head[by_rank[1:][same]] = False
        first = np.flatnonzero(head)
        earlier = self.last_slot[rank[first]]
        pred[first] = earlier
        had = earlier >= 0
        sl["succ"][earlier[had] & sl.mask] = ids[first[had]]
        fresh = self.first_slot[rank[first]] < 0
        self.first_slot[rank[first[fresh]]] = ids[first[fresh]]
        sl.put("pred", s0, pred)
        sl.put("succ", s0, succ)
        tail = np.ones(k, dtype=np.bool_)
        tail[by_rank[:-1][same]] = False
        self.last_slot[rank[tail]] = ids[tail]
        if final:  # ranks whose last slot came in an earlier window
            last = self.last_slot[self.last_slot >= 0]
            unknown = sl["succ"][last & sl.mask] == UNKNOWN
            sl["succ"][last[unknown] & sl.mask] = -1

        st = self.steps
        st.fit(self.low, b)
        st["step_open"][np.arange(a, b) & st.mask] = np.bincount(t.step - a, minlength=b - a) + np.bincount(
            step - a, minlength=b - a
        )
        self.step_slot[a + 1 : b + 1] = s0 + np.cumsum(np.bincount(step - a, minlength=b - a))
        self.step_member[a + 1 : b + 1] = m0 + 2 * np.cumsum(np.bincount(t.step - a, minlength=b - a))
        self.high = b

    # -- folding in ---------------------------------------------------------------------------------
    def _release(self) -> None:
        """Fold in and release the steps whose transfers and slots are all done."""
        st = self.steps
        hi = self.low
        open_ = st["step_open"]
        while hi < self.high and open_[hi & st.mask] == 0:
            hi += 1
        if hi == self.low:
            return
        lo = self.low
        tr, sl = self.transfers, self.slots
        x_lo, x_hi = int(self.step_first[lo]), int(self.step_first[hi])
        fraction, pair, start, drained = tr.span(x_lo, x_hi, "fraction", "pair", "start_s", "drained_s")
        nbytes = fraction * self.size_bytes
        self.pair_bytes += np.bincount(pair, weights=nbytes, minlength=self.pair_bytes.size)
        rates = np.divide(nbytes, drained - start, out=np.full(nbytes.size, np.inf), where=drained > start)
        s_lo, s_hi = int(self.step_slot[lo]), int(self.step_slot[hi])
        slot_step, slot_rank, slot_start, slot_end = sl.span(s_lo, s_hi, "step", "rank", "slot_start", "slot_end")
        finish = slot_end + self.delay[slot_rank]
        for i, (first, repeat, _) in enumerate(self.phases):
            a, b = max(first, lo), min(first + repeat, hi)
            if a >= b:
                continue
            in_slots = (slot_step >= a) & (slot_step < b)
            if in_slots.any():
                self.phase_start[i] = min(self.phase_start[i], float(slot_start[in_slots].min()))
                self.phase_end[i] = max(self.phase_end[i], float(finish[in_slots].max()))
            part = rates[self.step_first[a] - self.step_first[lo] : self.step_first[b] - self.step_first[lo]]
            if part.size:
                self.phase_slowest[i] = min(self.phase_slowest[i], float(part.min()))
                self.phase_rates[i].add(part)
        shown = np.flatnonzero(slot_rank < self.trace_ranks)
        row = np.searchsorted(self.steps_with, slot_step[shown])
        self.trace_start[row, slot_rank[shown]] = slot_start[shown]
        self.trace_end[row, slot_rank[shown]] = finish[shown]
        tr = self.transfers
        fields = ("send_slot", "recv_slot", "trigger", "start_s", "drained_s", "delivered_s", "slowest", "bottleneck")
        self.path.add(
            tuple(tr[name] for name in fields),
            (np.ascontiguousarray(slot_rank), sl["rank"], sl["slot_last"], sl["parent"]),
            np.array([tr.mask, sl.mask], dtype=np.int64),
            s_lo,
        )
        self.low = hi

    # -- the run ------------------------------------------------------------------------------------
    def run(self, progress: Callable[[float], None] | None = None) -> None:
        """Run to the end (``progress``: as run_kernel's)."""
        routes = self.routes
        pending = self.slots["pending"]
        self._work = make_work(routes.link_capacity, routes.length, self.in_flight, (pending, 0), self.kernel_stats)
        self._lay_out()
        active = np.flatnonzero(self._has_slots())
        while self.high < self.num_steps and np.any(self.first_slot[active] < 0):
            self._lay_out()
        idle = np.ones(self.n, dtype=np.bool_)
        idle[active] = False
        self.rank_end[idle] = 0.0
        queue = Queue(
            self.n,
            self.in_flight,
            np.zeros(active.size),
            self.first_slot[active],
            progress,
            constants=(np.asarray(routes.latency_s, dtype=np.float64), self.delay),
            look_ahead=True,
        )
        try:
            self._drive(queue)
            self.fair_share = [median.median() for median in self.phase_rates]
        finally:
            for median in self.phase_rates:
                median.close()
        counters = self._work[8][-1]
        self.kernel_stats[3], self.kernel_stats[4] = counters[3], counters[4]

    def _drive(self, queue: Queue) -> None:
        """Call the kernel until the run is over, laying out and folding in steps as it asks."""
        status = MORE
        while status != DONE:
            if status == MORE:
                route, program, out = self._program()
            clock = time.process_time()
            status = queue.step(route, program, out, self._work, self.total)
            self.cpu_s["kernel"] += time.process_time() - clock
            if status in (MORE, DONE):
                clock = time.process_time()
                self._release()
                self.cpu_s["fold"] += time.process_time() - clock
            if status == MORE:
                self._lay_out()
        if queue.status != DONE:
            raise RuntimeError(f"{self.schedule.name}: more than {self.in_flight} transfers in flight at once")
        if self.low < self.num_steps:
            raise RuntimeError(f"{self.schedule.name}: steps from {self.low} on never finished")

    def _has_slots(self) -> npt.NDArray[np.bool_]:
        has = np.zeros(self.n, dtype=np.bool_)
        has[self.pair_keys // self.n] = True
        has[self.pair_keys % self.n] = True
        return has

    def _program(self) -> tuple[Any, ...]:
        """The kernel's arguments over the buffers as they are (laying out may have grown them)."""
        tr, sl, mb, st = self.transfers, self.slots, self.members, self.steps
        routes = self.routes
        self._work = (sl["pending"], tr["ready"], tr["holder"], *self._work[3:])
        route = (tr["pair"], routes.ptr, routes.link, routes.weight, routes.link_capacity)
        program = (
            tr["fraction"],
            self.size_bytes,
            routes.latency_s,
            np.zeros(0),
            tr["send_slot"],
            tr["recv_slot"],
            sl["m0"],
            sl["m1"],
            mb["member"],
            sl["rank"],
            np.zeros(0, dtype=np.int64),
            self.delay,
            np.array([tr.mask, sl.mask, mb.mask, st.mask], dtype=np.int64),
            sl["succ"],
            sl["pred"],
            sl["parent"],
            sl["step"],
            st["step_open"],
            self.clock,
        )
        out = (
            sl["slot_start"],
            sl["slot_end"],
            sl["slot_last"],
            tr["trigger"],
            tr["start_s"],
            tr["drained_s"],
            tr["delivered_s"],
            self.rank_end,
            tr["slowest"],
            tr["bottleneck"],
        )
        return route, program, out

    # -- results ------------------------------------------------------------------------------------
    def chain(self) -> ChainRecords:
        """The critical path's records, earliest first, from the last slot of the rank that finished last."""
        current = int(self.last_slot[int(np.argmax(self.rank_end))]) if self.total else -1
        picked = self.path.walk(current)
        if not picked.size:
            empty = np.zeros(0, dtype=np.int64)
            return ChainRecords(empty, empty, empty, *(np.zeros(0),) * 4, empty, np.zeros(0))
        r = {name: a[picked] for name, a in self.path.records.items()}
        bottleneck = r["bottleneck"].astype(np.int64)
        src, dst = r["src"].astype(np.int64), r["dst"].astype(np.int64)
        return ChainRecords(
            src=src,
            dst=dst,
            step=np.searchsorted(self.step_slot, r["slot"], side="right") - 1,
            start_s=r["start_s"],
            drained_s=r["drained_s"],
            delivered_s=r["delivered_s"],
            slowest_rate=r["slowest_rate"],
            bottleneck=np.where(bottleneck >= 0, self.used_links[np.maximum(bottleneck, 0)], -1),
            delay_s=self.delay[np.where(r["sent"], src, dst)],
        )

    def phase_results(self) -> tuple[PhaseResult, ...]:
        """Per phase of the schedule: as run_event reports it from a whole layout."""
        return tuple(
            PhaseResult(
                first_step=first,
                repeat=repeat,
                num_flows=flows,
                start_s=float(self.phase_start[i]) if np.isfinite(self.phase_start[i]) else 0.0,
                end_s=float(self.phase_end[i]) if np.isfinite(self.phase_end[i]) else 0.0,
                slowest_rate_Bps=float(self.phase_slowest[i]),
                fair_share_Bps=self.fair_share[i],
            )
            for i, (first, repeat, flows) in enumerate(self.phases)
        )
