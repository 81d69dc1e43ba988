"""What reveals a lost packet before the probe does: the next message on the same connection (the agreement's
frames, the collective's data), the data a receiver sends back (its ACKs ride on it), and what a burst held by a
silent link does to the resends; each against its closed form."""

from __future__ import annotations

import math

import numpy as np
import pytest

from allreduce.schedules import all_reduce
from allreduce.sim import LossModel
from allreduce.sim._bursts import Bursts
from allreduce.sim._phases import (
    _ack_stalls,
    _agreement_steps,
    _frames_crossing,
    _held_final_acks,
    agreement_delays,
    phase_data,
)
from allreduce.sim._routing import Router
from allreduce.sim._tcp import (
    DELACK_MIN_S,
    TIMEOUT_MIN_S,
    LostTransfers,
    TcpStack,
    _held_resends,
    _one_loss,
    draw_held_ack_seconds,
    draw_repair_seconds,
)
from allreduce.sim._tcp_window import (
    window_reduction_seconds,
)
from allreduce.topology import FloatArray, IntArray, switch

Z = 4.0
RTT = 20e-6
TAU = 1e-6
# The linux preset's logic with exact timers (and its delayed ACK), so every cost is a closed form.
EXACT = TcpStack("exact", rto_min_s=0.2, hz=0.0, rack_tlp=True, delayed_ack_s=DELACK_MIN_S)


def _into_gpu0(p: float) -> tuple[Router, FloatArray]:
    """Four ranks on one switch, packets lost only on the way into gpu0 (rank 0's receiving link)."""
    topology = switch(4)
    link = np.zeros(topology.num_links)
    link[[i for i in range(topology.num_links) if topology.link_name(i) == "switch0->gpu0"]] = p
    return Router(topology, np.arange(4), None, 0), link


def test_a_lost_barrier_frame_is_revealed_by_the_agreement_frame_after_it() -> None:
    # Barrier then agreement: rank 0 receives a lone frame from rank 1 in each. The barrier's is followed on
    # its connection by the agreement's (the sender does not wait for rank 0): a few steps, never the probe.
    router, link = _into_gpu0(0.05)
    samples = 20_000
    barrier = LossModel(fabric="tcp", tcp="linux", barrier=True)
    delay, _, lost, _ = agreement_delays(np.random.default_rng(3), router, samples, barrier, link)
    # Only the agreement's lone frame pays the probe; the other five packets rank 0 receives (the barrier's three,
    # the agreement's two-frame step) wait for the RTO only if their resend is lost too.
    p = 0.05
    expected = 1 - (1 - p) * (1 - p * p) ** 5
    probed = (delay[0] >= 0.204).mean()
    assert abs(probed - expected) < Z * math.sqrt(expected * (1 - expected) / samples)
    assert lost.sum() > 0


def test_a_ring_waits_for_the_probe_where_halving_doublings_data_reveals_the_frame() -> None:
    # Rank 0's agreement frames come from rank 1 (1 -> 0) and rank 2 (2 -> 0). Halving-doubling sends data on
    # both connections (2 -> 0 first, 1 -> 0 second): the data reveals a lost frame. A ring (r -> r + 1) sends
    # on neither, so the lone frame from rank 1 waits for the probe.
    router, link = _into_gpu0(0.05)
    model = LossModel(fabric="tcp", tcp="linux")
    samples = 20_000

    def probed(algorithm: str) -> float:
        data = phase_data(all_reduce(algorithm, 4), router, 2**20, link, connections=True)
        delay, *_ = agreement_delays(np.random.default_rng(4), router, samples, model, link, data=data)
        return float((delay[0] >= 0.204).mean())

    # The RTO is paid otherwise only where a resend is lost too (p^2 per packet; three packets).
    p = 0.05
    ring = 1 - (1 - p) * (1 - p * p) ** 2
    assert abs(probed("ring") - ring) < Z * math.sqrt(ring * (1 - ring) / samples)
    halving_doubling = 1 - (1 - p * p) ** 3
    assert abs(probed("halving_doubling") - halving_doubling) < Z * math.sqrt(halving_doubling / samples)


def test_a_pairwise_exchange_never_stalls_on_a_lost_ack() -> None:
    # Every halving-doubling step is an exchange: the receiver's own data carries its cumulative ACK.
    router, _ = _into_gpu0(0.0)
    link = np.full(router.topology.num_links, 0.02)
    model = LossModel(fabric="tcp", tcp="linux")
    for d in phase_data(all_reduce("halving_doubling", 4), router, 2**20, link, connections=True):
        assert d.two_way is not None
        assert d.two_way.all()
        packets = np.ceil(d.nbytes / model.mtu).astype(np.int64)
        assert _ack_stalls(np.random.default_rng(5), model, d, packets, 2000).step.size == 0


def test_a_ring_receiver_sends_nothing_back_so_its_lost_acks_stall() -> None:
    router, _ = _into_gpu0(0.0)
    link = np.full(router.topology.num_links, 0.02)
    model = LossModel(fabric="tcp", tcp="linux")
    ring = phase_data(all_reduce("ring", 4), router, 2**20, link, connections=True)[0]
    assert ring.two_way is not None
    assert not ring.two_way.any()
    packets = np.ceil(ring.nbytes / model.mtu).astype(np.int64)
    assert _ack_stalls(np.random.default_rng(5), model, ring, packets, 2000).step.size > 0


def test_a_burst_held_by_a_silent_link_takes_the_resends_until_it_expires() -> None:
    # Resends at 0.205 s, then each backed-off RTO (0.2 s, 0.4 s): 0.205 and 0.405 are within a 0.5 s hold and
    # lost with `stay`; 0.805 meets the good state (no new burst: entry 0). So P(again = m) = s^m (1 - s), m < 2,
    # and s^2 for m = 2.
    n, s = 200_000, 0.75
    again = _held_resends(
        np.random.default_rng(6), (np.full(n, s), np.zeros(n), 0.5), np.full(n, 0.205), np.full(n, 0.2)
    )
    expected = [1 - s, s * (1 - s), s * s]
    for m, share in enumerate(expected):
        assert abs((again == m).mean() - share) < Z * math.sqrt(share * (1 - share) / n)
    assert again.max() == 2


def _last_two(n: int, *, q: float, seed: int) -> tuple[FloatArray, IntArray]:
    """Transfers of two packets: one lost uniformly at random (bursts start rarely), and a burst that starts at
    the first always takes the second too; each resend lost with ``q``."""
    transfers = LostTransfers(
        np.full(n, q),
        np.full(n, 2, dtype=np.int64),
        np.full(n, RTT),
        np.full(n, TAU),
        bursts=Bursts(np.full(n, 1e-9), np.full(n, 1 - 1e-12)),
    )
    return draw_repair_seconds(np.random.default_rng(seed), EXACT, transfers)


WINDOW = float(window_reduction_seconds(np.array([RTT]), np.array([TAU]))[0])


def test_a_lost_tail_of_two_packets_is_probed_without_rto_min() -> None:
    # Both lost: two packets out, so the probe is armed at 2*srtt + 2 ms (tcp_schedule_loss_probe adds rto_min
    # only with one out), resends the last, and its SACK marks the first, one round trip later. The second alone:
    # one packet out, the probe at 2*srtt + rto_min capped by the RTO.
    n = 20_000
    extra, fired = _last_two(n, q=1e-12, seed=8)
    both = fired == 0
    np.testing.assert_allclose(extra[both], 2 * (RTT + TAU) + 2 * RTT + TIMEOUT_MIN_S + WINDOW, rtol=1e-12)
    np.testing.assert_allclose(extra[~both], RTT + TAU + RTT + 0.2 + WINDOW, rtol=1e-12)
    assert abs(both.mean() - 0.5) < Z * math.sqrt(0.25 / n)


def test_a_lost_probe_with_several_out_waits_for_the_rto_from_the_first_sending() -> None:
    # The last packet lost with the one before it, and its probe too (q each resend): tcp_rearm_rto times the RTO
    # from the head's first sending, so it fires RTO after the loss, not after the probe, and the backed-off
    # ones follow: RTT + tau + RTO (2^m - 1) for m resends lost, every one an RTO.
    n, q = 200_000, 0.3
    extra, again = _one_loss(
        np.random.default_rng(9),
        EXACT,
        np.zeros(n, dtype=np.int64),
        q=np.full(n, q),
        q_ack=np.zeros(n),
        rtt=np.full(n, RTT),
        tau=np.full(n, TAU),
        gap=np.full(n, math.inf),
        lost_before=np.ones(n, dtype=np.bool_),
    )
    rto = RTT + 0.2
    assert again.max() >= 3
    lost = again > 0
    np.testing.assert_allclose(extra[lost], RTT + TAU + rto * (2.0 ** again[lost] - 1), rtol=1e-9)
    np.testing.assert_allclose(extra[~lost], 2 * (RTT + TAU) + 2 * RTT + TIMEOUT_MIN_S, rtol=1e-12)
    assert abs(lost.mean() - q) < Z * math.sqrt(q * (1 - q) / n)


def test_a_held_burst_with_several_out_takes_the_probe_and_the_rtos_from_the_loss() -> None:
    # Several out: the probe a few ms after the loss, then RTOs at 0.2, 0.6, 1.4 s from it; with a 0.7 s hold
    # three resends meet the bad state. One out: 0.205, 0.405 and 0.805 s, two within it.
    n, s = 200_000, 0.75
    held = (np.full(n, s), np.zeros(n), 0.7)
    several = _held_resends(
        np.random.default_rng(10), held, np.full(n, 0.006), np.full(n, 0.2), several=np.ones(n, dtype=np.bool_)
    )
    one = _held_resends(np.random.default_rng(10), held, np.full(n, 0.205), np.full(n, 0.2))
    assert several.max() == 3
    assert one.max() == 2
    for m, share in enumerate([1 - s, s * (1 - s), s * s * (1 - s), s**3]):
        assert abs((several == m).mean() - share) < Z * math.sqrt(share * (1 - share) / n)


def test_a_held_burst_takes_a_data_tails_resends_but_not_a_control_frames() -> None:
    # One-packet transfers, each lost by a burst (stay 0.75) on a chain held for 1 s. Data: the probe's resend at
    # ~0.2 s meets the bad state, so the RTO fires after it three times in four. A control frame: the collective's
    # other packets have moved the chain on, so the resend is lost only at the long-run rate (here 1e-9).
    n, s = 20_000, 0.75

    def fired(*, small: bool) -> IntArray:
        transfers = LostTransfers(
            np.full(n, 1e-9),
            np.ones(n, dtype=np.int64),
            np.full(n, RTT),
            np.full(n, TAU),
            bursts=Bursts(np.full(n, 1e-12), np.full(n, s), 1.0),
            small=small,
        )
        return draw_repair_seconds(np.random.default_rng(12), EXACT, transfers)[1]

    data = fired(small=False)
    assert abs((data >= 2).mean() - s) < Z * math.sqrt(s * (1 - s) / n)
    assert (fired(small=True) == 1).all()  # the one-packet probe, and no RTO


def test_a_resend_on_a_sack_is_lost_by_a_new_burst_not_at_the_long_run_rate() -> None:
    # A long-run rate of 0.3 in bursts that almost never start (g = 1e-9), one loss uniform in a transfer of 50:
    # repaired on the SACKs of the packets behind it, its resend, right behind a delivered packet, is lost only
    # if a burst starts at it, so no timer fires but for the last packet's (1 in 50: the probe, 200 ms on, and
    # its resend lost at the long-run rate); independent loss at 0.3 loses every resend three times in ten.
    n = 20_000

    def fired(bursts: Bursts | None) -> IntArray:
        transfers = LostTransfers(
            np.full(n, 0.3), np.full(n, 50, dtype=np.int64), np.full(n, RTT), np.full(n, TAU), bursts=bursts
        )
        return draw_repair_seconds(np.random.default_rng(13), EXACT, transfers)[1]

    bursty = fired(Bursts(np.full(n, 1e-9), np.full(n, 1e-9)))
    assert abs((bursty > 0).mean() - 1 / 50) < Z * math.sqrt(0.02 * 0.98 / n)
    independent = fired(None)
    assert (independent > 0).mean() > 0.25


def test_the_last_of_two_small_frames_is_probed_before_the_first_is_acknowledged() -> None:
    # Two sub-MSS frames, one lost. The first: the second's SACK arms the reordering timer (min_rtt/4 + 2 ms).
    # The second: the interactive receiver holds the first's ACK for 40 ms, so the probe armed with two out
    # (2*srtt + 2 ms) resends it. Neither pays the one-packet probe's rto_min, as full segments would.
    n = 4000

    def extra(*, small: bool) -> tuple[FloatArray, IntArray]:
        transfers = LostTransfers(
            np.full(n, 1e-9), np.full(n, 2, dtype=np.int64), np.full(n, RTT), np.full(n, TAU), small=small
        )
        return draw_repair_seconds(np.random.default_rng(7), EXACT, transfers)

    small, timers = extra(small=True)
    assert small.max() < RTT + TAU + 2 * RTT + 2e-3 + 2 * RTT + 1e-4
    assert not timers.any()  # no timer of the rto_min class fired
    full, timers = extra(small=False)
    share = float((full >= 0.2).mean())
    assert abs(share - 0.5) < Z * math.sqrt(0.25 / n)
    assert timers.sum() == (full >= 0.2).sum()


@pytest.mark.parametrize("hold", [-1.0, math.inf, math.nan])
def test_a_bursts_hold_is_a_finite_time(hold: float) -> None:
    with pytest.raises(ValueError, match="a burst's hold must be a finite time >= 0"):
        LossModel(0.01, fabric="tcp", burst=4.0, burst_hold_s=hold)


def test_a_control_frame_on_a_bursty_link_is_lost_only_by_a_burst_starting_at_it() -> None:
    # Four ranks on one switch, every link p in bursts of 4, one agreement (no barrier): per rank one frame to
    # r - 1, then two to r - 2 (two segments: the second leaves while the first is out), each packet behind a
    # delivered one on its link, so lost only when a burst starts on either of its two links, g_path = 1 - (1 -
    # g)^2 per packet, not the long-run 1 - (1 - p)^2.
    p, burst = 0.02, 4.0
    topology = switch(4)
    router = Router(topology, np.arange(4), None, 0)
    link = np.full(topology.num_links, p)
    samples = 20_000
    model = LossModel(fabric="tcp", tcp="linux", burst=burst, burst_hold_s=1.0)
    lost = agreement_delays(np.random.default_rng(14), router, samples, model, link)[2]
    g = p / (burst * (1 - p) + p)
    keep = (1 - g) ** 2
    expected = 4 * (1 - keep) + 4 * (1 - keep**2)
    assert abs(lost.mean() - expected) < Z * math.sqrt(expected / samples)
    long_run = 1 - (1 - p) ** 2
    assert expected < (4 * long_run + 4 * (1 - (1 - long_run) ** 2)) / 3


def test_packets_crossing_a_held_link_end_the_burst_before_the_probes_resend() -> None:
    # One-packet data tails, each lost by a burst (stay 0.75, g ~ 0) on a chain held for 1 s, with two packets
    # of other connections across the link after it: each meets the bad state and ends it with 1/4, so the
    # probe's resend is lost with 0.75^3, not 0.75; after a lost resend nothing precedes the RTO's (0.75 again).
    n, a = 20_000, 0.75
    transfers = LostTransfers(
        np.full(n, 1e-9),
        np.ones(n, dtype=np.int64),
        np.full(n, RTT),
        np.full(n, TAU),
        bursts=Bursts(np.full(n, 1e-12), np.full(n, a), 1.0, cleared=np.full(n, 2.0)),
    )
    fired = draw_repair_seconds(np.random.default_rng(16), EXACT, transfers)[1]
    for share, m in ((a**3, 2), (a**3 * a, 3)):
        assert abs((fired >= m).mean() - share) < Z * math.sqrt(share * (1 - share) / n)


def test_the_next_barriers_first_frames_cross_a_held_link_but_the_waiting_ranks() -> None:
    # Four ranks on one switch; rank s sends its first barrier frame to s - 1. Rank 2 waits for a lost tail:
    # into gpu2 only rank 3's frame crosses; out of gpu2 its own would, but it waits; out of gpu3, rank 3's.
    topology = switch(4)
    router = Router(topology, np.arange(4), None, 0)
    last = phase_data(
        all_reduce("ring", 4), router, 2**18, np.zeros(topology.num_links), connections=True, next_barrier=True
    )[-1]
    assert last.next_frames is not None
    names = {topology.link_name(i): i for i in range(topology.num_links)}
    links = np.array([names["switch0->gpu2"], names["gpu2->switch0"], names["gpu3->switch0"]], dtype=np.int64)
    crossing = _frames_crossing(last.next_frames, np.full(3, 2, dtype=np.int64), links)
    assert crossing.tolist() == [1.0, 0.0, 1.0]


def _held_ack(n: int, *, stay: float, hold: float, crossing: float, seed: int) -> tuple[FloatArray, IntArray]:
    """The receiver's next frame back behind a final ACK a burst took (bursts that almost never start anew)."""
    bursts = Bursts(np.full(n, 1e-12), np.full(n, stay), hold)
    return draw_held_ack_seconds(
        np.random.default_rng(seed), EXACT, rtt=np.full(n, RTT), tau=np.full(n, TAU), bursts=bursts,
        crossing=np.full(n, crossing),
    )  # fmt: skip


def test_a_frame_behind_a_held_final_ack_is_lost_with_stay_and_else_costs_nothing() -> None:
    n, s = 200_000, 0.75
    extra, _ = _held_ack(n, stay=s, hold=1.0, crossing=0.0, seed=17)
    share = 1 - s
    assert abs((extra == 0).mean() - share) < Z * math.sqrt(share * (1 - share) / n)


def test_a_held_final_ack_frame_is_repaired_in_the_probes_round_unless_its_three_packets_are_lost() -> None:
    # Behind the lost frame: the agreement's frame, the sender's probe's ACK and the receiver's probe, each lost
    # with `stay` while the chain holds; one through, and the probe's round repairs the frame: 2(RTT + tau) +
    # 2 srtt + 2 ms with exact timers.
    n, s = 200_000, 0.75
    extra, fired = _held_ack(n, stay=s, hold=1.0, crossing=0.0, seed=18)
    probed = (extra > 0) & (fired == 0)
    np.testing.assert_allclose(extra[probed], 2 * (RTT + TAU) + 2 * RTT + TIMEOUT_MIN_S, rtol=1e-12)
    share = s * (1 - s**3)
    assert abs(probed.mean() - share) < Z * math.sqrt(share * (1 - share) / n)


def test_other_packets_crossing_a_held_final_ack_link_make_the_rto_rarer() -> None:
    # Two more frames across the link before the first RTO: the chain reaches it with stay^5, not stay^3.
    n, s = 200_000, 0.75
    for crossing, power in ((0.0, 3), (2.0, 5)):
        _, fired = _held_ack(n, stay=s, hold=1.0, crossing=crossing, seed=19)
        share = s * s**power
        assert abs((fired > 0).mean() - share) < Z * math.sqrt(share * (1 - share) / n)


def test_a_held_final_ack_frame_waits_for_the_rtos_timed_from_its_first_sending() -> None:
    # m RTOs: RTT + tau + RTO (2^m - 1), RTO = srtt + rto_min, as a held data tail with several packets out.
    n = 200_000
    extra, fired = _held_ack(n, stay=0.9, hold=1.0, crossing=0.0, seed=20)
    timed = fired > 0
    assert fired.max() >= 3
    np.testing.assert_allclose(extra[timed], RTT + TAU + (RTT + 0.2) * (2.0 ** fired[timed] - 1), rtol=1e-9)


def test_each_rto_round_of_a_held_final_ack_is_lost_with_stay_squared_until_the_hold_ends() -> None:
    # Each round the sender's RTO resend draws an ACK across the link, then the receiver's resend of the frame
    # crosses it: both lost with stay^2 while within the hold. RTOs at 0.2, 0.6, 1.4 s: with a 0.7 s hold the
    # third meets the good state (no new bursts), so at most three fire.
    n, s = 400_000, 0.8
    _, fired = _held_ack(n, stay=s, hold=0.7, crossing=0.0, seed=21)
    reach = s * s**3  # the frame and the probe's round lost
    shares = [reach * (1 - s**2), reach * s**2 * (1 - s**2), reach * s**4]
    for m, share in enumerate(shares, start=1):
        assert abs((fired == m).mean() - share) < Z * math.sqrt(share * (1 - share) / n)
    assert fired.max() == 3


def _barrier_frames_behind(algorithm: str, p: float, samples: int) -> tuple[FloatArray, float]:
    """Four ranks on one switch, bursts (of 4, held 1 s) only on the way into gpu0; the barrier's first frames
    (rank s to s - 1) after a collective of ``algorithm``: the receivers' delays from held final ACKs, and the
    burst's entry on that link."""
    router, link = _into_gpu0(p)
    model = LossModel(fabric="tcp", tcp="linux", barrier=True, burst=4.0, burst_hold_s=1.0)
    data = phase_data(all_reduce(algorithm, 4), router, 2**18, link, connections=True, next_barrier=True)
    first = _agreement_steps(router, model, link)[0]
    delay = np.zeros((4, samples))
    code = np.full((4, samples), -1, dtype=np.int64)
    counts = np.zeros(samples, dtype=np.int64), np.zeros(samples, dtype=np.int64)
    _held_final_acks(np.random.default_rng(22), first, data[-1], model=model, delay=delay, code=code,
                     lost=counts[0], timeouts=counts[1])  # fmt: skip
    g = p / (4 * (1 - p) + p)
    return delay, g


def test_a_rings_next_barrier_frame_rides_the_held_path_of_its_final_acks() -> None:
    # The ring's last step sends 0 -> 1 and rank 1 sends nothing back; its final ACKs and then rank 1's first
    # barrier frame to rank 0 take the way into gpu0. A burst starting at the ACK (g) takes the frame with stay.
    p, samples = 0.05, 200_000
    delay, g = _barrier_frames_behind("ring", p, samples)
    share = g * (0.75 + g / 4)
    assert abs((delay[0] > 0).mean() - share) < Z * math.sqrt(share * (1 - share) / samples)
    assert not delay[1:].any()  # no other frame crosses a lossy link


def test_an_exchange_sends_its_data_back_so_no_final_ack_is_held() -> None:
    # Halving-doubling's last step is an exchange: the receiver's data carries its ACKs, and a burst that takes
    # them takes data the collective waits for (a held data tail, charged there).
    delay, _ = _barrier_frames_behind("halving_doubling", 0.05, 20_000)
    assert not delay.any()
