"""What both event engines share: a schedule's transfers matched from its per-rank programs, routed once
per rank pair, and laid out in arrays — per transfer (bytes, route, latency, its send and receive slots), per
slot (a rank's step: its rank, its transfers) — with the arrays a run fills in (when each slot began and
ended, when each transfer started, drained and was delivered, its slowest rate and bottleneck link)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.schedules import Schedule
from allreduce.sim._routing import Router

__all__ = ["ChainRecords", "Layout", "PairRoutes", "Problem", "Transfers", "match_transfers", "numbered", "route_pairs"]

IntArray = npt.NDArray[np.int64]
Int32Array = npt.NDArray[np.int32]
FloatArray = npt.NDArray[np.float64]

# A table indexed by key numbers distinct keys without a sort where it is no larger than this many 32-bit
# entries per key (a sort's work arrays take about as much).
_TABLE_PER_KEY = 4


@dataclass(frozen=True, eq=False)
class Transfers:
    """Every transfer of a schedule, matched from the per-rank programs: rank ``src`` sends ``fraction`` of the
    buffer to rank ``dst`` at ``step`` (32-bit ranks and steps: millions of transfers are held at once)."""

    src: Int32Array
    dst: Int32Array
    step: Int32Array
    fraction: FloatArray

    def __len__(self) -> int:
        return int(self.src.shape[0])


@dataclass(frozen=True)
class ChainRecords:
    """The critical path, earliest first: per link its transfer (ranks, step, when it started, drained and was
    delivered, its slowest rate and the link that set it: a topology link or -1) and the delay of the rank whose
    slot it ended."""

    src: IntArray
    dst: IntArray
    step: IntArray
    start_s: FloatArray
    drained_s: FloatArray
    delivered_s: FloatArray
    slowest_rate: FloatArray
    bottleneck: IntArray
    delay_s: FloatArray


# What a run simulates: a schedule, its router, its transfers (match_transfers), the bytes per rank, and each
# rank's delay after a step (None: none). Layout's first arguments.
Problem = tuple[Schedule, Router, Transfers, float, FloatArray | None]


def match_transfers(schedule: Schedule, steps: tuple[int, int] | None = None) -> Transfers:
    """Every transfer of the schedule (``steps``: of the steps ``[first, stop)`` only), ordered by step, sender,
    receiver and first block.

    The k-th send from a to b meets the k-th receive at b from a. Both sides are derived from the same stored
    streams (a rank's receives are its peers' sends), so the pairs are the streams expanded, one transfer per
    stream and step: no per-rank program is built."""
    s = schedule.streams
    if steps is None:
        first = np.zeros(len(s), dtype=np.int64)
        count = s.steps
    else:  # each stream's own steps that fall in the range
        first = np.clip(steps[0] - s.start, 0, s.steps)
        count = np.clip(steps[1] - s.start, 0, s.steps) - first
    total = int(count.sum())
    stream = np.repeat(np.arange(len(s), dtype=np.int64), count)
    j = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(count) - count - first, count)
    src = s.src[stream]
    dst = np.mod(s.peer[stream] + j * s.peer_stride[stream], schedule.world_size)
    step = s.start[stream] + j
    block = np.asarray(
        s.block_base[stream]
        + np.mod(s.block_offset[stream] + j * s.block_stride[stream], s.block_period[stream]) * s.block_count[stream],
        dtype=np.int64,
    )
    order = _sort_order(step, src, dst, block, schedule.world_size)
    del block
    return Transfers(
        src=src[order].astype(np.int32),
        dst=dst[order].astype(np.int32),
        step=step[order].astype(np.int32),
        fraction=s.block_count[stream[order]].astype(np.float64) / schedule.buffer_blocks,
    )


def _sort_order(step: IntArray, src: IntArray, dst: IntArray, block: IntArray, n: int) -> IntArray:
    """The order of (step, src, dst, block): one sort of a combined key where it fits 63 bits (a quarter of
    lexsort's four), else lexsort."""
    if not step.size:
        return np.zeros(0, dtype=np.int64)
    steps = int(step.max()) + 1
    blocks = int(block.max()) + 1
    if int(step.min()) >= 0 and int(block.min()) >= 0 and steps * n * n * blocks < 2**62:
        key = ((step * n + src) * n + dst) * blocks + block
        return np.asarray(np.argsort(key, kind="stable"), dtype=np.int64)
    return np.asarray(np.lexsort((block, dst, src, step)), dtype=np.int64)


def numbered(keys: IntArray, space: int) -> tuple[IntArray, Int32Array]:
    """The distinct ``keys`` (all in ``[0, space)``) in increasing order, and each key's place among them: by a
    table over the key space where it is small (no sort), else by np.unique."""
    if space <= _TABLE_PER_KEY * keys.size + 1024:
        table = np.zeros(space, dtype=np.int32)
        table[keys] = 1
        distinct = np.flatnonzero(table)
        table[distinct] = np.arange(distinct.size, dtype=np.int32)
        return distinct, table[keys]
    distinct, inverse = np.unique(keys, return_inverse=True)
    return distinct, inverse.reshape(-1).astype(np.int32)


@dataclass(frozen=True, eq=False)
class PairRoutes:
    """The routes of a run's rank pairs: per pair its entries (``ptr``, ``length``), their links (numbered densely
    over the links used, in their order: ``used_links``) and weights, and its latency; per used link its
    capacity."""

    ptr: IntArray
    length: IntArray
    used_links: IntArray
    link: IntArray
    weight: FloatArray
    latency_s: FloatArray
    link_capacity: FloatArray


def route_pairs(router: Router, keys: IntArray, n: int) -> PairRoutes:
    """Route the rank pairs ``keys`` (``src * n + dst``); ValueError where a link on a route has no capacity."""
    routes = router.route_ranks(keys // n, keys % n)
    used_links, pair_link = np.unique(routes.link, return_inverse=True)
    capacity = router.topology.link_bandwidth_Bps
    link_capacity = capacity[used_links]
    if np.any(~(link_capacity > 0)):
        bad = int(used_links[~(link_capacity > 0)][0])
        raise ValueError(f"link {bad} carries flows but has capacity {capacity[bad]} (must be > 0)")
    return PairRoutes(
        ptr=routes.flow_ptr,
        length=np.diff(routes.flow_ptr),
        used_links=used_links,
        link=pair_link.reshape(-1).astype(np.int64),
        weight=routes.weight,
        latency_s=routes.latency_s,
        link_capacity=link_capacity,
    )


class Layout:
    """A run's arrays: what is fixed (routes, slots) and what the run fills in."""

    def __init__(
        self,
        schedule: Schedule,
        router: Router,
        transfers: Transfers,
        size_bytes: float,
        rank_delay_s: FloatArray | None,
        *,
        start_s: FloatArray | None = None,
        extra_s: FloatArray | None = None,
    ) -> None:
        """``start_s`` (per rank): when each rank reaches the collective (default: all at 0); ``extra_s`` (per
        transfer): a delay added to its delivery after its last byte drained — a retransmission or latency
        jitter, which the fluid model charges to no link's capacity (as the fast engine's recurrence does)."""
        self.schedule = schedule
        self.router = router
        self.capacity = router.topology.link_bandwidth_Bps
        n = schedule.world_size
        t = transfers
        self.t = t
        self.size_bytes = float(size_bytes)
        self._nbytes: FloatArray | None = None
        self.delay = np.zeros(n) if rank_delay_s is None else rank_delay_s

        # Route each distinct (src, dst) pair once.
        keys, self.pair = numbered(t.src.astype(np.int64) * n + t.dst, n * n)
        routes = route_pairs(router, keys, n)
        self.pair_ptr, self.pair_len, self.pair_latency = routes.ptr, routes.length, routes.latency_s
        self.used_links, self.pair_link, self.pair_weight = routes.used_links, routes.link, routes.weight
        self.link_capacity = routes.link_capacity
        # The extra delays per transfer: the compiled core adds them as it delivers, so a run on it holds no
        # per-transfer latency (millions of entries).
        self.extra_s = extra_s
        self._transfer_latency: FloatArray | None = None
        self.start_at = np.zeros(n) if start_s is None else np.asarray(start_s, dtype=np.float64)

        # Slots: one per (rank, step) in which the rank transfers; each transfer sits in two (send, receive).
        steps = int(t.step.max()) + 1 if len(t) else 1
        keys = np.concatenate([t.src, t.dst]).astype(np.int64) * steps
        keys[: len(t)] += t.step
        keys[len(t) :] += t.step
        slot_keys, slot_of = numbered(keys, n * steps)
        del keys
        self.num_slots = int(slot_keys.size)
        self.send_slot = slot_of[: len(t)]
        self.recv_slot = slot_of[len(t) :]
        # Keys sort by rank then step, so a rank's slots are consecutive and in step order.
        self.slot_rank = (slot_keys // steps).astype(np.int32)
        self.slot_step = (slot_keys % steps).astype(np.int32)
        del slot_keys
        self.rank_first_slot = np.searchsorted(self.slot_rank, np.arange(n), side="left")
        self.rank_stop_slot = np.searchsorted(self.slot_rank, np.arange(n), side="right")
        counts = np.bincount(slot_of, minlength=self.num_slots)
        self.slot_ptr: npt.NDArray[np.integer[Any]] = np.zeros(
            self.num_slots + 1, dtype=np.int32 if 2 * len(t) < 2**31 else np.int64
        )
        np.cumsum(counts, out=self.slot_ptr[1:])
        del counts
        # Transfers of slot s: slot_member[slot_ptr[s]:slot_ptr[s+1]], sends before receives, each in order.
        members = np.argsort(slot_of, kind="stable")
        np.remainder(members, max(len(t), 1), out=members)
        self.slot_member = members.astype(np.int32)
        del members

        self._clear()
        self._prepare()

    def _prepare(self) -> None:
        """What a kind of run derives from the layout once it is built (none here; see WindowRun, _Run)."""

    def _clear(self) -> None:
        count = len(self.t)
        self.slot_start = np.full(self.num_slots, np.nan)
        self.slot_end = np.full(self.num_slots, np.nan)
        self.slot_last = np.full(self.num_slots, -1, dtype=np.int32)  # transfer that completed the slot
        self.trigger = np.full(count, -1, dtype=np.int32)  # slot whose start let the transfer begin
        self.start_s = np.full(count, np.nan)
        self.drained_s = np.full(count, np.nan)
        self.delivered_s = np.full(count, np.nan)
        self.rank_end = np.zeros(self.schedule.world_size)
        self.slowest_rate = np.full(count, np.inf)  # per transfer, filled in when the run ends
        self.bottleneck = np.full(count, -1, dtype=np.int32)

    @property
    def nbytes(self) -> FloatArray:
        """Per transfer, its bytes (made on first use: the compiled core multiplies as it starts each)."""
        if self._nbytes is None:
            self._nbytes = self.t.fraction * self.size_bytes
        return self._nbytes

    @property
    def latency(self) -> FloatArray:
        """Per transfer, its path's latency and its extra delay: the time from its last byte leaving to its
        delivery (made on first use: the numpy cores read it, the compiled core adds the two itself)."""
        if self._transfer_latency is None:
            self._transfer_latency = self.pair_latency[self.pair]
            if self.extra_s is not None:
                self._transfer_latency = self._transfer_latency + self.extra_s
        return self._transfer_latency

    def replay(self, start_s: FloatArray, extra_s: FloatArray) -> None:
        """Ready the same transfers for another run, with ranks reaching the collective at ``start_s`` and
        ``extra_s`` added to each delivery (as the constructor has them): routes and slots are kept."""
        self.start_at = np.asarray(start_s, dtype=np.float64)
        self.extra_s = extra_s
        self._transfer_latency = None
        self._clear()
