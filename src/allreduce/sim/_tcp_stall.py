"""What a lost ACK costs a window-limited flow: the probe, then the receiver's delayed ACK (or an RTO).

A transfer of ``P`` packets whose window ``W`` is smaller goes out in
``⌈P/W⌉`` flights, each sent as the ACKs of the one before arrive. On a host with GRO (:attr:`TcpStack.gro`)
a window that arrives back to back is merged by the receiver (up to 64 KiB, :data:`GRO_MAX_BYTES`) and
acknowledged by one ACK (without GRO, as on the emulated clusters' veths, every second segment is acknowledged
and the next ACK covers a lost one: captured at 25 Mbit/s, no such stall); where that
ACK is lost (probability ``q_ack`` per flight), the sender has nothing in flight to reveal it (a larger
window is acknowledged by a stream of ACKs, the next of which covers a lost one);
the probe fires at ``2·srtt + 2 ms`` and sends the next segment. Its one segment is acknowledged at once by
a receiver in quick-ACK mode, but the connections of a collective carry data one way and the runtime's
agreement frames the other, so the receiver is in Linux's interactive ("pingpong") mode
(``inet_csk_in_pingpong_mode``), where a single segment is acknowledged only by the delayed-ACK timer,
``TCP_DELACK_MIN`` = 40 ms (``__tcp_ack_snd_check``: at once only for more than one full segment).
So each such flight but the last (after the last, the receiver has everything) costs
``RTT + timer(2·srtt + 2 ms) + timer(40 ms)``, 44–52 ms at HZ=250 (:func:`draw_ack_stall_seconds`). Where
the receiver sends data back on the connection in the same step (halving-doubling's exchanges), every one of
its segments carries the cumulative ACK (RFC 9293 §3.4) and a lost ACK stalls nothing.
Measured on the emulated clusters (every link 3e-3, ftrace of ``tcp_probe``): windows of 2–18 segments
waiting 48–55 ms for an ACK, about one per collective; with ``quickack 1`` on the hosts' routes there were
none, and 8 probes instead of 91 (the ``tuned`` preset assumes that route setting). The delayed ACK that ends
such a stall acknowledges the whole flight, none of it resent, so the sender's RTT sample runs from the flight's
first sending (``tcp_clean_rtx_queue``): srtt moves by an eighth of the stall, and the segments up to the next
stall (or the transfer's end) are paced behind it as after a lost repair ACK (:func:`paced_seconds`, at the
flight's window; traced at every link 1e-2 and 3e-3: the ACKs ending 77 of 331 and 10 of 61 stalls of 35–60 ms
raised srtt by more than 3 ms, by a sample of 43–45 ms at the median, and the next 20 segments took 123 and 85 ms
after them against 54 and 8 ms after the others); where an RTO ends the stall, what its ACK echoes depends on
which segment the receiver last took in order, and no pacing is charged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from allreduce.sim._tcp import GRO_MAX_BYTES, TIMEOUT_MIN_S, TcpStack, unheard_rtos
from allreduce.sim._tcp_window import loss_window_packets, paced_seconds
from allreduce.topology import FloatArray, IntArray

__all__ = ["StallPacing", "ack_stall_flights", "draw_ack_stall_seconds"]


def ack_stall_flights(q: FloatArray, packets: IntArray, mtu_bytes: int) -> IntArray:
    """The flights of a transfer of ``packets`` at loss ``q`` whose last ACK, if lost, stalls it on a receiver with
    GRO (:attr:`TcpStack.gro`; :func:`allreduce.sim._phases.draw_losses` draws none without): all but the last of
    its ``⌈P/W⌉`` flights (:func:`loss_window_packets`); none where one window holds the transfer, or where a
    window is more than one GRO batch (:data:`GRO_MAX_BYTES` of ``mtu_bytes`` packets), whose ACKs follow one
    another so that the next covers a lost one."""
    window = loss_window_packets(q)
    stalls = (window < packets) & (window * mtu_bytes <= GRO_MAX_BYTES)
    with np.errstate(divide="ignore", invalid="ignore"):
        flights = np.where(stalls, np.ceil(packets / np.maximum(window, 1.0)), 1.0)
    return np.asarray(flights - 1, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class StallPacing:
    """What follows each lost flight-ending ACK of a transfer: ``segments[i, j]``, the segments transfer ``i``
    sends after its ``j``-th stall and before the next stall's flight ends (or the transfer does), its flights'
    window ``window`` and one packet's time ``packet_s`` (:func:`draw_ack_stall_seconds`)."""

    segments: FloatArray
    window: FloatArray
    packet_s: FloatArray


def draw_ack_stall_seconds(
    rng: np.random.Generator,
    stack: TcpStack,
    *,
    stalls: IntArray,
    rtt_s: FloatArray,
    q: FloatArray,
    q_ack: FloatArray,
    paced: StallPacing | None = None,
) -> tuple[FloatArray, IntArray]:
    """What ``stalls`` lost flight-ending ACKs cost a transfer (see the module docstring): per stall
    ``RTT + timer(2·srtt + 2 ms) + timer(delayed ACK)`` (no delayed ACK: the probe's ACK returns at once); where
    the probe (probability ``q``) or its ACK (``q_ack``) is lost too, the RTO armed when the probe left fires
    instead of the delayed ACK: ``timer(2·srtt + 2 ms) + timer(RTO)``, and the RTOs after it while each one's
    resend or its ACK is lost (:func:`unheard_rtos`). With ``paced``, a stall the probe's delayed ACK ends is
    followed by its segments paced behind the srtt it inflated: that ACK acknowledges the whole flight, none of it
    resent, so the sender's RTT sample runs from the flight's first sending (``tcp_clean_rtx_queue``), the stall
    and a round trip (the flight's own sending time left out), and :func:`paced_seconds` at the flight's window.
    Returns (seconds, RTOs)."""
    total = np.zeros(stalls.size)
    timeouts = np.zeros(stalls.size, dtype=np.int64)
    for j in range(int(stalls.max(initial=0))):
        more = np.flatnonzero(stalls > j)
        rtt = rtt_s[more]
        probe = rtt + stack.timer(rng, 2 * rtt + TIMEOUT_MIN_S)
        answered = stack.timer(rng, np.full(rtt.size, stack.delayed_ack_s)) if stack.delayed_ack_s > 0 else 0.0
        heard = (1 - q[more]) * (1 - q_ack[more])
        lost = rng.random(more.size) >= heard
        # after that RTO its resend or that resend's ACK lost waits for the next, doubled
        again = lost & (rng.random(more.size) >= heard)
        backoff, rounds = unheard_rtos(
            rng, stack, stack.rto(rtt), silent=1 - heard, backed_off=np.ones(more.size, np.int64), firing=again
        )
        total[more] += probe + np.where(lost, stack.timer(rng, stack.rto(rtt)), answered) + backoff
        timeouts[more] += lost + rounds
        if paced is not None and stack.paced:
            ended = more[~lost]
            total[ended] += paced_seconds(
                rtt_s[ended], (probe + answered)[~lost] + rtt_s[ended], paced.segments[ended, j], paced.window[ended],
                paced.packet_s[ended],
            )  # fmt: skip
    return total, timeouts
