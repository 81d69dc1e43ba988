"""Linux's loss recovery (RACK-TLP on timer ticks, RTO backoff, CUBIC's window) against its closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from allreduce.schedules import all_reduce
from allreduce.sim import LossModel, TailConfig, simulate_tail
from allreduce.sim._phases import agreement_delays, phase_data
from allreduce.sim._routing import Router
from allreduce.sim._tcp import (
    DELACK_MIN_S,
    ODD_BEFORE_SHARE,
    TCP_STACKS,
    TIMEOUT_MIN_S,
    LostTransfers,
    TcpStack,
    draw_repair_seconds,
)
from allreduce.sim._tcp_window import (
    CUBIC_BETA,
    CUBIC_C,
    loss_window_packets,
    window_reduction_seconds,
)
from allreduce.topology import parse_topology, switch

Z = 4.0
RTT = 20e-6
TAU = 1e-6
LINUX = TCP_STACKS["linux"]
# The linux preset's logic with exact timers, so every cost is a closed form.
EXACT = TcpStack("exact", rto_min_s=0.2, hz=0.0, rack_tlp=True)


def _draw(
    stack: TcpStack,
    n: int,
    packets: int,
    *,
    q: float = 1e-9,
    q_ack: float = 0.0,
    gap: float = math.inf,
    seed: int = 5,
    window: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    transfers = LostTransfers(
        np.full(n, q),
        np.full(n, packets, dtype=np.int64),
        np.full(n, RTT),
        np.full(n, TAU),
        q_ack=np.full(n, q_ack),
        gap_s=np.full(n, gap),
        window=None if window is None else np.full(n, window),
    )
    return draw_repair_seconds(np.random.default_rng(seed), stack, transfers)


WINDOW = float(window_reduction_seconds(np.array([RTT]), np.array([TAU]))[0])


def test_a_timer_fires_one_to_two_ticks_after_it_is_armed_for_less_than_a_tick() -> None:
    # usecs_to_jiffies rounds 2.005 ms up to one 4 ms tick; the timer wheel fires it 1 to 2 ticks later.
    fired = LINUX.timer(np.random.default_rng(0), np.full(40_000, 2.005e-3))
    assert fired.min() >= 4e-3
    assert fired.max() < 8e-3
    assert abs(fired.mean() - 6e-3) < Z * 4e-3 / math.sqrt(12 * fired.size)


def test_a_timer_of_several_ticks_rounds_up_to_whole_ticks() -> None:
    fired = LINUX.timer(np.random.default_rng(0), np.full(1000, 0.2 + 40e-6))
    assert fired.min() >= 0.204
    assert fired.max() < 0.208


def test_a_loss_with_three_packets_behind_it_costs_the_repair_past_the_transfer_end() -> None:
    packets = 40
    extra, fired = _draw(EXACT, 20_000, packets)
    assert not fired[extra < 1e-3].any()
    # Position i is uniform; k = P - 1 - i packets follow. Where k >= 3 the cost is max(tau, RTT + (4 - k) tau).
    mid = extra < 1e-3
    assert abs(mid.mean() - (packets - 3) / packets) < Z * math.sqrt(0.1 / extra.size)
    allowed = {max(TAU, RTT + (4 - k) * TAU) + WINDOW for k in range(3, packets)}
    assert set(np.round(extra[mid], 15)) <= {round(a, 15) for a in allowed}


def test_the_last_packet_alone_costs_the_one_packet_probe() -> None:
    extra, fired = _draw(LINUX, 20_000, packets=1)
    assert fired.min() >= 1
    base = RTT + TAU + WINDOW
    # 2*srtt + rto_min (capped by srtt + rto_min) rounded up to 51 ticks of 4 ms, fired 51 to 52 ticks later.
    once = fired == 1
    assert extra[once].min() >= base + 0.204
    assert extra[once].max() < base + 0.208


def test_a_transfers_last_packet_lost_alone_pays_rto_min_only_where_the_one_before_was_acknowledged() -> None:
    # Two packets, the last lost (half the losses): a receiver acknowledging every second full segment leaves the
    # one before it waiting for its pair half the time (ODD_BEFORE_SHARE); two are out, and the probe armed at
    # 2 srtt + 2 ms resends the last. Otherwise the one before is acknowledged and the probe waits rto_min.
    delayed_ack = TcpStack(
        "exact-delack", rto_min_s=0.2, hz=0.0, rack_tlp=True, delayed_ack_s=DELACK_MIN_S, paced=False, gro=False
    )
    n = 40_000
    extra, fired = _draw(delayed_ack, n, packets=2)
    short = np.isclose(extra, RTT + TAU + 2 * RTT + TIMEOUT_MIN_S + WINDOW, rtol=0, atol=1e-12)
    share = 0.5 * ODD_BEFORE_SHARE
    assert abs(short.mean() - share) < Z * math.sqrt(share * (1 - share) / n)
    assert abs(fired.mean() - (0.5 - share)) < Z * math.sqrt(share * (1 - share) / n)
    # quickack (every segment acknowledged at once) leaves nothing waiting: every lost last packet pays rto_min
    assert abs(_draw(EXACT, n, packets=2)[1].mean() - 0.5) < Z * math.sqrt(0.25 / n)


def test_a_loss_with_one_or_two_packets_behind_it_costs_the_reordering_timer() -> None:
    extra, _ = _draw(EXACT, 30_000, packets=3)
    # k = 2 and k = 1 (two thirds of the losses): RTT + tau + min_rtt/4 + 2 ms; k = 0: the probe.
    reo = RTT + TAU + RTT / 4 + TIMEOUT_MIN_S + WINDOW
    probe = RTT + TAU + min(2 * RTT + 0.2, RTT + 0.2) + WINDOW
    at_reo = np.isclose(extra, reo, rtol=0, atol=1e-12)
    at_probe = np.isclose(extra, probe, rtol=0, atol=1e-12)
    assert np.all(at_reo | at_probe | (extra > probe))
    assert abs(at_reo.mean() - 2 / 3) < Z * math.sqrt(2 / 9 / extra.size)


def test_the_next_transfer_on_the_connection_reveals_a_tail_loss() -> None:
    gap = 1e-3
    extra, fired = _draw(EXACT, 20_000, packets=1, gap=gap)
    assert not np.any(fired[extra < 0.1])
    # k = 0: the next transfer's packets arrive gap later, three SACKs mark the hole: gap + 1.5 RTT + 4 tau.
    np.testing.assert_allclose(extra[fired == 0], gap + 1.5 * RTT + 4 * TAU + WINDOW, rtol=1e-12)


def test_lost_acks_turn_a_reordering_repair_into_a_probe() -> None:
    # k = 1: its one SACK lost (q_ack -> 1): the probe at 2 srtt + 2 ms with several packets out, then its SACK.
    extra, _ = _draw(EXACT, 4000, packets=2, q_ack=1 - 1e-12)
    k1 = extra < 0.1
    np.testing.assert_allclose(extra[k1], 2 * (RTT + TAU) + 2 * RTT + TIMEOUT_MIN_S + WINDOW, rtol=1e-12)
    extra, _ = _draw(EXACT, 4000, packets=2, q_ack=0.0)
    k1 = extra < 0.1
    np.testing.assert_allclose(extra[k1], RTT + TAU + RTT / 4 + TIMEOUT_MIN_S + WINDOW, rtol=1e-12)


def test_a_lost_probe_waits_for_the_rto_doubled_per_loss() -> None:
    extra, fired = _draw(EXACT, 200_000, packets=1, q=0.3)
    rto = RTT + 0.2
    probe = RTT + TAU + min(2 * RTT + 0.2, rto) + WINDOW
    resent = fired - 1
    assert resent.max() >= 3
    # Each wait twice the last (RFC 6298 5.5), up to TCP_RTO_MAX (120 s).
    waits = np.array([sum(min(rto * 2.0**j, 120.0) for j in range(m)) for m in range(int(resent.max()) + 1)])
    np.testing.assert_allclose(extra, probe + waits[resent], rtol=1e-9)
    # The probe is lost again with probability q each time: m ~ Geometric.
    assert abs(np.mean(resent >= 1) - 0.3) < Z * math.sqrt(0.21 / resent.size)


def test_several_losses_in_a_transfer_are_repaired_together() -> None:
    gap = 1e-3
    rng = np.random.default_rng(3)
    n = 20_000
    # a window of sqrt(1.5/0.1) = 3.9 packets holds the whole transfer: one recovery episode
    transfers = LostTransfers(
        np.full(n, 0.1), np.full(n, 3, dtype=np.int64), np.full(n, RTT), np.full(n, TAU), gap_s=np.full(n, gap),
        window=loss_window_packets(np.full(n, 0.1)),
    )  # fmt: skip
    extra, fired = draw_repair_seconds(rng, EXACT, transfers)
    clean = fired == 0
    # Each loss alone costs at most gap + 1.5 RTT + 4 tau; NewReno's sum would give 2-3x that where 2-3 are lost.
    assert clean.mean() > 0.3
    assert extra[clean].max() <= gap + 1.5 * RTT + 4 * TAU + WINDOW + 1e-12


def _episodes_reference(rng: np.random.Generator, n: int, packets: int, q: float) -> tuple[np.ndarray, np.ndarray]:
    """Bernoulli(q) losses among ``packets`` (given one at least), none of the last three packets lost; each loss
    with ``k >= 3`` behind it costs ``max(tau, RTT + (4 - k) tau)``, and its repair is lost again ``m`` times
    (geometric): more than a window behind it, data sent after the repair is SACKed and RACK resends it a round
    trip on, ``m (RTT + 2 tau)``; within the last window an RTO fires, and the transfer is left out. Returns the
    cost per transfer with recovery episodes charged in turn (a loss more than a window sqrt(1.5/q) past its
    episode's first starts the next) and with every loss in one."""
    window = math.sqrt(1.5 / q)
    lost = rng.random((n, packets)) < q
    lost = lost[lost.any(axis=1) & ~lost[:, -3:].any(axis=1)]
    again = np.where(lost, rng.geometric(1 - q, size=lost.shape) - 1, 0)
    behind = packets - 1 - np.arange(packets)
    kept = ~((again > 0) & (behind <= window)).any(axis=1)  # an RTO: left out
    lost, again = lost[kept], again[kept]
    summed, largest = np.zeros(lost.shape[0]), np.zeros(lost.shape[0])
    start, episode = np.full(lost.shape[0], -1), np.zeros(lost.shape[0])
    for position in range(packets):
        at = lost[:, position]
        cost = max(TAU, RTT + (4 - (packets - 1 - position)) * TAU) + again[:, position] * (RTT + 2 * TAU)
        new = at & ((start < 0) | (position - start > window))
        summed[new] += episode[new]
        episode[new], start[new] = cost[new], position
        episode[at & ~new] = np.maximum(episode[at & ~new], cost[at & ~new])
        largest[at] = np.maximum(largest[at], cost[at])
    return summed + episode, largest


def test_losses_a_window_apart_are_repaired_in_recovery_episodes_one_after_another() -> None:
    # q = 0.05: a window of 5.5 packets, so a 40-packet transfer's losses fall in several recovery episodes
    # (Linux leaves recovery once high_seq, what was sent when it began, is acknowledged; a loss sent after it
    # starts the next), and each episode's repair adds to the last's
    packets, q = 40, 0.05
    extra, fired = _draw(EXACT, 60_000, packets, q=q, window=math.sqrt(1.5 / q))
    # no loss among the last three (their timers cost milliseconds) and no repair lost (an RTO)
    cost = extra[(fired == 0) & (extra < 1e-3)] - WINDOW
    summed, largest = _episodes_reference(np.random.default_rng(1), 60_000, packets, q)
    tolerance = Z * math.hypot(cost.std() / math.sqrt(cost.size), summed.std() / math.sqrt(summed.size))
    assert abs(cost.mean() - summed.mean()) < tolerance
    assert cost.mean() - largest.mean() > 4 * tolerance


def test_cubic_window_regrowth_at_the_bdp_has_its_closed_form() -> None:
    # Small windows grow back linearly (alpha = 3(1-b)/(1+b) per RTT): (1-b)/2 * (1+b)/3 * W * RTT.
    rtt, tau = 100e-6, 10e-6
    window = rtt / tau
    got = float(window_reduction_seconds(np.array([rtt]), np.array([tau]))[0])
    assert got == pytest.approx((1 - CUBIC_BETA) / 2 * (1 + CUBIC_BETA) / 3 * window * rtt, rel=1e-12)
    # Huge windows on long paths regrow along the cubic: (1-b)/4 * K, K = cbrt(W (1-b) / C).
    rtt, tau = 1.0, 1e-6
    got = float(window_reduction_seconds(np.array([rtt]), np.array([tau]))[0])
    assert got == pytest.approx((1 - CUBIC_BETA) / 4 * (rtt / tau * (1 - CUBIC_BETA) / CUBIC_C) ** (1 / 3))


def test_a_ring_step_is_followed_at_once_and_its_last_step_by_nothing() -> None:
    topology = parse_topology("clos:leaves=2,spines=1,hosts_per_leaf=2")
    router = Router(topology, np.arange(4), None, 0)
    data = phase_data(all_reduce("ring", 4), router, 2**20, np.zeros(topology.num_links), connections=True)
    assert data[0].follow_gap_s is not None
    assert data[1].follow_gap_s is not None
    assert np.all(data[0].follow_gap_s == 0)
    assert np.all(np.isinf(data[1].follow_gap_s))


def test_halving_doubling_waits_two_steps_for_the_distance_two_connection() -> None:
    topology = parse_topology("clos:leaves=2,spines=1,hosts_per_leaf=2")
    router = Router(topology, np.arange(4), None, 0)
    data = phase_data(all_reduce("halving_doubling", 4), router, 2**20, np.zeros(topology.num_links), connections=True)
    between = data[1].seconds.max() + data[2].seconds.max()
    assert data[0].follow_gap_s is not None
    np.testing.assert_allclose(data[0].follow_gap_s, between, rtol=1e-12)
    assert data[1].follow_gap_s is not None
    np.testing.assert_allclose(data[1].follow_gap_s, 0.0)


def test_a_lost_one_frame_agreement_message_holds_its_receiver_back_by_the_probe() -> None:
    # One switch, loss only into gpu0: rank 0 receives one frame from rank 1 (step 0) and two from rank 2
    # (step 1). The lone frame waits for the one-packet probe (2*srtt + rto_min); of two small frames the
    # first is revealed by the second, and the second is probed before the first is acknowledged.
    topology = switch(4)
    p = 0.05
    link = np.zeros(topology.num_links)
    into = [i for i in range(topology.num_links) if topology.link_name(i) == "switch0->gpu0"]
    link[into] = p
    router = Router(topology, np.arange(4), None, 0)
    samples = 20_000
    model = LossModel(fabric="tcp", tcp="linux")
    delay, code, lost, _ = agreement_delays(np.random.default_rng(2), router, samples, model, link)
    assert not delay[1:].any()
    held = delay[0] > 0
    expected = 1 - (1 - p) ** 3
    assert abs(held.mean() - expected) < Z * math.sqrt(expected * (1 - expected) / samples)
    probed = delay[0] >= 0.204
    # the lone frame, or a resend of one of the other two lost as well (then the RTO)
    expected_probed = 1 - (1 - p) * (1 - p * p) ** 2
    assert abs(probed.mean() - expected_probed) < Z * math.sqrt(expected_probed * (1 - expected_probed) / samples)
    assert delay[0][held & ~probed].max() < 0.02
    assert set(code[0][held].tolist()) == {4 + into[0]}
    assert lost.sum() >= held.sum()


def test_linux_charges_a_mid_collective_tail_loss_far_less_than_rfc6298() -> None:
    topology = parse_topology("clos:leaves=2,spines=1,hosts_per_leaf=2")
    ring = all_reduce("ring", 4)
    links = (("leaf0->spine0", 2e-3),)

    def p99(tcp: str) -> float:
        config = TailConfig(samples=400, seed=4, loss=LossModel(fabric="tcp", links=links, tcp=tcp, agreement=False))
        result = simulate_tail(ring, topology, size_bytes=2**20, config=config)
        return float(np.percentile(result.collective_s, 99) - result.baseline_s)

    assert p99("linux") < p99("rfc6298") / 5


def test_simulate_tail_refuses_a_loss_no_stack_recovers_from() -> None:
    topology = parse_topology("clos:leaves=2,spines=1,hosts_per_leaf=2")
    config = TailConfig(samples=10, loss=LossModel(0.7, fabric="tcp", tcp="linux"))
    with pytest.raises(ValueError, match="too lossy to recover from"):
        simulate_tail(all_reduce("ring", 4), topology, size_bytes=2**20, config=config)


def test_simulate_tail_refuses_samples_beyond_its_memory_limit() -> None:
    topology = parse_topology("clos:leaves=2,spines=1,hosts_per_leaf=2")
    with pytest.raises(ValueError, match="GiB"):
        simulate_tail(all_reduce("ring", 4), topology, size_bytes=2**20, config=TailConfig(samples=10**9))
