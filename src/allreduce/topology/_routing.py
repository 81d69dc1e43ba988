"""Routing: which links every flow crosses.

Routings (all over *minimal* paths — fewest hops — that never pass through a GPU unless the topology says GPUs
forward, as on a ring or a torus):

- ``"shortest"``: one deterministic path per (src, dst), chosen by the destination alone as static forwarding
  tables do (D-mod-k: at a hop with ``c`` equal-cost next hops take number ``dst mod c``); on tori it is
  dimension order;
- ``"ecmp"``: at every hop a deterministic hash of (src GPU, dst GPU, seed, hop) picks one of the equal-cost
  next hops, as a switch hashes a flow's 5-tuple, so two flows can land on one link while another idles;
- ``"spray"``: ideal packet spraying: the flow is spread evenly over *all* its minimal paths (a link gets the
  fraction of those paths that cross it);
- ``"dimension_order"`` (tori only): correct dimension 0 first, then 1, then 2, each the short way round (on a
  tie, the + direction).

Dragonflies are the exception to "fewest hops": they route local-global-local over the group pair's cables
(at most one global hop), as dragonfly switches do, even where a path through a third group has fewer hops.

Structured topologies (Clos and fat-tree, rail-optimized, torus, dragonfly, full mesh) are routed
arithmetically: the node sequence comes from the builder's structure and the links from one sorted-key lookup,
O(flows × hops) numpy work (spraying on a torus weighs each move of the minimal-path box by multinomial path
counts, once per box shape). File-defined topologies, and every flow whose structured path crosses a failed
link, are routed by a search from the destination: a vectorised level-by-level BFS for a batch of destinations,
then a walk from each source along the next hops that get one hop closer (after a failure a dragonfly flow
takes the fewest-hop detour, and a torus flow under dimension order the first fewest-hop one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.topology._builders import (
    ClosStructure,
    DirectStructure,
    DragonflyStructure,
    RailStructure,
    TorusStructure,
)
from allreduce.topology._graph import FloatArray, IntArray, NodeKind, Routes, Topology

__all__ = ["ROUTINGS", "ecmp_hash", "reachability_gaps", "route"]

ROUTINGS: tuple[str, ...] = ("shortest", "ecmp", "spray", "dimension_order")

_UNREACHED = np.iinfo(np.int32).max // 2
# Cap on the (destinations × links) matrix of one BFS batch: 8M int32 = 32 MB.
_BATCH_CELLS = 8_000_000


# ----------------------------------------------------------------------------------------------------------
# Hashing
# ----------------------------------------------------------------------------------------------------------
def ecmp_hash(src: IntArray, dst: IntArray, seed: int, hop: int | IntArray) -> npt.NDArray[np.uint64]:
    """A deterministic 64-bit hash of (src, dst, seed, hop) per flow (splitmix64's finaliser over a mix)."""
    with np.errstate(over="ignore"):
        x = (
            np.asarray(src, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            ^ np.asarray(dst, dtype=np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
            ^ np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * np.uint64(0x165667B19E3779F9)
            ^ np.asarray(hop, dtype=np.uint64) * np.uint64(0xD6E8FEB86659FD93)
        )
        x = np.asarray(x, dtype=np.uint64)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def _pick(count: IntArray, src: IntArray, dst: IntArray, *, routing: str, seed: int, hop: int | IntArray) -> IntArray:
    """Which of ``count`` equal-cost next hops each flow takes."""
    count = np.asarray(count, dtype=np.int64)
    if routing == "shortest":
        return np.asarray(np.mod(dst, count), dtype=np.int64)
    h = ecmp_hash(src, dst, seed, hop)
    return np.asarray(h % count.astype(np.uint64), dtype=np.int64)


# ----------------------------------------------------------------------------------------------------------
# Hop layers and assembly into CSR
# ----------------------------------------------------------------------------------------------------------
@dataclass
class _Layer:
    """Entries of one hop layer: flow ``flow[i]`` crosses ``src[i, w] -> dst[i, w]`` with share ``weight``."""

    flow: IntArray  # (m,)
    hop: IntArray  # (m,) or (m, w): hop index of each entry
    src: IntArray  # (m, w) node
    dst: IntArray  # (m, w) node
    weight: float | FloatArray  # scalar or (m, w)


def _layer(
    flow: IntArray, hop: int | IntArray, src: npt.ArrayLike, dst: npt.ArrayLike, weight: float | FloatArray = 1.0
) -> _Layer:
    m = flow.shape[0]
    if m == 0:
        empty = np.zeros((0, 1), dtype=np.int64)
        return _Layer(flow, np.zeros(0, dtype=np.int64), empty, empty, 1.0)
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
    return _Layer(flow, np.broadcast_to(hop_arr, s.shape), s, d, weight)


class _LinkIndex:
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
class _Entries:
    """Flat (flow, hop, link, weight) entries plus per-flow latency where it was computed exactly."""

    flow: IntArray
    hop: IntArray
    link: IntArray
    weight: FloatArray


def _resolve(layers: list[_Layer], index: _LinkIndex, num_flows: int) -> tuple[_Entries, npt.NDArray[np.bool_]]:
    """Turn node-pair layers into link entries; flows that hit a missing link are reported as broken."""
    flows, hops, links, weights = [], [], [], []
    broken = np.zeros(num_flows, dtype=np.bool_)
    while layers:
        layer = layers.pop(0)
        m, w = layer.src.shape
        if m == 0:
            continue
        weight = layer.weight
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
        return _Entries(empty_i, empty_i, empty_i, np.zeros(0, dtype=np.float64)), broken
    entries = _Entries(np.concatenate(flows), np.concatenate(hops), np.concatenate(links), np.concatenate(weights))
    return entries, broken


def _select(entries: _Entries, keep: npt.NDArray[np.bool_]) -> _Entries:
    return _Entries(entries.flow[keep], entries.hop[keep], entries.link[keep], entries.weight[keep])


def _assemble(topology: Topology, parts: list[_Entries], num_flows: int, exact_latency: dict[int, float]) -> Routes:
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


# ----------------------------------------------------------------------------------------------------------
# Structured routing
# ----------------------------------------------------------------------------------------------------------
def _clos_layers(
    st: ClosStructure, src: IntArray, dst: IntArray, flows: IntArray, *, routing: str, seed: int
) -> list[_Layer]:
    h, lp, sp, cp = st.hosts_per_leaf, st.leaves_per_pod, st.spines_per_pod, st.cores_per_plane
    leaf_s, leaf_d = src // h, dst // h
    pod_s, pod_d = leaf_s // lp, leaf_d // lp
    layers: list[_Layer] = []
    # Every flow between two GPUs goes up to its leaf and ends coming down from the destination's leaf.
    same_leaf = leaf_s == leaf_d
    f = flows[same_leaf]
    layers += [
        _layer(f, 0, src[same_leaf], st.leaf0 + leaf_s[same_leaf]),
        _layer(f, 1, st.leaf0 + leaf_d[same_leaf], dst[same_leaf]),
    ]
    same_pod = ~same_leaf & (pod_s == pod_d)
    cross = ~same_leaf & (pod_s != pod_d)
    for mask, tiers in ((same_pod, 2), (cross, 3)):
        if not mask.any():
            continue
        f = flows[mask]
        s, d = src[mask], dst[mask]
        ls, ld = st.leaf0 + leaf_s[mask], st.leaf0 + leaf_d[mask]
        ps, pd = pod_s[mask], pod_d[mask]
        last = 2 * tiers - 1
        layers += [_layer(f, 0, s, ls), _layer(f, last, ld, d)]
        if routing == "spray":
            i = np.arange(sp, dtype=np.int64)[None, :]
            spine_s = st.spine0 + ps[:, None] * sp + i
            spine_d = st.spine0 + pd[:, None] * sp + i
            layers += [
                _layer(f, 1, ls[:, None], spine_s, 1.0 / sp),
                _layer(f, last - 1, spine_d, ld[:, None], 1.0 / sp),
            ]
            if tiers == 3:
                # Path (i, j): spine i of the source pod, core j of plane i; every one of sp·cp paths equally.
                core = st.core0 + (i * cp)[:, :, None] + np.arange(cp, dtype=np.int64)[None, None, :]
                core = np.broadcast_to(core, (f.shape[0], sp, cp))
                w = 1.0 / (sp * cp)
                layers += [
                    _layer(f, 2, np.broadcast_to(spine_s[:, :, None], core.shape), core, w),
                    _layer(f, 3, core, np.broadcast_to(spine_d[:, :, None], core.shape), w),
                ]
            continue
        i = _pick(np.full(f.shape, sp), s, d, routing=routing, seed=seed, hop=1)
        spine_s = st.spine0 + ps * sp + i
        spine_d = st.spine0 + pd * sp + i
        layers += [_layer(f, 1, ls, spine_s), _layer(f, last - 1, spine_d, ld)]
        if tiers == 3:
            pick_d = d // sp if routing == "shortest" else d
            j = _pick(np.full(f.shape, cp), s, pick_d, routing=routing, seed=seed, hop=2)
            core = st.core0 + i * cp + j
            layers += [_layer(f, 2, spine_s, core), _layer(f, 3, core, spine_d)]
    return layers


def _rail_layers(
    st: RailStructure, src: IntArray, dst: IntArray, flows: IntArray, *, routing: str, seed: int
) -> list[_Layer]:
    g = st.gpus_per_node
    node_s, node_d = src // g, dst // g
    unit_s, unit_d = node_s // st.nodes_per_unit, node_d // st.nodes_per_unit
    rail_s = st.rail0 + unit_s * g + src % g
    rail_d = st.rail0 + unit_d * g + dst % g
    layers: list[_Layer] = []
    intra = node_s == node_d
    f = flows[intra]
    if st.mesh:
        layers.append(_layer(f, 0, src[intra], dst[intra]))
    else:
        nvs = st.nvswitch0 + node_s[intra]
        layers += [_layer(f, 0, src[intra], nvs), _layer(f, 1, nvs, dst[intra])]
    same_rail = ~intra & (rail_s == rail_d)
    across = ~intra & (rail_s != rail_d)
    for mask, hops in ((same_rail, 4), (across, 6)):
        if not mask.any():
            continue
        f = flows[mask]
        s, d = src[mask], dst[mask]
        rs, rd = rail_s[mask], rail_d[mask]
        layers += [
            _layer(f, 0, s, st.nic0 + s),
            _layer(f, 1, st.nic0 + s, rs),
            _layer(f, hops - 2, rd, st.nic0 + d),
            _layer(f, hops - 1, st.nic0 + d, d),
        ]
        if hops == 6:
            if routing == "spray":
                spine = st.spine0 + np.arange(st.spines, dtype=np.int64)[None, :]
                spine = np.broadcast_to(spine, (f.shape[0], st.spines))
                w = 1.0 / st.spines
                layers += [_layer(f, 2, rs[:, None], spine, w), _layer(f, 3, spine, rd[:, None], w)]
            else:
                spine = st.spine0 + _pick(np.full(f.shape, st.spines), s, d, routing=routing, seed=seed, hop=2)
                layers += [_layer(f, 2, rs, spine), _layer(f, 3, spine, rd)]
    return layers


def _torus_layers(
    st: TorusStructure, src: IntArray, dst: IntArray, flows: IntArray, *, routing: str, seed: int
) -> list[_Layer]:
    dims = st.dims
    cs = np.stack(np.unravel_index(src, dims), axis=1).astype(np.int64)
    cd = np.stack(np.unravel_index(dst, dims), axis=1).astype(np.int64)
    size = np.asarray(dims, dtype=np.int64)[None, :]
    forward = np.mod(cd - cs, size)  # hops going +
    steps = np.minimum(forward, size - forward)
    # Direction per dimension: +1, -1, or 0 where both ways are equally short (decided at the first move).
    direction = np.where(forward < size - forward, 1, -1).astype(np.int64)
    # On a ring of 2 both ways are the same single link: no tie to split.
    direction[(forward == size - forward) & (forward > 0) & (size > 2)] = 0
    if routing == "spray":
        return _torus_spray_layers(dims, cs, steps, direction, flows)
    if routing in ("dimension_order", "shortest"):
        direction[direction == 0] = 1
    cur = cs.copy()
    hop = np.zeros(src.shape[0], dtype=np.int64)
    layers: list[_Layer] = []

    def move(active: npt.NDArray[np.bool_], axis: npt.NDArray[np.int64], sign: npt.NDArray[np.int64]) -> None:
        rows = np.flatnonzero(active)
        before = np.ravel_multi_index(cur[rows].T, dims).astype(np.int64)
        cur[rows, axis] = np.mod(cur[rows, axis] + sign, size[0, axis])
        after = np.ravel_multi_index(cur[rows].T, dims).astype(np.int64)
        layers.append(_layer(flows[rows], hop[rows], before, after))
        hop[rows] += 1
        steps[rows, axis] -= 1

    if routing in ("dimension_order", "shortest"):
        for axis in range(len(dims)):
            while True:
                active = steps[:, axis] > 0
                if not active.any():
                    break
                rows = np.flatnonzero(active)
                move(active, np.full(rows.shape, axis), direction[rows, axis])
        return layers
    # ECMP: at every hop, hash among the productive (dimension, direction) moves.
    while True:
        active = steps.sum(axis=1) > 0
        if not active.any():
            return layers
        rows = np.flatnonzero(active)
        options = np.where(steps[rows] > 0, np.where(direction[rows] == 0, 2, 1), 0)
        choice = _pick(options.sum(axis=1), src[rows], dst[rows], routing="ecmp", seed=seed, hop=hop[rows])
        cumulative = np.cumsum(options, axis=1)
        axis = np.argmax(cumulative > choice[:, None], axis=1).astype(np.int64)
        within = choice - (cumulative[np.arange(rows.shape[0]), axis] - options[np.arange(rows.shape[0]), axis])
        d = direction[rows, axis]
        sign = np.where(d == 0, np.where(within == 0, 1, -1), d).astype(np.int64)
        direction[rows, axis] = sign
        move(active, axis, sign)


def _log_multinomial(counts: IntArray) -> FloatArray:
    """log((Σ counts)! / Π counts!) along the last axis: the number of orderings of the moves."""
    lgamma = np.vectorize(math.lgamma, otypes=[np.float64])
    return np.asarray(lgamma(counts.sum(axis=-1) + 1.0) - lgamma(counts + 1.0).sum(axis=-1), dtype=np.float64)


def _torus_spray_layers(
    dims: tuple[int, ...], start: IntArray, steps: IntArray, direction: IntArray, flows: IntArray
) -> list[_Layer]:
    """Spread each flow evenly over all its minimal paths on a torus.

    The minimal paths of a flow are the orderings of its moves: ``steps[k]`` moves along dimension ``k`` in its
    short direction (either way round where both are equally short, half the paths each). Within one choice of
    directions, the move along ``k`` from offset ``p`` of the box carries the share
    M(p)·M(steps - p - e_k) / M(steps) of the paths, where M is the multinomial number of orderings. That
    depends only on the box's shape, so it is computed once per distinct ``steps`` vector.
    """
    ndim = len(dims)
    size = np.asarray(dims, dtype=np.int64)
    # Expand ties: one variant per choice of direction, each with an equal share of the flow.
    variant_flow = np.arange(flows.shape[0], dtype=np.int64)
    variant_dir = direction.copy()
    share = np.ones(flows.shape[0], dtype=np.float64)
    for axis in range(ndim):
        tied = np.flatnonzero(variant_dir[:, axis] == 0)
        if tied.size == 0:
            continue
        variant_dir[tied, axis] = 1
        share[tied] /= 2.0
        extra = variant_dir[tied].copy()
        extra[:, axis] = -1
        variant_flow = np.concatenate([variant_flow, variant_flow[tied]])
        variant_dir = np.concatenate([variant_dir, extra])
        share = np.concatenate([share, share[tied]])
    variant_steps = steps[variant_flow]
    shapes, shape_of = np.unique(variant_steps, axis=0, return_inverse=True)
    shape_of = shape_of.reshape(-1)
    layers: list[_Layer] = []
    for index, shape in enumerate(shapes):
        members = np.flatnonzero(shape_of == index)
        total = _log_multinomial(shape)
        # Every (box offset p, dimension k) with p[k] < shape[k]: a move of the minimal paths.
        offsets = np.stack(np.unravel_index(np.arange(int(np.prod(shape + 1))), tuple(shape + 1)), axis=1)
        for axis in range(ndim):
            p = offsets[offsets[:, axis] < shape[axis]]
            if p.shape[0] == 0:
                continue
            rest = shape[None, :] - p
            rest[:, axis] -= 1
            weight = np.exp(_log_multinomial(p) + _log_multinomial(rest) - total)  # (points,)
            v = variant_flow[members]
            dirs = variant_dir[members]  # (m, ndim)
            here = np.mod(start[v][:, None, :] + dirs[:, None, :] * p[None, :, :], size)  # (m, points, ndim)
            there = here.copy()
            there[:, :, axis] = np.mod(there[:, :, axis] + dirs[:, None, axis], size[axis])
            src_node = np.ravel_multi_index(tuple(np.moveaxis(here, -1, 0)), dims)
            dst_node = np.ravel_multi_index(tuple(np.moveaxis(there, -1, 0)), dims)
            hop = np.broadcast_to(p.sum(axis=1)[None, :], src_node.shape)
            layers.append(_layer(flows[v], hop, src_node, dst_node, share[members][:, None] * weight[None, :]))
    return layers


def _structured_layers(
    topology: Topology, src: IntArray, dst: IntArray, flows: IntArray, *, routing: str, seed: int
) -> list[_Layer] | None:
    """Node-pair layers for the flows, or None when the structure cannot route this way (use the search)."""
    base = topology.root if topology.root is not None else topology
    st = base.structure
    src_node, dst_node = base.gpu_node[src], base.gpu_node[dst]
    if isinstance(st, ClosStructure):
        return _clos_layers(st, src_node, dst_node, flows, routing=routing, seed=seed)
    if isinstance(st, RailStructure):
        return _rail_layers(st, src_node, dst_node, flows, routing=routing, seed=seed)
    if isinstance(st, TorusStructure):
        return _torus_layers(st, src_node, dst_node, flows, routing=routing, seed=seed)
    if isinstance(st, DirectStructure):
        return [_layer(flows, 0, src_node, dst_node)]
    if isinstance(st, DragonflyStructure):
        return _dragonfly_layers(st, src_node, dst_node, flows, routing=routing, seed=seed)
    return None


def _dragonfly_layers(
    st: DragonflyStructure, src: IntArray, dst: IntArray, flows: IntArray, *, routing: str, seed: int
) -> list[_Layer]:
    """Minimal dragonfly routing: up to the source router, a local hop to a gateway router holding a cable to
    the destination group, the global hop, a local hop to the destination router, down. Among the group pair's
    cables, only those with the fewest hops count as equal-cost."""
    R, gl = st.routers_per_group, st.global_links
    r_s, r_d = src // st.hosts_per_router, dst // st.hosts_per_router
    g_s, g_d = r_s // R, r_d // R
    layers: list[_Layer] = []
    same_router = r_s == r_d
    same_group = ~same_router & (g_s == g_d)
    across = g_s != g_d
    for mask, local in ((same_router, False), (same_group, True)):
        f = flows[mask]
        layers.append(_layer(f, 0, src[mask], st.router0 + r_s[mask]))
        if local:
            layers.append(_layer(f, 1, st.router0 + r_s[mask], st.router0 + r_d[mask]))
        layers.append(_layer(f, 1 + int(local), st.router0 + r_d[mask], dst[mask]))
    if not across.any():
        return layers
    f, s, d = flows[across], src[across], dst[across]
    rs, rd, gs, gd = r_s[across], r_d[across], g_s[across], g_d[across]
    c = np.arange(gl, dtype=np.int64)[None, :]
    gate_s = gs[:, None] * R + ((gd - (gd > gs))[:, None] * gl + c) % R  # (m, gl) router indices
    gate_d = gd[:, None] * R + ((gs - (gs > gd))[:, None] * gl + c) % R
    before = gate_s != rs[:, None]  # a local hop before the global one
    after = gate_d != rd[:, None]
    hops = 1 + before.astype(np.int64) + after.astype(np.int64)
    best = hops == hops.min(axis=1, keepdims=True)
    count = best.sum(axis=1)
    if routing == "spray":
        weight = np.where(best, 1.0 / count[:, None], 0.0)
    else:
        pick = _pick(count, s, d, routing=routing, seed=seed, hop=1)
        # The pick-th of the best cables, in cable order.
        rank = np.cumsum(best, axis=1) - 1
        weight = (best & (rank == pick[:, None])).astype(np.float64)
    keep = weight > 0
    rows, cable = np.nonzero(keep)
    w = weight[rows, cable]
    fr = f[rows]
    gsr, gdr = st.router0 + gate_s[rows, cable], st.router0 + gate_d[rows, cable]
    b, a = before[rows, cable], after[rows, cable]
    # Entries per (flow, cable); hop positions shift by the optional local hop before the global one.
    layers.append(_layer(f, 0, s, st.router0 + rs))
    layers.append(_layer(fr[b], 1, (st.router0 + rs[rows])[b], gsr[b], w[b]))
    layers.append(_layer(fr, 1 + b.astype(np.int64), gsr, gdr, w))
    layers.append(_layer(fr[a], 2 + b[a].astype(np.int64), gdr[a], (st.router0 + rd[rows])[a], w[a]))
    layers.append(_layer(f, 1 + hops.min(axis=1), st.router0 + rd, d))
    return layers


# ----------------------------------------------------------------------------------------------------------
# Search-based routing
# ----------------------------------------------------------------------------------------------------------
class _Graph:
    """Out-links grouped by source node, and which nodes may be passed through."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        n = topology.num_nodes
        self.order = np.argsort(topology.link_src, kind="stable").astype(np.int64)
        self.ls = topology.link_src[self.order]
        self.ld = topology.link_dst[self.order]
        self.lat = topology.link_latency_s[self.order]
        self.ptr = np.searchsorted(self.ls, np.arange(n + 1, dtype=np.int64)).astype(np.int64)
        self.degree = np.diff(self.ptr)
        self.has_out = np.flatnonzero(self.degree > 0)
        in_order = np.argsort(topology.link_dst, kind="stable")
        self.in_src = topology.link_src[in_order]
        self.in_ptr = np.searchsorted(topology.link_dst[in_order], np.arange(n + 1, dtype=np.int64)).astype(np.int64)
        self.in_degree = np.diff(self.in_ptr)
        self.transit = np.ones(n, dtype=np.bool_) if topology.gpu_transit else topology.node_kind != int(NodeKind.GPU)

    def distances(self, targets: IntArray) -> npt.NDArray[np.int32]:
        """Hops from every node to each target (rows), passing only through transit nodes.

        A breadth-first search backwards over in-links from all targets at once: the frontier is a set of
        (row, node) pairs, so every link is looked at once per target, not once per level."""
        n = self.topology.num_nodes
        rows = np.arange(targets.shape[0], dtype=np.int64)
        dist = np.full((targets.shape[0], n), _UNREACHED, dtype=np.int32)
        dist[rows, targets] = 0
        front_row, front_node = rows, np.asarray(targets, dtype=np.int64)
        flat_dist = dist.reshape(-1)
        # Scratch for deduplicating a frontier without sorting: the last writer of a (row, node) cell wins.
        writer = np.zeros(flat_dist.shape[0], dtype=np.int64)
        level = 0
        while front_row.size:
            # A non-transit node is reached but passes nothing on, unless it is the target itself.
            spread = self.transit[front_node] | (level == 0)
            front_row, front_node = front_row[spread], front_node[spread]
            deg = self.in_degree[front_node]
            row = np.repeat(front_row, deg)
            offset = np.arange(row.shape[0], dtype=np.int64) - np.repeat(np.cumsum(deg) - deg, deg)
            pred = self.in_src[np.repeat(self.in_ptr[front_node], deg) + offset]
            flat = row * n + pred
            flat = flat[flat_dist[flat] == _UNREACHED]
            writer[flat] = np.arange(flat.shape[0], dtype=np.int64)
            flat = flat[writer[flat] == np.arange(flat.shape[0], dtype=np.int64)]
            front_row, front_node = flat // n, flat % n
            level += 1
            flat_dist[flat] = level
        return dist

    def effective(self, dist: npt.NDArray[np.int32], targets: IntArray) -> npt.NDArray[np.int32]:
        """Distances as seen by a predecessor: a non-transit node is a dead end unless it is the target."""
        eff = np.where(self.transit[None, :], dist, _UNREACHED).astype(np.int32)
        eff[np.arange(targets.shape[0]), targets] = 0
        return eff

    def path_counts(self, dist: npt.NDArray[np.int32], eff: npt.NDArray[np.int32]) -> FloatArray:
        """Number of minimal paths from every node to each row's target (float: counts grow fast).

        Only successors with ``eff`` one less count, so paths never pass through a non-transit node."""
        counts = np.where(eff == 0, 1.0, 0.0)
        starts = self.ptr[self.has_out]
        reach = dist < _UNREACHED
        max_d = int(dist[reach].max()) if reach.any() else 0
        for level in range(1, max_d + 1):
            contrib = np.where(eff[:, self.ld] == level - 1, counts[:, self.ld], 0.0)
            total = np.add.reduceat(contrib, starts, axis=1)
            at_level = dist[:, self.has_out] == level
            counts[:, self.has_out] = np.where(at_level, total, counts[:, self.has_out])
        return counts

    def next_hops(
        self, node: IntArray, row: IntArray, dist: npt.NDArray[np.int32], eff: npt.NDArray[np.int32]
    ) -> tuple[IntArray, IntArray]:
        """For each (node, row) query: (query index, sorted link position) of the out-links one hop closer."""
        deg = self.degree[node]
        query = np.repeat(np.arange(node.shape[0], dtype=np.int64), deg)
        first = np.repeat(self.ptr[node], deg)
        offset = np.arange(query.shape[0], dtype=np.int64) - np.repeat(np.cumsum(deg) - deg, deg)
        pos = first + offset
        good = eff[row[query], self.ld[pos]] == dist[row[query], node[query]] - 1
        return query[good], pos[good]


def _search(
    topology: Topology,
    src: IntArray,
    dst: IntArray,
    flows: IntArray,
    *,
    routing: str,
    seed: int,
) -> tuple[list[_Entries], dict[int, float]]:
    """Route flows (GPU indices) by searching the graph; raises ValueError naming unreachable pairs."""
    graph = _Graph(topology)
    src_node = topology.gpu_node[src]
    dst_node = topology.gpu_node[dst]
    targets, inverse = np.unique(dst_node, return_inverse=True)
    batch = max(1, _BATCH_CELLS // max(topology.num_links, topology.num_nodes, 1))
    parts: list[_Entries] = []
    exact: dict[int, float] = {}
    for lo in range(0, targets.shape[0], batch):
        tgt = targets[lo : lo + batch]
        sel = np.flatnonzero((inverse >= lo) & (inverse < lo + tgt.shape[0]))
        row = (inverse[sel] - lo).astype(np.int64)
        dist = graph.distances(tgt)
        eff = graph.effective(dist, tgt)
        d0 = dist[row, src_node[sel]]
        unreachable = d0 >= _UNREACHED
        if unreachable.any():
            f = int(sel[np.flatnonzero(unreachable)[0]])
            _raise_no_path(topology, int(src[f]), int(dst[f]), int(unreachable.sum()))
        if routing == "spray":
            part, lat = _spray_walk(graph, dist=dist, eff=eff, start=src_node[sel], row=row, flows=flows[sel])
            parts.append(part)
            exact.update(zip(flows[sel].tolist(), lat.tolist(), strict=True))
        else:
            parts.append(
                _single_walk(
                    graph,
                    dist=dist,
                    eff=eff,
                    start=src_node[sel],
                    row=row,
                    flows=flows[sel],
                    src_gpu=src[sel],
                    dst_gpu=dst[sel],
                    routing=routing,
                    seed=seed,
                )
            )
    return parts, exact


def _single_walk(
    graph: _Graph,
    *,
    dist: npt.NDArray[np.int32],
    eff: npt.NDArray[np.int32],
    start: IntArray,
    row: IntArray,
    flows: IntArray,
    src_gpu: IntArray,
    dst_gpu: IntArray,
    routing: str,
    seed: int,
) -> _Entries:
    cur = start.copy()
    alive = np.flatnonzero(dist[row, cur] > 0)
    out_flow, out_hop, out_link = [], [], []
    hop = 0
    while alive.size:
        query, pos = graph.next_hops(cur[alive], row[alive], dist, eff)
        count = np.bincount(query, minlength=alive.shape[0])
        first = np.cumsum(count) - count
        choice = _pick(count, src_gpu[alive], dst_gpu[alive], routing=routing, seed=seed, hop=hop)
        chosen = pos[first + choice]
        out_flow.append(flows[alive])
        out_hop.append(np.full(alive.shape, hop, dtype=np.int64))
        out_link.append(graph.order[chosen])
        cur[alive] = graph.ld[chosen]
        alive = alive[dist[row[alive], cur[alive]] > 0]
        hop += 1
    if not out_flow:
        z = np.zeros(0, dtype=np.int64)
        return _Entries(z, z, z, np.zeros(0, dtype=np.float64))
    link = np.concatenate(out_link)
    return _Entries(np.concatenate(out_flow), np.concatenate(out_hop), link, np.ones(link.shape, dtype=np.float64))


def _spray_walk(
    graph: _Graph,
    *,
    dist: npt.NDArray[np.int32],
    eff: npt.NDArray[np.int32],
    start: IntArray,
    row: IntArray,
    flows: IntArray,
) -> tuple[_Entries, FloatArray]:
    """Spread each flow over all its minimal paths: link u->v carries paths(src→u)·paths(v→dst)/paths(src→dst)."""
    counts = graph.path_counts(dist, eff)
    total = counts[row, start]
    n = graph.topology.num_nodes
    # States: (query index, node, number of minimal paths src→node, longest latency src→node).
    q = np.arange(start.shape[0], dtype=np.int64)
    node = start.copy()
    paths = np.ones(start.shape[0], dtype=np.float64)
    lat = np.zeros(start.shape[0], dtype=np.float64)
    latency = np.zeros(start.shape[0], dtype=np.float64)
    out_flow, out_hop, out_link, out_w = [], [], [], []
    hop = 0
    while True:
        arrived = dist[row[q], node] == 0
        np.maximum.at(latency, q[arrived], lat[arrived])
        keep = ~arrived
        q, node, paths, lat = q[keep], node[keep], paths[keep], lat[keep]
        if q.size == 0:
            break
        query, pos = graph.next_hops(node, row[q], dist, eff)
        sq = q[query]
        v = graph.ld[pos]
        via = paths[query]
        weight = via * counts[row[sq], v] / total[sq]
        out_flow.append(flows[sq])
        out_hop.append(np.full(sq.shape, hop, dtype=np.int64))
        out_link.append(graph.order[pos])
        out_w.append(weight)
        key = sq * n + v
        uniq, inv = np.unique(key, return_inverse=True)
        paths = np.bincount(inv, weights=via, minlength=uniq.shape[0]).astype(np.float64)
        new_lat = np.full(uniq.shape[0], -np.inf)
        np.maximum.at(new_lat, inv, lat[query] + graph.lat[pos])
        q, node, lat = uniq // n, uniq % n, new_lat
        hop += 1
    entries = _Entries(
        np.concatenate(out_flow) if out_flow else np.zeros(0, dtype=np.int64),
        np.concatenate(out_hop) if out_hop else np.zeros(0, dtype=np.int64),
        np.concatenate(out_link) if out_link else np.zeros(0, dtype=np.int64),
        np.concatenate(out_w) if out_w else np.zeros(0, dtype=np.float64),
    )
    return entries, latency


def _raise_no_path(topology: Topology, src_gpu: int, dst_gpu: int, how_many: int) -> None:
    others = f" (and at least {how_many - 1} more GPU pairs)" if how_many > 1 else ""
    failed = ""
    if topology.failed_links:
        shown = ", ".join(topology.failed_links[:8])
        more = ", ..." if len(topology.failed_links) > 8 else ""
        failed = f" after the failure of {shown}{more}"
    raise ValueError(
        f"{topology.name}: no path from {topology.gpu_name(src_gpu)} to {topology.gpu_name(dst_gpu)}{failed}{others}"
    )


def reachability_gaps(topology: Topology) -> tuple[int, int, int] | None:
    """The first ordered GPU pair (src, dst) with no path and how many pairs lack one; None if all connect."""
    graph = _Graph(topology)
    gpu_nodes = topology.gpu_node
    batch = max(1, _BATCH_CELLS // max(topology.num_links, topology.num_nodes, 1))
    first: tuple[int, int] | None = None
    missing = 0
    for lo in range(0, gpu_nodes.shape[0], batch):
        dist = graph.distances(gpu_nodes[lo : lo + batch])
        unreachable = dist[:, gpu_nodes] >= _UNREACHED  # rows: destination GPU, columns: source GPU
        if unreachable.any():
            missing += int(unreachable.sum())
            if first is None:
                s, d = np.argwhere(unreachable.T)[0]  # lowest source GPU first
                first = (int(s), lo + int(d))
    return None if first is None else (first[0], first[1], missing)


# ----------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------
def _as_gpus(topology: Topology, values: npt.ArrayLike, what: str) -> IntArray:
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu":
        if arr.size and not np.all(np.asarray(arr, dtype=np.float64) == np.floor(np.asarray(arr, dtype=np.float64))):
            raise ValueError(f"route: {what} must be integer GPU indices")
        arr = arr.astype(np.int64)
    arr = np.asarray(arr, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero((arr < 0) | (arr >= topology.num_gpus))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"route: {what}[{i}] = {int(arr[i])} is not a GPU of {topology.name} (0..{topology.num_gpus - 1})"
        )
    return arr


def route(
    topology: Topology,
    src_gpu: npt.ArrayLike | Sequence[int],
    dst_gpu: npt.ArrayLike | Sequence[int],
    *,
    routing: str | None = None,
    seed: int = 0,
) -> Routes:
    """The links each flow ``src_gpu[f] -> dst_gpu[f]`` crosses under ``routing`` (see the module docstring).

    ``routing=None`` (the default) takes the topology's default: dimension order on tori and rings, ECMP
    everywhere else. A flow from a GPU to
    itself gets an empty path with latency 0. A pair with no path raises ValueError naming both GPUs (and the
    failed links, if any).
    """
    routing = topology.default_routing if routing is None else routing
    if routing not in ROUTINGS:
        raise ValueError(f"route: unknown routing {routing!r}; choose one of {', '.join(ROUTINGS)}")
    src = _as_gpus(topology, src_gpu, "src_gpu")
    dst = _as_gpus(topology, dst_gpu, "dst_gpu")
    if src.shape != dst.shape:
        raise ValueError(f"route: {src.shape[0]} sources but {dst.shape[0]} destinations")
    base = topology.root if topology.root is not None else topology
    if routing == "dimension_order" and not isinstance(base.structure, TorusStructure):
        raise ValueError(f"route: dimension_order routing needs a torus or ring, not {topology.name}")
    num_flows = src.shape[0]
    moving = np.flatnonzero(src != dst).astype(np.int64)
    parts: list[_Entries] = []
    exact: dict[int, float] = {}
    layers = _structured_layers(topology, src[moving], dst[moving], moving, routing=routing, seed=seed)
    search = moving
    if layers is not None:
        entries, broken = _resolve(layers, _LinkIndex(topology), num_flows)
        del layers  # the node-pair arrays can be as large as the routes themselves (spraying)
        parts.append(_select(entries, ~broken[entries.flow]) if broken.any() else entries)
        search = np.flatnonzero(broken).astype(np.int64)
    if search.size:
        if routing == "dimension_order":
            # Dimension order has exactly one path; around a failed link fall back to the minimal detour.
            routing = "shortest"
        found, found_exact = _search(topology, src[search], dst[search], search, routing=routing, seed=seed)
        parts += found
        exact.update(found_exact)
    return _assemble(topology, parts, num_flows, exact)
