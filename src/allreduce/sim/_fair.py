"""Max-min fair rates of concurrent flows over shared links (progressive filling on a CSR incidence).

Flow ``f`` crosses links ``link[flow_ptr[f]:flow_ptr[f+1]]`` and puts ``weight`` of its rate on each (1 on a
single path; 1/k on each of k sprayed paths). Max-min fairness: no flow's rate can grow without shrinking the
rate of a flow that is no faster. Progressive filling computes it: raise every unfrozen flow's rate together;
the first link to fill up (remaining capacity / weight of its unfrozen flows is smallest) freezes the flows
that cross it at that level; repeat with what capacity is left. One iteration per distinct bottleneck level,
each a few numpy passes over the incidence — never one Python object per flow.

The link that froze a flow is its *bottleneck*: the one the simulator names when that flow is slow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["FairShare", "fill_dense", "max_min_rates"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

# Links whose fill levels agree to this relative tolerance saturate "together": their flows freeze in one
# iteration. Without it, rounding in the sums would split one level into many and cost an iteration each.
_LEVEL_RTOL = 1e-9


@dataclass(frozen=True, eq=False)
class FairShare:
    """Per flow: its max-min fair rate (inf for a flow that crosses no link) and the link that froze it (-1)."""

    rate_Bps: FloatArray
    bottleneck_link: IntArray
    levels: int  # progressive-filling iterations = distinct bottleneck levels


def max_min_rates(
    flow_ptr: npt.ArrayLike,
    link: npt.ArrayLike,
    weight: npt.ArrayLike,
    capacity_Bps: npt.ArrayLike,
) -> FairShare:
    """Max-min fair rates of the flows of a CSR incidence over links of the given capacities (bytes/s)."""
    ptr = np.asarray(flow_ptr, dtype=np.int64)
    links = np.asarray(link, dtype=np.int64)
    weights = np.asarray(weight, dtype=np.float64)
    capacity = np.asarray(capacity_Bps, dtype=np.float64)
    if ptr.ndim != 1 or ptr.size < 1 or ptr[0] != 0 or np.any(np.diff(ptr) < 0) or ptr[-1] != links.size:
        raise ValueError("flow_ptr must start at 0, never decrease, and end at the number of link entries")
    if weights.shape != links.shape:
        raise ValueError(f"weight has {weights.size} entries but link has {links.size}")
    if links.size and (links.min() < 0 or links.max() >= capacity.size):
        bad = int(links[(links < 0) | (links >= capacity.size)][0])
        raise ValueError(f"link index {bad} is not one of the {capacity.size} links")
    if np.any(weights <= 0) or not np.all(np.isfinite(weights)):
        raise ValueError("every weight must be a finite number > 0")
    num_flows = ptr.size - 1
    rate = np.full(num_flows, np.inf)
    bottleneck = np.full(num_flows, -1, dtype=np.int64)
    if links.size == 0:
        return FairShare(rate, bottleneck, 0)

    entry_flow = np.repeat(np.arange(num_flows, dtype=np.int64), np.diff(ptr))
    # Work on the links that some flow uses, renumbered densely: bincounts then cost O(entries), not O(links).
    used, local = np.unique(links, return_inverse=True)
    local = local.reshape(-1).astype(np.int64)
    remaining = capacity[used]
    if np.any(~(remaining > 0)):
        bad = int(used[~(remaining > 0)][0])
        raise ValueError(f"link {bad} carries flows but has capacity {capacity[bad]} (must be > 0)")
    rate, local_bottleneck, levels = fill_dense(num_flows, entry_flow, local, weights, remaining)
    found = local_bottleneck >= 0
    bottleneck[found] = used[local_bottleneck[found]]
    return FairShare(rate, bottleneck, levels)


def fill_dense(
    num_flows: int,
    entry_flow: IntArray,
    entry_link: IntArray,
    entry_weight: FloatArray,
    capacity_Bps: FloatArray,
) -> tuple[FloatArray, IntArray, int]:
    """Progressive filling without validation, for callers that solve many incidences over the same links
    (the event engine): links are already dense (``entry_link`` indexes ``capacity_Bps``, all > 0) and the
    entries are grouped by flow in path order (``entry_flow`` non-decreasing).

    Returns (rate per flow, bottleneck link per flow (-1: none), number of levels)."""
    rate = np.full(num_flows, np.inf)
    bottleneck = np.full(num_flows, -1, dtype=np.int64)
    remaining = np.array(capacity_Bps, dtype=np.float64)
    num_links = remaining.size
    frozen = np.zeros(num_flows, dtype=np.bool_)
    flow, link, weight = entry_flow, entry_link, entry_weight  # entries of unfrozen flows
    levels = 0
    while flow.size:
        demand = np.bincount(link, weights=weight, minlength=num_links)
        level = np.full(num_links, np.inf)
        np.divide(remaining, demand, out=level, where=demand > 0)
        fill = float(level.min())
        if not np.isfinite(fill):
            break  # only infinitely fast links left
        levels += 1
        hit = np.flatnonzero(level[link] <= fill * (1 + _LEVEL_RTOL))
        hit_flow = flow[hit]
        # Entries are grouped by flow in path order: a flow's first saturated link on its path is its
        # bottleneck (the saturated links of one level fill together, to within _LEVEL_RTOL).
        first = np.ones(hit.size, dtype=np.bool_)
        first[1:] = hit_flow[1:] != hit_flow[:-1]
        rate[hit_flow] = fill
        bottleneck[hit_flow[first]] = link[hit[first]]
        frozen[hit_flow] = True
        done = frozen[flow]
        remaining -= np.bincount(link[done], weights=weight[done] * fill, minlength=num_links)
        np.maximum(remaining, 0.0, out=remaining)
        keep = ~done
        flow, link, weight = flow[keep], link[keep], weight[keep]
    return rate, bottleneck, levels
