"""Explicit routing: a PathTable's paths are what route() returns, and bad tables name the culprit."""

from __future__ import annotations

import numpy as np
import pytest

from allreduce.topology import PathTable, clos, route


def _two_spine_clos():  # 2 leaves x 2 hosts, 2 spines: every cross-leaf pair has two equal paths
    return clos(leaves=2, spines=2, hosts_per_leaf=2)


def _link(topology, name: str) -> int:
    return next(i for i in range(topology.num_links) if topology.link_name(i) == name)


def _via_spine(topology, src: int, dst: int, spine: int) -> tuple[int, ...]:
    src_name, dst_name = topology.gpu_name(src), topology.gpu_name(dst)
    src_leaf = next(topology.link_name(i).split("->")[1] for i in range(topology.num_links)
                    if topology.link_name(i).startswith(src_name + "->"))  # fmt: skip
    dst_leaf = next(topology.link_name(i).split("->")[0] for i in range(topology.num_links)
                    if topology.link_name(i).endswith("->" + dst_name))  # fmt: skip
    names = [f"{src_name}->{src_leaf}", f"{src_leaf}->spine{spine}", f"spine{spine}->{dst_leaf}",
             f"{dst_leaf}->{dst_name}"]  # fmt: skip
    return tuple(_link(topology, n) for n in names)


def test_route_follows_the_table_through_the_spine_it_names() -> None:
    topology = _two_spine_clos()
    table = PathTable({(0, 2): _via_spine(topology, 0, 2, 1), (2, 0): _via_spine(topology, 2, 0, 0)})
    routes = route(topology, [0, 2], [2, 0], routing=table)
    assert [topology.link_name(int(i)) for i in routes.links_of(0)][1].endswith("->spine1")
    assert [topology.link_name(int(i)) for i in routes.links_of(1)][1].endswith("->spine0")


def test_table_latency_is_the_sum_over_its_links() -> None:
    topology = _two_spine_clos()
    path = _via_spine(topology, 0, 3, 0)
    routes = route(topology, [0], [3], routing=PathTable({(0, 3): path}))
    assert routes.latency_s[0] == pytest.approx(float(np.sum(topology.link_latency_s[list(path)])))


def test_a_flow_to_itself_is_empty_without_a_table_entry() -> None:
    routes = route(_two_spine_clos(), [1], [1], routing=PathTable({}))
    assert routes.links_of(0).size == 0


def test_a_missing_pair_names_both_gpus() -> None:
    topology = _two_spine_clos()
    with pytest.raises(ValueError, match=f"no path from {topology.gpu_name(0)} to {topology.gpu_name(2)}"):
        route(topology, [0], [2], routing=PathTable({}))


def test_a_path_that_is_not_a_walk_is_refused() -> None:
    topology = _two_spine_clos()
    path = _via_spine(topology, 0, 2, 0)
    with pytest.raises(ValueError, match="does not leave"):
        route(topology, [0], [2], routing=PathTable({(0, 2): (path[0], path[2], path[3])}))


def test_a_path_ending_elsewhere_is_refused() -> None:
    topology = _two_spine_clos()
    with pytest.raises(ValueError, match="the path ends at"):
        route(topology, [0], [3], routing=PathTable({(0, 3): _via_spine(topology, 0, 2, 0)}))
