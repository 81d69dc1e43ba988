"""Routing by graph search, for file-defined topologies and for flows whose structured path crosses a failed link.

A vectorised level-by-level BFS from a batch of destinations, then a walk from each source along the next hops
that get one hop closer: one of them picked per hop (D-mod-k or ECMP hash), or all of them weighted by path counts
when spraying. After a failure a dragonfly flow takes the fewest-hop detour, and a torus flow under dimension order
the first fewest-hop one. Also answers which GPU pairs have no path at all (:func:`reachability_gaps`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from allreduce.topology._ecmp import pick_next_hop
from allreduce.topology._graph import FloatArray, IntArray, NodeKind, Topology
from allreduce.topology._hop_layers import Entries

__all__ = ["reachability_gaps", "search_routes"]

# Hop distance of a node that cannot reach the target: half of int32's range, so adding a hop cannot overflow.
_UNREACHED = np.iinfo(np.int32).max // 2
# Cap on the (destinations × links) matrix of one BFS batch: 8M int32 = 32 MB.
_BATCH_CELLS = 8_000_000


class _Flows(NamedTuple):
    """Flows searched together: hop distances to their destinations (``dist``; ``eff``, the distances counted
    through nodes a path may pass), and per flow its start node, its destination's row and its index."""

    dist: npt.NDArray[np.int32]
    eff: npt.NDArray[np.int32]
    start: IntArray
    row: IntArray
    flows: IntArray


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


def search_routes(
    topology: Topology,
    src: IntArray,
    dst: IntArray,
    flows: IntArray,
    *,
    routing: str,
    seed: int,
) -> tuple[list[Entries], dict[int, float]]:
    """Route flows (GPU indices) by searching the graph; raises ValueError naming unreachable pairs."""
    graph = _Graph(topology)
    src_node = topology.gpu_node[src]
    dst_node = topology.gpu_node[dst]
    targets, inverse = np.unique(dst_node, return_inverse=True)
    batch = max(1, _BATCH_CELLS // max(topology.num_links, topology.num_nodes, 1))
    parts: list[Entries] = []
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
        searched = _Flows(dist, eff, src_node[sel], row, flows[sel])
        if routing == "spray":
            part, lat = _spray_walk(graph, searched)
            parts.append(part)
            exact.update(zip(flows[sel].tolist(), lat.tolist(), strict=True))
        else:
            parts.append(_single_walk(graph, searched, src_gpu=src[sel], dst_gpu=dst[sel], routing=routing, seed=seed))
    return parts, exact


def _single_walk(
    graph: _Graph, searched: _Flows, *, src_gpu: IntArray, dst_gpu: IntArray, routing: str, seed: int
) -> Entries:
    """Walk each flow along one next hop per hop, picked by ``routing`` (D-mod-k or an ECMP hash)."""
    dist, eff, start, row, flows = searched
    cur = start.copy()
    alive = np.flatnonzero(dist[row, cur] > 0)
    out_flow, out_hop, out_link = [], [], []
    hop = 0
    while alive.size:
        query, pos = graph.next_hops(cur[alive], row[alive], dist, eff)
        count = np.bincount(query, minlength=alive.shape[0])
        first = np.cumsum(count) - count
        choice = pick_next_hop(count, src_gpu[alive], dst_gpu[alive], routing=routing, seed=seed, hop=hop)
        chosen = pos[first + choice]
        out_flow.append(flows[alive])
        out_hop.append(np.full(alive.shape, hop, dtype=np.int64))
        out_link.append(graph.order[chosen])
        cur[alive] = graph.ld[chosen]
        alive = alive[dist[row[alive], cur[alive]] > 0]
        hop += 1
    if not out_flow:
        z = np.zeros(0, dtype=np.int64)
        return Entries(z, z, z, np.zeros(0, dtype=np.float64))
    link = np.concatenate(out_link)
    return Entries(np.concatenate(out_flow), np.concatenate(out_hop), link, np.ones(link.shape, dtype=np.float64))


def _spray_walk(graph: _Graph, searched: _Flows) -> tuple[Entries, FloatArray]:
    """Spread each flow over all its minimal paths: link u->v carries paths(src→u)·paths(v→dst)/paths(src→dst)."""
    dist, eff, start, row, flows = searched
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
    entries = Entries(
        np.concatenate(out_flow) if out_flow else np.zeros(0, dtype=np.int64),
        np.concatenate(out_hop) if out_hop else np.zeros(0, dtype=np.int64),
        np.concatenate(out_link) if out_link else np.zeros(0, dtype=np.int64),
        np.concatenate(out_w) if out_w else np.zeros(0, dtype=np.float64),
    )
    return entries, latency


def _raise_no_path(topology: Topology, src_gpu: int, dst_gpu: int, how_many: int) -> None:
    count = how_many - 1
    others = f" (and at least {count} more GPU {'pair' if count == 1 else 'pairs'})" if count else ""
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
