"""What follows a repair decides how a lost retransmission or a lost repair ACK is found (RACK a round trip on, or
the RTO), and a receiver without GRO acknowledges every second segment, so a lost ACK stalls no flight."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from allreduce.schedules import all_reduce
from allreduce.sim import LossModel
from allreduce.sim._phases import draw_losses, phase_data
from allreduce.sim._routing import Router
from allreduce.sim._tcp import DELACK_MIN_S, TCP_STACKS, TcpStack, _one_loss
from allreduce.sim._tcp_cwnd import FOLLOW_MIN_WINDOW
from allreduce.topology import switch

Z = 4.0
RTT = 20e-6
TAU = 1e-6
EXACT = TcpStack("exact", rto_min_s=0.2, hz=0.0, rack_tlp=True, delayed_ack_s=DELACK_MIN_S)


def _losses(
    after: int,
    *,
    q: float,
    q_ack: float = 0.0,
    window: float = 10.0,
    gap: float = 0.0,
    resend_q: float | None = None,
    n: int = 40_000,
) -> tuple[np.ndarray, np.ndarray]:
    """One loss with ``after`` packets of its transfer behind it, at loss ``q``, found by a window of ``window``
    packets, the connection's next transfer following ``gap`` after this one (inf: none does); ``resend_q``: a
    bursty link's, on which a resend on SACKs is lost (None: independent loss)."""
    return _one_loss(
        np.random.default_rng(11),
        EXACT,
        np.full(n, after, dtype=np.int64),
        q=np.full(n, q),
        q_ack=np.full(n, q_ack),
        rtt=np.full(n, RTT),
        tau=np.full(n, TAU),
        gap=np.full(n, gap),
        packets=np.full(n, after + 1, dtype=np.int64),
        window=np.full(n, window),
        resend_q=None if resend_q is None else np.full(n, resend_q),
    )


def test_a_lost_repair_with_unsent_data_behind_it_is_resent_a_round_trip_on_without_a_timer() -> None:
    # a window of 10 packets, 20 behind the loss: the rest was unsent when the loss was found, so data follows the
    # repair and RACK marks a lost repair once that data is SACKed: RTT + 2 tau per loss of the repair (q = 0.3)
    q = 0.3
    cost, fired = _losses(20, q=q)
    assert not fired.any()
    repair = max(TAU, RTT + (4 - 20) * TAU)  # the repair on SACKs, past the transfer's end
    again = np.round((cost - repair) / (RTT + 2 * TAU), 6)
    np.testing.assert_allclose(again, np.round(again), atol=1e-6)
    # lost again m times with q^m (1 - q)
    assert abs(np.mean(again >= 1) - q) < Z * math.sqrt(q * (1 - q) / cost.size)
    assert abs(np.mean(again >= 2) - q * q) < Z * math.sqrt(q * q / cost.size)


def test_a_lost_repair_in_a_connections_last_window_waits_for_the_rto() -> None:
    # 4 packets behind the loss, a window of 10: all of them were sent when the SACKs of three marked the loss, and
    # no transfer follows on the connection, so nothing follows the repair: a lost repair waits for the RTO
    q = 0.015
    cost, fired = _losses(4, q=q, gap=math.inf)
    assert abs(np.mean(fired >= 1) - q) < Z * math.sqrt(q / cost.size)
    assert cost[fired >= 1].min() >= 0.2


def test_a_lost_repair_in_a_transfers_last_window_is_found_by_the_next_transfers_sacks() -> None:
    # the same loss with the connection's next transfer 3 ms after this one: the fourth SACK lets its data out after
    # the repair (PRR), and RACK marks a lost repair once that data is SACKed: gap + RTT + 2 tau per loss, no timer
    q, gap = 0.3, 3e-3
    cost, fired = _losses(4, q=q, gap=gap)
    assert not fired.any()
    again = cost > 2 * RTT + 4 * TAU
    assert abs(again.mean() - q) < Z * math.sqrt(q * (1 - q) / cost.size)
    assert cost[again].min() == pytest.approx(max(TAU, RTT) + gap + RTT + 2 * TAU)
    # three behind it: the third SACK sends the repair, and no fourth lets anything out after it
    assert abs(np.mean(_losses(3, q=q, gap=gap)[1] >= 1) - q) < Z * math.sqrt(q * (1 - q) / cost.size)


def test_on_a_bursty_link_the_next_transfer_does_not_find_a_lost_repair() -> None:
    # the burst that took the repair takes the packets right behind it (captured, bursts of 4: 7 of 11 lost repairs
    # with one or two segments after them ended in RTOs), so the next transfer is not counted on: the RTO
    q, gap = 0.3, 3e-3
    cost, fired = _losses(4, q=q, gap=gap, resend_q=q)
    assert abs(np.mean(fired >= 1) - q) < Z * math.sqrt(q * (1 - q) / cost.size)
    assert cost[fired >= 1].min() >= 0.2


def test_a_lost_repair_with_data_behind_it_waits_for_the_rto_where_the_window_is_small() -> None:
    # a window of 4: the three packets behind the loss are SACKed before the repair leaves and proportional rate
    # reduction lets no new data out after it (a fourth SACK would), so nothing follows a lost repair but the RTO
    q = 0.3
    cost, fired = _losses(20, q=q, window=FOLLOW_MIN_WINDOW - 1)
    assert abs(np.mean(fired >= 1) - q) < Z * math.sqrt(q * (1 - q) / cost.size)
    assert cost[fired >= 1].min() >= 0.2
    assert not _losses(20, q=q, window=FOLLOW_MIN_WINDOW)[1].any()


def test_a_lost_repair_ack_is_covered_by_the_next_ack_where_data_follows() -> None:
    # the repair's ACK lost with 0.5: with unsent data behind (20 packets, window 10) the next ACK covers it
    cost, fired = _losses(20, q=0.3, q_ack=0.5)
    assert not fired.any()
    assert cost.max() < 0.01
    # within the last window, the next transfer's data behind it: its ACKs cover the lost one
    assert not _losses(4, q=0.015, q_ack=0.5)[1].any()
    # a window of 4: nothing is let out after the repair, and its lost ACK holds the next transfer until the RTO
    cost, fired = _losses(4, q=0.015, q_ack=0.5, window=FOLLOW_MIN_WINDOW - 1)
    assert abs(np.mean(fired >= 1) - 0.5) < Z * math.sqrt(0.25 / cost.size) + 0.015


def test_without_gro_a_lost_ack_stalls_no_flight() -> None:
    # loss on every link of a switch: with GRO each flight's last ACK lost stalls its flow (probe + delayed ACK,
    # >= 42 ms); without GRO (one ACK per two segments, the emulated hosts' veths) the next ACK covers a lost one,
    # so only the transfers that lose data are delayed
    p = 2e-3
    topology = switch(4)
    router = Router(topology, np.arange(4), None, 0)
    d = phase_data(all_reduce("ring", 4), router, 2**20, np.full(topology.num_links, p), connections=True)[0]
    gro = draw_losses(np.random.default_rng(4), LossModel(p, fabric="tcp", tcp="linux-gro"), d, 2000)
    plain = draw_losses(np.random.default_rng(4), LossModel(p, fabric="tcp", tcp="linux"), d, 2000)
    assert gro.step.size > plain.step.size


def test_the_linux_preset_has_no_gro_and_says_so() -> None:
    # the emulated clusters' hosts: veths merge nothing, so the receiver acknowledges every second segment
    assert not TCP_STACKS["linux"].gro
    assert TCP_STACKS["linux-gro"].gro
    assert "no GRO" in TCP_STACKS["linux"].settings()
    assert replace(TCP_STACKS["linux"], gro=True).settings() == TCP_STACKS["linux-gro"].settings().replace(
        "linux-gro", "linux"
    )
