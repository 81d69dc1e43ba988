"""Patterns shared between routers of one cluster (and the tail's noise-free runs on them), and the follow gaps
of a tail's connections (the collective's own flows and the agreement's frames before it)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from allreduce.schedules import all_reduce
from allreduce.sim import LossModel
from allreduce.sim._fast import run_fast, run_fast_checked
from allreduce.sim._phases import _agreement_steps, _data_follow_gaps, phase_data
from allreduce.sim._routing import Router
from allreduce.topology import parse_topology, place


def _router(topology_spec: str = "fat-tree:k=4", *, seed: int = 0, topology: object = None) -> Router:
    topo = parse_topology(topology_spec) if topology is None else topology
    rank_gpu = np.asarray(place(16, topo, "linear"), dtype=np.int64)  # type: ignore[arg-type]
    return Router(topo, rank_gpu, None, seed)  # type: ignore[arg-type]


def test_two_routers_of_one_cluster_share_a_pattern() -> None:
    first = _router()
    second = Router(first.topology, first.rank_gpu.copy(), None, 0)
    src = np.arange(16, dtype=np.int64)
    dst = (src + 5) % 16
    assert second.pattern(src, dst) is first.pattern(src, dst)


@pytest.mark.parametrize("change", ["seed", "topology", "placement"])
def test_a_router_of_another_seed_topology_or_placement_routes_its_own(change: str) -> None:
    first = _router()
    topology, rank_gpu, seed = first.topology, first.rank_gpu, 0
    if change == "seed":
        seed = 1
    elif change == "topology":
        topology = parse_topology("fat-tree:k=4")  # equal, but another object: faults make new ones
    else:
        rank_gpu = rank_gpu[::-1].copy()
    src = np.arange(16, dtype=np.int64)
    dst = (src + 5) % 16
    assert Router(topology, rank_gpu, None, seed).pattern(src, dst) is not first.pattern(src, dst)


@pytest.mark.parametrize("slowed", ["unused", "used"])
def test_a_topology_with_slower_links_takes_the_routes_and_the_rates_it_can(slowed: str) -> None:
    # An oversubscribed tier or a degraded link (Topology.scaled) routes as the cluster does; the fair rates
    # stay where no link the pattern uses was slowed, and are solved again where one was.
    first = _router()
    src = np.arange(16, dtype=np.int64)
    dst = (src + 5) % 16
    original = first.pattern(src, dst)
    used = np.unique(original.routes.link)
    links = used[:1] if slowed == "used" else np.setdiff1d(np.arange(first.topology.num_links), used)[:4]
    slower = first.topology.scaled(links, 0.25)
    pattern = Router(slower, first.rank_gpu, None, 0).pattern(src, dst)
    fresh = Router(parse_topology("fat-tree:k=4").scaled(links, 0.25), first.rank_gpu, None, 0).pattern(src, dst)
    assert pattern.routes is original.routes
    assert (pattern.rate_Bps is original.rate_Bps) == (slowed == "unused")
    np.testing.assert_array_equal(pattern.rate_Bps, fresh.rate_Bps)
    np.testing.assert_array_equal(pattern.bottleneck_link, fresh.bottleneck_link)
    if slowed == "used":
        assert pattern.rate_Bps.min() < original.rate_Bps.min()


def test_the_tails_noise_free_run_is_shared_by_routers_of_one_cluster_and_size() -> None:
    # Each loss model's tail of one bucket size begins with the same noise-free run: computed once.
    first = _router()
    schedule = all_reduce("double_binary_tree", 16)
    result, exact = run_fast_checked(schedule, first, size_bytes=2**20, rank_delay_s=None, trace_ranks=0)
    again = Router(first.topology, first.rank_gpu.copy(), None, 0)
    assert run_fast_checked(schedule, again, size_bytes=2**20, rank_delay_s=None, trace_ranks=0)[0] is result
    fresh = run_fast(schedule, _router(), size_bytes=2**20, rank_delay_s=None, trace_ranks=0)
    assert (result.seconds, exact) == (fresh.seconds, fresh.exact)
    np.testing.assert_array_equal(result.rank_end_s, fresh.rank_end_s)
    slow = np.zeros(16)
    slow[3] = 1e-3
    for other in (
        run_fast_checked(schedule, first, size_bytes=2**21, rank_delay_s=None, trace_ranks=0),
        run_fast_checked(schedule, first, size_bytes=2**20, rank_delay_s=slow, trace_ranks=0),
        run_fast_checked(schedule, _router(seed=1), size_bytes=2**20, rank_delay_s=None, trace_ranks=0),
    ):
        assert other[0] is not result


def _follow_gaps_by_definition(data: list, world_size: int) -> list[np.ndarray]:
    """The gap of every flow by its definition: the steps of the phases between its own and the next one in
    which its connection carries a transfer, each as long as its longest flow; inf if none does."""
    step_s = [float(d.seconds.max(initial=0.0)) * d.phase.repeat for d in data]
    out = []
    for i, d in enumerate(data):
        gaps = []
        for src, dst in zip(d.phase.src.tolist(), d.phase.dst.tolist(), strict=True):
            gap, between = math.inf, 0.0
            for j in range(i + 1, len(data)):
                if np.any((data[j].phase.src == src) & (data[j].phase.dst == dst)):
                    gap = between
                    break
                between += step_s[j]
            gaps.append(gap)
        out.append(np.asarray(gaps))
    return out


@pytest.mark.parametrize(
    ("name", "world_size"), [("ring", 16), ("double_binary_tree", 16), ("halving_doubling", 16), ("hierarchical", 16)]
)
def test_follow_gaps_are_the_steps_until_the_connection_is_used_again(name: str, world_size: int) -> None:
    router = _router()
    schedule = all_reduce(name, world_size, group_size=4) if name == "hierarchical" else all_reduce(name, world_size)
    link_loss = np.full(router.topology.num_links, 1e-6)
    data = phase_data(schedule, router, 2**20, link_loss, connections=True)
    for d, expected in zip(data, _follow_gaps_by_definition(data, world_size), strict=True):
        assert d.follow_gap_s is not None
        np.testing.assert_array_equal(d.follow_gap_s, expected)


@pytest.mark.parametrize(
    ("name", "placement", "every"),
    [
        ("ring", "linear", 1),
        ("double_binary_tree", "random", 1),
        ("halving_doubling", "random", 2),
        ("recursive_doubling", "linear", 3),
        ("hierarchical", "random", 1),
    ],
)
def test_an_agreement_frame_waits_for_the_first_data_phase_on_its_connection(
    name: str, placement: str, every: int
) -> None:
    # Every ``every``-th data phase only: connections the kept phases never use wait for nothing (inf).
    topology = parse_topology("fat-tree:k=4")
    router = Router(topology, np.asarray(place(16, topology, placement, seed=3), dtype=np.int64), None, 0)
    schedule = all_reduce(name, 16, group_size=4) if name == "hierarchical" else all_reduce(name, 16)
    link_loss = np.full(topology.num_links, 1e-6)
    data = phase_data(schedule, router, 2**20, link_loss, connections=True)[::every]
    steps = _agreement_steps(router, LossModel(1e-6, fabric="tcp"), link_loss)
    step_s = [float(d.seconds.max(initial=0.0)) * d.phase.repeat for d in data]
    for s, (step, gaps) in enumerate(zip(steps, _data_follow_gaps(16, steps, data), strict=True)):
        for sender in range(16):
            expected, between = math.inf, sum(later.seconds for later in steps[s + 1 :])
            for d, seconds in zip(data, step_s, strict=True):
                if np.any((d.phase.src == sender) & (d.phase.dst == step.dst[sender])):
                    expected = between
                    break
                between += seconds
            assert gaps[sender] == expected, f"agreement step {s}, sender {sender}"
