"""Lost ACKs of window-limited flows (the probe, then the interactive receiver's delayed ACK), the barrier a
benchmark times with each collective, and bursty (Gilbert–Elliott) loss, against their closed forms."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from allreduce.schedules import all_reduce
from allreduce.sim import LossModel
from allreduce.sim._bursts import Bursts, chain_loss, gilbert_elliott, next_loss, resend_loss
from allreduce.sim._phases import _ack_stalls, _stall_pacing, agreement_delays, draw_losses, phase_data
from allreduce.sim._routing import Router
from allreduce.sim._tcp import (
    DELACK_MIN_S,
    TCP_STACKS,
    TIMEOUT_MIN_S,
    LostTransfers,
    TcpStack,
    _lost_repair_ack,
    draw_repair_seconds,
)
from allreduce.sim._tcp_cwnd import FOLLOW_MIN_WINDOW
from allreduce.sim._tcp_stall import StallPacing, ack_stall_flights, draw_ack_stall_seconds
from allreduce.sim._tcp_window import (
    PACING_CA_RATIO,
    PACING_SS_RATIO,
    RTO_PACED_WINDOW,
    loss_window_packets,
    paced_seconds,
    rto_pacing_ratio,
    window_reduction_seconds,
)
from allreduce.topology import switch

Z = 4.0
RTT = 20e-6
# The linux preset's logic with exact timers, so every cost is a closed form.
EXACT = TcpStack("exact", rto_min_s=0.2, hz=0.0, rack_tlp=True, delayed_ack_s=DELACK_MIN_S)


def test_cubic_keeps_the_reno_friendly_average_window_at_a_loss_rate() -> None:
    # RFC 8312 5.1: AIMD(3(1-b)/(1+b), b) averages sqrt(1.5/q) packets, whatever b.
    np.testing.assert_allclose(loss_window_packets(np.array([1e-2, 1.5e-4])), [math.sqrt(150), 100.0])
    assert np.isinf(loss_window_packets(np.array([0.0]))).all()


def test_a_transfer_has_one_stalling_flight_fewer_than_its_windows() -> None:
    # q = 1.5e-2: W = 10 packets; 25 packets go out in 3 flights, the last of which nothing waits behind.
    q = np.full(4, 1.5e-2)
    flights = ack_stall_flights(q, np.array([25, 10, 9, 1], dtype=np.int64), 1500)
    assert flights.tolist() == [2, 0, 0, 0]
    assert ack_stall_flights(np.zeros(1), np.array([10**6], dtype=np.int64), 1500).tolist() == [0]


def test_a_window_beyond_one_gro_batch_never_stalls_on_one_ack() -> None:
    # q = 1.5e-4: W = 100 packets of 1,500 B, 150 kB: acknowledged by a stream of ACKs, not one.
    assert ack_stall_flights(np.full(1, 1.5e-4), np.array([250], dtype=np.int64), 1500).tolist() == [0]
    # The same window of 600 B packets (60 kB) is one GRO batch.
    assert ack_stall_flights(np.full(1, 1.5e-4), np.array([250], dtype=np.int64), 600).tolist() == [2]


def test_a_lost_flight_ending_ack_costs_the_probe_and_the_delayed_ack() -> None:
    n = 1000
    extra, timeouts = draw_ack_stall_seconds(
        np.random.default_rng(0), EXACT, stalls=np.full(n, 2), rtt_s=np.full(n, RTT), q=np.zeros(n), q_ack=np.zeros(n)
    )
    np.testing.assert_allclose(extra, 2 * (RTT + 2 * RTT + TIMEOUT_MIN_S + DELACK_MIN_S))
    assert not timeouts.any()


def test_without_delayed_acks_the_probe_alone_costs_a_stall() -> None:
    quick = TcpStack("quick", rto_min_s=0.2, hz=0.0, rack_tlp=True)
    extra, _ = draw_ack_stall_seconds(
        np.random.default_rng(0), quick, stalls=np.ones(10, dtype=np.int64), rtt_s=np.full(10, RTT),
        q=np.zeros(10), q_ack=np.zeros(10),
    )  # fmt: skip
    np.testing.assert_allclose(extra, RTT + 2 * RTT + TIMEOUT_MIN_S)
    assert TCP_STACKS["tuned"].delayed_ack_s == 0
    assert TCP_STACKS["linux"].delayed_ack_s == DELACK_MIN_S


def test_a_lost_probe_or_probe_ack_waits_for_the_rto_instead() -> None:
    n = 40_000
    q, q_ack = 0.3, 0.2
    extra, timeouts = draw_ack_stall_seconds(
        np.random.default_rng(1), EXACT, stalls=np.ones(n, dtype=np.int64), rtt_s=np.full(n, RTT),
        q=np.full(n, q), q_ack=np.full(n, q_ack),
    )  # fmt: skip
    expected = 1 - (1 - q) * (1 - q_ack)
    assert abs(np.mean(timeouts >= 1) - expected) < Z * math.sqrt(expected * (1 - expected) / n)
    probe = RTT + 2 * RTT + TIMEOUT_MIN_S
    rto = RTT + EXACT.rto_min_s
    np.testing.assert_allclose(extra[timeouts == 1], probe + rto)
    np.testing.assert_allclose(extra[timeouts == 0], probe + DELACK_MIN_S)
    # after that RTO (one segment out, no probe in the Loss state) its resend or its ACK lost: the next, doubled
    fired = timeouts >= 1
    assert abs(np.mean(timeouts[fired] >= 2) - expected) < Z * math.sqrt(expected * (1 - expected) / fired.sum())
    np.testing.assert_allclose(extra[timeouts == 2], probe + 3 * rto)
    np.testing.assert_allclose(extra[timeouts == 3], probe + 7 * rto)


def test_each_stall_paces_the_segments_up_to_the_next_stalls_flight() -> None:
    # 100 packets in flights of W = 10: 9 stalling flights. Every later flight's ACK lost (q_ack = 1): stalls at
    # 2..8, each pacing the next flight's 10 segments, the last the 100 - 9 * 10 = 10 after it.
    first, flights, packets = np.array([2]), np.array([9]), np.array([100])
    stalls, paced = _stall_pacing(np.random.default_rng(0), first, flights, q_ack=np.ones(1), packets=packets,
                                 window=np.full(1, 10.0), packet_s=np.zeros(1))  # fmt: skip
    assert stalls.tolist() == [7]
    assert paced.segments[0, :7].tolist() == [10.0] * 7
    # one stall at flight 2 (no later ACK lost): the rest of the transfer, 100 - 3 * 10
    stalls, paced = _stall_pacing(np.random.default_rng(0), first, flights, q_ack=np.full(1, 1e-12),
                                 packets=packets, window=np.full(1, 10.0), packet_s=np.zeros(1))  # fmt: skip
    assert stalls.tolist() == [1]
    assert paced.segments[:, 0].tolist() == [70.0]


def test_a_stall_the_delayed_ack_ends_paces_what_follows_by_the_closed_form() -> None:
    # the delayed ACK acknowledges the whole flight, none of it resent: the RTT sample is the stall and a round
    # trip, srtt_1 - RTT = (stall)/8, and with tau below every gap the M segments after it take
    # 8 (srtt_1 - RTT)(1 - (7/8)^M)/(1.2 w) longer
    n, window, segments = 100, 6.0, 30.0
    stall = RTT + 2 * RTT + TIMEOUT_MIN_S + DELACK_MIN_S
    paced = StallPacing(np.full((n, 1), segments), np.full(n, window), np.zeros(n))
    extra, timeouts = draw_ack_stall_seconds(
        np.random.default_rng(0), EXACT, stalls=np.ones(n, dtype=np.int64), rtt_s=np.full(n, RTT), q=np.zeros(n),
        q_ack=np.zeros(n), paced=paced,
    )  # fmt: skip
    closed = stall * (1 - 0.875**segments) / (1.2 * window)
    np.testing.assert_allclose(extra, stall + closed, rtol=1e-12)
    assert closed > 0.005
    assert not timeouts.any()


def test_a_stall_the_rto_ends_is_not_charged_pacing() -> None:
    # where the RTO ends the stall, what its ACK echoes depends on the receiver's last in-order segment: no pacing
    n = 20_000
    paced = StallPacing(np.full((n, 1), 30.0), np.full(n, 6.0), np.zeros(n))
    extra, timeouts = draw_ack_stall_seconds(
        np.random.default_rng(1), EXACT, stalls=np.ones(n, dtype=np.int64), rtt_s=np.full(n, RTT),
        q=np.full(n, 0.3), q_ack=np.full(n, 0.2), paced=paced,
    )  # fmt: skip
    probe = RTT + 2 * RTT + TIMEOUT_MIN_S
    np.testing.assert_allclose(extra[timeouts == 1], probe + RTT + EXACT.rto_min_s)


def test_flows_with_lossy_acks_stall_at_the_closed_form_rate() -> None:
    # Every link p on one switch: data and ACKs cross two links, q = 1 - (1 - p)^2; a 256 KiB transfer is 175
    # packets in ceil(175 / sqrt(1.5/q)) flights, and each but the last stalls if its last ACK is lost.
    p = 2e-3
    topology = switch(4)
    router = Router(topology, np.arange(4), None, 0)
    data = phase_data(all_reduce("ring", 4), router, 2**20, np.full(topology.num_links, p), connections=True)
    d = data[0]
    samples = 4000
    packets = np.ceil(d.nbytes / 1500).astype(np.int64)
    stalls = _ack_stalls(np.random.default_rng(3), LossModel(p, fabric="tcp", tcp="linux-gro"), d, packets, samples)
    q = 1 - (1 - p) ** 2
    flights = math.ceil(175 / math.sqrt(1.5 / q)) - 1
    expected = 1 - (1 - q) ** flights
    transfers = d.phase.repeat * len(d.phase) * samples
    assert abs(stalls.step.size / transfers - expected) < Z * math.sqrt(expected / transfers)
    assert stalls.extra_s.min() >= TIMEOUT_MIN_S + DELACK_MIN_S


def test_a_flow_whose_data_is_never_lost_never_waits_on_its_acks() -> None:
    # Loss only from gpu0 into the switch: rank 0's data to rank 1 is lost, and rank 0's ACKs to rank 3; rank 3's
    # data is not, so its window never limits it, and rank 0's ACKs come back on clean links.
    topology = switch(4)
    router = Router(topology, np.arange(4), None, 0)
    link = np.zeros(topology.num_links)
    link[[i for i in range(topology.num_links) if topology.link_name(i) == "gpu0->switch0"]] = 0.05
    d = phase_data(all_reduce("ring", 4), router, 2**20, link, connections=True)[0]
    packets = np.ceil(d.nbytes / 1500).astype(np.int64)
    model = LossModel(fabric="tcp", tcp="linux")
    assert _ack_stalls(np.random.default_rng(4), model, d, packets, 2000).step.size == 0
    losses = draw_losses(np.random.default_rng(4), model, d, 2000)
    assert set(d.phase.src[losses.flow].tolist()) == {0}


def test_a_barrier_before_the_collective_doubles_the_agreements_losses() -> None:
    topology = switch(4)
    router = Router(topology, np.arange(4), None, 0)
    link = np.full(topology.num_links, 0.01)
    # the barrier's frames mostly cost little (the agreement frame after them reveals a loss), so the mean delay
    # grows by about 5%: enough samples that the draws' noise stays below that
    samples = 200_000
    once = agreement_delays(np.random.default_rng(5), router, samples, LossModel(fabric="tcp", tcp="linux"), link)
    twice = agreement_delays(
        np.random.default_rng(5), router, samples, LossModel(fabric="tcp", tcp="linux", barrier=True), link
    )
    ratio = twice[2].mean() / once[2].mean()
    assert ratio == pytest.approx(2.0, abs=Z * math.sqrt(2 / once[2].sum()) * 2)
    assert twice[0].max(axis=0).mean() > once[0].max(axis=0).mean()


def _emulated_chain(p: float, burst: float, packets: int, seed: int) -> np.ndarray:
    """Packet by packet, the emulator's firewall rules (emulate/_loss.py): bad drops and leaves after the packet
    with probability 1/burst; good turns bad with probability g (and that packet is dropped)."""
    rng = np.random.default_rng(seed)
    g = p / (burst * (1 - p) + p)
    enter = rng.random(packets) < g
    leave = rng.random(packets) < 1 / burst
    lost = np.zeros(packets, dtype=np.bool_)
    bad = False
    for i in range(packets):
        if not bad and enter[i]:
            bad = True
        if bad:
            lost[i] = True
            bad = not leave[i]
    return lost


def test_the_gilbert_elliott_closed_forms_are_the_emulators_chain() -> None:
    p, burst = 0.02, 4.0
    entry, stay = gilbert_elliott(np.array([p]), burst)
    lost = _emulated_chain(p, burst, 400_000, seed=6)
    assert abs(lost.mean() - p) < Z * math.sqrt(p * burst / lost.size)
    after = lost[1:][lost[:-1]]
    assert abs(after.mean() - stay[0]) < Z * math.sqrt(0.25 / after.size)
    # Independent loss is the chain with bursts of one.
    entry1, stay1 = gilbert_elliott(np.array([p]), 1.0)
    np.testing.assert_allclose([entry1[0], stay1[0]], [p, p])
    assert entry[0] < p


@pytest.mark.slow
def test_a_resend_behind_a_delivered_packet_is_lost_as_the_emulators_chain_loses_it() -> None:
    # Packet by packet: the packet n + 1 places after a delivered one is lost with resend_loss(n), from g
    # (n = 0, a burst starting at it) towards the long-run rate p.
    p, burst = 0.05, 4.0
    entry, stay = gilbert_elliott(np.array([p]), burst)
    lost = _emulated_chain(p, burst, 400_000, seed=9)
    delivered = np.flatnonzero(~lost[:-60])
    for n in (0, 2, 8, 50):
        expected = float(resend_loss(Bursts(entry, stay), np.array([float(n)]))[0])
        measured = lost[delivered + 1 + n].mean()
        assert abs(measured - expected) < Z * math.sqrt(expected * burst / delivered.size)
    np.testing.assert_allclose(resend_loss(Bursts(entry, stay), np.array([0.0, 1e4])), [entry[0], p], rtol=1e-9)


@pytest.mark.slow
def test_a_packet_behind_a_lost_one_is_lost_as_the_emulators_chain_loses_it() -> None:
    # Packet by packet: the packet n + 1 places after a lost one is lost with chain_loss(n, after_loss=True),
    # from stay (n = 0) towards the long-run rate p.
    p, burst = 0.05, 4.0
    entry, stay = gilbert_elliott(np.array([p]), burst)
    lost = _emulated_chain(p, burst, 400_000, seed=15)
    behind = np.flatnonzero(lost[:-60])
    for n in (0, 1, 3, 50):
        expected = float(chain_loss(Bursts(entry, stay), np.array([float(n)]), after_loss=True)[0])
        measured = lost[behind + 1 + n].mean()
        assert abs(measured - expected) < Z * math.sqrt(expected * burst / behind.size)
    np.testing.assert_allclose(
        chain_loss(Bursts(entry, stay), np.array([0.0, 1e4]), after_loss=True), [stay[0], p], rtol=1e-9
    )


def test_a_burst_continues_with_the_stay_probability() -> None:
    n = 200_000
    bursts = Bursts(np.full(n, 0.01), np.full(n, 0.7))
    gap = next_loss(np.random.default_rng(7), np.zeros(n), bursts, np.zeros(n, dtype=np.int64), np.arange(n))
    expected = 0.7 + 0.3 * 0.01
    assert abs((gap == 1).mean() - expected) < Z * math.sqrt(expected * (1 - expected) / n)


def test_bursty_links_lose_fewer_transfers_at_the_same_rate() -> None:
    # One switch, every link p in bursts of 4: a transfer of P packets is untouched with probability
    # (1 - q)(1 - g)^(P - 1), g the path's chance that a burst starts.
    p, burst = 1e-3, 4.0
    topology = switch(4)
    router = Router(topology, np.arange(4), None, 0)
    d = phase_data(all_reduce("ring", 4), router, 2**20, np.full(topology.num_links, p), connections=False)[0]
    samples = 4000
    model = LossModel(p, fabric="tcp", tcp="rfc6298", burst=burst)
    losses = draw_losses(np.random.default_rng(8), model, d, samples)
    g = gilbert_elliott(np.array([p]), burst)[0][0]
    entry = 1 - (1 - g) ** 2
    q = 1 - (1 - p) ** 2
    expected = 1 - (1 - q) * (1 - entry) ** (175 - 1)
    transfers = d.phase.repeat * len(d.phase) * samples
    assert abs(losses.step.size / transfers - expected) < Z * math.sqrt(expected / transfers)
    independent = 1 - (1 - q) ** 175
    assert expected < independent / 2


TAU = 1e-6
RTO = RTT + 0.2  # srtt + rto_min
WINDOW = float(window_reduction_seconds(np.array([RTT]), np.array([TAU]))[0])


def _repairs(n: int, packets: int, *, q_ack: float, gap: float) -> tuple[np.ndarray, np.ndarray]:
    """One loss per transfer (q -> 0), its repair's ACK lost with ``q_ack``, the connection's next transfer ``gap``
    after this one's end, in a window of 4 packets: the packets behind a loss are SACKed before its repair leaves,
    and proportional rate reduction lets nothing out after it (``FOLLOW_MIN_WINDOW``), not the next transfer
    either."""
    transfers = LostTransfers(
        np.full(n, 1e-9),
        np.full(n, packets, dtype=np.int64),
        np.full(n, RTT),
        np.full(n, TAU),
        q_ack=np.full(n, q_ack),
        gap_s=np.full(n, gap),
        window=np.full(n, FOLLOW_MIN_WINDOW - 1.0),
    )
    return draw_repair_seconds(np.random.default_rng(3), EXACT, transfers)


def _paced_after(wait: float, segments: int, q: float = 1e-9) -> float:
    """What pacing adds to ``segments`` held behind a wait of ``wait`` (the RTT sample it gives) at loss ``q``."""
    one = np.ones(1)
    ratio = rto_pacing_ratio(q * one)
    return float(paced_seconds(RTT * one, (wait + RTT) * one, segments * one, RTO_PACED_WINDOW * one, TAU * one,
                               ratio=ratio)[0])  # fmt: skip


def test_a_repair_whose_ack_is_lost_holds_the_next_transfer_until_the_rto() -> None:
    packets, q_ack = 8, 0.3
    extra, fired = _repairs(40_000, packets, q_ack=q_ack, gap=0.0)
    # Losses with k >= 3 behind them (5 of 8 positions) are repaired on SACKs, max(tau, RTT + (4 - k) tau) past
    # the end; where the repair's ACK is lost, the RTO fires RTO after it and the next transfer waits for it, and
    # where that RTO's resend or its ACK is lost too (q_ack here), the next RTO, doubled: RTO (2^m - 1) for m.
    # The held transfer is paced behind the srtt the wait inflated (test_data_held_by_a_lost_repair_ack_is_paced_...).
    repair = np.round([max(TAU, RTT + (4 - k) * TAU) + WINDOW for k in range(3, packets)], 12)
    on_sacks = np.isin(np.round(extra, 12), repair)
    once = np.isin(np.round(extra, 12), np.round(repair + RTO + _paced_after(RTO, packets), 12))
    twice = np.isin(np.round(extra, 12), np.round(repair + 3 * RTO + _paced_after(3 * RTO, packets), 12))
    assert not fired[on_sacks].any()
    assert np.all(fired[once] == 1)
    assert np.all(fired[twice] == 2)
    # k < 3: the next transfer (gap 0) reveals the loss and its ACKs acknowledge the repair: never held
    held = fired > 0
    assert np.all(once | twice | (fired > 2) | ~held)
    mid = on_sacks | held
    assert abs(mid.mean() - 5 / 8) < Z * math.sqrt(0.25 / extra.size)
    assert abs(held.sum() / mid.sum() - q_ack) < Z * math.sqrt(q_ack * (1 - q_ack) / mid.sum())
    assert abs(np.mean(fired[held] >= 2) - q_ack) < Z * math.sqrt(q_ack * (1 - q_ack) / held.sum())


def test_the_next_transfers_gap_is_taken_off_a_lost_repair_acks_wait() -> None:
    gap = 0.05
    extra, fired = _repairs(20_000, 8, q_ack=0.3, gap=gap)
    repair = np.round([max(TAU, RTT + (4 - k) * TAU) + WINDOW for k in range(3, 8)], 12)
    held = np.isin(np.round(extra, 12), np.round(repair + RTO - gap + _paced_after(RTO, 8), 12))
    assert held.any()
    assert np.all(fired[held] == 1)


def test_a_lost_repair_ack_costs_nothing_when_nothing_follows_on_the_connection() -> None:
    # the connection's last transfer in the collective: the receiver has the data; the RTO holds nothing
    extra, fired = _repairs(20_000, 8, q_ack=0.3, gap=math.inf)
    # the repairs on SACKs, the reordering timer's and the probe's with several out (7 of 8 positions) cost
    # milliseconds; the one-packet probe of the last packet (1 of 8) is the only timer of the rto_min class
    assert extra[fired == 0].max() <= 2 * (RTT + TAU) + 2 * RTT + TIMEOUT_MIN_S + WINDOW + 1e-12
    probe = RTT + TAU + min(2 * RTT + 0.2, RTO) + WINDOW
    np.testing.assert_allclose(extra[fired == 1], probe, rtol=1e-12)
    assert abs(np.mean(fired == 1) - 1 / 8) < Z * math.sqrt(7 / 64 / extra.size)


def _unheard(
    after: int, gap: float, backed_off: int, *, n: int = 40_000, packet_s: float = 1e3, stack: TcpStack = EXACT
) -> tuple[np.ndarray, np.ndarray]:
    """What ``_lost_repair_ack`` adds to a repair delivered at 1 ms, the window 10 packets (q = 1.5e-2), its ACK
    and every later resend's ACK lost with 0.5. Packets of ``packet_s``: by default slower than any gap pacing
    sets, so that the waits show alone."""
    charged, rtos = _lost_repair_ack(
        np.random.default_rng(0),
        stack,
        packets=np.full(n, after + 1, dtype=np.int64),
        rtt=np.full(n, RTT),
        tau=np.full(n, packet_s),
        cost=np.full(n, 1e-3),
        repaired=np.ones(n, dtype=np.bool_),
        backed_off=np.full(n, backed_off, dtype=np.int64),
        q=np.full(n, 1.5e-2),
        q_ack=np.full(n, 0.5),
        rto=np.full(n, RTO),
        gap=np.full(n, gap),
    )
    return charged - 1e-3, rtos


def test_lost_resend_acks_back_off_the_rto_while_the_next_transfer_waits() -> None:
    # 6 packets behind the loss, all sent; the next transfer follows at once and waits for every RTO; the first
    # RTO's resend is silent (lost, or its ACK) with 1 - (1 - q)(1 - q_ack), and each silent one doubles the next
    wait, rtos = _unheard(after=6, gap=0.0, backed_off=0)
    # each wait twice the last, up to TCP_RTO_MAX (120 s)
    waits = np.cumsum([0.0] + [min(RTO * 2.0**j, 120.0) for j in range(int(rtos.max()))])
    np.testing.assert_allclose(wait, waits[rtos], rtol=1e-12, atol=1e-15)
    silent = 1 - (1 - 1.5e-2) * 0.5
    assert abs(np.mean(rtos == 0) - 0.5) < Z * math.sqrt(0.25 / rtos.size)
    held = rtos > 0
    assert abs(np.mean(rtos[held] >= 2) - silent) < Z * math.sqrt(silent * (1 - silent) / held.sum())


def test_an_inflated_srtt_paces_what_follows_by_its_closed_form() -> None:
    # tau below every gap: sum over M segments of (srtt_j - RTT)/(1.2 w), the excess shrinking by 7/8 per ACK
    rtt, sample, window = 50e-6, 0.206, 2.0
    excess = (1 - 0.125) * rtt + 0.125 * sample - rtt
    for segments in (1, 10, 45):
        paced = paced_seconds(np.array([rtt]), np.array([sample]), np.array([float(segments)]), np.array([window]),
                              np.zeros(1))  # fmt: skip
        closed = 8 * excess * (1 - 0.875**segments) / (1.2 * window)
        np.testing.assert_allclose(paced, closed, rtol=1e-12)
    # the emulated clusters' trace (every link 1e-2, quickack 1): srtt 26 ms after an RTO of 206 ms, cwnd 2, the
    # next segments 10.9, 9.4, 8.3, ... ms apart (srtt/2.4 each), 44 of them 92 ms after the RTO's ACK
    paced = paced_seconds(np.array([rtt]), np.array([sample]), np.array([44.0]), np.array([window]), np.full(1, 1.2e-4))
    assert 0.080 < float(paced[0]) + 44 * 1.2e-4 < 0.095
    # the sample of a path's own round trip paces nothing beyond the path's rate
    assert not paced_seconds(
        np.array([rtt]), np.array([rtt]), np.array([44.0]), np.array([window]), np.full(1, 1.2e-4)
    ).any()


def test_data_held_by_a_lost_repair_ack_is_paced_behind_the_wait_it_measured() -> None:
    # the next transfer (7 packets, as long as this one) follows at once: where one RTO is heard, it follows its
    # wait, paced behind an RTT sample of the whole wait (RTO + RTT) at the window after the RTO, 2 segments
    # (tcp_enter_loss sets 1, the resend's ACK adds the one segment it delivers, and one segment in flight grows it
    # no further), at 200%: 2 < ssthresh/2, the recovery's floor(0.7 * 2W/1.7) = 8 (W = 10)
    wait, rtos = _unheard(after=6, gap=0.0, backed_off=0, packet_s=1.2e-4)
    one = np.ones(1)
    paced = float(paced_seconds(RTT * one, (RTO + RTT) * one, 7.0 * one, 2.0 * one, 1.2e-4 * one, ratio=2.0)[0])
    # twice what CUBIC's average window after the cut, max(0.7 W, 2) = 7 at 120%, would pace
    cubic = float(paced_seconds(RTT * one, (RTO + RTT) * one, 7.0 * one, 7.0 * one, 1.2e-4 * one)[0])
    assert paced > 2 * cubic > 0.01
    np.testing.assert_allclose(wait[rtos == 1], RTO + paced, rtol=1e-12)


def test_after_an_rto_the_paced_window_of_two_leaves_at_the_slow_start_ratio_while_under_half_ssthresh() -> None:
    assert RTO_PACED_WINDOW == 2.0
    # tcp_update_pacing_rate: 200% while cwnd < ssthresh/2 (integers), else 120%; ssthresh = max(floor(0.7 c), 2)
    # of the window c = 2W/1.7 at the loss, W = sqrt(1.5/q)
    for q in (1e-9, 1e-3, 1e-2, 2e-2, 4e-2, 0.2):
        at_loss = 2 * math.sqrt(1.5 / q) / 1.7
        ssthresh = max(math.floor(0.7 * at_loss), 2)
        expected = PACING_SS_RATIO if ssthresh // 2 > 2 else PACING_CA_RATIO
        assert float(rto_pacing_ratio(np.array([q]))[0]) == expected
    # the emulated clusters' paths at every link 1e-2 (2-4%): 200% on two lossy links, 120% on four
    assert rto_pacing_ratio(np.array([2e-2, 4e-2])).tolist() == [2.0, 1.2]
    # no loss on the flow's own data (its ACKs lost): the window before was unlimited
    assert float(rto_pacing_ratio(np.zeros(1))[0]) == PACING_SS_RATIO


def test_an_unpaced_stack_sends_what_an_inflated_srtt_would_have_paced_at_once() -> None:
    # a CUBIC socket that is not SK_PACING_NEEDED, behind a qdisc other than fq: the same stall and RTO, no pacing
    unpaced = replace(EXACT, paced=False)
    n, window, segments = 100, 6.0, 30.0
    paced = StallPacing(np.full((n, 1), segments), np.full(n, window), np.zeros(n))
    extra, _ = draw_ack_stall_seconds(
        np.random.default_rng(0), unpaced, stalls=np.ones(n, dtype=np.int64), rtt_s=np.full(n, RTT), q=np.zeros(n),
        q_ack=np.zeros(n), paced=paced,
    )  # fmt: skip
    np.testing.assert_allclose(extra, RTT + 2 * RTT + TIMEOUT_MIN_S + DELACK_MIN_S, rtol=1e-12)
    wait, rtos = _unheard(after=6, gap=0.0, backed_off=0, packet_s=1.2e-4, stack=unpaced)
    np.testing.assert_allclose(wait[rtos == 1], RTO, rtol=1e-12)
    assert TCP_STACKS["linux-paced"].paced
    assert not TCP_STACKS["linux"].paced
    assert "unpaced" in TCP_STACKS["linux"].settings()


def test_a_lost_repair_ack_after_backed_off_rtos_waits_for_the_next_doubled_rto() -> None:
    # the repair was resent by two RTOs already: the next waits 4 RTO
    wait, rtos = _unheard(after=6, gap=0.0, backed_off=2)
    np.testing.assert_allclose(wait[rtos == 1], 4 * RTO, rtol=1e-12)


def test_a_lost_repair_ack_within_the_last_window_holds_only_the_next_transfer() -> None:
    # 6 packets behind the loss, all sent: only the next transfer, 50 ms after this one's end, waits
    wait, rtos = _unheard(after=6, gap=0.05, backed_off=0)
    np.testing.assert_allclose(wait[rtos == 1], RTO - 0.05, rtol=1e-12)
    np.testing.assert_allclose(wait[rtos == 2], 3 * RTO - 0.05, rtol=1e-12)
    # a second later: only the chains of RTOs that outlast it (0.2 + 0.4 + 0.8 s) hold it, by what is left
    wait, rtos = _unheard(after=6, gap=1.0, backed_off=0)
    waits = np.cumsum([0.0] + [min(RTO * 2.0**j, 120.0) for j in range(int(rtos.max()))])
    held = rtos > 0
    assert rtos[held].min() >= 3
    np.testing.assert_allclose(wait[held], waits[rtos[held]] - 1.0, rtol=1e-9)
    assert not wait[~held].any()


def test_a_tail_the_next_transfer_reveals_is_acknowledged_by_it() -> None:
    # k = 0 revealed by the next transfer's SACKs: its data follows the repair and acknowledges it
    gap = 1e-3
    extra, fired = _repairs(20_000, 1, q_ack=0.5, gap=gap)
    assert not fired.any()
    np.testing.assert_allclose(extra, gap + 1.5 * RTT + 4 * TAU + WINDOW, rtol=1e-12)
