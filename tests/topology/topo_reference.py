"""Independent references for the topology tests: a plain-Python BFS over the link arrays."""

from __future__ import annotations

from collections import deque

import numpy as np

from allreduce.topology import NodeKind, Routes, Topology


def adjacency(topology: Topology) -> list[list[tuple[int, int]]]:
    """Per node, its (link, successor) pairs."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(topology.num_nodes)]
    for link, (a, b) in enumerate(zip(topology.link_src.tolist(), topology.link_dst.tolist(), strict=True)):
        out[a].append((link, b))
    return out


def hops_from(topology: Topology, start: int) -> dict[int, int]:
    """Fewest hops from ``start`` to every reachable node, never passing through a GPU (unless GPUs forward)."""
    adj = adjacency(topology)
    kinds = topology.node_kind.tolist()
    dist = {start: 0}
    queue = deque([start])
    while queue:
        u = queue.popleft()
        if u != start and kinds[u] == NodeKind.GPU and not topology.gpu_transit:
            continue  # a GPU is an endpoint, not a router
        for _, v in adj[u]:
            if v not in dist:
                dist[v] = dist[u] + 1
                queue.append(v)
    return dist


def check_route(topology: Topology, routes: Routes, flow: int, src_gpu: int, dst_gpu: int) -> None:
    """The flow's links carry exactly one unit from src to dst (flow conservation), over existing links."""
    links = routes.links_of(flow)
    weights = routes.weights_of(flow)
    assert np.all((links >= 0) & (links < topology.num_links))
    assert np.all(weights > 0)
    assert np.unique(links).size == links.size, "a link is listed twice: shares on one link must be summed"
    net = np.zeros(topology.num_nodes)
    np.add.at(net, topology.link_src[links], weights)
    np.subtract.at(net, topology.link_dst[links], weights)
    expected = np.zeros(topology.num_nodes)
    if src_gpu != dst_gpu:
        expected[topology.gpu_node[src_gpu]] += 1.0
        expected[topology.gpu_node[dst_gpu]] -= 1.0
    np.testing.assert_allclose(net, expected, atol=1e-9)


def check_minimal(topology: Topology, routes: Routes, flow: int, src_gpu: int, dst_gpu: int) -> None:
    """Every link of the flow lies on a minimal path, and each hop layer carries weight 1 in total."""
    s, d = int(topology.gpu_node[src_gpu]), int(topology.gpu_node[dst_gpu])
    from_src = hops_from(topology, s)
    total = from_src[d]
    links = routes.links_of(flow)
    weights = routes.weights_of(flow)
    layer_weight = np.zeros(total)
    for link, weight in zip(links.tolist(), weights.tolist(), strict=True):
        u, v = int(topology.link_src[link]), int(topology.link_dst[link])
        layer = from_src[u]
        assert from_src.get(v) == layer + 1, f"link {topology.link_name(link)} is not on a minimal path"
        if v != d and not topology.gpu_transit:
            assert topology.node_kind[v] != NodeKind.GPU, f"{topology.link_name(link)} passes through a GPU"
        # v must still reach d in total-layer-1 hops: check with a BFS from v.
        assert hops_from(topology, v).get(d) == total - layer - 1 or v == d
        layer_weight[layer] += weight
    np.testing.assert_allclose(layer_weight, np.ones(total), atol=1e-9)
