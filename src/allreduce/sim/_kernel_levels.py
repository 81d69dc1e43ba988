"""Max-min fair rates re-solved from the changed links outwards, for the compiled event core (sim/_kernel.py).

Progressive filling raises every rate together and freezes a transfer at the level where a link on its path
fills. After a change (transfers started or drained at one instant) the filling is replayed lazily, level by
level in increasing order, and only where it can differ from the last one:

- a link is *perturbed* when its set of draining transfers changed, or when a transfer crossing it took a rate
  other than its old one; a perturbed link's fill level is kept exactly (room left by the transfers frozen on
  it, over the weight of those not frozen yet) and it fills when the level reaches it;
- every other link keeps the level it filled at the last time it was solved (``level``; infinite if it never
  filled): its transfers and their rates are the same, so it fills at the same level again;
- when a link is perturbed at level ``lam``, its transfers whose old rate is below ``lam`` are frozen at it
  (whatever froze them has not changed below ``lam``, or a link on their path would have been perturbed
  first); the rest are *in play*, each with a check at its old rate: at that level, if a link on its path
  that is not perturbed filled at that same level, it freezes there again with its old rate; if not, it rises
  past its old rate and every link it crosses is perturbed.

So a re-solve costs what the change reaches through transfers whose rates move, not the whole component of
transfers sharing links with it (which a full re-solve fills level by level, most of them to the rate they had).
Most of a ring's changes reach nothing: a transfer starts or drains on links no other transfer drains through.
:func:`resolve_alone` answers those without the queue, setting the same floats the filling would.
The result is the max-min fair allocation, as a full progressive filling gives it, to rounding: the sums are
running sums, links whose levels agree to _LEVEL_RTOL fill together (as sim/_fair.py), and a transfer whose new
rate is within _KEEP_RTOL of its old one keeps the old one (no new drain event). The compiled code allocates
nothing (sim/_jit.py): :func:`solve_scratch` makes its arrays, the queue of levels among them (the event
queue's heap, sim/_kernel_heap.py: level, then the item, for a deterministic order).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from allreduce.sim._jit import inline, njit
from allreduce.sim._kernel_heap import pop, push

__all__ = ["alone_unlinked", "resolve", "resolve_alone", "resolve_fill", "resolve_solo", "solve_scratch"]

# Links whose fill levels agree to this relative tolerance saturate together (as sim/_fair.py and sim/_event.py).
_LEVEL_RTOL = 1e-9
# A level this close to a transfer's old rate is that rate: rounding of the running sums moves no drain event.
_KEEP_RTOL = 1e-12

# Per link (int rows): the level group that filled it, the re-solve that perturbed it, the version of its entry
# in the queue, its transfers not frozen yet. (float rows): the level it filled at, room, weight not frozen. The
# kernel keeps a link's rows in one record (sim/_kernel.py's link_records): the level and the group that filled
# it, what a transfer alone on its links reads (resolve_alone), in the cache line of its list's head and tail.
_FILLED, _PERTURBED, _VERSION, _UNFROZEN = 0, 1, 2, 3
_LEVEL, _ROOM, _DEMAND = 0, 1, 2
# Per block (int rows): the re-solve that put it in play, the one that froze it, its new bottleneck link.
_IN_PLAY, _FROZEN, _BOTTLENECK = 0, 1, 2
# Counters: perturbed links, transfers in play, queue size, level groups so far (a run's: group numbers mark
# filled links), list nodes visited.
_NUM_PERTURBED, _NUM_IN_PLAY, _QUEUE, _GROUP, _VISITED = 0, 1, 2, 3, 4


def solve_scratch(num_links: int, blocks: int, hops: int, per_link: tuple[Any, Any] | None = None) -> tuple[Any, ...]:
    """The arrays :func:`resolve` keeps its state in, for ``num_links`` links and ``blocks`` transfers draining
    at once on paths of at most ``hops`` links (``per_link``: the links' int and float rows, (4, num_links) and
    (3, num_links), where the caller keeps them; made here if not). The queue holds at most a check per
    transfer, an entry per link perturbed and one per link a freezing transfer updates (``hops`` per transfer)."""
    queue = blocks * (hops + 1) + num_links + 1
    per_link_i, per_link_f = (
        per_link if per_link is not None else (np.empty((4, num_links), dtype=np.int64), np.empty((3, num_links)))
    )
    per_link_i[...] = 0
    per_link_f[...] = 0.0
    per_link_f[_LEVEL] = np.inf
    return (
        per_link_i,
        per_link_f,
        np.empty(num_links, dtype=np.int64),  # the links perturbed (each once)
        np.zeros((3, blocks), dtype=np.int64),
        np.empty(blocks),  # new rate
        np.empty(blocks, dtype=np.int64),  # the blocks in play (each once)
        np.empty(queue),  # queue: levels
        np.zeros(3 * queue, dtype=np.int64),  # queue: order, item, version
        np.empty(queue, dtype=np.int64),  # the entries of one level group
        np.empty(num_links, dtype=np.int64),  # the links a level group fills
        np.zeros(5, dtype=np.int64),  # counters
    )


@inline
def _requeue(link: int, st: Any) -> None:
    """Link ``link``'s fill level changed: its queue entry is the new one (none while nothing on it is
    unfrozen: the level is infinite)."""
    links_i, links_f, _, _, _, _, heap_t, heap_k, _, _, counters = st
    links_i[_VERSION, link] += 1
    if links_i[_UNFROZEN, link] <= 0:
        return
    demand = links_f[_DEMAND, link]
    if not demand > 0:
        return
    item = 2 * link + 1
    level = links_f[_ROOM, link] / demand
    counters[_QUEUE] = push(heap_t, heap_k, counters[_QUEUE], level, item, item, links_i[_VERSION, link])


@inline
def _play(block: int, rate: float, stamp: int, st: Any) -> None:
    """Block ``block`` is in play: listed, and checked at its old rate ``rate`` (none where that is 0, a new
    transfer; infinite, one on infinitely fast links; or negative, one frozen already)."""
    _, _, _, blocks_i, _, play_list, heap_t, heap_k, _, _, counters = st
    blocks_i[_IN_PLAY, block] = stamp
    play_list[counters[_NUM_IN_PLAY]] = block
    counters[_NUM_IN_PLAY] += 1
    if 0.0 < rate < np.inf:
        counters[_QUEUE] = push(heap_t, heap_k, counters[_QUEUE], rate, 2 * block, 2 * block, 0)


@inline
def _perturb(link: int, lam: float, stamp: int, net: Any, st: Any) -> None:
    """Link ``link`` is perturbed at level ``lam``: its room and demand summed afresh, its transfers with old
    rates below ``lam`` frozen at them, the others in play."""
    _, _, _, capacity, head, _, node_w, node_next, shift, rate = net
    links_i, links_f, pert_list, blocks_i, new_r, _, _, _, _, _, counters = st
    links_i[_PERTURBED, link] = stamp
    pert_list[counters[_NUM_PERTURBED]] = link
    counters[_NUM_PERTURBED] += 1
    room = capacity[link]
    demand = 0.0
    unfrozen = 0
    node = head[link]
    while node >= 0:
        block = node >> shift
        weight = node_w[node]
        node = node_next[node]
        counters[_VISITED] += 1
        if blocks_i[_IN_PLAY, block] != stamp:
            r = rate[block]
            if r < lam:
                _play(block, -1.0, stamp, st)
                blocks_i[_FROZEN, block] = stamp
                new_r[block] = r
            else:
                _play(block, r, stamp, st)
        if blocks_i[_FROZEN, block] == stamp:
            room -= weight * new_r[block]
        else:
            demand += weight
            unfrozen += 1
    links_f[_ROOM, link] = max(room, 0.0)
    links_f[_DEMAND, link] = demand
    links_i[_UNFROZEN, link] = unfrozen
    _requeue(link, st)


@inline
def _freeze(block: int, r: float, lam: float, group: int, stamp: int, net: Any, st: Any) -> None:  # noqa: PLR0917
    """Freeze ``block`` at rate ``r`` (level ``lam``; its old rate if within _KEEP_RTOL): the perturbed links
    it crosses lose what it takes; if its rate changed, the others are perturbed."""
    pair, pair_ptr, pair_link, _, _, _, node_w, _, shift, rate = net
    links_i, links_f, _, blocks_i, new_r, _, _, _, _, _, _ = st
    old = rate[block]
    if old == r or abs(r - old) <= _KEEP_RTOL * old:
        r = old
    blocks_i[_FROZEN, block] = stamp
    new_r[block] = r
    changed = r != old
    p = pair[block]
    first = -1
    for h in range(pair_ptr[p + 1] - pair_ptr[p]):
        link = pair_link[pair_ptr[p] + h]
        if first < 0 and links_i[_FILLED, link] == group:
            first = link
        if links_i[_PERTURBED, link] == stamp:
            links_f[_ROOM, link] = max(links_f[_ROOM, link] - node_w[(block << shift) + h] * r, 0.0)
            links_f[_DEMAND, link] -= node_w[(block << shift) + h]
            links_i[_UNFROZEN, link] -= 1
            if links_i[_FILLED, link] != group:
                _requeue(link, st)
        elif changed:
            _perturb(link, lam, stamp, net, st)
    blocks_i[_BOTTLENECK, block] = first


@inline
def _check(block: int, group: int, stamp: int, net: Any, st: Any) -> None:
    """The level reached block ``block``'s old rate: it keeps it if a link on its path that is not perturbed
    filled at that level; else it rises past it, and every link it crosses is perturbed."""
    pair, pair_ptr, pair_link, _, _, _, _, _, _, rate = net
    links_i, links_f, _, blocks_i, _, _, _, _, _, _, _ = st
    if blocks_i[_FROZEN, block] == stamp:
        return
    r = rate[block]
    p = pair[block]
    for e in range(pair_ptr[p], pair_ptr[p + 1]):
        link = pair_link[e]
        if links_i[_PERTURBED, link] != stamp and abs(links_f[_LEVEL, link] - r) <= _KEEP_RTOL * r:
            _freeze(block, r, r, group, stamp, net, st)
            return
    for e in range(pair_ptr[p], pair_ptr[p + 1]):
        link = pair_link[e]
        if links_i[_PERTURBED, link] != stamp:
            _perturb(link, r, stamp, net, st)


@inline
def _stale(item: int, version: int, stamp: int, links_i: Any, blocks_i: Any) -> bool:
    """Whether a queue entry is out of date: a link's level that moved since, or the check of a transfer
    frozen since."""
    if item & 1:
        return bool(links_i[_VERSION, item >> 1] != version)
    return bool(blocks_i[_FROZEN, item >> 1] == stamp)


@inline
def resolve_alone(  # noqa: PLR0917 (numba has no keyword-only parameters)
    started: Any, num_started: int, changed: Any, num_changed: int, net: Any, st: Any
) -> int:
    """The re-solve where no changed link is shared: each holds no draining transfer, or only the one that
    started (most of a ring's changes: a transfer starting or draining on links of its own). The filling
    then has one level, the least of the started transfer's links' capacity over its weight, and sets what
    :func:`resolve_fill` would, the same floats: the links within _LEVEL_RTOL of that level fill at it (its
    bottleneck: the first on its path), the other changed links fill at no level. Returns how many
    transfers are in play (0 or 1), or -1 where some changed link is shared (or fills at no finite level):
    then :func:`resolve_fill` solves."""
    pair, pair_ptr, pair_link, capacity, head, _, node_w, node_next, shift, _ = net
    links_i, links_f, _, blocks_i, new_r, play_list, _, _, _, _, counters = st
    if num_started > 1:
        return -1
    block = started[0] if num_started else -1
    lam = np.inf
    for i in range(num_changed):
        node = head[changed[i]]
        if node < 0:
            continue
        if node >> shift != block or node_next[node] >= 0:
            return -1
        level = capacity[changed[i]] / node_w[node]
        if not 0.0 < level < np.inf:
            return -1
        lam = min(lam, level)
    limit = lam * (1 + _LEVEL_RTOL)
    if num_started:
        counters[_GROUP] += 1
    for i in range(num_changed):
        link = changed[i]
        node = head[link]
        if node >= 0 and capacity[link] / node_w[node] <= limit:
            links_f[_LEVEL, link] = lam
            links_i[_FILLED, link] = counters[_GROUP]
        else:
            links_f[_LEVEL, link] = np.inf
    if not num_started:
        return 0
    p = pair[block]
    for e in range(pair_ptr[p], pair_ptr[p + 1]):
        if links_i[_FILLED, pair_link[e]] == counters[_GROUP]:
            blocks_i[_BOTTLENECK, block] = pair_link[e]
            break
    new_r[block] = lam
    play_list[0] = block
    return 1


@inline
def alone_unlinked(block: int, changed: Any, num_changed: int, net: Any) -> bool:
    """Whether block ``block``, started at this instant and not linked into its links' lists yet, would be the
    only transfer :func:`resolve_alone` finds: its links hold no other (their lists empty: -1), cross no link
    twice, each with a finite level (``node_w``: its weights, written when it started), and every other changed
    link is empty."""
    pair, pair_ptr, pair_link, capacity, head, _, node_w, _, shift, _ = net
    p = pair[block]
    for e in range(pair_ptr[p], pair_ptr[p + 1]):
        link = pair_link[e]
        if head[link] != -1 or not 0.0 < capacity[link] / node_w[(block << shift) + e - pair_ptr[p]] < np.inf:
            return False
        for before in range(pair_ptr[p], e):
            if pair_link[before] == link:
                return False
    for i in range(num_changed):  # noqa: SIM110 (a loop numba compiles)
        if head[changed[i]] >= 0:
            return False
    return True


@inline
def resolve_solo(block: int, changed: Any, num_changed: int, net: Any, st: Any) -> int:
    """:func:`resolve_alone` for the block :func:`alone_unlinked` found, without it in its links' lists: the
    same floats (its level, the least of its links' capacity over its weight; the links within _LEVEL_RTOL of
    it fill at it, the other changed links at none; its bottleneck the first of those on its path). Marks its
    links as held by it alone (``head``: -2 - block) and returns 1."""
    pair, pair_ptr, pair_link, capacity, head, _, node_w, _, shift, _ = net
    links_i, links_f, _, blocks_i, new_r, play_list, _, _, _, _, counters = st
    p = pair[block]
    lam = np.inf
    for e in range(pair_ptr[p], pair_ptr[p + 1]):
        lam = min(lam, capacity[pair_link[e]] / node_w[(block << shift) + e - pair_ptr[p]])
    limit = lam * (1 + _LEVEL_RTOL)
    counters[_GROUP] += 1
    for i in range(num_changed):
        links_f[_LEVEL, changed[i]] = np.inf
    first = -1
    for e in range(pair_ptr[p], pair_ptr[p + 1]):
        link = pair_link[e]
        head[link] = -2 - block
        if capacity[link] / node_w[(block << shift) + e - pair_ptr[p]] <= limit:
            links_f[_LEVEL, link] = lam
            links_i[_FILLED, link] = counters[_GROUP]
            if first < 0:
                first = link
    blocks_i[_BOTTLENECK, block] = first
    new_r[block] = lam
    play_list[0] = block
    return 1


@njit
def resolve(  # noqa: PLR0917 (numba has no keyword-only parameters)
    started: Any, num_started: int, changed: Any, num_changed: int, stamp: int, net: Any, st: Any
) -> int:
    """Re-solve after the blocks ``started[:num_started]`` began draining and the links ``changed[:num_changed]``
    changed their sets of draining transfers (``stamp``: this re-solve's number, larger than any before);
    ``net``: the pair per block (of the transfer draining in it), pair_ptr, pair_link, capacity, the links'
    lists of nodes (head, node_x, node_w, node_next, shift) and the rate per block. Leaves the blocks in play
    listed in ``st`` with their new rates (infinite where no link fills), and returns how many."""
    num: int = resolve_alone(started, num_started, changed, num_changed, net, st)
    if num < 0:
        num = resolve_fill(started, num_started, changed, num_changed, stamp, net, st)
    return num


@njit
def resolve_fill(  # noqa: PLR0917
    started: Any, num_started: int, changed: Any, num_changed: int, stamp: int, net: Any, st: Any
) -> int:
    """:func:`resolve` where :func:`resolve_alone` does not apply: the lazy progressive filling (the module's
    docstring)."""
    head, node_next, shift = net[4], net[7], net[8]
    links_i, links_f, pert_list, blocks_i, new_r, play_list, heap_t, heap_k, group_items, filled, counters = st
    counters[_NUM_PERTURBED] = 0
    counters[_NUM_IN_PLAY] = 0
    counters[_QUEUE] = 0
    first_group = counters[_GROUP]
    for i in range(num_started):
        _play(started[i], 0.0, stamp, st)
    for i in range(num_changed):
        _perturb(changed[i], 0.0, stamp, net, st)
    while counters[_QUEUE]:
        if _stale(heap_k[1], heap_k[2], stamp, links_i, blocks_i):
            counters[_QUEUE] = pop(heap_t, heap_k, counters[_QUEUE])
            continue
        # The least level in the queue, and every entry within _LEVEL_RTOL of it: one group.
        lam = heap_t[0]
        limit = lam * (1 + _LEVEL_RTOL)
        num_items = 0
        while counters[_QUEUE] and heap_t[0] <= limit:
            item, version = heap_k[1], heap_k[2]
            counters[_QUEUE] = pop(heap_t, heap_k, counters[_QUEUE])
            if not _stale(item, version, stamp, links_i, blocks_i):
                group_items[num_items] = item
                num_items += 1
        counters[_GROUP] += 1
        group = counters[_GROUP]
        for k in range(num_items):
            if not group_items[k] & 1:
                _check(group_items[k] >> 1, group, stamp, net, st)
        # The links that fill at this level (a check that froze a transfer on one moved its level: it fills if
        # the level stays within the group's).
        num_filled = 0
        for k in range(num_items):
            item = group_items[k]
            link = item >> 1
            if not item & 1 or links_i[_FILLED, link] == group or links_i[_UNFROZEN, link] <= 0:
                continue
            demand = links_f[_DEMAND, link]
            if not (demand > 0 and links_f[_ROOM, link] / demand <= limit):
                continue
            links_i[_FILLED, link] = group
            links_i[_VERSION, link] += 1
            links_f[_LEVEL, link] = lam
            filled[num_filled] = link
            num_filled += 1
        for k in range(num_filled):
            node = head[filled[k]]
            while node >= 0:
                block = node >> shift
                node = node_next[node]
                counters[_VISITED] += 1
                if blocks_i[_FROZEN, block] != stamp:
                    _freeze(block, lam, lam, group, stamp, net, st)
    # A perturbed link that did not fill this time does not fill at any level.
    for k in range(counters[_NUM_PERTURBED]):
        link = pert_list[k]
        if links_i[_FILLED, link] <= first_group:
            links_f[_LEVEL, link] = np.inf
    for k in range(counters[_NUM_IN_PLAY]):
        block = play_list[k]
        if blocks_i[_FROZEN, block] != stamp:
            new_r[block] = np.inf
            blocks_i[_BOTTLENECK, block] = -1
    count: int = counters[_NUM_IN_PLAY]
    return count
