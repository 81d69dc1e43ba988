"""Hop layers: the node pairs every flow crosses, hop by hop, resolved to links and assembled into CSR ``Routes``.

Both routers (arithmetic and search) produce flat (flow, hop, link, weight) entries; :func:`assemble` sorts them
into one :class:`~allreduce.topology.Routes` and computes every flow's path latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.topology._graph import FloatArray, IntArray, Routes, Topology

__all__ = ["Entries", "Layer", "LinkIndex", "assemble", "hop_layer", "resolve", "select"]


@dataclass
class Layer:
    """Entries of one hop layer: flow ``flow[i]`` crosses ``src[i, w] -> dst[i, w]`` with share ``weight``."""

    flow: IntArray  # (m,)
    hop: IntArray  # (m,) or (m, w): hop index of each entry
    src: IntArray  # (m, w) node
    dst: IntArray  # (m, w) node
    weight: float | FloatArray  # scalar or (m, w)


def hop_layer(
    flow: IntArray, hop: int | IntArray, src: npt.ArrayLike, dst: npt.ArrayLike, weight: float | FloatArray = 1.0
) -> Layer:
    """The layer of flows ``flow`` at ``hop``: node pairs ``src -> dst``, scalars or one row (of any width) per flow."""
    m = flow.shape[0]
    if m == 0:
        empty = np.zeros((0, 1), dtype=np.int64)
        return Layer(flow, np.zeros(0, dtype=np.int64), empty, empty, 1.0)
    s = np.asarray(src, dtype=np.int64)
    d = np.asarray(dst, dtype=np.int64)
    s = s.reshape(m, -1) if s.ndim else np.full((m, 1), s, dtype=np.int64)
    d = d.reshape(m, -1) if d.ndim else np.full((m, 1), d, dtype=np.int64)
    s, d = np.broadcast_arrays(s, d)
    hop_arr = np.asarray(hop, dtype=np.int64)
    hop_arr = (
        hop_arr
        if hop_arr.ndim == 2
        else np.broadcast_to(hop_arr.reshape(-1)[:, None] if hop_arr.ndim else hop_arr, (m, 1))
    )
    return Layer(flow, np.broadcast_to(hop_arr, s.shape), s, d, weight)


class LinkIndex:
    """Node pair -> link index, by binary search over sorted (src, dst) keys."""

    def __init__(self, topology: Topology) -> None:
        self.num_nodes = topology.num_nodes
        keys = topology.link_src * self.num_nodes + topology.link_dst
        self.order = np.argsort(keys, kind="stable")
        self.keys = keys[self.order]

    def lookup(self, src: IntArray, dst: IntArray) -> IntArray:
        """Link index per pair, -1 where no such link exists."""
        key = src * self.num_nodes + dst
        if self.keys.shape[0] == 0:
            return np.full(key.shape, -1, dtype=np.int64)
        pos = np.searchsorted(self.keys, key)
        pos_c = np.minimum(pos, self.keys.shape[0] - 1)
        found = self.keys[pos_c] == key
        return np.where(found, self.order[pos_c], -1).astype(np.int64)


@dataclass
class Entries:
    """Flat (flow, hop, link, weight) entries, one per link a flow crosses at a hop."""

    flow: IntArray
    hop: IntArray
    link: IntArray
    weight: FloatArray


def resolve(layers: list[Layer], index: LinkIndex, num_flows: int) -> tuple[Entries, npt.NDArray[np.bool_]]:
    """Turn node-pair layers into link entries; flows that hit a missing link are reported as broken."""
    flows, hops, links, weights = [], [], [], []
    broken = np.zeros(num_flows, dtype=np.bool_)
    while layers:
        layer = layers.pop(0)
        m, w = layer.src.shape
        if m == 0:
            continue
        link = index.lookup(layer.src.reshape(-1), layer.dst.reshape(-1))
        flow = np.repeat(layer.flow, w)
        missing = link < 0
        if missing.any():
            broken[flow[missing]] = True
        flows.append(flow)
        hops.append(np.broadcast_to(layer.hop, (m, w)).reshape(-1))
        links.append(link)
        weight = layer.weight
        weights.append(
            np.full(m * w, weight, dtype=np.float64)
            if isinstance(weight, float)
            else np.asarray(weight, dtype=np.float64).reshape(-1)
        )
    if not flows:
        empty_i = np.zeros(0, dtype=np.int64)
        return Entries(empty_i, empty_i, empty_i, np.zeros(0, dtype=np.float64)), broken
    entries = Entries(np.concatenate(flows), np.concatenate(hops), np.concatenate(links), np.concatenate(weights))
    return entries, broken


def select(entries: Entries, keep: npt.NDArray[np.bool_]) -> Entries:
    return Entries(entries.flow[keep], entries.hop[keep], entries.link[keep], entries.weight[keep])


def assemble(topology: Topology, parts: list[Entries], num_flows: int, exact_latency: dict[int, float]) -> Routes:
    """CSR routes in (flow, hop) order; latency = Σ over hops of the slowest link of that hop layer."""

    def joined(name: str, dtype: type) -> npt.NDArray[Any]:
        arrays = [getattr(p, name) for p in parts]
        if len(arrays) == 1:
            return np.asarray(arrays[0], dtype=dtype)
        return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)

    flow, hop, link = joined("flow", np.int64), joined("hop", np.int64), joined("link", np.int64)
    weight = joined("weight", np.float64)
    parts.clear()
    # One integer sort on (flow, hop, link) (at most ~10^6 flows × 10 hops × 10^6 links: fits in int64). Paths
    # of a sprayed flow can share a link (two dragonfly cables leaving one router): sum such duplicates.
    num_hops = int(hop.max()) + 1 if hop.size else 1
    key = (flow * num_hops + hop) * max(topology.num_links, 1) + link
    order = np.argsort(key, kind="stable")
    key = key[order]
    flow, hop, link, weight = flow[order], hop[order], link[order], weight[order]
    if key.size > 1 and bool(np.any(key[1:] == key[:-1])):
        first = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
        weight = np.add.reduceat(weight, first)
        flow, hop, link = flow[first], hop[first], link[first]
    counts = np.bincount(flow, minlength=num_flows)
    flow_ptr = np.zeros(num_flows + 1, dtype=np.int64)
    np.cumsum(counts, out=flow_ptr[1:])
    # Path latency: per (flow, hop) the slowest link of the layer, summed over hops. Exact for a single path,
    # and for spraying over paths whose layers have equal latencies (every builder); searched flows pass their
    # exact longest-path latency in `exact_latency`.
    latency = np.zeros(num_flows, dtype=np.float64)
    if flow.size:
        lat = topology.link_latency_s[link]
        new_group = np.ones(flow.shape[0], dtype=np.bool_)
        new_group[1:] = (flow[1:] != flow[:-1]) | (hop[1:] != hop[:-1])
        starts = np.flatnonzero(new_group)
        layer_max = np.maximum.reduceat(lat, starts)
        latency = np.bincount(flow[starts], weights=layer_max, minlength=num_flows).astype(np.float64)
    for f, value in exact_latency.items():
        latency[f] = value
    return Routes(flow_ptr=flow_ptr, link=link.astype(np.int64), weight=weight, latency_s=latency)
