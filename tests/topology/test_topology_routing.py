"""Routing: paths exist and are minimal, hand-computed paths, ECMP collisions vs spraying, failures."""

from __future__ import annotations

import dataclasses
from functools import cache

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from topo_reference import check_minimal, check_route, hops_from

from allreduce.schedules import hierarchical_all_reduce
from allreduce.topology import (
    NodeKind,
    Topology,
    clos,
    dragonfly,
    fat_tree,
    fully_connected,
    parse_topology,
    rail_optimized,
    ring,
    route,
    switch,
    torus,
)

SMALL = (
    "fat-tree:k=4",
    "clos:leaves=4,spines=3,hosts=3,oversub=2",
    "clos:leaves=4,spines=4,hosts=2,cores=4,pods=2",
    "rail:nodes=4,gpus=4,nodes_per_unit=2,spines=3",
    "rail:nodes=2,gpus=4,mesh",
    "torus:4x3",
    "torus:3x2x2",
    "ring:7",
    "dragonfly:groups=4,routers=3,hosts=2",
    "dragonfly:groups=3,routers=2,hosts=1,global_links=3",
    "switch:5",
    "full:5",
)


@cache
def build(spec: str) -> Topology:
    return parse_topology(spec)


def links(topology: Topology, routes_links: np.ndarray) -> list[str]:
    return [topology.link_name(int(i)) for i in routes_links]


@given(
    spec=st.sampled_from(SMALL),
    routing=st.sampled_from(["shortest", "ecmp", "spray", "dimension_order"]),
    seed=st.integers(0, 2**32),
    data=st.data(),
)
@pytest.mark.slow
def test_every_route_is_a_minimal_path_over_existing_links(
    spec: str, routing: str, seed: int, data: st.DataObject
) -> None:
    t = build(spec)
    if routing == "dimension_order" and not spec.startswith(("torus", "ring")):
        routing = "ecmp"
    # Dragonflies route local-global-local, not by fewest hops: tested against their own reference below.
    minimal = not spec.startswith("dragonfly")
    pairs = data.draw(st.lists(st.tuples(st.integers(0, t.num_gpus - 1), st.integers(0, t.num_gpus - 1)), max_size=6))
    src = np.array([p[0] for p in pairs], dtype=np.int64)
    dst = np.array([p[1] for p in pairs], dtype=np.int64)
    r = route(t, src, dst, routing=routing, seed=seed)
    assert r.num_flows == len(pairs)
    for f, (s, d) in enumerate(pairs):
        check_route(t, r, f, s, d)
        if s == d:
            assert r.links_of(f).size == 0
            assert r.latency_s[f] == 0.0
            continue
        if minimal:
            check_minimal(t, r, f, s, d)
        if routing != "spray":
            assert np.all(r.weights_of(f) == 1.0)
            # a single path: its latency is the sum of its links'
            assert r.latency_s[f] == pytest.approx(t.link_latency_s[r.links_of(f)].sum())


def test_fat_tree_shortest_is_destination_mod_k() -> None:
    t = fat_tree(4)
    r = route(t, [0, 0, 0], [15, 1, 2], routing="shortest")
    # D-mod-k: to gpu15, spine 15 mod 2 = 1 of the pod, core 1 of that plane (15 // 2 mod 2)
    assert links(t, r.links_of(0)) == [
        "gpu0->edge0", "edge0->agg1", "agg1->core3", "core3->agg7", "agg7->edge7", "edge7->gpu15",
    ]  # fmt: skip
    assert links(t, r.links_of(1)) == ["gpu0->edge0", "edge0->gpu1"]
    assert links(t, r.links_of(2)) == ["gpu0->edge0", "edge0->agg0", "agg0->edge1", "edge1->gpu2"]
    np.testing.assert_allclose(r.latency_s, [6e-6, 2e-6, 4e-6])


def test_fat_tree_spray_spreads_over_all_paths() -> None:
    t = fat_tree(4)
    r = route(t, [0], [15], routing="spray")
    got = dict(zip(links(t, r.links_of(0)), r.weights_of(0).tolist(), strict=True))
    expected = {"gpu0->edge0": 1.0, "edge0->agg0": 0.5, "edge0->agg1": 0.5, "edge7->gpu15": 1.0}
    expected |= {"agg6->edge7": 0.5, "agg7->edge7": 0.5}
    expected |= {f"agg{a}->core{c}": 0.25 for a, c in ((0, 0), (0, 1), (1, 2), (1, 3))}
    expected |= {f"core{c}->agg{a}": 0.25 for a, c in ((6, 0), (6, 1), (7, 2), (7, 3))}
    assert got == pytest.approx(expected)
    assert r.latency_s[0] == pytest.approx(6e-6)


def test_torus_dimension_order_by_hand() -> None:
    t = torus((4, 4))
    # (0,0) -> (2,2): dimension 0 first, ties the + way: (1,0), (2,0), then (2,1), (2,2)
    # (0,0) -> (3,1): dimension 0 the short way round (-1), then +1
    r = route(t, [0, 0], [10, 13])
    assert links(t, r.links_of(0)) == ["gpu0->gpu4", "gpu4->gpu8", "gpu8->gpu9", "gpu9->gpu10"]
    assert links(t, r.links_of(1)) == ["gpu0->gpu12", "gpu12->gpu13"]


def test_ring_routes_the_short_way() -> None:
    t = ring(8)
    r = route(t, [0, 0, 6], [3, 5, 1], routing="dimension_order")
    assert links(t, r.links_of(0)) == ["gpu0->gpu1", "gpu1->gpu2", "gpu2->gpu3"]
    assert links(t, r.links_of(1)) == ["gpu0->gpu7", "gpu7->gpu6", "gpu6->gpu5"]
    assert links(t, r.links_of(2)) == ["gpu6->gpu7", "gpu7->gpu0", "gpu0->gpu1"]
    spray = route(t, [0], [4], routing="spray")  # both ways round are minimal
    assert spray.weights_of(0).tolist() == [0.5] * 8


def test_ecmp_is_deterministic_and_seeded() -> None:
    t = fat_tree(8)
    rng = np.random.default_rng(0)
    src = np.arange(t.num_gpus)
    dst = rng.permutation(t.num_gpus)
    a = route(t, src, dst, routing="ecmp", seed=1)
    b = route(t, src, dst, routing="ecmp", seed=1)
    c = route(t, src, dst, routing="ecmp", seed=2)
    assert np.array_equal(a.link, b.link)
    assert np.array_equal(a.flow_ptr, c.flow_ptr)  # same path lengths
    assert not np.array_equal(a.link, c.link)  # different hashes, different choices


def inter_switch(t: Topology) -> np.ndarray:
    return (t.node_kind[t.link_src] == NodeKind.SWITCH) & (t.node_kind[t.link_dst] == NodeKind.SWITCH)


def test_ecmp_collides_on_a_fat_tree_while_spraying_spreads() -> None:
    t = fat_tree(8)
    src = np.random.default_rng(3).permutation(t.num_gpus)
    dst = np.roll(src, -1)  # a ring over a random placement
    ecmp = route(t, src, dst, routing="ecmp").link_load(t.num_links)
    spray = route(t, src, dst, routing="spray").link_load(t.num_links)
    collided = np.flatnonzero(inter_switch(t) & (ecmp >= 2))
    assert collided.size > 0, "a hash spreading 128 flows over 16 uplinks per pod collides somewhere"
    assert spray.max() <= 1.0 + 1e-9
    # the total traffic is the same: spraying moves it, it does not remove it
    assert spray.sum() == pytest.approx(ecmp.sum())


@given(seed=st.integers(0, 2**32), k=st.sampled_from([4, 6, 8]))
def test_spraying_any_permutation_on_a_fat_tree_loads_no_link_above_one(seed: int, k: int) -> None:
    t = fat_tree(k)
    rng = np.random.default_rng(seed)
    src = rng.permutation(t.num_gpus)
    dst = rng.permutation(t.num_gpus)
    load = route(t, src, dst, routing="spray").link_load(t.num_links)
    assert load.max() <= 1.0 + 1e-9


@pytest.mark.parametrize(
    "spec",
    [
        "fat-tree:k=4",
        "clos:leaves=4,spines=4,hosts=2,cores=4,pods=2",
        "rail:nodes=4,gpus=2",
        "torus:4x4",
        "torus:3x4x2",
    ],
)
@pytest.mark.parametrize("routing", ["spray", "ecmp", "shortest"])
def test_arithmetic_routing_agrees_with_the_graph_search(spec: str, routing: str) -> None:
    """The arithmetic routes of a structured topology and the BFS routes of the same graph: spraying gives
    identical per-link loads; single-path routings give paths of the same lengths and latencies."""
    t = build(spec)
    searched = dataclasses.replace(t, structure=None)
    rng = np.random.default_rng(7)
    src = np.repeat(np.arange(t.num_gpus), 3)
    dst = rng.integers(0, t.num_gpus, src.shape[0])
    a = route(t, src, dst, routing=routing)
    b = route(searched, src, dst, routing=routing)
    if spec.startswith("torus") and routing != "spray":
        routing = "spray"  # single paths on a torus: dimension order vs D-mod-k differ by design; compare spraying
        a = route(t, src, dst, routing=routing)
        b = route(searched, src, dst, routing=routing)
    np.testing.assert_array_equal(np.diff(a.flow_ptr) > 0, np.diff(b.flow_ptr) > 0)
    np.testing.assert_allclose(a.latency_s, b.latency_s)
    if routing == "spray":
        np.testing.assert_allclose(a.link_load(t.num_links), b.link_load(t.num_links), atol=1e-12)
    else:
        np.testing.assert_array_equal(a.flow_ptr, b.flow_ptr)


def test_rail_optimized_hierarchical_flows_stay_on_their_tiers() -> None:
    t = rail_optimized(4, 4, nodes_per_unit=2)
    phases = list(hierarchical_all_reduce(16, 4).phases())
    intra = phases[0]
    r = route(t, intra.src, intra.dst)
    used = t.node_kind[t.link_dst[r.link]]
    assert set(links(t, r.links_of(0))) == {"gpu0->nvs0", "nvs0->gpu1"}
    assert not np.any(used == NodeKind.NIC)  # intra-node traffic never touches a NIC
    inter = next(p for p in phases if np.all(p.src // 4 != p.dst // 4))
    r = route(t, inter.src, inter.dst)
    for f in range(r.num_flows):
        names = links(t, r.links_of(f))
        same_unit = inter.src[f] // 8 == inter.dst[f] // 8
        assert any("spine" in n for n in names) != same_unit, names
        assert len(names) == (4 if same_unit else 6)


def dragonfly_min_hops(t: Topology, routers: int, hosts: int, src: int, dst: int) -> int:
    """Reference: local-global-local routing, over whichever global cable of the group pair is closest."""
    r_s, r_d = t.num_gpus + src // hosts, t.num_gpus + dst // hosts
    if r_s == r_d:
        return 2
    group = lambda node: (node - t.num_gpus) // routers  # noqa: E731
    if group(r_s) == group(r_d):
        return 3
    cables = [
        (u, v)
        for u, v in zip(t.link_src.tolist(), t.link_dst.tolist(), strict=True)
        if u >= t.num_gpus and v >= t.num_gpus and group(u) == group(r_s) and group(v) == group(r_d)
    ]
    return 2 + min((u != r_s) + 1 + (v != r_d) for u, v in cables)


@pytest.mark.parametrize("routing", ["shortest", "ecmp", "spray"])
@pytest.mark.parametrize(("groups", "routers", "hosts", "global_links"), [(9, 4, 1, 1), (5, 4, 1, 2), (3, 2, 1, 3)])
@pytest.mark.slow
def test_dragonfly_routes_local_global_local(
    routing: str, groups: int, routers: int, hosts: int, global_links: int
) -> None:
    t = dragonfly(groups, routers, hosts, global_links=global_links)
    n = t.num_gpus
    src = np.repeat(np.arange(n), n)
    dst = np.tile(np.arange(n), n)
    r = route(t, src, dst, routing=routing)
    router = t.node_kind == NodeKind.SWITCH
    group = np.where(router, (np.arange(t.num_nodes) - n) // routers, -1)
    is_global = router[t.link_src] & router[t.link_dst] & (group[t.link_src] != group[t.link_dst])
    for f in range(src.shape[0]):
        s, d = int(src[f]), int(dst[f])
        check_route(t, r, f, s, d)
        if s == d:
            continue
        # one unit of the flow crosses exactly one global link in total (split over cables when sprayed)
        expected_global = 1.0 if group[n + s // hosts] != group[n + d // hosts] else 0.0
        assert r.weights_of(f)[is_global[r.links_of(f)]].sum() == pytest.approx(expected_global)
        # every unit travels the reference's number of hops
        assert r.weights_of(f).sum() == pytest.approx(dragonfly_min_hops(t, routers, hosts, s, d))


@pytest.mark.slow
def test_dragonfly_never_takes_the_two_global_shortcut() -> None:
    """In a 9-group dragonfly some pairs have a 4-hop path through a third group; minimal dragonfly routing
    still takes its 5-hop local-global-local path (as real dragonflies do: two global hops cost more)."""
    t = dragonfly(9, 4, 2)
    n = t.num_gpus
    src = np.repeat(np.arange(n), n)
    dst = np.tile(np.arange(n), n)
    lengths = np.diff(route(t, src, dst, routing="shortest").flow_ptr)
    bfs = np.array([hops_from(t, int(t.gpu_node[s])).get(int(t.gpu_node[d]), 0) for s, d in zip(src, dst, strict=True)])
    assert np.any(lengths > bfs)
    assert lengths.max() == 5


def test_failed_link_reroutes_only_the_flows_that_crossed_it() -> None:
    t = fat_tree(4)
    src = np.arange(16)
    dst = np.roll(src, -4)
    before = route(t, src, dst, routing="ecmp")
    victim = int(before.links_of(3)[2])  # an aggregation->core link of flow 3 (cross-pod)
    assert t.node_kind[t.link_dst[victim]] == NodeKind.SWITCH
    failed = t.without([victim])
    assert failed.num_links == t.num_links - 1
    assert failed.failed_links == (t.link_name(victim),)
    after = route(failed, src, dst, routing="ecmp")
    crossed = {f for f in range(16) if victim in before.links_of(f)}
    for f in range(16):
        check_route(failed, after, f, int(src[f]), int(dst[f]))
        check_minimal(failed, after, f, int(src[f]), int(dst[f]))
        original = failed.root_link[after.links_of(f)]
        assert victim not in original
        if f not in crossed:
            np.testing.assert_array_equal(original, before.links_of(f))


def test_failed_host_link_names_the_gpus_that_can_no_longer_talk() -> None:
    t = fat_tree(4)
    cut = t.without([t.find_link("edge1->gpu3")])
    with pytest.raises(ValueError, match=r"no path from gpu0 to gpu3 after the failure of edge1->gpu3"):
        route(cut, [0, 1], [3, 2])
    # other pairs still route
    r = route(cut, [3], [0])
    assert links(cut, r.links_of(0))[0] == "gpu3->edge1"


def test_failures_on_a_torus_detour_around_the_dead_link() -> None:
    t = torus((4, 4))
    cut = t.without([t.find_link("gpu0->gpu4")])
    r = route(cut, [0], [8])  # dimension order would take gpu0->gpu4->gpu8
    check_route(cut, r, 0, 0, 8)
    assert "gpu0->gpu4" not in links(cut, r.links_of(0))
    assert r.links_of(0).size == 2  # the other way round: gpu0->gpu12->gpu8


def test_degraded_links_keep_their_routes() -> None:
    t = fat_tree(4)
    slow = t.scaled([t.find_link("edge0->agg0")], 0.1)
    assert slow.link_bandwidth_Bps[t.find_link("edge0->agg0")] == pytest.approx(0.1 * t.link_bandwidth_Bps[0])
    a, b = route(t, [0, 1], [4, 12]), route(slow, [0, 1], [4, 12])
    np.testing.assert_array_equal(a.link, b.link)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"src_gpu": [0], "dst_gpu": [16]}, r"dst_gpu\[0\] = 16 is not a GPU of fat-tree"),
        ({"src_gpu": [-1], "dst_gpu": [1]}, r"src_gpu\[0\] = -1"),
        ({"src_gpu": [0, 1], "dst_gpu": [1]}, "2 sources but 1 destinations"),
        ({"src_gpu": [0], "dst_gpu": [1], "routing": "adaptive"}, "unknown routing 'adaptive'"),
        ({"src_gpu": [0], "dst_gpu": [1], "routing": "dimension_order"}, "needs a torus or ring"),
        ({"src_gpu": [0.5], "dst_gpu": [1]}, "integer GPU indices"),
    ],
)
def test_route_rejects_bad_input(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        route(fat_tree(4), **kwargs)  # type: ignore[arg-type]


def test_routing_none_takes_the_topology_default() -> None:
    t = torus((4, 4))
    np.testing.assert_array_equal(
        route(t, [0], [10], routing=None).link, route(t, [0], [10], routing="dimension_order").link
    )
    s = switch(4)
    assert route(s, [0], [1], routing=None).links_of(0).size == 2
    f = fully_connected(4)
    assert links(f, route(f, [1], [3], routing=None).links_of(0)) == ["gpu1->gpu3"]


def test_clos_oversubscribed_spray_over_every_spine() -> None:
    t = clos(2, 4, 4, 4.0)
    r = route(t, [0], [4], routing="spray")
    assert links(t, r.links_of(0)) == [
        "gpu0->leaf0",
        *(f"leaf0->spine{i}" for i in range(4)),
        *(f"spine{i}->leaf1" for i in range(4)),
        "leaf1->gpu4",
    ]
    np.testing.assert_allclose(r.weights_of(0), [1.0] + [0.25] * 8 + [1.0])
