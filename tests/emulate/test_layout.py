"""The layout of an emulated cluster, computed without creating anything (no root needed)."""

from __future__ import annotations

import ipaddress

import numpy as np
import pytest

from allreduce.emulate import MAX_HOSTS, EmulationSpec, layout
from allreduce.topology import parse_topology

CLOS = "clos:leaves=2,spines=2,hosts_per_leaf=2"


def test_every_directed_link_is_one_direction_of_exactly_one_cable() -> None:
    built = layout(parse_topology(CLOS), name="t", rate_bps=200e6)
    directions = sorted([c.link_ab for c in built.cables] + [c.link_ba for c in built.cables])
    assert directions == list(range(built.topology.num_links))


def test_each_cable_is_a_slash_30_of_its_own() -> None:
    built = layout(parse_topology(CLOS), name="t", rate_bps=200e6)
    nets = {ipaddress.ip_interface(f"{c.a_addr}/30").network for c in built.cables}
    assert len(nets) == len(built.cables)
    for cable in built.cables:
        assert (
            ipaddress.ip_interface(f"{cable.b_addr}/30").network == ipaddress.ip_interface(f"{cable.a_addr}/30").network
        )


def test_the_fastest_host_link_runs_at_the_rate_and_ratios_are_kept() -> None:
    topology = parse_topology("clos:leaves=2,spines=1,hosts_per_leaf=4,oversub=4")
    built = layout(topology, name="t", rate_bps=200e6)
    rates = {}
    for cable in built.cables:
        rates[cable.link_ab] = cable.rate_ab_bps
        rates[cable.link_ba] = cable.rate_ba_bps
    shaped = np.array([rates[i] for i in range(topology.num_links)])
    assert shaped.max() == pytest.approx(200e6) or shaped.max() > 200e6
    np.testing.assert_allclose(shaped / shaped[0], topology.link_bandwidth_Bps / topology.link_bandwidth_Bps[0])


def test_a_degraded_host_link_is_slowed_without_rescaling_the_others() -> None:
    plain = EmulationSpec(CLOS, name="t").layout()
    slowed = EmulationSpec(CLOS, name="t", degrade=(("gpu0->leaf0", 0.1),)).layout()
    assert slowed.scale == plain.scale
    first = next(c for c in slowed.cables if slowed.topology.link_name(c.link_ab) == "gpu0->leaf0")
    same = next(c for c in plain.cables if c.index == first.index)
    assert first.rate_ab_bps == pytest.approx(0.1 * same.rate_ab_bps)
    assert first.rate_ba_bps == pytest.approx(same.rate_ba_bps)


def test_a_leaf_reaches_the_other_leaf_through_both_spines() -> None:
    built = layout(parse_topology(CLOS), name="t", rate_bps=200e6)
    leaf0 = built.topology.find_node("leaf0")
    remote = built.host_address[2]  # gpu2 hangs off leaf1
    (route,) = [r for r in built.routes if r.node == leaf0 and r.destination == remote]
    assert len(route.next_hops) == 2


def test_hosts_route_from_their_own_address() -> None:
    built = layout(parse_topology(CLOS), name="t", rate_bps=200e6)
    for route in built.routes:
        node = route.node
        if node in set(built.topology.gpu_node.tolist()):
            gpu = int(np.nonzero(built.topology.gpu_node == node)[0][0])
            assert route.source == built.host_address[gpu]
        else:
            assert route.source is None


def test_every_host_has_a_route_to_every_other_host() -> None:
    built = layout(parse_topology("fat-tree:k=4"), name="t", rate_bps=200e6)
    hosts = built.topology.gpu_node.tolist()
    pairs = {(r.node, r.destination) for r in built.routes if r.next_hops}
    for g, node in enumerate(hosts):
        for h in range(len(hosts)):
            if h != g:
                assert (node, built.host_address[h]) in pairs


def test_more_hosts_than_the_cap_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=rf"at most {MAX_HOSTS} hosts"):
        layout(parse_topology("clos:leaves=2,spines=2,hosts_per_leaf=9"), name="t", rate_bps=200e6)


@pytest.mark.parametrize("name", ["", "UPPER", "toolongname", "a-b"])
def test_a_name_that_would_not_fit_interface_names_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="emulation name"):
        layout(parse_topology(CLOS), name=name, rate_bps=200e6)


@pytest.mark.parametrize("rate", [0.0, -1.0, 1e22, float("nan")])
def test_a_rate_outside_what_the_cpu_and_token_bucket_handle_is_refused(rate: float) -> None:
    with pytest.raises(ValueError, match="rate"):
        layout(parse_topology(CLOS), name="t", rate_bps=rate)


def test_interface_names_fit_the_kernel_limit() -> None:
    built = layout(parse_topology("clos:leaves=4,spines=4,hosts_per_leaf=4"), name="abcdefgh", rate_bps=200e6)
    assert max(len(c.a_dev) for c in built.cables) <= 15


def test_a_queue_on_a_link_name_resolves_to_that_direction() -> None:
    spec = EmulationSpec(CLOS, name="t", queue=(("leaf0->spine0", 65536),))
    built = spec.layout()
    (link,) = spec.queue_bytes(built)
    assert built.topology.link_name(link) == "leaf0->spine0"


def test_a_queue_on_a_link_that_does_not_exist_names_it() -> None:
    spec = EmulationSpec(CLOS, name="t", queue=(("leaf9->spine0", 65536),))
    with pytest.raises(ValueError, match="leaf9"):
        spec.queue_bytes(spec.layout())
