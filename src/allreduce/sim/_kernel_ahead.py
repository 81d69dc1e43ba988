"""The event core's look-ahead (sim/_kernel.py): as a delivery is popped from a lane, ask for the memory the
deliveries a few places behind it will read.

A lane is first-in first-out, so the entries behind its head are deliveries due soon; their transfers, slots and
links lie in buffers of millions of entries, where each load would otherwise wait for the one before it. Only the
streamed layout's kernel runs it (``Queue(look_ahead=True)``): whole layouts fit in the caches. A prefetch
changes no value (sim/_jit.prefetcher), so results are the same bit for bit with it or without.
"""

from __future__ import annotations

from typing import Any

from allreduce.sim._jit import inline, prefetcher
from allreduce.sim._kernel_heap import DELIVER

__all__ = ["look_ahead"]

# How many events ahead of a lane's head each stage of the look-ahead works.
_AHEAD = (28, 24, 20, 16, 12, 8, 4, 2)

prefetch = prefetcher()


@inline
def look_ahead(lane: int, lane_k: Any, lane_pos: Any, program: Any, pair: Any, route: Any) -> None:  # noqa: PLR0917
    """Ask for the entries the deliveries a few places behind lane ``lane``'s head will read, a stage at a time
    (_AHEAD): each stage reads what the stage before asked for (by now in the cache) and asks for the next (a
    transfer's entries, its slots', the slots that follow them, their members, the members' entries, their pairs'
    route bounds, the routes' entries, their links), so the waits for memory of one delivery overlap with the work
    of those before it. Changes no value (sim/_jit.prefetcher)."""
    send_slot, recv_slot, delivered_s, pending, slot_end, succ, slot_m0, slot_m1, slot_member, ready = program[:10]
    slot_start, start_s, slot_rank, rank_stop_slot, masks = program[10:]
    pair_ptr, pair_link, pair_weight, tail = route
    streamed = succ.size > 0
    head, end = lane_pos[2 * lane], lane_pos[2 * lane + 1]
    lane_mask = (lane_k.shape[1] >> 1) - 1
    tmask, smask, mmask = masks[0], masks[1], masks[2]
    for stage in range(8):
        at = head + _AHEAD[stage]
        if at >= end:
            continue
        item = lane_k[lane, 2 * (at & lane_mask) + 1]
        if item & 3 != DELIVER:
            continue
        xi = (item >> 2) & tmask
        if stage == 0:
            prefetch(send_slot, xi)
            prefetch(delivered_s, xi)
            continue
        for slot in (send_slot[xi], recv_slot[xi]):
            si = slot & smask
            if stage == 1:
                prefetch(pending, si)
                prefetch(slot_end, si)
                prefetch(slot_rank, si)
                continue
            following = succ[si] if streamed else (slot + 1 if slot + 1 < rank_stop_slot[slot_rank[si]] else -1)
            if following < 0:
                continue
            fi = following & smask
            if stage == 2:
                prefetch(slot_m0, fi)
                prefetch(slot_start, fi)
                continue
            for m in range(slot_m0[fi], slot_m1[fi]):
                if stage == 3:
                    prefetch(slot_member, m & mmask)
                    continue
                yi = slot_member[m & mmask] & tmask
                if stage == 4:
                    prefetch(ready, yi)
                    prefetch(start_s, yi)
                    continue
                p = pair[yi]
                if stage == 5:
                    prefetch(pair_ptr, p)
                    continue
                e0, e1 = pair_ptr[p], pair_ptr[p + 1]
                if stage == 6:
                    prefetch(pair_link, e0)
                    prefetch(pair_weight, e0)
                    continue
                for e in range(e0, e1):
                    prefetch(tail, pair_link[e])
