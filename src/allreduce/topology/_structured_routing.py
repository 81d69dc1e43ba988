"""Arithmetic routing of the builders' structured topologies (Clos and fat-tree, rail-optimized, torus,
dragonfly, full mesh): each flow's node sequence computed from the structure, O(flows × hops) numpy work.

Spraying on a torus weighs each move of the minimal-path box by multinomial path counts, once per box shape.
Dragonflies route local-global-local over the group pair's cables (at most one global hop), as dragonfly
switches do, even where a path through a third group has fewer hops.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from allreduce.topology._builders import (
    ClosStructure,
    DirectStructure,
    DragonflyStructure,
    RailStructure,
    TorusStructure,
)
from allreduce.topology._ecmp import pick_next_hop
from allreduce.topology._graph import FloatArray, IntArray, Topology
from allreduce.topology._hop_layers import Layer, hop_layer

__all__ = ["structured_layers"]


def _middle(count: int, src: IntArray, dst: IntArray, *, routing: str, seed: int, hop: int) -> tuple[IntArray, float]:
    """Which of ``count`` equivalent switches each flow crosses at ``hop``, one row per flow, and the share of the
    flow each carries: all of them, 1/count each, when spraying; else the one ``routing`` picks (D-mod-k or an
    ECMP hash of the pair ``src``, ``dst``), all of the flow."""
    if routing == "spray":
        return np.broadcast_to(np.arange(count, dtype=np.int64), (src.shape[0], count)), 1.0 / count
    return pick_next_hop(np.full(src.shape, count), src, dst, routing=routing, seed=seed, hop=hop)[:, None], 1.0


def _clos_layers(
    st: ClosStructure, src: IntArray, dst: IntArray, flows: IntArray, *, routing: str, seed: int
) -> list[Layer]:
    h, lp, sp, cp = st.hosts_per_leaf, st.leaves_per_pod, st.spines_per_pod, st.cores_per_plane
    leaf_s, leaf_d = src // h, dst // h
    pod_s, pod_d = leaf_s // lp, leaf_d // lp
    layers: list[Layer] = []
    # Every flow between two GPUs goes up to its leaf and ends coming down from the destination's leaf.
    same_leaf = leaf_s == leaf_d
    f = flows[same_leaf]
    layers += [
        hop_layer(f, 0, src[same_leaf], st.leaf0 + leaf_s[same_leaf]),
        hop_layer(f, 1, st.leaf0 + leaf_d[same_leaf], dst[same_leaf]),
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
        layers += [hop_layer(f, 0, s, ls), hop_layer(f, last, ld, d)]
        i, spine_weight = _middle(sp, s, d, routing=routing, seed=seed, hop=1)
        spine_s = st.spine0 + ps[:, None] * sp + i
        spine_d = st.spine0 + pd[:, None] * sp + i
        layers += [
            hop_layer(f, 1, ls[:, None], spine_s, spine_weight),
            hop_layer(f, last - 1, spine_d, ld[:, None], spine_weight),
        ]
        if tiers == 3:
            # Path (i, j): spine i of the source pod, core j of plane i.
            j, _ = _middle(cp, s, d // sp if routing == "shortest" else d, routing=routing, seed=seed, hop=2)
            core = st.core0 + (i * cp)[:, :, None] + j[:, None, :]
            w = 1.0 / (i.shape[1] * j.shape[1])  # every one of the paths (i, j) equally: 1/(sp·cp) sprayed
            layers += [
                hop_layer(f, 2, np.broadcast_to(spine_s[:, :, None], core.shape), core, w),
                hop_layer(f, 3, core, np.broadcast_to(spine_d[:, :, None], core.shape), w),
            ]
    return layers


def _rail_layers(
    st: RailStructure, src: IntArray, dst: IntArray, flows: IntArray, *, routing: str, seed: int
) -> list[Layer]:
    g = st.gpus_per_node
    node_s, node_d = src // g, dst // g
    unit_s, unit_d = node_s // st.nodes_per_unit, node_d // st.nodes_per_unit
    rail_s = st.rail0 + unit_s * g + src % g
    rail_d = st.rail0 + unit_d * g + dst % g
    layers: list[Layer] = []
    intra = node_s == node_d
    f = flows[intra]
    if st.mesh:
        layers.append(hop_layer(f, 0, src[intra], dst[intra]))
    else:
        nvs = st.nvswitch0 + node_s[intra]
        layers += [hop_layer(f, 0, src[intra], nvs), hop_layer(f, 1, nvs, dst[intra])]
    same_rail = ~intra & (rail_s == rail_d)
    across = ~intra & (rail_s != rail_d)
    for mask, hops in ((same_rail, 4), (across, 6)):
        if not mask.any():
            continue
        f = flows[mask]
        s, d = src[mask], dst[mask]
        rs, rd = rail_s[mask], rail_d[mask]
        layers += [
            hop_layer(f, 0, s, st.nic0 + s),
            hop_layer(f, 1, st.nic0 + s, rs),
            hop_layer(f, hops - 2, rd, st.nic0 + d),
            hop_layer(f, hops - 1, st.nic0 + d, d),
        ]
        if hops == 6:
            k, w = _middle(st.spines, s, d, routing=routing, seed=seed, hop=2)
            spine = st.spine0 + k
            layers += [hop_layer(f, 2, rs[:, None], spine, w), hop_layer(f, 3, spine, rd[:, None], w)]
    return layers


def _torus_layers(
    st: TorusStructure, src: IntArray, dst: IntArray, flows: IntArray, *, routing: str, seed: int
) -> list[Layer]:
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
    layers: list[Layer] = []

    def move(active: npt.NDArray[np.bool_], axis: npt.NDArray[np.int64], sign: npt.NDArray[np.int64]) -> None:
        rows = np.flatnonzero(active)
        before = np.ravel_multi_index(cur[rows].T, dims).astype(np.int64)
        cur[rows, axis] = np.mod(cur[rows, axis] + sign, size[0, axis])
        after = np.ravel_multi_index(cur[rows].T, dims).astype(np.int64)
        layers.append(hop_layer(flows[rows], hop[rows], before, after))
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
        choice = pick_next_hop(options.sum(axis=1), src[rows], dst[rows], routing="ecmp", seed=seed, hop=hop[rows])
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
) -> list[Layer]:
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
    layers: list[Layer] = []
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
            layers.append(hop_layer(flows[v], hop, src_node, dst_node, share[members][:, None] * weight[None, :]))
    return layers


def structured_layers(
    topology: Topology, src: IntArray, dst: IntArray, flows: IntArray, *, routing: str, seed: int
) -> list[Layer] | None:
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
        return [hop_layer(flows, 0, src_node, dst_node)]
    if isinstance(st, DragonflyStructure):
        return _dragonfly_layers(st, src_node, dst_node, flows, routing=routing, seed=seed)
    return None


def _dragonfly_layers(
    st: DragonflyStructure, src: IntArray, dst: IntArray, flows: IntArray, *, routing: str, seed: int
) -> list[Layer]:
    """Minimal dragonfly routing: up to the source router, a local hop to a gateway router holding a cable to
    the destination group, the global hop, a local hop to the destination router, down. Among the group pair's
    cables, only those with the fewest hops count as equal-cost."""
    R, gl = st.routers_per_group, st.global_links
    r_s, r_d = src // st.hosts_per_router, dst // st.hosts_per_router
    g_s, g_d = r_s // R, r_d // R
    layers: list[Layer] = []
    same_router = r_s == r_d
    same_group = ~same_router & (g_s == g_d)
    across = g_s != g_d
    for mask, local in ((same_router, False), (same_group, True)):
        f = flows[mask]
        layers.append(hop_layer(f, 0, src[mask], st.router0 + r_s[mask]))
        if local:
            layers.append(hop_layer(f, 1, st.router0 + r_s[mask], st.router0 + r_d[mask]))
        layers.append(hop_layer(f, 1 + int(local), st.router0 + r_d[mask], dst[mask]))
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
        pick = pick_next_hop(count, s, d, routing=routing, seed=seed, hop=1)
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
    layers.append(hop_layer(f, 0, s, st.router0 + rs))
    layers.append(hop_layer(fr[b], 1, (st.router0 + rs[rows])[b], gsr[b], w[b]))
    layers.append(hop_layer(fr, 1 + b.astype(np.int64), gsr, gdr, w))
    layers.append(hop_layer(fr[a], 2 + b[a].astype(np.int64), gdr[a], (st.router0 + rd[rows])[a], w[a]))
    layers.append(hop_layer(f, 1 + hops.min(axis=1), st.router0 + rd, d))
    return layers
