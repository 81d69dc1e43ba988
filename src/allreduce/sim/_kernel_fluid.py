"""Max-min fair rates of the transfers a change touches, for the compiled event core (sim/_kernel.py).

The formulas and summation orders of the per-event Python core (sim/_event.py's ``_Run``) and of
``sim/_fair.fill_dense``, so that results agree bit for bit: the threshold below which no rate can have changed
(``_Run._threshold``); progressive filling with running sums for a few transfers (``_Run._fill_python``); and
for more, progressive filling a level at a time with fresh sums (``fill_dense``), done here without a pass over
every entry per level: a level takes the links at the least fill level (to _LEVEL_RTOL) and updates only the
links its frozen transfers cross. The levels are scanned while the component has filled in few levels (most
do: a scan of contiguous levels costs less than a tree's updates), then kept in a min segment tree (a
component that fills in many). A link's demand (the weight of
its unfrozen transfers) is then updated by subtraction where that is exact (every weight on it a multiple of
2^-20, see :func:`summable_links`: the sums are exact in any order) and summed afresh in entry order elsewhere;
what a level takes from a link is summed in entry order as ``fill_dense`` does. So a component of ``F``
transfers and ``E`` link entries costs about ``E log E`` rather than ``E`` per level.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.sim._jit import inline, njit

__all__ = ["dense_scratch", "fill_dense", "fill_small", "number_path", "sort_ids", "summable_links", "threshold"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

# Links whose fill levels agree to this relative tolerance saturate together (as sim/_fair.py and sim/_event.py).
_LEVEL_RTOL = 1e-9
# Weights that are multiples of 2^-_EXACT_BITS and at most 1 sum exactly in any order, for fewer than
# 2^(53 - _EXACT_BITS) terms (more transfers than any run holds): every partial sum fits a double's mantissa.
_EXACT_BITS = 16
# A level's least fill level and tight links are found by a scan of every link's level while that costs less than
# this many times what the previous level's updates would have cost a min segment tree (a leaf and its path to
# the root per link it touched); then by the tree. A few hundred contiguous levels scan faster than the tree
# updates them, the more so in a component that fills in a few levels (most); one of thousands of links that
# fills in many levels, a few links at a time, needs the tree.
_SCAN_OVER_TREE = 1


def summable_links(pair_link: IntArray, pair_weight: FloatArray, num_links: int) -> BoolArray:
    """Per dense link, whether the weights crossing it sum exactly in any order (see _EXACT_BITS): the dense
    fill may then keep a link's demand by subtraction instead of summing it afresh."""
    scaled = pair_weight * 2.0**_EXACT_BITS
    fine = (scaled == np.floor(scaled)) & (pair_weight <= 1.0)
    return np.asarray(np.bincount(pair_link[~fine], minlength=num_links) == 0, dtype=np.bool_)


@inline
def number_path(p: int, route: Any, local: Any, comp_links: Any, count: int) -> int:
    """Number the links of pair ``p``'s path not numbered yet (``local``), in path order, from ``count`` on;
    returns how many are numbered."""
    _, pair_ptr, pair_link, _, _ = route
    for e in range(pair_ptr[p], pair_ptr[p + 1]):
        link = pair_link[e]
        if local[link] < 0:
            local[link] = count
            comp_links[count] = link
            count += 1
    return count


# -- the fluid: rates of a changed component -------------------------------------------------------------------
@inline
def _shellsort(key: Any, second: Any, count: int) -> None:
    """Sort ``key[:count]`` by (key, second) in place, moving ``second`` along: a shell sort (gaps 1, 4, 10,
    23, ...: each about 2.25 times the last), which needs no room (the compiled core allocates nothing); gap 1 is
    an insertion sort."""
    gap = 1
    while 9 * gap < 4 * count:
        gap = (9 * gap + 3) // 4
    while gap >= 1:
        for i in range(gap, count):
            k, v = key[i], second[i]
            j = i
            while j >= gap and (key[j - gap] > k or (key[j - gap] == k and second[j - gap] > v)):
                key[j] = key[j - gap]
                second[j] = second[j - gap]
                j -= gap
            key[j] = k
            second[j] = v
        gap = max((4 * gap) // 9, 1) if gap > 1 else 0


@inline
def _sort_pairs(key: Any, second: Any, count: int) -> None:
    """Sort ``key[:count]`` (ties by ``second``), moving ``second`` along: insertion sort for the few flows
    a link usually carries, a shell sort beyond (equal pairs are alike, so any correct sort orders them the
    same)."""
    if count > 32:
        _shellsort(key, second, count)
        return
    for i in range(1, count):
        k, v = key[i], second[i]
        j = i - 1
        while j >= 0 and (key[j] > k or (key[j] == k and second[j] > v)):
            key[j + 1] = key[j]
            second[j + 1] = second[j]
            j -= 1
        key[j + 1] = k
        second[j + 1] = v


@inline
def threshold(  # noqa: PLR0917 (numba has no keyword-only parameters)
    started: Any, num_started: int, drained_rate: float, route: Any, lists: Any, rate: Any, stamp: int, scratch: Any
) -> float:
    """A rate below which no transfer's max-min fair rate can have changed (``_Run._threshold``)."""
    pair, pair_ptr, pair_link, _, capacity = route
    head, _, node_w, node_next, shift = lists
    seen, old_r, old_w = scratch
    theta = drained_rate
    for i in range(num_started):
        p = pair[started[i]]
        for e in range(pair_ptr[p], pair_ptr[p + 1]):
            link = pair_link[e]
            if seen[link] == stamp:
                continue
            seen[link] = stamp
            rising = 0.0
            count = 0
            node = head[link]
            while node >= 0:
                r = rate[node >> shift]
                if r == 0.0:
                    rising += node_w[node]
                else:
                    old_r[count] = r
                    old_w[count] = node_w[node]
                    count += 1
                node = node_next[node]
            room = capacity[link]
            for j in range(count):
                rising += old_w[j]
            _sort_pairs(old_r, old_w, count)  # in (rate, weight) order, as Python sorts the tuples
            for j in range(count):
                r = old_r[j]
                if room <= r * rising:
                    break
                room -= old_w[j] * r
                rising -= old_w[j]
            theta = min(theta, room / rising)
    return theta * (1 - 4 * _LEVEL_RTOL)


@inline
def fill_small(  # noqa: PLR0917 (numba has no keyword-only parameters)
    members: Any, num: int, route: Any, room: Any, lists: Any, comp_pos: Any, new: Any, scratch: Any
) -> None:
    """Progressive filling with running sums over the component's links (``_Run._fill_python``), in the order
    the transfers reach them (``place``: a link's place in that order, valid where ``links`` agrees)."""
    links, demand, count, tight, rated, place = scratch
    pair, pair_ptr, pair_link, pair_weight, _ = route
    num_links = 0
    for i in range(num):
        p = pair[members[i]]
        for e in range(pair_ptr[p], pair_ptr[p + 1]):
            link = pair_link[e]
            k = place[link]
            if k >= num_links or links[k] != link:
                k = num_links
                place[link] = k
                links[k] = link
                demand[k] = 0.0
                count[k] = 0
                num_links += 1
            demand[k] += pair_weight[e]
            count[k] += 1
    rated[:num] = False
    head, node_x, _, node_next, shift = lists
    new_rate, new_bottleneck = new
    while True:
        fill = np.inf
        any_left = False
        for k in range(num_links):
            if count[k] > 0:
                any_left = True
                fill = min(fill, room[links[k]] / demand[k])
        if not any_left or not np.isfinite(fill):
            break
        limit = fill * (1 + _LEVEL_RTOL)
        for k in range(num_links):
            tight[k] = count[k] > 0 and room[links[k]] / demand[k] <= limit
        for k in range(num_links):
            if not tight[k]:
                continue
            node = head[links[k]]
            while node >= 0:
                x = node_x[node]
                pos = comp_pos[node >> shift] - 1
                node = node_next[node]
                if pos < 0 or rated[pos]:
                    continue
                rated[pos] = True
                new_rate[pos] = fill
                p = pair[x]
                first = -1
                for e in range(pair_ptr[p], pair_ptr[p + 1]):
                    lk = pair_link[e]
                    j = place[lk]
                    if first < 0 and tight[j]:
                        first = lk
                    room[lk] = max(room[lk] - pair_weight[e] * fill, 0.0)
                    demand[j] -= pair_weight[e]
                    count[j] -= 1
                new_bottleneck[pos] = first


@inline
def sort_ids(ids: Any, count: int, stack: Any) -> None:
    """Sort the distinct ``ids[:count]`` in place: a quicksort (median of three; the larger part waits on
    ``stack``, at least 128 entries, while the smaller is sorted, so it holds at most log2(count) parts) down
    to parts of 16, sorted by insertion."""
    lo, hi = 0, count - 1
    top = 0
    while True:
        if hi - lo < 16:
            for i in range(lo + 1, hi + 1):
                x = ids[i]
                k = i - 1
                while k >= lo and ids[k] > x:
                    ids[k + 1] = ids[k]
                    k -= 1
                ids[k + 1] = x
            if top == 0:
                return
            top -= 2
            lo, hi = stack[top], stack[top + 1]
            continue
        a, b, c = ids[lo], ids[(lo + hi) >> 1], ids[hi]
        pivot = max(min(a, b), min(max(a, b), c))
        i, j = lo, hi
        while i <= j:
            while ids[i] < pivot:
                i += 1
            while ids[j] > pivot:
                j -= 1
            if i <= j:
                ids[i], ids[j] = ids[j], ids[i]
                i += 1
                j -= 1
        if j - lo < hi - i:
            stack[top], stack[top + 1] = i, hi
            hi = j
        else:
            stack[top], stack[top + 1] = lo, j
            lo = i
        top += 2


@inline
def _set_level(tree: Any, size: int, j: int, value: float) -> None:
    """Link ``j``'s fill level is ``value``: its leaf and the minima above it, up to the first that stays (the
    ones above it then stay too)."""
    node = size + j
    tree[node] = value
    node >>= 1
    while node:
        least = min(tree[2 * node], tree[2 * node + 1])
        if least == tree[node]:
            return
        tree[node] = least
        node >>= 1


@inline
def _freeze_links(found: Any, num_found: int, level: int, links: Any, frozen: Any, picked: Any, stack: Any) -> int:  # noqa: PLR0917
    """Mark the links ``found[:num_found]`` (in increasing order) tight at ``level``, freeze the unfrozen
    transfers that cross them (``picked``, in increasing order); returns how many."""
    link_ptr, link_entry, entry_flow, tight = links
    count = 0
    for i in range(num_found):
        j = found[i]
        tight[j] = level
        for q in range(link_ptr[j], link_ptr[j + 1]):
            f = entry_flow[link_entry[q]]
            if not frozen[f]:
                frozen[f] = True
                picked[count] = f
                count += 1
    sort_ids(picked, count, stack)
    return count


@njit
def _freeze_level(  # noqa: PLR0917 (numba has no keyword-only parameters)
    tree: Any, size: int, limit: float, level: int, links: Any, frozen: Any, picked: Any, scratch: Any
) -> int:
    """The links whose fill level is at most ``limit``, found by a walk of the tree (left to right), tight at
    ``level`` (:func:`_freeze_links`)."""
    found, stack = scratch
    num_found = 0
    stack[0] = 1
    top = 1
    while top:
        top -= 1
        node = stack[top]
        if not tree[node] <= limit:  # as fill_dense's test (a NaN level is never tight)
            continue
        if node < size:
            stack[top] = 2 * node + 1
            stack[top + 1] = 2 * node
            top += 2
            continue
        found[num_found] = node - size
        num_found += 1
    count: int = _freeze_links(found, num_found, level, links, frozen, picked, stack)
    return count


@inline
def _least(tree: Any, size: int, count: int) -> float:
    """The least of the leaves ``tree[size:size + count]``, in four running minima: one would wait on the last
    comparison at every leaf. The least of numbers is the same in any order."""
    a = b = c = d = np.inf
    j = size
    stop = size + count
    while j + 4 <= stop:
        a = min(a, tree[j])
        b = min(b, tree[j + 1])
        c = min(c, tree[j + 2])
        d = min(d, tree[j + 3])
        j += 4
    while j < stop:
        a = min(a, tree[j])
        j += 1
    return min(a, b, c, d)


@inline
def _freeze_scan(  # noqa: PLR0917 (numba has no keyword-only parameters)
    tree: Any, size: int, num_links: int, limit: float, level: int, links: Any, frozen: Any, picked: Any, scratch: Any
) -> int:
    """:func:`_freeze_level` by a scan of the leaves in link order, where the tree above them is not kept: the
    same links tight, the same transfers picked. The tight links are listed without a branch per link."""
    found, stack = scratch
    num_found = 0
    for j in range(num_links):
        found[num_found] = j
        num_found += tree[size + j] <= limit  # as fill_dense's test (a NaN level is never tight)
    count: int = _freeze_links(found, num_found, level, links, frozen, picked, stack)
    return count


def dense_scratch(flows: int, entries: int, links: int, scan: int = _SCAN_OVER_TREE) -> tuple[Any, ...]:
    """The room :func:`fill_dense` works in, for components of at most ``flows`` transfers, ``entries`` link
    entries and ``links`` links; ``scan``: as _SCAN_OVER_TREE (0: the tree from the first level)."""
    size = 1
    while size < links:
        size *= 2
    return (
        np.empty(flows + 1, dtype=np.int64),  # flow_ptr
        np.empty(flows, dtype=np.bool_),  # frozen
        np.empty(flows, dtype=np.int64),  # picked
        np.empty(entries, dtype=np.int64),  # link
        np.empty(entries),  # weight
        np.empty(entries, dtype=np.int64),  # entry_flow
        np.empty(entries, dtype=np.int64),  # link_entry
        np.empty(links + 1, dtype=np.int64),  # link_ptr
        np.empty((3, links)),  # demand, remaining, taken
        np.empty((4, links), dtype=np.int64),  # tight, touched_at, touched, at
        np.empty(links, dtype=np.bool_),  # exact
        np.empty(2 * size),  # tree
        np.empty(130, dtype=np.int64),  # stack: a depth-first walk pushes two nodes per level of the tree
        np.full(1, scan, dtype=np.int64),
    )


@njit
def fill_dense(  # noqa: PLR0917 (numba has no keyword-only parameters)
    members: Any, num: int, comp: Any, route: Any, room: Any, new: Any, summable: Any, scratch: Any
) -> int:
    """Progressive filling a level at a time with fresh sums (``sim/_fair.fill_dense``), over the component's
    links (``local`` numbers them, ``comp_links`` names them), in ``scratch`` (:func:`dense_scratch`);
    returns the number of levels."""
    pair, pair_ptr, pair_link, pair_weight, _ = route
    comp_links, num_links, local = comp
    new_rate, new_bottleneck = new
    flow_ptr, frozen, picked, link, weight, entry_flow, link_entry, link_ptr = scratch[:8]
    per_link, per_link_int, exact, tree, stack, scan_over_tree = scratch[8:]
    demand, remaining, taken = per_link[0], per_link[1], per_link[2]
    tight, touched_at, touched, at = per_link_int[0], per_link_int[1], per_link_int[2], per_link_int[3]
    # The entries, transfer by transfer in path order (fill_dense's order), and per link in that order.
    total = 0
    for i in range(num):
        flow_ptr[i] = total
        p = pair[members[i]]
        total += pair_ptr[p + 1] - pair_ptr[p]
        frozen[i] = False
    flow_ptr[num] = total
    for j in range(num_links + 1):
        link_ptr[j] = 0
    for j in range(num_links):
        demand[j] = 0.0
        taken[j] = 0.0
        tight[j] = 0
        touched_at[j] = 0
    k = 0
    for i in range(num):
        p = pair[members[i]]
        for e in range(pair_ptr[p], pair_ptr[p + 1]):
            j = local[pair_link[e]]
            link[k] = j
            weight[k] = pair_weight[e]
            entry_flow[k] = i
            demand[j] += pair_weight[e]
            link_ptr[j + 1] += 1
            k += 1
    for j in range(num_links):
        link_ptr[j + 1] += link_ptr[j]
        at[j] = link_ptr[j]
    for e in range(total):
        j = link[e]
        link_entry[at[j]] = e
        at[j] += 1
    size = 1
    while size < num_links:
        size *= 2
    for j in range(num_links):
        remaining[j] = room[comp_links[j]]
        exact[j] = summable[comp_links[j]]
        tree[size + j] = remaining[j] / demand[j] if demand[j] > 0 else np.inf

    links = (link_ptr, link_entry, entry_flow, tight)
    left = num
    levels = 0
    depth = 1
    while (1 << depth) < 2 * size:
        depth += 1
    scan = True  # the leaves alone, scanned per level, until that costs more than the tree (see _SCAN_OVER_TREE)
    tree_cost = num_links  # what the last level's updates would have cost the tree
    while left:
        levels += 1
        if scan and num_links > scan_over_tree[0] * tree_cost:
            scan = False
            for j in range(num_links, size):
                tree[size + j] = np.inf
            for node in range(size - 1, 0, -1):
                tree[node] = min(tree[2 * node], tree[2 * node + 1])
        fill = _least(tree, size, num_links) if scan else tree[1]
        if not np.isfinite(fill):
            break  # only infinitely fast links left
        limit = fill * (1 + _LEVEL_RTOL)
        if scan:
            count = _freeze_scan(tree, size, num_links, limit, levels, links, frozen, picked, (at, stack))
        else:
            count = _freeze_level(tree, size, limit, levels, links, frozen, picked, (at, stack))
        left -= count
        num_touched = 0
        # What the frozen transfers take, per link in entry order (transfers in increasing order).
        for q in range(count):
            f = picked[q]
            new_rate[f] = fill
            first = -1
            for e in range(flow_ptr[f], flow_ptr[f + 1]):
                j = link[e]
                if first < 0 and tight[j] == levels:
                    first = j
                taken[j] += weight[e] * fill
                if exact[j]:
                    demand[j] -= weight[e]
                if touched_at[j] != levels:
                    touched_at[j] = levels
                    touched[num_touched] = j
                    num_touched += 1
            new_bottleneck[f] = comp_links[first]
        if levels == 1:
            # fill_dense clips every link's capacity left after the first level (a room left by transfers
            # below the threshold may round below zero); after it, only the touched links change.
            for j in range(num_links):
                if touched_at[j] != levels:
                    remaining[j] = max(remaining[j] - taken[j], 0.0)
                    tree[size + j] = remaining[j] / demand[j] if demand[j] > 0 else np.inf
        for t in range(num_touched):
            j = touched[t]
            remaining[j] = max(remaining[j] - taken[j], 0.0)
            taken[j] = 0.0
            if not exact[j]:
                d = 0.0
                for q in range(link_ptr[j], link_ptr[j + 1]):
                    e = link_entry[q]
                    if not frozen[entry_flow[e]]:
                        d += weight[e]
                demand[j] = d
            value = remaining[j] / demand[j] if demand[j] > 0 else np.inf
            if scan or levels == 1:
                tree[size + j] = value
            else:
                _set_level(tree, size, j, value)
        tree_cost = num_touched * depth
        if levels == 1 and not scan:
            for node in range(size - 1, 0, -1):
                tree[node] = min(tree[2 * node], tree[2 * node + 1])
    return levels
