"""The critical path's records of a streamed run (sim/_stream.py), kept while the walk back at the end may need
them.

Per released slot a record: the transfer that ended it (its ranks, times, slowest rate and bottleneck) and its
parent, the slot before the one whose start let that transfer begin, held as the parent record's position. A
slot still in the buffers reaches the released ones only through its rank's last released slot (a parent is
the slot before a slot of the same step), so those, one per rank, are the roots: each record counts its kept
children, plus one while it is a root, and is dropped when that count falls to zero, walking up. So each record
is written, counted in and dropped once, whatever the run's size; the arrays are compacted when more than half
of them are dropped. The records kept are the slots the chains from the roots pass through: about 2.5 M (of
25 M released) on a randomly placed 16,384-rank ring after 1,500 of its 32,766 steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.sim._jit import njit

__all__ = ["COLLECT_MIN", "PathRecords"]

IntArray = npt.NDArray[np.int64]

# The records are compacted when more than half of them, and more than this, were dropped.
COLLECT_MIN = 1 << 16
# The record fields, in the order _gather_records takes them (57 bytes a record: the step follows from the slot,
# the delay from the slot's rank, the transfer's sender or not).
RECORD_FIELDS = (
    ("slot", np.int64),
    ("up", np.int64),
    ("src", np.int32),
    ("dst", np.int32),
    ("sent", np.bool_),
    ("start_s", np.float64),
    ("drained_s", np.float64),
    ("delivered_s", np.float64),
    ("slowest_rate", np.float64),
    ("bottleneck", np.int32),
    ("rc", np.int32),
)


@njit
def _adopt(records: Any, first: int, rank: Any, root: Any, replaced: Any) -> int:
    """Count new records in (``records``: every record's parent's position ``up`` and count ``rc``; the new
    ones are ``first, first + 1, ...``, one per entry of ``rank``, their rank, with ``up`` set and ``rc`` 0):
    each is a child of its parent, and each rank's last of them becomes its root (``root``: per rank, its last
    released slot's record). Then drop every record no root reaches any more (``rc`` -1), walking up from the
    new records and from the roots replaced (``replaced``: room for as many). ``rc`` counts a record's
    children kept, plus one while it is a root. Returns how many were dropped."""
    up, rc = records
    count = rank.size
    for i in range(first, first + count):
        if up[i] >= 0:
            rc[up[i]] += 1
    num_replaced = 0
    for i in range(count):
        old = root[rank[i]]
        root[rank[i]] = first + i
        rc[first + i] += 1
        if old >= 0:
            rc[old] -= 1
            replaced[num_replaced] = old
            num_replaced += 1
    dropped = 0
    for i in range(count + num_replaced):
        x = first + i if i < count else replaced[i - count]
        while x >= 0 and rc[x] == 0:
            rc[x] = -1
            dropped += 1
            x = up[x]
            if x >= 0:
                rc[x] -= 1
    return dropped


@njit
def _gather_records(rings: Any, masks: Any, s_lo: int, records: Any, first: int, root: Any) -> int:  # noqa: PLR0917
    """Write the records of the released slots ``s_lo, s_lo + 1, ...`` at positions ``first, first + 1, ...``
    (``records``: the arrays of RECORD_FIELDS, with room): per slot the transfer that ended it (``rings``: the
    transfers' send and receive slots, trigger, start, drain and delivery times, slowest rate and bottleneck;
    the released slots' ranks, one per record; the slots' rank, last transfer and parent; ``masks``: the
    transfers' and slots') and its parent's position (-1 none, ``rc`` 0). The parent is the slot before the
    one whose start let that transfer begin (its trigger, in the released slot's step): released in this
    batch, or before it, and then the last released slot of the trigger's rank, its root (``root``). Returns
    how many records were written, or -1 where a parent has no record kept."""
    send_slot, recv_slot, trigger, start_s, drained_s, delivered_s, slowest, bottleneck = rings[:8]
    released, slot_rank, slot_last, parent = rings[8:]
    tmask, smask = masks[0], masks[1]
    r_slot, r_up, r_src, r_dst, r_sent, r_start, r_drained, r_delivered, r_slowest, r_bottleneck, r_rc = records
    count = released.size
    for i in range(count):
        s = s_lo + i
        si = s & smask
        xi = slot_last[si] & tmask
        at = first + i
        r_slot[at] = s
        r_src[at] = slot_rank[send_slot[xi] & smask]
        r_dst[at] = slot_rank[recv_slot[xi] & smask]
        r_sent[at] = send_slot[xi] == s
        r_start[at] = start_s[xi]
        r_drained[at] = drained_s[xi]
        r_delivered[at] = delivered_s[xi]
        r_slowest[at] = slowest[xi]
        r_bottleneck[at] = bottleneck[xi]
        r_rc[at] = 0
        up = parent[si]
        if up < 0:
            r_up[at] = -1
            continue
        found = first + up - s_lo if up >= s_lo else root[slot_rank[trigger[xi] & smask]]
        if found < 0 or r_slot[found] != up or r_rc[found] < 0:
            return -1
        r_up[at] = found
    written: int = released.size
    return written


class PathRecords:
    """The records of a streamed run's released slots that a walk back from a rank's last slot may need."""

    def __init__(self, ranks: int, collect_min: int = COLLECT_MIN) -> None:
        """``collect_min``: the records are compacted when more than half of them, and more than this, were
        dropped."""
        self.records: dict[str, Any] = {}
        self.num_records = 0
        self.root = np.full(ranks, -1, dtype=np.int64)  # per rank, its last released slot's record
        self.dropped = 0  # records dropped since the last compaction
        self.collect_min = collect_min

    def add(self, transfers: tuple[Any, ...], slots: tuple[Any, ...], masks: IntArray, s_lo: int) -> None:
        """Keep the records of the released slots ``s_lo, s_lo + 1, ...``, and drop those no root reaches any
        more. ``transfers``: the transfers' rings of send and receive slots, trigger, start, drain and delivery
        times, slowest rate and bottleneck; ``slots``: the released slots' ranks, then the slots' rings of rank,
        last transfer and parent; ``masks``: the transfers' rings' and the slots'."""
        count = slots[0].size
        if not self.records:
            self.records = {name: np.empty(max(2 * count, 1024), dtype=dtype) for name, dtype in RECORD_FIELDS}
        first = self.num_records
        size = first + count
        if size > self.records["slot"].size:
            capacity = max(size, self.records["slot"].size * 3 // 2)
            for name, a in self.records.items():
                grown = np.empty(capacity, dtype=a.dtype)
                grown[:first] = a[:first]
                self.records[name] = grown
        records = tuple(self.records[name] for name, _ in RECORD_FIELDS)
        if _gather_records((*transfers, *slots), masks, s_lo, records, first, self.root) < 0:
            raise RuntimeError("a critical path's parent slot has no record")
        self.num_records = size
        replaced = np.empty(count, dtype=np.int64)
        self.dropped += _adopt((self.records["up"], self.records["rc"]), first, slots[0], self.root, replaced)
        if self.dropped > max(self.num_records // 2, self.collect_min):
            self.compact()

    def compact(self) -> None:
        """Leave out the records dropped (each kept record's parent is kept: it moves with it)."""
        count = self.num_records
        keep = self.records["rc"][:count] >= 0
        kept = int(np.count_nonzero(keep))
        position = np.cumsum(keep) - 1
        for a in self.records.values():
            a[:kept] = a[:count][keep]
        up = self.records["up"][:kept]
        up[up >= 0] = position[up[up >= 0]]
        rooted = self.root >= 0
        self.root[rooted] = position[self.root[rooted]]
        self.num_records = kept
        self.dropped = 0

    def walk(self, slot: int) -> IntArray:
        """The positions of the records from slot ``slot``'s (a root's; -1: none) up, earliest first."""
        if slot < 0 or not self.num_records:
            return np.zeros(0, dtype=np.int64)
        at: list[int] = []
        i = int(np.searchsorted(self.records["slot"][: self.num_records], slot))
        while i >= 0:
            at.append(i)
            i = int(self.records["up"][i])
        return np.asarray(at[::-1], dtype=np.int64)
