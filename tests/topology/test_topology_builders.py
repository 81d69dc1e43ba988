"""Builders: node and link counts against closed forms, bandwidths, names, structure."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from allreduce.topology import (
    NVLINK_BANDWIDTH_BPS,
    NodeKind,
    Topology,
    clos,
    dragonfly,
    fat_tree,
    fully_connected,
    rail_optimized,
    ring,
    switch,
    torus,
)


def kind_count(topology: Topology, kind: NodeKind) -> int:
    return int(np.count_nonzero(topology.node_kind == kind))


def cables_are_paired(topology: Topology) -> bool:
    """Every directed link has its reverse (all builders make cables), and no pair appears twice."""
    forward = set(zip(topology.link_src.tolist(), topology.link_dst.tolist(), strict=True))
    return len(forward) == topology.num_links and all((b, a) in forward for a, b in forward)


@given(st.integers(1, 8).map(lambda h: 2 * h))
def test_fat_tree_counts_match_closed_forms(k: int) -> None:
    t = fat_tree(k)
    assert t.num_gpus == k**3 // 4
    assert kind_count(t, NodeKind.SWITCH) == 5 * k * k // 4
    # host-edge, edge-agg, agg-core: k³/4 cables each, two directed links per cable
    assert t.num_links == 2 * 3 * k**3 // 4
    assert cables_are_paired(t)
    # every switch has k ports
    degree = np.bincount(t.link_src, minlength=t.num_nodes)
    assert np.all(degree[t.num_gpus :] == k)
    assert np.all(degree[: t.num_gpus] == 1)
    assert np.all(t.link_bandwidth_Bps == t.link_bandwidth_Bps[0])


def test_fat_tree_names_follow_the_tiers() -> None:
    t = fat_tree(4)
    assert [t.node_name(i) for i in (0, 15, 16, 23, 24, 31, 32, 35)] == [
        "gpu0", "gpu15", "edge0", "edge7", "agg0", "agg7", "core0", "core3",
    ]  # fmt: skip
    assert t.name == "fat-tree:k=4,bw=400Gbps,lat=1us"
    # core i*k/2 + j joins aggregation switch i of every pod: core1 (plane 0) links to agg0, agg2, agg4, agg6
    core1 = t.find_node("core1")
    assert sorted(t.node_name(int(n)) for n in t.link_dst[t.link_src == core1]) == ["agg0", "agg2", "agg4", "agg6"]


def test_fat_tree_rejects_odd_k() -> None:
    with pytest.raises(ValueError, match="k must be even, got 5"):
        fat_tree(5)


@given(
    leaves=st.integers(1, 6),
    spines=st.integers(1, 5),
    hosts=st.integers(1, 6),
    oversub=st.sampled_from([1.0, 2.0, 4.0, 1.5]),
)
def test_two_tier_clos_counts_and_oversubscription(leaves: int, spines: int, hosts: int, oversub: float) -> None:
    bw = 50e9
    t = clos(leaves, spines, hosts, oversub, bandwidth_Bps=bw)
    assert t.num_gpus == leaves * hosts
    assert kind_count(t, NodeKind.SWITCH) == leaves + spines
    assert t.num_links == 2 * (leaves * hosts + leaves * spines)
    assert cables_are_paired(t)
    # a leaf's uplink capacity is its host capacity / oversub
    leaf0 = t.find_node("leaf0")
    up = (t.link_src == leaf0) & (t.node_kind[t.link_dst] == NodeKind.SWITCH)
    down = (t.link_src == leaf0) & (t.node_kind[t.link_dst] == NodeKind.GPU)
    assert t.link_bandwidth_Bps[down].sum() / t.link_bandwidth_Bps[up].sum() == pytest.approx(oversub)


def test_three_tier_clos_core_oversubscription() -> None:
    # 8 leaves, 4 spines in 2 pods (2 spines per pod -> 2 planes), 4 cores (2 per plane)
    t = clos(8, 4, 4, 2.0, cores=4, pods=2, core_oversub=3.0, bandwidth_Bps=100.0)
    assert t.num_gpus == 32
    assert kind_count(t, NodeKind.SWITCH) == 8 + 4 + 4
    assert t.num_links == 2 * (32 + 8 * 2 + 4 * 2)
    spine0 = t.find_node("spine0")
    to_core = (t.link_src == spine0) & np.isin(t.link_dst, [t.find_node(f"core{j}") for j in range(4)])
    to_leaf = (t.link_src == spine0) & ~to_core
    # leaf uplink = 4 hosts × 100 / (2 spines × 2) = 100 B/s; spine0 faces 4 leaves of pod 0
    assert t.link_bandwidth_Bps[to_leaf] == pytest.approx([100.0] * 4)
    assert t.link_bandwidth_Bps[to_leaf].sum() / t.link_bandwidth_Bps[to_core].sum() == pytest.approx(3.0)
    # spine 0 of each pod is in plane 0: cores 0 and 1
    assert sorted(t.node_name(int(n)) for n in t.link_dst[to_core]) == ["core0", "core1"]


def test_fat_tree_equals_the_equivalent_clos_graph() -> None:
    k = 6
    a, b = fat_tree(k), clos(k * k // 2, k * k // 2, k // 2, cores=(k // 2) ** 2, pods=k)
    assert np.array_equal(a.link_src, b.link_src)
    assert np.array_equal(a.link_dst, b.link_dst)
    np.testing.assert_allclose(a.link_bandwidth_Bps, b.link_bandwidth_Bps)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"leaves": 4, "spines": 2, "hosts_per_leaf": 2, "pods": 2}, "need a core tier"),
        ({"leaves": 5, "spines": 2, "hosts_per_leaf": 2, "cores": 2, "pods": 2}, "split evenly into 2 pods"),
        ({"leaves": 4, "spines": 4, "hosts_per_leaf": 2, "cores": 3, "pods": 2}, "3 cores must split evenly"),
        ({"leaves": 0, "spines": 2, "hosts_per_leaf": 2}, "clos leaves must be an integer >= 1, got 0"),
        ({"leaves": 2, "spines": 2, "hosts_per_leaf": 2, "oversub": 0.0}, "clos oversub must be a positive"),
    ],
)
def test_clos_rejects_bad_parameters(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        clos(**kwargs)  # type: ignore[arg-type]


@given(
    nodes=st.sampled_from([1, 2, 4, 6]),
    gpus=st.integers(1, 8),
    unit=st.sampled_from([1, 2]),
    spines=st.integers(1, 4),
    mesh=st.booleans(),
)
def test_rail_optimized_counts(nodes: int, gpus: int, unit: int, spines: int, mesh: bool) -> None:
    unit = min(unit, nodes)
    t = rail_optimized(nodes, gpus, nodes_per_unit=unit, spines=spines, mesh=mesh)
    n_gpu = nodes * gpus
    rails = (nodes // unit) * gpus
    assert t.num_gpus == n_gpu
    assert kind_count(t, NodeKind.NIC) == n_gpu
    assert kind_count(t, NodeKind.SWITCH) == (0 if mesh else nodes) + rails + spines
    intra = nodes * gpus * (gpus - 1) // 2 if mesh else n_gpu
    assert t.num_links == 2 * (intra + n_gpu + n_gpu + rails * spines)
    assert cables_are_paired(t)


def test_rail_optimized_puts_local_gpu_i_of_every_node_on_rail_i() -> None:
    t = rail_optimized(4, 8, nodes_per_unit=2)
    for gpu in range(t.num_gpus):
        nic = t.find_node(f"nic{gpu}")
        rail = [t.node_name(int(n)) for n in t.link_dst[t.link_src == nic] if t.node_kind[n] == NodeKind.SWITCH]
        node, local = divmod(gpu, 8)
        assert rail == [f"rail{(node // 2) * 8 + local}"]
    # NVLink from every GPU to its node's NVSwitch at the documented default
    link = t.find_link("gpu9->nvs1")
    assert t.link_bandwidth_Bps[link] == NVLINK_BANDWIDTH_BPS


@pytest.mark.parametrize(
    ("dims", "links"),
    [((8,), 16), ((2,), 2), ((1,), 0), ((4, 4), 64), ((2, 3), 2 * (3 + 6)), ((3, 3, 3), 27 * 6), ((2, 2, 2), 24)],
)
def test_torus_link_counts(dims: tuple[int, ...], links: int) -> None:
    t = torus(dims)
    assert t.num_gpus == int(np.prod(dims))
    assert t.num_links == links
    assert cables_are_paired(t)
    assert t.gpu_transit
    assert t.default_routing == "dimension_order"


def test_torus_wraps_around() -> None:
    t = torus((4, 3))
    # gpu at (3, 2) = 11 links to (0, 2) = 2 and (3, 0) = 9
    assert t.find_link("gpu11->gpu2") >= 0
    assert t.find_link("gpu11->gpu9") >= 0
    with pytest.raises(ValueError, match="no link 'gpu11->gpu0'"):
        t.find_link("gpu11->gpu0")


def test_ring_and_full_mesh() -> None:
    r = ring(5)
    assert r.num_links == 10
    assert {r.link_name(i) for i in range(r.num_links)} >= {"gpu4->gpu0", "gpu0->gpu4", "gpu2->gpu3"}
    f = fully_connected(6)
    assert f.num_links == 30
    assert cables_are_paired(f)


def test_switch() -> None:
    t = switch(7, bandwidth_Bps=10.0, latency_s=2e-6)
    assert t.num_gpus == 7
    assert t.num_links == 14
    assert t.link_name(0) == "gpu0->switch0"
    assert np.all(t.link_latency_s == 2e-6)


@given(groups=st.integers(1, 7), routers=st.integers(1, 4), hosts=st.integers(1, 3), global_links=st.integers(1, 3))
def test_dragonfly_counts(groups: int, routers: int, hosts: int, global_links: int) -> None:
    bw = 10.0
    t = dragonfly(groups, routers, hosts, global_links=global_links, bandwidth_Bps=bw)
    assert t.num_gpus == groups * routers * hosts
    assert kind_count(t, NodeKind.SWITCH) == groups * routers
    assert cables_are_paired(t)
    router = t.node_kind == NodeKind.SWITCH
    group_of = np.where(router, (np.arange(t.num_nodes) - t.num_gpus) // routers, -1)
    is_global = router[t.link_src] & router[t.link_dst] & (group_of[t.link_src] != group_of[t.link_dst])
    is_local = router[t.link_src] & router[t.link_dst] & ~is_global
    assert int(is_local.sum()) == groups * routers * (routers - 1)
    # global capacity between every pair of groups: global_links cables (merged where they share routers)
    for a in range(groups):
        for b in range(groups):
            if a != b:
                pair = is_global & (group_of[t.link_src] == a) & (group_of[t.link_dst] == b)
                assert t.link_bandwidth_Bps[pair].sum() == pytest.approx(global_links * bw)
    assert t.node_name(t.num_gpus + groups * routers - 1) == f"r{groups - 1}.{routers - 1}"
