"""The contract types: names and their inverse, faults (scaled, without), Routes helpers; placement."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from allreduce.topology import Topology, dragonfly, fat_tree, place, rail_optimized, route, torus


@pytest.mark.parametrize("topology", [fat_tree(4), rail_optimized(2, 4, mesh=False), dragonfly(3, 2, 1), torus((3, 3))])
def test_find_link_inverts_link_name(topology: Topology) -> None:
    for link in range(topology.num_links):
        assert topology.find_link(topology.link_name(link)) == link


def test_find_link_errors_name_the_link_and_what_exists() -> None:
    t = fat_tree(4)
    with pytest.raises(ValueError, match=r"no link 'edge0->core0'; edge0 links to gpu0, gpu1, agg0, agg1"):
        t.find_link("edge0->core0")
    with pytest.raises(ValueError, match=r"no node named 'leaf3'; the nodes are gpu0..gpu15, edge0..edge7, agg0"):
        t.find_link("leaf3->spine1")
    with pytest.raises(ValueError, match=r"no node named 'core4'"):
        t.find_link("agg0->core4")
    with pytest.raises(ValueError, match="write it as SRC->DST"):
        t.find_link("edge0")


def test_dotted_router_names() -> None:
    t = dragonfly(3, 4, 1)
    assert t.node_name(t.find_node("r2.3")) == "r2.3"
    with pytest.raises(ValueError, match=r"no node named 'r3\.0'"):
        t.find_node("r3.0")


def test_without_renumbers_survivors_in_order_and_maps_back() -> None:
    t = fat_tree(4)
    dead = [t.find_link("agg0->core0"), t.find_link("core0->agg0")]
    once = t.without(dead[:1])
    twice = once.without([once.find_link("core0->agg0")])
    assert twice.root is t
    assert twice.failed_links == ("agg0->core0", "core0->agg0")
    assert twice.num_links == t.num_links - 2
    assert np.all(np.diff(twice.root_link) > 0)
    assert not set(dead) & set(twice.root_link.tolist())
    for link in range(twice.num_links):
        assert twice.link_name(link) == t.link_name(int(twice.root_link[link]))
    with pytest.raises(ValueError, match=r"no link 'agg0->core0' \(failed: agg0->core0\)"):
        twice.find_link("agg0->core0")


def test_scaled_and_bad_fault_arguments() -> None:
    t = fat_tree(4)
    link = t.find_link("agg0->core0")
    s = t.scaled([link], 0.25)
    assert s.link_bandwidth_Bps[link] == t.link_bandwidth_Bps[link] / 4
    assert np.array_equal(np.delete(s.link_bandwidth_Bps, link), np.delete(t.link_bandwidth_Bps, link))
    assert t.link_bandwidth_Bps[link] == 50e9  # the original is untouched
    with pytest.raises(ValueError, match=r"factor must be > 0"):
        t.scaled([link], 0.0)
    with pytest.raises(ValueError, match=r"link index 96 is not in 0\.\.95"):
        t.without([96])


def test_topology_checks_its_arrays() -> None:
    kinds = np.zeros(2, dtype=np.int8)
    one = np.array([1.0])
    with pytest.raises(ValueError, match=r"a link names a node outside 0\.\.1"):
        Topology("bad", kinds, np.array([0]), np.array([2]), one, one, np.arange(2))
    with pytest.raises(ValueError, match=r"link node0->node1 has bandwidth 0\.0"):
        Topology("bad", kinds, np.array([0]), np.array([1]), np.array([0.0]), one, np.arange(2))


def test_routes_helpers() -> None:
    t = fat_tree(4)
    r = route(t, [0, 5, 9], [1, 5, 14])
    assert r.num_flows == 3
    assert r.flow_of_entry().tolist() == [0, 0, *([2] * 6)]
    load = r.link_load(t.num_links)
    assert load.sum() == 8
    assert load[t.find_link("gpu0->edge0")] == 1


# ---------------------------------------------------------------------------------------------------------
# Placement
# ---------------------------------------------------------------------------------------------------------
@given(ranks=st.integers(1, 128), seed=st.integers(0, 2**32))
def test_placements_are_injective_and_seeded(ranks: int, seed: int) -> None:
    t = fat_tree(8)  # 128 GPUs
    linear = place(ranks, t)
    assert linear.tolist() == list(range(ranks))
    scattered = place(ranks, t, "random", seed=seed)
    assert scattered.shape == (ranks,)
    assert np.unique(scattered).size == ranks
    assert scattered.min() >= 0
    assert scattered.max() < t.num_gpus
    assert np.array_equal(scattered, place(ranks, t, "random", seed=seed))
    if ranks == t.num_gpus:
        assert sorted(scattered.tolist()) == list(range(t.num_gpus))  # a permutation


def test_random_placement_depends_on_the_seed() -> None:
    t = fat_tree(8)
    assert not np.array_equal(place(64, t, "random", seed=1), place(64, t, "random", seed=2))


@pytest.mark.parametrize("seed", [-1, 1.5, "7"])
def test_random_placement_needs_a_whole_seed(seed: object) -> None:
    with pytest.raises(ValueError, match=r"seed that is a whole number >= 0, got"):
        place(4, fat_tree(4), "random", seed=seed)  # type: ignore[arg-type]


def test_explicit_placement() -> None:
    t = fat_tree(4)
    assert place(3, t, [5, 0, 9]).tolist() == [5, 0, 9]
    assert place(3, t, "5,0,9").tolist() == [5, 0, 9]


@pytest.mark.parametrize(
    ("ranks", "placement", "message"),
    [
        (3, [0, 1], "names 2 GPUs for 3 ranks"),
        (2, [0, 16], "rank 1 is placed on GPU 16, but fat-tree.* has GPUs 0..15"),
        (3, [4, 2, 4], "ranks 0 and 2 are both placed on GPU 4"),
        (17, "linear", "17 ranks do not fit on the 16 GPUs"),
        (2, "packed", "unknown placement 'packed'"),
        (2, "0,x", "cannot read '0,x'"),
        (0, "linear", "positive integer, got 0"),
        (2, [0.5, 1.5], "integer GPU indices"),
    ],
)
def test_bad_placements_are_named(ranks: int, placement: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        place(ranks, fat_tree(4), placement)  # type: ignore[arg-type]
