"""What a TCP stack's loss recovery adds to a collective's transfer: Linux's RACK-TLP on jiffy timers, or RFC 6298.

A :class:`TcpStack` is a preset of kernel settings (:data:`TCP_STACKS`): ``linux`` (a stock kernel: RACK and
TLP on, ``rto_min`` 200 ms, HZ=250, CUBIC), ``tuned`` (a data-centre stack: the same code, ``rto_min`` 5 ms on
the route, HZ=1000) and ``rfc6298`` (three duplicate ACKs or the retransmission timer, no probe: the model this
project had first, kept as it was in :mod:`allreduce.sim._loss`).

:func:`draw_repair_seconds` charges a transfer that lost packets, for a RACK-TLP stack, per lost packet at
position ``i`` of ``P`` with ``k = P − 1 − i`` packets of the transfer after it (``RTT`` the path's round
trip, ``τ`` one packet at the flow's rate, ``J = 1/HZ`` a timer tick):

- ``k ≥ 3``: the SACKs of three later packets mark it lost at once (RFC 8985 §6.2: Linux's
  ``tcp_rack_reo_wnd`` is 0 once ``sacked_out`` reaches ``tp->reordering``, 3, and no reordering was seen),
  and the retransmission is delivered ``RTT + 4τ`` after the lost packet would have been, while the ``k``
  packets after it keep the link busy: ``max(τ, RTT + (4 − k)τ)``;
- ``1 ≤ k < 3``: one or two later packets are SACKed, too few to skip the reordering window
  (``min_rtt/4``), so RACK arms its reordering timer, ``remaining + TCP_TIMEOUT_MIN_US`` (2 ms) rounded up to
  a tick (``tcp_rack_mark_lost``); a kernel timer of ``n`` ticks fires ``n`` to ``n + 1`` ticks after it is
  armed (the timer wheel rounds an expiry up by one tick so that it never fires early): 4–8 ms at HZ=250.
  ``RTT + τ + timer``;
- ``k = 0`` (the transfer's last packet): once every earlier packet is acknowledged, one packet is out, and
  ``tcp_schedule_loss_probe`` arms the probe at ``2·srtt + rto_min`` (not ``2·srtt + 2 ms``: with one
  packet out the receiver may be delaying its ACK), capped by the RTO: 204–208 ms on a stock kernel. The probe
  resends the last packet: ``RTT + τ + timer``. But the probe armed as the last packet leaves, others still
  out, is ``2·srtt + 2 ms``, and only an ACK that leaves the last one alone rearms it with ``rto_min``: a
  receiver acknowledges every second full segment (``__tcp_ack_snd_check``, RFC 9293 §3.8.6.3), so where the
  segment before the last waits for its pair (:data:`ODD_BEFORE_SHARE`, half the time; its delayed ACK is
  40 ms away) the short probe resends the last first: ``RTT + τ + timer(2·srtt + 2 ms)``. Captured at
  25 Mbit/s (every link 3e-3, 256 KiB ring, 600 repetitions in two runs): the receiver acknowledged everything
  before a transfer's last segment in an ACK of its own at 44–47% of 9,400 transfer ends, and of 24 lone
  losses of a last segment 7 waited 206 ms and 17 were resent after 6–44 ms (a receiver busy sending
  acknowledged none of the segments before, or the one before waited for its pair). Not with GRO (one ACK per
  merged batch) nor ``quickack``;
- ``k = 0`` with the packet before it lost too (a burst took the transfer's tail, or two losses did): several
  packets are out, so the probe is armed at ``2·srtt + 2 ms`` and resends the last, whose SACK marks the others
  (RACK, no reordering window in recovery), one round trip later: ``2·(RTT + τ) + timer``. Where the probe is
  lost, the RTO is timed from the head of the queue's first sending (``tcp_rearm_rto`` offsets it by the time
  elapsed), so it fires ``RTO`` after the loss and replaces the probe's wait: ``RTT + τ + timer(RTO)``, then
  the backoff below;
- what comes next on the connection: a collective sends many transfers on one connection, and the sender
  starts the next one when it is ready, whether or not the receiver has all of this one. ``gap`` after this
  transfer's end the next transfer's packets arrive, and their SACKs reveal the hole as above:
  ``gap + 1.5·RTT + (4 − k)τ``. A tail loss costs the cheapest of the ways that apply; only the last transfer
  of a connection in a collective (and a single-packet message) pays the probe's ``rto_min`` (where the segment
  before it was acknowledged, above). The runtime's
  agreement frames are messages too: a barrier's frame is followed on its connection by the collective's
  agreement frame, the agreement's by the collective's data where it uses that connection
  (:func:`allreduce.sim._phases.agreement_delays`);
- small segments: the last of several sub-MSS segments (the agreement's frames) lost while an interactive
  receiver still holds the ACK of the earlier ones (it acknowledges at once only more than one full segment,
  ``__tcp_ack_snd_check``): the probe armed with several packets out, ``2·srtt + 2 ms``, resends it first;
- lost ACKs: ACKs are cumulative and the next one repeats what a lost one said, so within a flight they cost
  nothing (the ACK that ends a flight of a window-limited flow is below); one case is a tail loss whose ``k``
  revealing SACKs are all lost (probability ``q_ack^k``): the
  probe then fires at ``2·srtt + 2 ms`` with several packets out, and its own SACK marks the hole, one more
  ``RTT + τ``;
- the resent packet lost again (probability ``q`` each time): what finds it depends on what the sender sends after
  the repair. Where more than a window (the packets in flight the loss found,
  :func:`~allreduce.sim._tcp_cwnd.draw_loss_windows`) of the transfer followed the loss, the rest was unsent when
  the loss was found, and the window held at least ``FOLLOW_MIN_WINDOW`` (5) packets, proportional rate
  reduction lets it out as the SACKs of the packets still in flight arrive (``tcp_cwnd_reduction``); once one of
  them is SACKed, RACK marks the lost retransmission (RFC 8985 §6, ``tcp_rack_detect_loss``: a packet sent after it
  delivered, and no reordering window in recovery, ``tcp_rack_reo_wnd``), and resends it: ``RTT + 2τ`` more per loss
  of the repair, no timer. Where the loss was in the transfer's last window, what follows the repair is the
  connection's next transfer, written as its step begins: where it begins before the RTO would fire (and the
  window held ``FOLLOW_MIN_WINDOW``), its SACKs find the lost repair the same way, ``gap + RTT + 2τ`` more per
  loss. Where nothing follows (the connection's last transfer in the collective, proportional rate reduction
  having set the window to what is in flight), and on a bursty link, whose burst takes the packets right behind
  a lost repair, the RTO finds it, ``srtt + rto_min`` rounded up to a tick, doubled for each further loss (RFC
  6298 §5.5, ``icsk_backoff``). Captured unpaced (2026-12-07, 25 Mbit/s, 256 KiB ring, tcpdump in each host):
  every link 3e-3, 600 repetitions: a lost repair ended in an RTO in 6 of 8 cases with nothing sent after it,
  in 0 of 56 with one or more new segments after it; every link 1e-2, 150: 71 of 76, and 15 of 131 (the one or
  two segments behind it lost too); bursts of 4 at 3e-3, 400: 13 of 22, 7 of 11 with one or two segments after
  it, 0 of 11 with more. Captured paced earlier (the same rings, and 1 MiB): of 67 RTOs on the ring's
  connections in recovery, 65 came with nothing sent after the repair; 71 lost retransmissions with data sent
  after them were resent within 150 ms; and at 1 MiB
  (181 packets a transfer) 2 of 37 lost retransmissions or repair ACKs ended in an RTO, at 256 KiB (45) 12 of 20
  (the hosts' counters: ``TCPSackRecoveryFail`` 2 in 100 collectives at 1 MiB). At 100 Mbit/s the emulation is
  CPU-bound and a ring's sender has 2–3 segments in flight, so nothing follows any repair: there the counters show
  lost retransmissions ending in RTOs one for one (``TCPLostRetransmit`` against ``TCPSackRecoveryFail``: 4/4, 2/2,
  19/19, 30/31).
  A lost probe is such a loss too. The repair's ACK lost (probability ``q_ack``) ends the same way: where data
  follows the repair, its ACK is cumulative and covers the lost one; where nothing follows, nothing acknowledges the
  repair (no probe is armed outside the Open state, ``tcp_schedule_loss_probe``), so the RTO fires ``timer(RTO)``
  after it and resends a packet the receiver has, which it answers at once. What waits is the connection's next
  transfer, ``gap`` after this one's end (nothing for a connection's last transfer in the collective; a tail the
  next transfer reveals is acknowledged by that transfer's ACKs). After the RTO the window is one segment
  (``tcp_enter_loss``) and no probe is armed in the Loss state, so its resend lost or its ACK lost, ``1 − (1 − q)(1
  − q_ack)``, waits for the next RTO, doubled, and so on. So a repair in its transfer's last window ends in the RTO
  with ``q + q_ack``, about ``2q`` (each such RTO marks the retransmission lost, ``TCPLostRetransmit``, whether it
  or its ACK was lost); traced (every link 1e-2, ``tcp_probe`` and ``tcp_cong_state_set``: 61 of 84 RTOs on the
  ring's connections) they come in recovery with 2–3 segments out and nothing sent for 208 ms, and the data queued
  behind leaves within a millisecond of the resend's ACK (:func:`_lost_repair_ack`). Captured, what decides it is
  what the sender had sent past the loss when it resent it: of the lost repairs with at most two packets past the
  loss, 67 of 78 ended in an RTO; with three or more, 60 of 68 were found by RACK. Such repairs were 19% of all at
  every link 3e-3 with 256 KiB, 8% with 1 MiB and 61% at every link 1e-2, where the model's last window holds 29%,
  7% and 16% of the losses: at 1e-2 the sender had 2 segments out at the median send (3 at 3e-3, 7 without loss)
  where the average window ``√(1.5/q)`` says 6–9. Hence the window drawn per transfer from the stationary law of
  CUBIC's window with Linux's floors (:mod:`allreduce.sim._tcp_cwnd`), and the condition that it hold at least
  ``DUPTHRESH + 2`` packets: three SACKs find the loss, a fourth lets proportional rate reduction send past the
  repair; with fewer, nothing follows it wherever the loss is. The ACK that ends the wait echoes the repair's
  timestamp (the receiver had it: ``ts_recent`` is the last segment's that advanced ``rcv_nxt``, RFC 7323 §4.3), so
  the sender's RTT sample is the whole wait and srtt jumps by an eighth of it (RFC 6298 §2.3). Linux sets every
  flow's pacing rate, ``1.2·cwnd·mss/srtt`` in congestion avoidance (``tcp_update_pacing_rate``), but holds a CUBIC
  flow to it only behind the fq qdisc or once the socket is ``SK_PACING_NEEDED`` (``tcp_pacing_check``,
  ``tcp_update_skb_after_send``); a token bucket does not pace. The emulated ranks' connections were, until
  2026-12-07: the kernel's default, each namespace's too, is BBR, whose init sets it as the connection is
  established, and the runtime's switch to CUBIC after the handshake kept it (``tcp_reinit_congestion_control``
  never clears it); a socket CUBIC from the start, as the runtime now makes it, sends its window unpaced. Whether a
  host paces is therefore the host's (its default congestion control and qdisc), not TCP's recovery:
  :attr:`TcpStack.paced`, off for ``linux`` (these hosts, and a CUBIC-default host without fq), on for
  ``linux-paced`` and ``tuned`` (fq). Where paced, the data behind leaves ``srtt_j/(r·w)`` apart, each ACK taking an
  eighth of the excess off (:func:`paced_seconds`; traced: srtt 26 ms after a 206 ms RTO, segments 10.9, 9.4, 8.3 ms
  apart at cwnd 2); unpaced, it leaves as the window allows. The window is 2 (:data:`RTO_PACED_WINDOW`):
  ``tcp_enter_loss`` sets it to the packets in flight and one, 1 once ``tcp_timeout_mark_lost`` has marked
  everything out lost; the resend's ACK newly delivers one segment (those after the repair were SACKed before),
  which slow start adds; and while the pacing gap is longer than the round trip, one segment is in flight, and slow
  start grows the window only while it is below twice the most segments in flight (``tcp_is_cwnd_limited``), so it
  stays at 2 whatever ``ssthresh`` is (traced at every link 1e-2, ``quickack 1``: 26 of 27 such RTOs at ``cwnd`` 2).
  ``r`` is 200% while ``cwnd < ssthresh/2``, else 120% (``tcp_update_pacing_rate``), with the ``ssthresh`` the
  recovery set, which the RTO keeps (:func:`rto_pacing_ratio`). With bursts (:class:`Bursts`) on a link whose chain
  is clocked by its own packets (the emulator's firewall), the resend after a probe or RTO is the next packet the
  stalled link sees, lost with the burst's ``stay`` until the bad state expires (:func:`_held_resends`), unless
  other connections' packets cross the link before the probe: after the collective's last step only the rank waiting
  for the lost tail is held, and where repetitions are timed from a barrier, every other rank sends its first frame
  of the next one at once; each that meets the bad state ends it with ``1/burst``, so the probe's resend is lost
  with :func:`chain_loss` after them (``stay^(n+1)`` for ``n`` such packets and a rare new burst;
  :attr:`Bursts.cleared`, counted in :mod:`allreduce.sim._phases`). Not so for the runtime's control frames
  (agreement, barrier): their exchanges run on every connection at once and a sender does not wait for its receiver,
  so the step's other frames, the next step's and the collective's data on the ranks the loss does not hold cross
  the lossy links in the milliseconds after the burst, and each packet that meets the bad state ends it with
  ``1/burst``; the probe, ``2·srtt`` or more later, finds the chain as any packet does and is lost with the long-run
  rate. A resend sent on SACKs follows the delivered packet that revealed the loss, which left the chain good, so a
  new burst must start for it to be lost (:func:`resend_loss`);
- a burst on such a chain that takes a connection's final ACK (its last transfer in the collective, the receiver
  sending nothing back: a ring's): the receiver has the data and the sender's send was done once handed to the
  connection, so the collective waits for nothing. The receiver's next packet on that path is its next barrier's
  first frame (rank d to d − 1: a ring's connection d − 1 → d the other way, so the ACKs' route), sent as it
  finishes, right behind the lost ACK; the sender of the data waits in that barrier, and the repetition timed from it
  pays. Then the agreement's frame, the sender's probe (its ACK) and the receiver's probe cross the link, and in each
  RTO round the sender's resend's ACK and the frame's resend (:func:`draw_held_ack_seconds`);
- several losses in one transfer: SACK tells the sender every hole in one round trip and RACK repairs them
  together, so the losses of one recovery episode cost the largest of their costs (NewReno's one hole per round
  trip is the ``rfc6298`` preset's sum). An episode ends once ``high_seq``, what was sent when it began, is
  acknowledged (``tcp_fastretrans_alert``; RFC 6675 §5 "RecoveryPoint"), about a window past its first loss, so a
  loss more than a window (the one drawn for the transfer) after the episode's first is sent after ``high_seq`` and
  starts the next episode, repaired after the one before: the episodes' costs add (traced at every link 1e-2, a
  connection's RTOs come one after another, about 210 ms apart);
- the congestion window: CUBIC's cut, charged once per lost transfer, its average window ``W`` at a loss rate
  (:func:`loss_window_packets`) and the pacing after an inflated srtt (:func:`paced_seconds`) are
  :mod:`allreduce.sim._tcp_window`'s;
- lost ACKs of a window-limited flow (a flight's last ACK lost, the probe and the receiver's delayed ACK):
  :mod:`allreduce.sim._tcp_stall`;

``srtt`` and ``min_rtt`` are the path's RTT (the fluid model has no queues); where queues stand, the probe's
``2·srtt`` grows with them. After an RTO whose ACK does not inflate srtt (the repair itself was lost) the window
restarts at one packet and slow start takes ``log2(W)`` round trips to refill it, at most ``log2(W)·RTT`` more,
which is not charged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from allreduce.sim._bursts import Bursts, chain_loss, first_loss, next_loss, resend_loss
from allreduce.sim._tcp_cwnd import FOLLOW_MIN_WINDOW, draw_loss_windows
from allreduce.sim._tcp_window import (
    CUBIC_BETA,
    RTO_PACED_WINDOW,
    paced_seconds,
    rto_pacing_ratio,
    window_reduction_seconds,
)
from allreduce.topology import FloatArray, IntArray

__all__ = [
    "DELACK_MIN_S",
    "GIVE_UP_AFTER",
    "GRO_MAX_BYTES",
    "HELD_ACK_PROBE_ROUND",
    "ODD_BEFORE_SHARE",
    "TCP_STACKS",
    "LostTransfers",
    "TcpStack",
    "draw_held_ack_seconds",
    "draw_repair_seconds",
    "unheard_rtos",
]

# Linux's TCP_TIMEOUT_MIN_US: the least the reordering and probe timers add (2 ms since Linux 6.7).
TIMEOUT_MIN_S = 2e-3
# RFC 8985 §6.2: the reordering window is a quarter of the minimum RTT.
REO_WND_FRACTION = 0.25
# Linux's tp->reordering default (net.ipv4.tcp_reordering): packets SACKed after a hole that make it a loss.
DUPTHRESH = 3
# The most a receiver's GRO merges into one segment (its default gro_max_size, GRO_LEGACY_MAX_SIZE): a window
# that arrives back to back up to this size is acknowledged by one ACK.
GRO_MAX_BYTES = 65536
# Linux's TCP_DELACK_MIN (HZ/25): the least a delayed ACK waits.
DELACK_MIN_S = 0.04
# Linux's TCP_RTO_MAX: the backed-off timer stops doubling there.
RTO_MAX_S = 120.0
# A packet lost this many times in a row ends the connection in a real stack (Linux: tcp_retries2 = 15
# timeouts); the model stops drawing there, and refuses loss rates at which that is not negligible.
GIVE_UP_AFTER = 16
# A receiver acknowledges every second full segment: the one before a transfer's last waits for its pair half the time
ODD_BEFORE_SHARE = 0.5


@dataclass(frozen=True)
class TcpStack:
    """A TCP stack's loss-recovery settings: ``rto_min_s`` (Linux's ``TCP_RTO_MIN`` or a route's ``rto_min``),
    ``hz`` (kernel timer ticks per second; 0: exact timers), ``rack_tlp`` (RACK-TLP loss detection:
    ``net.ipv4.tcp_recovery=1``, ``net.ipv4.tcp_early_retrans=3``; off: the ``rfc6298`` model),
    ``delayed_ack_s`` (how long a receiver in interactive mode holds the ACK of one segment,
    ``TCP_DELACK_MIN``; 0: at once, a route's ``quickack 1``), ``paced`` (the kernel holds the flow to its pacing
    rate: the socket is ``SK_PACING_NEEDED`` or the host's qdisc is fq; off: a CUBIC socket behind pfifo_fast or
    fq_codel sends what its window allows at once, and an inflated srtt slows nothing, see the module docstring),
    ``gro`` (the receiver's NIC merges a window that arrives back to back and acknowledges it with one ACK; off:
    one ACK per two segments, as the emulated clusters' veths, see
    :func:`allreduce.sim._tcp_stall.ack_stall_flights`)."""

    name: str
    rto_min_s: float
    hz: float
    rack_tlp: bool
    delayed_ack_s: float = 0.0
    paced: bool = True
    gro: bool = True

    def with_rto_min(self, rto_min_s: float | None) -> TcpStack:
        return self if rto_min_s is None else replace(self, rto_min_s=rto_min_s)

    def settings(self) -> str:
        """The kernel settings this preset assumes, in one line."""
        from allreduce.units import format_seconds

        rto_min = format_seconds(self.rto_min_s)
        if not self.rack_tlp:
            return (
                f"{self.name}: fast retransmit after {DUPTHRESH} duplicate ACKs (NewReno, one hole per RTT), "
                f"else the retransmission timer RTO = {rto_min} with backoff; no probe, exact timers"
            )
        tick = format_seconds(1 / self.hz)
        ack = f"delayed ACK {format_seconds(self.delayed_ack_s)}" if self.delayed_ack_s else "quickack 1"
        pacing = "paced at 1.2*cwnd*mss/srtt" if self.paced else "unpaced"
        gro = "receiver GRO (one ACK per merged window)" if self.gro else "no GRO (one ACK per two segments)"
        return (
            f"{self.name}: RACK-TLP (net.ipv4.tcp_recovery=1, tcp_early_retrans=3), rto_min {rto_min}, "
            f"HZ={self.hz:g} ({tick} ticks), reordering window min_rtt/4 + 2 ms, probe 2*srtt + 2 ms "
            f"(2*srtt + rto_min with one packet out), {ack}, CUBIC beta {CUBIC_BETA:g}, {pacing}, {gro}"
        )

    def timer(self, rng: np.random.Generator, seconds: FloatArray) -> FloatArray:
        """When a timer armed for ``seconds`` fires: rounded up to ``n`` ticks (``usecs_to_jiffies``), and the
        timer wheel fires it ``n`` to ``n + 1`` ticks later, by where in the current tick it was armed."""
        if self.hz <= 0:
            return seconds
        ticks = np.maximum(np.ceil(seconds * self.hz - 1e-9), 1.0)
        return (ticks + rng.random(np.shape(seconds))) / self.hz

    def rto(self, srtt_s: FloatArray) -> FloatArray:
        """Linux's RTO before backoff: ``srtt + rttvar`` with ``rttvar`` at least ``rto_min``
        (``tcp_rtt_estimator``); a steady path's variance is below the floor."""
        return srtt_s + self.rto_min_s


TCP_STACKS = {
    "linux": TcpStack(
        "linux", rto_min_s=0.2, hz=250.0, rack_tlp=True, delayed_ack_s=DELACK_MIN_S, paced=False, gro=False
    ),
    "linux-gro": TcpStack("linux-gro", rto_min_s=0.2, hz=250.0, rack_tlp=True, delayed_ack_s=DELACK_MIN_S, paced=False),
    "linux-paced": TcpStack(
        "linux-paced", rto_min_s=0.2, hz=250.0, rack_tlp=True, delayed_ack_s=DELACK_MIN_S, gro=False
    ),
    "tuned": TcpStack("tuned", rto_min_s=5e-3, hz=1000.0, rack_tlp=True),
    "rfc6298": TcpStack("rfc6298", rto_min_s=0.2, hz=0.0, rack_tlp=False, paced=False),
}
"""The presets of ``--tcp``. ``linux``: a stock 6.x kernel with CUBIC and a qdisc that does not pace (pfifo_fast,
fq_codel, tbf: most distributions, and the emulated clusters' hosts, whose ranks choose CUBIC before the
handshake), no GRO (veths); ``linux-gro``: the same with a NIC's GRO; ``linux-paced``: ``linux`` with the kernel's
own pacing (a socket BBR established before CUBIC was set, as the emulated clusters' ranks did until 2026-12-07,
or fq); ``tuned``: a data-centre stack (fq paces, ``rto_min`` 5 ms, HZ=1000); ``rfc6298``: the model this project
had first."""


def _held_resends(
    rng: np.random.Generator,
    held: tuple[FloatArray, FloatArray, float],
    first_s: FloatArray,
    rto: FloatArray,
    *,
    several: npt.NDArray[np.bool_] | None = None,
    probe_q: FloatArray | None = None,
) -> IntArray:
    """How many times in a row a packet a burst took is lost again when it is resent by the probe (``first_s``
    after the loss) and then by each backed-off RTO, on a chain held by a silent link (:class:`Bursts`): the
    collective waits for this packet, so nothing else crosses the lossy link, and every resend within
    ``hold_s`` of the burst meets the bad state the burst left, lost with ``stay``; a later one meets the good
    state, lost only if a new burst starts (``entry_q``). The first RTO fires ``rto`` after the probe where one
    packet was out (the probe resent the head of the queue and the timer restarts from it), and ``rto`` after
    the loss where ``several`` were (``tcp_rearm_rto`` offsets the timer from the head's first sending); each
    later one waits twice as long as the one before (``icsk_rto <<= 1``). ``probe_q``: the probe's resend is
    lost with it within ``hold_s`` (other packets crossed the link before it, :func:`chain_loss`; None:
    ``stay``); a lost resend leaves the chain bad for the next one, which nothing else precedes."""
    stay, entry_q, hold_s = held
    first_rto = first_s + rto if several is None else np.where(several, rto, first_s + rto)
    sent_at = first_s.copy()
    again = np.zeros(first_s.size, dtype=np.int64)
    going = np.ones(first_s.size, dtype=np.bool_)
    for j in range(GIVE_UP_AFTER):
        held_q = stay if j > 0 or probe_q is None else probe_q
        lost = rng.random(first_s.size) < np.where(sent_at < hold_s, held_q, entry_q)
        going &= lost
        if not going.any():
            break
        again += going
        sent_at = first_rto if j == 0 else sent_at + np.minimum(rto * 2.0**j, RTO_MAX_S)
    return again


# The packets that cross a link held over a connection's final ACKs after the receiver's next frame back and before
# the first RTO (draw_held_ack_seconds): the receiver's next message on the connection (the agreement's frame, which
# follows the barrier's), the ACK of the sender's probe, and the receiver's probe.
HELD_ACK_PROBE_ROUND = 3


def draw_held_ack_seconds(
    rng: np.random.Generator,
    stack: TcpStack,
    *,
    rtt: FloatArray,
    tau: FloatArray,
    bursts: Bursts,
    crossing: FloatArray,
) -> tuple[FloatArray, IntArray]:
    """What a burst that took a connection's final ACK on a link that then falls silent (a chain clocked by the
    link's packets, held up to ``bursts.hold_s``) costs the receiver's next frame back to the sender, ``F``, which
    rides the ACK path (the same connection, the other way; see the module docstring). ``F`` follows the lost ACK
    and is lost with ``stay``. Then, before any timer of the ``rto_min`` class, ``crossing`` other packets cross the
    link and :data:`HELD_ACK_PROBE_ROUND` of the connection's own: if any gets through, the chain is good and ``F``
    is repaired in the probe's round, ``2·(RTT + τ) + timer(2·srtt + 2 ms)``; all are lost with
    ``chain_loss(crossing + 2)`` behind ``F`` (about ``stay^(crossing + 3)``). Then the receiver's RTO, timed from
    ``F``'s first sending (several out: ``tcp_rearm_rto``), resends ``F``, and each round the sender's backed-off
    RTO resend draws an ACK across the link first (its probe, and so its RTO, fired earlier): a round lost whole
    with ``stay²`` while it leaves within the hold, else only by a new burst (:func:`_held_resends`), ``F``
    delivered at ``RTT + τ + Σ_{j≤m} timer(RTO·2^j)``. Returns (seconds, RTOs fired), 0 where ``F`` got through."""
    n = rtt.size
    f_lost = rng.random(n) < bursts.stay
    rto = stack.rto(rtt)
    probe = 2 * (rtt + tau) + stack.timer(rng, np.minimum(2 * rtt + TIMEOUT_MIN_S, rto))
    probe_q = chain_loss(bursts, crossing + HELD_ACK_PROBE_ROUND - 1, after_loss=True)
    held = (bursts.stay**2, bursts.entry_q, bursts.hold_s)
    again = _held_resends(rng, held, probe, rto, several=np.ones(n, dtype=np.bool_), probe_q=probe_q)
    cost = np.where(again > 0, rtt + tau + stack.timer(rng, rto), probe)
    for j in range(1, int(again.max(initial=0))):
        waiting = again > j
        cost[waiting] += stack.timer(rng, np.minimum(rto[waiting] * 2.0**j, RTO_MAX_S))
    return np.where(f_lost, cost, 0.0), np.where(f_lost, again, 0)


def unheard_rtos(
    rng: np.random.Generator,
    stack: TcpStack,
    rto: FloatArray,
    *,
    silent: FloatArray,
    backed_off: IntArray,
    firing: npt.NDArray[np.bool_],
) -> tuple[FloatArray, IntArray]:
    """The RTOs that fire, where ``firing``, until one's resend and its ACK both get through: the first after
    ``backed_off`` earlier ones, ``timer(RTO·2^backed_off)``, each later one twice the last (``icsk_backoff``, up to
    ``TCP_RTO_MAX``), another with probability ``silent`` each (after an RTO the window is one segment,
    ``tcp_enter_loss``, and no probe is armed in the Loss state, so nothing but the resend can be acknowledged).
    Returns (the waits summed, how many fired)."""
    rounds = np.where(firing, np.minimum(rng.geometric(1 - silent), GIVE_UP_AFTER - backed_off), 0)
    wait = np.zeros(rto.size)
    for j in range(int(rounds.max(initial=0))):
        waiting = rounds > j
        wait[waiting] += stack.timer(rng, np.minimum(rto[waiting] * 2.0 ** (backed_off[waiting] + j), RTO_MAX_S))
    return wait, rounds


def _lost_repair_ack(
    rng: np.random.Generator,
    stack: TcpStack,
    *,
    packets: IntArray,
    rtt: FloatArray,
    tau: FloatArray,
    cost: FloatArray,
    repaired: npt.NDArray[np.bool_],
    backed_off: IntArray,
    q: FloatArray,
    q_ack: FloatArray,
    rto: FloatArray,
    gap: FloatArray,
) -> tuple[FloatArray, IntArray]:
    """A delivered repair whose ACK is lost (probability ``q_ack``, for the ``repaired`` losses, after
    ``backed_off`` RTOs that resent it): nothing sent after the repair acknowledges it (the module docstring), so
    the next RTO fires, ``timer(RTO·2^backed_off)`` after it, and resends a packet the receiver has; with the
    window at one segment (``tcp_enter_loss``) and no probe outside the Open state, nothing else is sent, so that
    resend or its ACK lost (``1 − (1 − q)(1 − q_ack)``) waits for the next, doubled. ``repaired`` holds only
    repairs that nothing follows (the loss in its transfer's last window, :func:`_one_loss`), so what waits until
    the sender hears is the connection's next transfer, which starts ``gap`` after this one ends. The ACK that ends
    the wait echoes the repair's timestamp (the receiver had it), so the sender's RTT sample is the whole wait, and
    the next transfer (taken as long as this one, ``packets``, as a ring's are) is paced behind the inflated srtt
    (:func:`paced_seconds`, at the window after the RTO, :data:`RTO_PACED_WINDOW`, and :func:`rto_pacing_ratio`).
    Returns (the cost with that wait, the RTOs that held data)."""
    none = np.zeros(packets.size, dtype=np.int64)
    if not np.any(repaired & (q_ack > 0)):
        return cost, none
    ack_lost = repaired & (rng.random(packets.size) < q_ack)
    if not ack_lost.any():
        return cost, none
    silent = 1 - (1 - q) * (1 - q_ack)
    wait, rounds = unheard_rtos(rng, stack, rto, silent=silent, backed_off=backed_off, firing=ack_lost)
    segments = packets.astype(np.float64)
    paced = np.zeros(packets.size)
    if stack.paced:
        w = np.full(int(ack_lost.sum()), RTO_PACED_WINDOW)
        paced[ack_lost] = paced_seconds(rtt[ack_lost], wait[ack_lost] + rtt[ack_lost], segments[ack_lost], w,
                                        tau[ack_lost], ratio=rto_pacing_ratio(q[ack_lost]))  # fmt: skip
    charged = np.maximum(cost, cost + wait - gap) + paced
    held = ack_lost & (charged > cost + paced)
    return np.where(held, charged, cost), np.where(held, rounds, 0)


def _one_loss(
    rng: np.random.Generator,
    stack: TcpStack,
    after: IntArray,
    *,
    q: FloatArray,
    q_ack: FloatArray,
    rtt: FloatArray,
    tau: FloatArray,
    gap: FloatArray,
    held: tuple[FloatArray, FloatArray, float] | None = None,
    unacked: npt.NDArray[np.bool_] | None = None,
    lost_before: npt.NDArray[np.bool_] | None = None,
    odd_before: npt.NDArray[np.bool_] | None = None,
    resend_q: FloatArray | None = None,
    probe_q: FloatArray | None = None,
    packets: IntArray | None = None,
    window: FloatArray | None = None,
) -> tuple[FloatArray, IntArray]:
    """The delay one lost packet with ``after`` packets of its transfer behind it adds, and how many timers of
    the ``rto_min`` class (the one-packet probe, the RTO) fired. ``held``: (stay, entry_q, hold seconds) of a
    burst held by a silent link (:func:`_held_resends`); ``unacked``: the packets before it are small segments
    an interactive receiver acknowledges only with its delayed-ACK timer (see :class:`LostTransfers`);
    ``lost_before``: the packet before it was lost too, so a lost last packet leaves several out; ``resend_q``:
    the probability that a repair sent on a SACK (not by the probe) is lost (:func:`resend_loss`; None: ``q``);
    ``probe_q``: that the probe's resend is lost by a held burst (:func:`_held_resends`); ``q_ack``: that an
    ACK is lost, which turns a delivered repair into an RTO for the data behind it (:func:`_lost_repair_ack`)."""
    mid = after >= DUPTHRESH
    cost_mid = np.maximum(tau, rtt + (DUPTHRESH + 1 - after) * tau)
    reo = rtt + tau + stack.timer(rng, REO_WND_FRACTION * rtt + TIMEOUT_MIN_S)
    rto = stack.rto(rtt)
    probe_one = rtt + tau + stack.timer(rng, np.minimum(2 * rtt + stack.rto_min_s, rto))
    probe_many = 2 * (rtt + tau) + stack.timer(rng, np.minimum(2 * rtt + TIMEOUT_MIN_S, rto))
    # Several packets out when the last one is lost: the probe is armed at 2*srtt + 2 ms (tcp_schedule_loss_probe
    # adds rto_min only with one out) and resends the last; where the ones before it were lost too, its SACK marks
    # them (RACK, no reordering window in recovery) and they follow one round trip later.
    several = np.zeros(after.size, dtype=np.bool_)
    last = probe_one
    if lost_before is not None:
        several = lost_before.copy()
        last = np.where(lost_before, probe_many, last)
    if unacked is not None:
        # the packets before it are delivered but still unacknowledged: the probe's resend is all that is missing
        last = np.where(unacked, probe_many - rtt - tau, last)
        several |= unacked
    if odd_before is not None:
        # the full segment before it is delivered but waits for its pair to be acknowledged: two are out, and the
        # probe armed at 2*srtt + 2 ms resends the last before the receiver's delayed ACK would rearm it
        last = np.where(odd_before & ~several, probe_many - rtt - tau, last)
        several |= odd_before
    sacks_lost = rng.random(after.size) < q_ack ** np.maximum(after, 0)
    tail = np.where(after == 0, last, np.where(sacks_lost, probe_many, reo))
    follow = gap + 1.5 * rtt + (DUPTHRESH + 1 - after) * tau
    probed = ~mid & (after == 0) & (last <= follow)
    # the next transfer's data reveals the loss: it follows the repair, and its ACKs acknowledge the repair too
    revealed = ~mid & (follow < tail)
    tail = np.minimum(tail, follow)
    cost = np.where(mid, cost_mid, tail)
    fired = (probed & ~several).astype(np.int64)  # the one-packet probe's rto_min is paid
    # Data sent after the repair: the rest of the transfer, unsent when the loss was found (more than a window
    # behind it), or else the connection's next transfer, written before the RTO would fire. A lost repair is then
    # found by RACK once that data is SACKed, a round trip on, and a lost repair ACK is covered by the next one: no
    # timer (the module docstring). Not the next transfer on a bursty link: the burst that took the repair takes
    # the packets right behind it.
    follows = np.zeros(after.size, dtype=np.bool_)
    next_follows = np.zeros(after.size, dtype=np.bool_)
    if window is not None:
        pushed = window >= FOLLOW_MIN_WINDOW
        follows = mid & (after > window) & pushed
        if resend_q is None:
            # a SACK after the repair lets it out (PRR): a fourth packet behind the loss
            next_follows = ~follows & pushed & (after > DUPTHRESH) & (gap + rtt < rto)
    # The repair lost again, m times in a row: the RTO, backed off.
    again = np.minimum(rng.geometric(1 - q) - 1, GIVE_UP_AFTER).astype(np.int64)
    if resend_q is not None:
        # the first resend on a SACK follows the packets that revealed the loss; the RTO's, 200 ms on, meet the
        # chain as any packet does
        first_lost = rng.random(after.size) < np.where(probed, q, resend_q)
        again = np.where(first_lost, np.minimum(again + 1, GIVE_UP_AFTER), 0)
    if held is not None:
        again = np.where(probed, _held_resends(rng, held, cost, rto, several=several, probe_q=probe_q), again)
    cost = cost + np.where(follows, again * (rtt + 2 * tau), 0.0)
    cost = cost + np.where(next_follows & (again > 0), gap + again * (rtt + 2 * tau), 0.0)
    follows |= next_follows
    again = np.where(follows, 0, again)
    if np.any(again > 0):
        # With several out, the RTO after a lost probe is timed from the head's first sending (tcp_rearm_rto
        # offsets it by the time elapsed): it replaces the probe's wait instead of following it.
        from_head = probed & several & (again > 0)
        first = np.minimum(follow, rtt + tau + stack.timer(rng, rto))
        cost = np.where(from_head, first, cost)
        backoff = np.zeros(after.size)
        for j in range(int(again.max())):
            waiting = (again > j) & ~(from_head & (j == 0))
            backoff[waiting] += stack.timer(rng, np.minimum(rto[waiting] * 2.0**j, RTO_MAX_S))
        cost = cost + backoff
        fired += again
    cost, unheard = _lost_repair_ack(rng, stack, packets=after + 1 if packets is None else packets, rtt=rtt,
                                     tau=tau, cost=cost, repaired=~revealed & ~follows, backed_off=again, q=q,
                                     q_ack=q_ack, rto=rto, gap=gap)  # fmt: skip
    return cost, fired + unheard


@dataclass(frozen=True, eq=False)
class LostTransfers:
    """Transfers that lost at least one packet, per transfer: the per-packet loss probability ``q``, its
    ``packets``, round trip ``rtt_s``, one packet's time ``packet_s``, the loss probability of its ACKs ``q_ack``
    (None: 0), ``gap_s``, when after its end the next transfer on its connection starts (None: none follows),
    ``bursts`` (how its losses cluster; None: independently), and ``small``: its packets are segments smaller
    than an MSS (the runtime's control frames, one ``sendmsg`` each with ``TCP_NODELAY``). A receiver in
    interactive mode acknowledges those only with its delayed-ACK timer (``__tcp_ack_snd_check`` sends at once
    only for more than one full segment), so when the last of several is lost, the earlier ones are still
    unacknowledged when the probe armed with several packets out (``2·srtt + 2 ms``) fires: the probe resends
    the last one, and the one-packet probe's ``rto_min`` is not paid. Nor does a held burst take their resends:
    the collective's other packets cross the link first (the module docstring). ``window``: the packets in flight
    when each transfer's losses are found (None: drawn by :func:`~allreduce.sim._tcp_cwnd.draw_loss_windows`)."""

    q: FloatArray
    packets: IntArray
    rtt_s: FloatArray
    packet_s: FloatArray
    q_ack: FloatArray | None = None
    gap_s: FloatArray | None = None
    bursts: Bursts | None = None
    small: bool = False
    window: FloatArray | None = None


def draw_repair_seconds(
    rng: np.random.Generator, stack: TcpStack, transfers: LostTransfers
) -> tuple[FloatArray, IntArray]:
    """The delay each of these transfers suffers on a RACK-TLP stack (see the module docstring). Returns (extra
    seconds, timers of the ``rto_min`` class that fired)."""
    q, packets, rtt_s, packet_s = transfers.q, transfers.packets, transfers.rtt_s, transfers.packet_s
    bursts = transfers.bursts
    n = q.size
    q_ack = np.zeros(n) if transfers.q_ack is None else transfers.q_ack
    gap_s = np.full(n, math.inf) if transfers.gap_s is None else transfers.gap_s
    extra = np.zeros(n)
    fired = np.zeros(n, dtype=np.int64)
    lost = np.arange(n)
    position = first_loss(rng, q if bursts is None else bursts.entry_q, packets)
    # a control frame's resend finds a chain the collective's other packets have moved on (the module docstring)
    held = bursts is not None and bursts.hold_s > 0 and not transfers.small
    hold = (bursts.stay, bursts.entry_q, bursts.hold_s) if held and bursts is not None else None
    # with bursts, a resend on a SACK is lost by a new burst starting on the link after the packets that crossed
    # it in the round trip since the revealing one (the flow's own, at its rate: a lower bound on the link's)
    resend_q = None
    if bursts is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            between = np.where(packet_s > 0, rtt_s / packet_s, 0.0)
        resend_q = resend_loss(bursts, between)
    # the probe's resend on a held link, behind the burst and the packets of other connections after it
    probe_q = None
    if hold is not None and bursts is not None and bursts.cleared is not None:
        probe_q = chain_loss(bursts, bursts.cleared, after_loss=True)
    previous = np.full(n, -2, dtype=np.int64)
    # recovery episodes: a loss sent after the episode's high_seq, a window past its first loss, starts the next
    # CUBIC cuts its window once per recovery: once per burst
    cuts_q = q if bursts is None else bursts.entry_q
    window = draw_loss_windows(rng, cuts_q, q_ack) if transfers.window is None else transfers.window
    episode_start = np.full(n, -1, dtype=np.int64)

    def odd_before(position: IntArray) -> npt.NDArray[np.bool_] | None:
        """Per loss, whether the full segment before it waits for its pair's ACK (:data:`ODD_BEFORE_SHARE`)."""
        if transfers.small or stack.delayed_ack_s <= 0 or stack.gro:
            return None  # small segments: ``unacked``; quickack, GRO: nothing waits for a pair
        return (position > 0) & (rng.random(position.size) < ODD_BEFORE_SHARE)

    episode = np.zeros(n)
    for _ in range(int(packets.max(initial=0)) + 1):
        if lost.size == 0:
            break
        cost, timers = _one_loss(
            rng,
            stack,
            packets[lost] - 1 - position,
            q=q[lost],
            q_ack=q_ack[lost],
            rtt=rtt_s[lost],
            tau=packet_s[lost],
            gap=gap_s[lost],
            held=None if hold is None else (hold[0][lost], hold[1][lost], hold[2]),
            unacked=(position > 0) if transfers.small and stack.delayed_ack_s > 0 else None,
            lost_before=previous == position - 1,
            odd_before=odd_before(position),
            resend_q=None if resend_q is None else resend_q[lost],
            probe_q=None if probe_q is None else probe_q[lost],
            packets=packets[lost],
            window=window[lost],
        )
        new = (episode_start[lost] < 0) | (position - episode_start[lost] > window[lost])
        extra[lost] += np.where(new, episode[lost], 0.0)
        episode[lost] = np.where(new, cost, np.maximum(episode[lost], cost))
        episode_start[lost] = np.where(new, position, episode_start[lost])
        fired[lost] += timers
        previous = position
        position = next_loss(rng, q, bursts, position, lost)
        keep = position < packets[lost]
        lost, position, previous = lost[keep], position[keep], previous[keep]
    extra += episode + window_reduction_seconds(rtt_s, packet_s)
    return extra, fired
