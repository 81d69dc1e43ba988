"""The simulator against hand-computed expectations (closed forms of simple cases).

Notation: S bytes per rank, B the host link bandwidth, L the latency of one link; on a single switch a flow
crosses two links (GPU -> switch -> GPU), so the per-step latency is α = 2L.
"""

from __future__ import annotations

import numpy as np
import pytest

from allreduce.schedules import CostModel, all_reduce, double_binary_tree_all_reduce, predict
from allreduce.sim import Faults, simulate
from allreduce.topology import clos, fat_tree, switch

S = float(2**26)  # 64 MiB
B = 50e9  # 400 Gb/s
L = 1e-6
ENGINES = ("fast", "event")


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# ------------------------------------------------------------------------------------------------------------
# Contention-free: the α–β closed forms
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 8, 13])
@pytest.mark.parametrize("engine", ENGINES)
def test_ring_on_one_switch_is_the_closed_form(n: int, engine: str) -> None:
    topo = switch(n, bandwidth_Bps=B, latency_s=L)
    result = simulate(all_reduce("ring", n), topo, size_bytes=S, engine=engine)
    alpha = 2 * L
    closed = 2 * (n - 1) * alpha + 2 * (n - 1) / n * S / B
    assert rel(result.seconds, closed) < 1e-6
    # The project's α–β model, evaluated from the schedule, says the same.
    assert rel(result.seconds, predict(all_reduce("ring", n), S, CostModel(alpha, B)).seconds) < 1e-6


@pytest.mark.parametrize("engine", ENGINES)
def test_halving_doubling_and_recursive_doubling_on_one_switch(engine: str) -> None:
    n = 16
    topo = switch(n, bandwidth_Bps=B, latency_s=L)
    alpha = 2 * L
    hd = simulate(all_reduce("halving_doubling", n), topo, size_bytes=S, engine=engine)
    assert rel(hd.seconds, 2 * 4 * alpha + 2 * (n - 1) / n * S / B) < 1e-6
    rd = simulate(all_reduce("recursive_doubling", n), topo, size_bytes=S, engine=engine)
    assert rel(rd.seconds, 4 * (alpha + S / B)) < 1e-6


@pytest.mark.parametrize("engine", ENGINES)
def test_ring_on_a_non_blocking_fat_tree_with_linear_placement(engine: str) -> None:
    # k=4: 16 hosts, 2 per edge switch, 2 edges per pod. Linear ring hops stay under one edge (2 links), cross
    # edges in a pod (4 links) or cross pods (6 links); no two flows share a link, so every flow runs at B and
    # the lockstep pace is the longest path: α = 6L.
    n = 16
    topo = fat_tree(4, bandwidth_Bps=B, latency_s=L)
    result = simulate(all_reduce("ring", n), topo, size_bytes=S, engine=engine)
    closed = 2 * (n - 1) * (6 * L) + 2 * (n - 1) / n * S / B
    assert rel(result.seconds, closed) < 1e-6
    assert result.phases[0].slowest_rate_Bps == pytest.approx(B, rel=1e-12)


# ------------------------------------------------------------------------------------------------------------
# Oversubscription and placement
# ------------------------------------------------------------------------------------------------------------
def _bandwidth_term(schedule_name: str, topo_kwargs: dict[str, object], **kwargs: object) -> float:
    """Time at S minus time at 0 bytes: the bandwidth term (latency cancels when the slowest flow is also the
    longest path, as in every case below)."""
    topo = clos(**topo_kwargs)  # type: ignore[arg-type]
    n = topo.num_gpus
    schedule = all_reduce(schedule_name, n)
    full = simulate(schedule, topo, size_bytes=S, engine="fast", **kwargs)  # type: ignore[arg-type]
    empty = simulate(schedule, topo, size_bytes=0, engine="fast", **kwargs)  # type: ignore[arg-type]
    return full.seconds - empty.seconds


def test_clos_at_4_to_1_costs_4x_when_every_ring_hop_crosses_the_spine() -> None:
    # 4 leaves x 8 hosts, 2 spines, 4:1: each leaf has 2 uplinks of 8B/(2*4) = B for 8 hosts.
    spec = {"leaves": 4, "spines": 2, "hosts_per_leaf": 8, "oversub": 4.0, "bandwidth_Bps": B, "latency_s": L}
    n = 32
    non_blocking = 2 * (n - 1) / n * S / B
    # Rank r on leaf r % 4: every hop r -> r+1 leaves its leaf; 8 flows share 2B of uplink: B/4 each
    # (spraying spreads them evenly; ECMP could only do worse).
    across = [(r % 4) * 8 + r // 4 for r in range(n)]
    crossing = _bandwidth_term("ring", spec, placement=across, routing="spray")
    assert rel(crossing, 4 * non_blocking) < 1e-9
    # Linear: only the 4 hops between leaves cross, one per uplink direction, each at B.
    linear = _bandwidth_term("ring", spec, routing="spray")
    assert rel(linear, non_blocking) < 1e-9
    ecmp = _bandwidth_term("ring", spec, placement=across)
    assert ecmp >= crossing * (1 - 1e-9)


# ------------------------------------------------------------------------------------------------------------
# One degraded link
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_host_link_at_10_percent_makes_ring_bandwidth_term_10x(engine: str) -> None:
    n = 8
    topo = switch(n, bandwidth_Bps=B, latency_s=L)
    faults = Faults(degraded=(("gpu3->switch0", 0.1),))
    result = simulate(all_reduce("ring", n), topo, size_bytes=S, faults=faults, engine=engine)
    # The slowest link sets the pace of every step: 2(N-1) steps of S/N at 0.1 B.
    assert rel(result.seconds, 2 * (n - 1) * (2 * L + S / n / (0.1 * B))) < 1e-6
    assert result.bottlenecks[0].name == "gpu3->switch0"


CLOS_2X4 = {"leaves": 2, "spines": 1, "hosts_per_leaf": 4, "bandwidth_Bps": B, "latency_s": L}


@pytest.mark.parametrize("engine", ENGINES)
def test_degraded_uplink_ring_and_hierarchical_by_hand(engine: str) -> None:
    """2 leaves x 4 hosts, one spine; leaf0->spine0 (4B) degraded to 10%: 0.4B.

    ring (linear): only hop 3 -> 4 crosses it, alone: 0.4B instead of B, so the bandwidth term grows 2.5x:
        14 steps x (S/8)/(0.4B) = 4.375 S/B against 1.75 S/B.
    hierarchical (groups = leaves): reduce-scatter and all-gather stay inside the leaves (6 steps of S/4 at B);
        the 2 steps across share the uplink among 4 flows of S/8: 0.1B each, 1.25 S/B per step:
        1.5 + 2.5 = 4.0 S/B against 1.5 + 0.25 = 1.75 S/B (2.29x).
    Every slowest flow also takes the longest path (4 links), so times are exact sums of latency and bytes.
    """
    topo = clos(**CLOS_2X4)  # type: ignore[arg-type]
    faults = Faults(degraded=(("leaf0->spine0", 0.1),))
    ring = all_reduce("ring", 8)
    healthy = simulate(ring, topo, size_bytes=S, engine=engine)
    slow = simulate(ring, topo, size_bytes=S, engine=engine, faults=faults)
    assert rel(healthy.seconds, 14 * 4 * L + 1.75 * S / B) < 1e-6
    assert rel(slow.seconds, 14 * 4 * L + 4.375 * S / B) < 1e-6
    assert slow.bottlenecks[0].name == "leaf0->spine0"

    hier = all_reduce("hierarchical", 8, group_size=4)
    healthy = simulate(hier, topo, size_bytes=S, engine=engine)
    slow = simulate(hier, topo, size_bytes=S, engine=engine, faults=faults)
    latency = 6 * 2 * L + 2 * 4 * L
    assert rel(healthy.seconds, latency + 1.75 * S / B) < 1e-6
    assert rel(slow.seconds, latency + 4.0 * S / B) < 1e-6
    assert slow.bottlenecks[0].name == "leaf0->spine0"


@pytest.mark.parametrize("engine", ENGINES)
def test_degraded_link_double_binary_tree_by_hand(engine: str) -> None:
    """Double binary tree on 4 ranks, one chunk per tree, on one switch. Tree A: 3 -> 1 -> {0, 2}, tree B:
    0 -> 2 -> {1, 3}; each tree carries S/2. Steps (flows):
        0: 0->1, 2->1 (A up), 1->2, 3->2 (B up)    1: 1->3 (A), 2->0 (B)
        2: 3->1 (A down), 0->2 (B down)              3: 1->0, 1->2 (A), 2->1, 2->3 (B)
    Healthy: steps 0 and 3 share a port two ways (S/2 at B/2), steps 1 and 2 do not: 4α + 3 S/B.
    gpu1's uplink at 0.1B: 1->2 takes 5 S/B at step 0, 1->3 5 S/B at step 1, and 1->0, 1->2 share 0.1B at
    step 3 (10 S/B); rank 1 is on the critical path throughout: 5 + 5 + 0.5 + 10 = 20.5 S/B (6.8x).
    """
    topo = switch(4, bandwidth_Bps=B, latency_s=L)
    tree = double_binary_tree_all_reduce(4, chunks=1)
    alpha = 2 * L
    healthy = simulate(tree, topo, size_bytes=S, engine=engine)
    assert rel(healthy.seconds, 4 * alpha + 3 * S / B) < 1e-6
    slow = simulate(tree, topo, size_bytes=S, engine=engine, faults=Faults(degraded=(("gpu1->switch0", 0.1),)))
    assert rel(slow.seconds, 4 * alpha + 20.5 * S / B) < 1e-6
    assert slow.bottlenecks[0].name == "gpu1->switch0"


# ------------------------------------------------------------------------------------------------------------
# ECMP collisions and spraying
# ------------------------------------------------------------------------------------------------------------
def test_ecmp_collides_on_a_fat_tree_and_spraying_does_not() -> None:
    topo = fat_tree(8, bandwidth_Bps=B, latency_s=L)  # 128 hosts, non-blocking
    n = topo.num_gpus
    ring = all_reduce("ring", n)
    ecmp = simulate(ring, topo, size_bytes=S, placement="random", seed=3, routing="ecmp", engine="fast")
    spray = simulate(ring, topo, size_bytes=S, placement="random", seed=3, routing="spray", engine="fast")
    # Spraying over every equal-cost path routes any permutation of a non-blocking fat-tree at full rate.
    assert spray.phases[0].slowest_rate_Bps == pytest.approx(B, rel=1e-9)
    assert rel(spray.seconds - 2 * (n - 1) * 6 * L, 2 * (n - 1) / n * S / B) < 1e-6
    # Hashing puts several flows on one switch-to-switch link: those flows get a fraction of B.
    assert ecmp.phases[0].slowest_rate_Bps <= B / 2 * (1 + 1e-9)
    assert ecmp.seconds > spray.seconds * 1.5
    # The links named are the colliding ones: between switches, carrying more than one flow's bytes.
    per_flow_bytes = 2 * (n - 1) * S / n
    for b in ecmp.bottlenecks:
        src, dst = b.name.split("->")
        assert not src.startswith("gpu"), b.name
        assert not dst.startswith("gpu"), b.name
        assert b.bytes >= 2 * per_flow_bytes * (1 - 1e-9), b.name
        assert b.utilization > 0.8  # busy for all but the path latency of each step


def test_link_bytes_add_up_to_bytes_times_hops() -> None:
    topo = fat_tree(4, bandwidth_Bps=B, latency_s=L)
    result = simulate(all_reduce("ring", 16), topo, size_bytes=S, routing="spray", engine="fast")
    # Per step, each of 16 flows of S/16 crosses 2 (same edge), 4 (same pod) or 6 (across pods) links.
    hops = np.asarray([2 if r % 2 == 0 else (4 if r % 4 == 1 else 6) for r in range(16)], dtype=np.float64)
    expected = 2 * 15 * S / 16 * hops.sum()
    assert rel(float(result.link_bytes.sum()), expected) < 1e-12
