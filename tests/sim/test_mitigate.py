"""Re-planning predicted: on a dragonfly whose global cable from group 0 to group 1 runs at 10%, the re-planned
ring visits the groups in another order and no longer waits on it; a rank whose cable is slow is put where a tree
moves the fewest bytes; a rank slow to compute cannot be routed around."""

from __future__ import annotations

import pytest

from allreduce.sim import Faults
from allreduce.sim._mitigate import mitigate_ring
from allreduce.topology import dragonfly

SIZE = 16 << 20


def test_a_degraded_global_cable_is_left_out_of_the_ring() -> None:
    topology = dragonfly(4, 2, 2)  # 16 GPUs, 4 per group; the linear ring goes group 0 -> 1 -> 2 -> 3 -> 0
    faults = Faults(degraded=(("r0.0->r1.0", 0.1),))
    m = mitigate_ring(topology, 16, size_bytes=SIZE, faults=faults)
    assert m.order != tuple(range(16))
    assert m.slowest_after_Bps >= 5 * m.slowest_before_Bps
    assert m.speedup > 3
    assert m.after.seconds == pytest.approx(mitigate_ring(topology, 16, size_bytes=SIZE).before.seconds, rel=0.05)


def test_a_healthy_fabric_keeps_its_ring() -> None:
    m = mitigate_ring(dragonfly(4, 2, 2), 16, size_bytes=SIZE)
    assert m.order == tuple(range(16))
    assert m.speedup == 1.0
    assert "the ring is kept" in m.note


def test_a_slow_rank_is_named_as_beyond_re_planning() -> None:
    m = mitigate_ring(dragonfly(4, 2, 2), 16, size_bytes=SIZE, faults=Faults(slow_ranks=((5, 1e-3),)))
    assert m.speedup == 1.0
    assert "cannot route around compute" in m.note


SLOW_PORT = (("gpu5->r1.0", 0.1), ("r1.0->gpu5", 0.1))
"""GPU 5's cable to its router at a tenth both ways: every link of rank 5 (placed linearly) is slow."""


def test_a_slow_port_is_put_where_a_tree_moves_the_fewest_bytes_within_the_bound_it_sets() -> None:
    """A ring moves 2(N-1)/N of the buffer through rank 5's cable each way, any all-reduce at least the buffer."""
    m = mitigate_ring(dragonfly(4, 2, 2), 8, size_bytes=SIZE, faults=Faults(degraded=SLOW_PORT), beyond_ring=True)
    assert m.slow_ranks == (5,)
    assert "tree" in m.algorithm
    assert 1.3 < m.speedup <= 2 * 7 / 8 * 1.01
    assert "rank 5: every link slow" in m.note


def test_a_slow_port_keeps_the_ring_when_only_ring_orders_are_asked_for() -> None:
    m = mitigate_ring(dragonfly(4, 2, 2), 8, size_bytes=SIZE, faults=Faults(degraded=SLOW_PORT))
    assert (m.algorithm, m.order, m.speedup) == ("ring", tuple(range(8)), 1.0)
    assert m.slow_ranks == (5,)
