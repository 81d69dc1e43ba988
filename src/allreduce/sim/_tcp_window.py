"""What a TCP flow's congestion window does to its transfers: CUBIC's cut after a loss and its regrowth, the
average window it keeps at a loss rate, and Linux's pacing of the segments sent behind an inflated srtt. The loss
recovery that calls on them is :mod:`allreduce.sim._tcp`'s (its docstring says where each applies).

- the cut: CUBIC sets ``cwnd ← β·cwnd`` (β = 0.7, RFC 8312 §4.5) once per recovery and grows
  back at ``α = 3(1 − β)/(1 + β)`` packets per RTT in its TCP-friendly region (§4.2) or along the cubic
  ``W(t) = C(t − K)³ + W_max`` (§4.1, C = 0.4, ``K = ∛(W_max(1 − β)/C)``), whichever is faster. With the
  window at the bandwidth-delay product ``W = RTT/τ`` packets before the loss (no standing queue: the fluid
  model's link), the link runs below its rate until the window is back: the bytes not sent take
  ``(1 − β)/2 · T`` with ``T = (1 + β)/3 · W · RTT`` (linear regrowth), or ``(1 − β)/4 · K`` (cubic), the
  smaller of the two. A standing queue of ``(1 − β)/β`` of the BDP or more hides it entirely, so this is an
  upper bound; it is charged once per lost transfer.
- ``W``, the window a flow keeps at per-packet loss ``q``: CUBIC in its TCP-friendly region grows by
  ``α = 3(1 − β)/(1 + β)`` per RTT and cuts by ``β``, an average window of ``√(α(1 + β)/(2(1 − β)q))`` =
  ``√(1.5/q)`` packets (RFC 8312 §5.1; Reno's too); without data loss the window does not limit a transfer
  (:func:`loss_window_packets`).
- pacing: Linux holds a paced flow to ``r·cwnd·mss/srtt`` (``tcp_update_pacing_rate``; ``r`` 1.2 in congestion
  avoidance, 2 early in slow start), and one RTT sample of a long wait raises srtt by an eighth of it (RFC 6298
  §2.3), each later ACK taking an eighth of the excess off: :func:`paced_seconds`; after an RTO the window is
  :data:`RTO_PACED_WINDOW` and the ratio :func:`rto_pacing_ratio`'s.
"""

from __future__ import annotations

import math

import numpy as np

from allreduce.topology import FloatArray

__all__ = [
    "CUBIC_BETA",
    "CUBIC_C",
    "PACING_CA_RATIO",
    "PACING_SS_RATIO",
    "RTO_PACED_WINDOW",
    "loss_window_packets",
    "paced_seconds",
    "rto_pacing_ratio",
    "window_reduction_seconds",
]

# RFC 8312 §4.5 and §5: CUBIC's multiplicative decrease and its cubic's constant (packets/s^3).
CUBIC_BETA = 0.7
CUBIC_C = 0.4
# The rate Linux holds a paced flow to (SK_PACING_NEEDED, see allreduce.sim._tcp's docstring):
# net.ipv4.tcp_pacing_ca_ratio (120%) of cwnd·mss/srtt in congestion avoidance (tcp_update_pacing_rate).
PACING_CA_RATIO = 1.2
# ... and net.ipv4.tcp_pacing_ss_ratio (200%) in slow start while cwnd < ssthresh/2 (tcp_update_pacing_rate).
PACING_SS_RATIO = 2.0
# The window a paced flow sends at after an RTO (see allreduce.sim._tcp._lost_repair_ack): tcp_enter_loss sets it
# to the packets in flight and one, 1 (tcp_timeout_mark_lost marks all that is out lost), and the resend's ACK
# newly delivers one segment (the rest were SACKed before), so slow start makes it 2; it grows no further while
# pacing keeps one segment in flight (slow start grows only while cwnd < 2·max_packets_out, tcp_is_cwnd_limited).
RTO_PACED_WINDOW = 2.0
# RFC 6298 §2.3 (tcp_rtt_estimator): srtt <- (1 - 1/8)·srtt + R/8 per RTT sample R.
SRTT_GAIN = 0.125
# An inflated srtt's excess after this many samples, (7/8)^64 ≈ 2e-4 of it, is not charged.
PACED_SAMPLES = 64


def window_reduction_seconds(rtt_s: FloatArray, packet_s: FloatArray) -> FloatArray:
    """What CUBIC's window reduction costs a flow whose window was its bandwidth-delay product (see the module
    docstring): ``min((1 − β)/2 · (1 + β)/3 · W · RTT, (1 − β)/4 · K)``, ``W = RTT/τ`` packets."""
    with np.errstate(divide="ignore", invalid="ignore"):
        window = np.where(packet_s > 0, rtt_s / packet_s, 0.0)
    linear = (1 - CUBIC_BETA) / 2 * (1 + CUBIC_BETA) / 3 * window * rtt_s
    cubic = (1 - CUBIC_BETA) / 4 * np.cbrt(window * (1 - CUBIC_BETA) / CUBIC_C)
    return np.asarray(np.minimum(linear, cubic), dtype=np.float64)


def loss_window_packets(q: FloatArray) -> FloatArray:
    """CUBIC's (and Reno's) average window at per-packet loss ``q``, in packets: ``√(1.5/q)`` (RFC 8312 §5.1);
    infinite without loss."""
    q = np.asarray(q, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return np.asarray(np.where(q > 0, np.sqrt(1.5 / np.where(q > 0, q, 1.0)), math.inf), dtype=np.float64)


def paced_seconds(
    rtt_s: FloatArray,
    sample_s: FloatArray,
    segments: FloatArray,
    window: FloatArray,
    packet_s: FloatArray,
    *,
    ratio: FloatArray | float = PACING_CA_RATIO,
) -> FloatArray:
    """What pacing adds to ``segments`` segments a flow sends after one RTT sample of ``sample_s`` (the module
    docstring): srtt becomes ``(1 − 1/8)·RTT + sample/8`` and each segment's ACK brings it back by an eighth of its
    excess, and segment ``j`` leaves ``max(τ, srtt_j/(r·w))`` after the one before (``w`` the window, ``r`` the
    pacing ``ratio``: 1.2 in congestion avoidance, 2 early in slow start), where ``max(τ, RTT/(r·w))`` would have
    done: with ``τ`` below both, ``8·(srtt_1 − RTT)·(1 − (7/8)^M)/(r·w)``."""
    srtt = (1 - SRTT_GAIN) * rtt_s + SRTT_GAIN * sample_s
    rate = ratio * window
    steady = np.maximum(packet_s, rtt_s / rate)
    extra = np.zeros(np.shape(rtt_s))
    for j in range(PACED_SAMPLES):
        due = segments > j
        if not due.any():
            break
        extra += np.where(due, np.maximum(packet_s, srtt / rate) - steady, 0.0)
        srtt = (1 - SRTT_GAIN) * srtt + SRTT_GAIN * rtt_s
    return extra


def rto_pacing_ratio(q: FloatArray) -> FloatArray:
    """The pacing ratio of a flow at loss ``q`` after an RTO in recovery, at its window :data:`RTO_PACED_WINDOW`:
    ``tcp_update_pacing_rate`` paces at 200% while ``cwnd < ssthresh/2`` (integers), else 120%. The RTO leaves
    ``ssthresh`` as the recovery set it (``tcp_enter_loss`` recomputes it only from Open or Disorder, or once
    ``high_seq`` is acknowledged), CUBIC's ``max(⌊β·cwnd⌋, 2)`` of the window the loss found, ``2W/(1 + β)`` on
    the sawtooth around the average ``W`` (:func:`loss_window_packets`)."""
    at_loss = 2 * loss_window_packets(q) / (1 + CUBIC_BETA)
    ssthresh = np.maximum(np.floor(CUBIC_BETA * np.minimum(at_loss, 1e9)), 2.0)
    slow_start = np.floor(ssthresh / 2) > RTO_PACED_WINDOW
    return np.asarray(np.where(slow_start, PACING_SS_RATIO, PACING_CA_RATIO), dtype=np.float64)
