"""More of the tail's closed forms: one retransmission timeout anywhere in a ring costs exactly its own time,
for both fabrics; the frequency of a step with a loss when paths cross different numbers of lossy links."""

from __future__ import annotations

import math

import numpy as np
import pytest

from allreduce.schedules import all_reduce
from allreduce.sim import LossModel, TailConfig, simulate, simulate_tail
from allreduce.topology import fat_tree, route, switch

# Deviations accepted, in standard errors (fixed seeds: a run always passes or always fails).
Z = 4.0


@pytest.mark.parametrize(("fabric", "mtu"), [("roce", 4096), ("tcp", 1500)])
def test_one_lost_transfer_anywhere_in_a_ring_costs_exactly_its_timeouts(fabric: str, mtu: int) -> None:
    # Every link drops packets; every transfer is one packet, so every loss is a tail loss (no packet follows
    # it: no NAK for RoCE, no duplicate ACKs for TCP) and waits for the timer. The ring on one switch runs in
    # lockstep, so every transfer is on the critical path: a sample with one lost transfer, wherever it is,
    # ends exactly its timeouts x (RTO + one packet's time) later (TCP as RFC 6298 has it: no probe).
    n, rto = 8, 1e-3
    topology = switch(n)
    loss = LossModel(2e-3, fabric, mtu_bytes=mtu, rto_s=rto, tcp="rfc6298")
    result = simulate_tail(
        all_reduce("ring", n), topology, size_bytes=float(mtu * n), config=TailConfig(samples=600, seed=21, loss=loss)
    )
    resend_s = mtu / topology.link_bandwidth_Bps[0]
    one = result.lost_transfers == 1
    assert one.sum() >= 50
    assert result.culprit[one].min() >= n  # a link, not a rank
    np.testing.assert_allclose(
        result.step_s[one] - result.baseline_s, result.timeouts[one] * (rto + resend_s), rtol=1e-9, atol=1e-15
    )
    # Several lost transfers cost at most the sum of their timeouts (they may overlap) and at least one's.
    several = result.lost_transfers > 1
    assert several.sum() >= 10
    grown = result.step_s[several] - result.baseline_s
    assert np.all(grown <= result.timeouts[several] * (rto + resend_s) * (1 + 1e-9))
    assert np.all(grown >= (rto + resend_s) * (1 - 1e-9))


def test_frequency_of_a_step_with_a_loss_on_paths_of_different_lengths() -> None:
    # A ring of 16 on a k=4 fat-tree: hops inside an edge switch cross 2 links, across pods 6; a packet is
    # lost with q_f = 1 - (1-p)^(links of flow f), and P(some loss in the step) = 1 - prod_f (1-q_f)^packets_f.
    n, p, mtu, size, k = 16, 4e-6, 1500, 2**20, 3000
    topology = fat_tree(4)
    schedule = all_reduce("ring", n)
    loss = LossModel(p, "tcp", mtu_bytes=mtu, rto_s=1e-3)
    result = simulate_tail(schedule, topology, size_bytes=float(size), config=TailConfig(samples=k, seed=8, loss=loss))
    free = simulate(schedule, topology, size_bytes=float(size), engine="fast")
    log_keep = 0.0
    lengths: set[int] = set()
    for phase in schedule.phases():
        packets = math.ceil(phase.fraction[0] * size / mtu)
        routes = route(topology, free.rank_gpu[phase.src], free.rank_gpu[phase.dst])
        assert np.all(routes.weight == 1.0)  # one path per flow (ECMP), so a flow crosses each link once
        links = np.diff(routes.flow_ptr)
        lengths.update(links.tolist())
        log_keep += phase.repeat * packets * float(np.sum(links)) * math.log1p(-p)
    assert len(lengths) > 1
    expected = -math.expm1(log_keep)
    assert 0.1 < expected < 0.9
    observed = result.loss_frequency()
    assert abs(observed - expected) < Z * math.sqrt(expected * (1 - expected) / k)
