"""What both event engines share: a schedule's transfers matched from its per-rank programs, routed once
per rank pair, and laid out in arrays — per transfer (bytes, route, latency, its send and receive slots), per
slot (a rank's step: its rank, its transfers) — with the arrays a run fills in (when each slot began and
ended, when each transfer started, drained and was delivered, its slowest rate and bottleneck link)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from allreduce.schedules import Schedule
from allreduce.sim._routing import Router

__all__ = ["Layout", "Problem", "Transfers", "match_transfers"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, eq=False)
class Transfers:
    """Every transfer of a schedule, matched from the per-rank programs: rank ``src`` sends ``fraction`` of the
    buffer to rank ``dst`` at ``step``."""

    src: IntArray
    dst: IntArray
    step: IntArray
    fraction: FloatArray

    def __len__(self) -> int:
        return int(self.src.shape[0])


# What a run simulates: a schedule, its router, its transfers (match_transfers), the bytes per rank, and each
# rank's delay after a step (None: none). Layout's first arguments.
Problem = tuple[Schedule, Router, Transfers, float, FloatArray | None]


def match_transfers(schedule: Schedule) -> Transfers:
    """Every transfer of the schedule, ordered by step, sender, receiver and first block.

    The k-th send from a to b meets the k-th receive at b from a. Both sides are derived from the same stored
    streams (a rank's receives are its peers' sends), so the pairs are the streams expanded, one transfer per
    stream and step: no per-rank program is built."""
    s = schedule.streams
    total = int(s.steps.sum())
    stream = np.repeat(np.arange(len(s), dtype=np.int64), s.steps)
    j = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(s.steps) - s.steps, s.steps)
    src = s.src[stream]
    dst = np.mod(s.peer[stream] + j * s.peer_stride[stream], schedule.world_size)
    step = s.start[stream] + j
    block = (
        s.block_base[stream]
        + np.mod(s.block_offset[stream] + j * s.block_stride[stream], s.block_period[stream]) * s.block_count[stream]
    )
    order = np.lexsort((block, dst, src, step))
    return Transfers(
        src=src[order],
        dst=dst[order],
        step=step[order],
        fraction=s.block_count[stream][order].astype(np.float64) / schedule.num_blocks,
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
        self.nbytes = t.fraction * float(size_bytes)
        self.delay = np.zeros(n) if rank_delay_s is None else rank_delay_s

        # Route each distinct (src, dst) pair once.
        pair_key = t.src * n + t.dst
        keys, self.pair = np.unique(pair_key, return_inverse=True)
        self.pair = self.pair.reshape(-1)
        routes = router.route_ranks(keys // n, keys % n)
        self.pair_ptr = routes.flow_ptr
        self.pair_len = np.diff(routes.flow_ptr)
        # Links renumbered densely over the ones this schedule uses.
        self.used_links, pair_link = np.unique(routes.link, return_inverse=True)
        self.pair_link = pair_link.reshape(-1).astype(np.int64)
        self.pair_weight = routes.weight
        self.link_capacity = link_capacity = self.capacity[self.used_links]
        if np.any(~(link_capacity > 0)):
            bad = int(self.used_links[~(link_capacity > 0)][0])
            raise ValueError(f"link {bad} carries flows but has capacity {self.capacity[bad]} (must be > 0)")
        self.path_latency = routes.latency_s[self.pair]
        self.latency = self.path_latency
        if extra_s is not None:
            self.latency = self.latency + extra_s
        self.start_at = np.zeros(n) if start_s is None else np.asarray(start_s, dtype=np.float64)

        # Slots: one per (rank, step) in which the rank transfers; each transfer sits in two (send, receive).
        slot_rank = np.concatenate([t.src, t.dst])
        slot_step = np.concatenate([t.step, t.step])
        slot_key = slot_rank * (int(t.step.max()) + 1 if len(t) else 1) + slot_step
        slot_keys, slot_of = np.unique(slot_key, return_inverse=True)
        slot_of = slot_of.reshape(-1)
        self.num_slots = int(slot_keys.size)
        self.send_slot = slot_of[: len(t)]
        self.recv_slot = slot_of[len(t) :]
        # Unique keys sort by rank then step, so a rank's slots are consecutive and in step order.
        first_of = np.unique(slot_of, return_index=True)[1]
        self.slot_rank = slot_rank[first_of]
        self.slot_step = slot_step[first_of]
        self.rank_first_slot = np.searchsorted(self.slot_rank, np.arange(n), side="left")
        self.rank_stop_slot = np.searchsorted(self.slot_rank, np.arange(n), side="right")
        members = np.argsort(slot_of, kind="stable")  # entries 0..2T-1 grouped by slot
        self.slot_ptr = np.concatenate([[0], np.cumsum(np.bincount(slot_of, minlength=self.num_slots))])
        self.slot_member = members % max(len(t), 1)  # transfers of slot s: slot_ptr[s]:slot_ptr[s+1]

        self._clear()

    def _clear(self) -> None:
        count = len(self.t)
        self.slot_start = np.full(self.num_slots, np.nan)
        self.slot_end = np.full(self.num_slots, np.nan)
        self.slot_last = np.full(self.num_slots, -1, dtype=np.int64)  # transfer that completed the slot
        self.trigger = np.full(count, -1, dtype=np.int64)  # slot whose start let the transfer begin
        self.start_s = np.full(count, np.nan)
        self.drained_s = np.full(count, np.nan)
        self.delivered_s = np.full(count, np.nan)
        self.rank_end = np.zeros(self.schedule.world_size)
        self.slowest_rate = np.full(count, np.inf)  # per transfer, filled in when the run ends
        self.bottleneck = np.full(count, -1, dtype=np.int64)

    def replay(self, start_s: FloatArray, extra_s: FloatArray) -> None:
        """Ready the same transfers for another run, with ranks reaching the collective at ``start_s`` and
        ``extra_s`` added to each delivery (as the constructor has them): routes and slots are kept."""
        self.start_at = np.asarray(start_s, dtype=np.float64)
        self.latency = self.path_latency + extra_s
        self._clear()
