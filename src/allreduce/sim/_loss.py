"""Packet loss and what a retransmission costs: TCP (fast retransmit or timeout) and RoCE go-back-N.

A transfer of B bytes is ``P = ceil(B / MTU)`` packets; each crosses the links of its path, and link ``l``
drops a packet with probability ``p_l``, independently. So a packet is lost with probability
``q = 1 − Π_l (1 − p_l)`` (on a sprayed route, whose links each carry a fraction ``w_l`` of the packets,
``q = 1 − Π_l (1 − p_l)^(w_l)``, the geometric mean over the paths), and the transfer loses at least one packet
with probability ``1 − (1 − q)^P``. What a loss adds to the transfer's delivery time, per fabric:

TCP (RFC 5681 §3.2 fast retransmit, RFC 6582 NewReno, RFC 6298 retransmission timer), per lost packet at
position ``i`` (0-based) of ``P``:

- at least ``DUPTHRESH = 3`` packets follow it: the third duplicate ACK triggers fast retransmit, and NewReno
  repairs one hole per round trip, so the loss costs one ``RTT``;
- fewer follow (a tail loss): no three duplicate ACKs arrive, the retransmission timer expires, and the packet
  is resent ``RTO`` after it was first sent: ``RTO + τ`` (``τ = MTU / rate``, resending it). RFC 6298 §2.4
  sets the minimum RTO to 1 s; Linux uses 200 ms (``TCP_RTO_MIN``), tuned data-centre stacks 1-4 ms.
- a lost retransmission waits for the timer again, doubled each time (RFC 6298 §5.5): ``RTO·(2^m − 1)``
  more for m consecutive losses of the resent packet.

RoCE, i.e. an InfiniBand reliable connection (IBTA Vol. 1 §9.7: go-back-N, the receiver discards packets
after a gap in the packet sequence numbers and answers with a NAK, a sequence error):

- loss at ``i < P − 1``: packet ``i + 1`` reveals the gap, the NAK returns, and the sender resends everything
  from ``i``. Sent at ``(i+1)τ``, packet ``i + 1`` arrives ``τ + lat`` later; the NAK is back ``RTT + 2τ`` after
  packet ``i`` left, and the ``P − i`` packets from ``i`` on take ``(P − i)τ`` again: delivery ends
  ``RTT + 2τ`` later than without the loss, wherever ``i`` is;
- loss of the last packet: nothing reveals it, the sender's local ACK timeout fires
  (``4.096 µs · 2^timeout``, IBTA Vol. 1 §9.7.6.1.3; NCCL's ``NCCL_IB_TIMEOUT`` and HCCL's ``HCCL_RDMA_TIMEOUT``
  set the exponent, 20 by default in HCCL's documentation: 4.29 s), then the packet is resent: ``RTO + τ``;
- the resent run of ``P − i`` packets may lose again, and costs the same way (drawn, not neglected).

``RTT`` is twice the path's one-way latency (the NAK or ACK returns the same way). A loss does not change the
rates of other flows: the link idles or carries the resent bytes, which the flow-level model does not charge
to its neighbours.

That is the TCP model of the ``rfc6298`` stack (``LossModel(tcp="rfc6298")``). The ``linux`` stack (the default)
and ``tuned`` repair losses as Linux does (RACK-TLP on kernel timer ticks, delayed ACKs, CUBIC's window):
:mod:`allreduce.sim._tcp`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from allreduce.sim._bursts import first_loss, next_loss
from allreduce.sim._tcp import (
    GIVE_UP_AFTER,
    TCP_STACKS,
    LostTransfers,
    TcpStack,
    draw_repair_seconds,
)
from allreduce.topology import FloatArray, IntArray, Routes

__all__ = [
    "DUPTHRESH",
    "FABRICS",
    "GIVE_UP_AFTER",
    "ROCE_DEFAULT_MTU_BYTES",
    "ROCE_DEFAULT_TIMEOUT_S",
    "TCP_DEFAULT_MTU_BYTES",
    "TCP_DEFAULT_RTO_S",
    "TCP_DEFAULT_STACK",
    "LossModel",
    "draw_extra_seconds",
    "packet_loss_probability",
    "transfer_loss_probability",
]

FABRICS = ("roce", "tcp")
# RFC 5681 §3.2: fast retransmit after three duplicate ACKs.
DUPTHRESH = 3
# Linux's TCP_RTO_MIN (RFC 6298 §2.4 asks for 1 s; Linux, and most data-centre stacks, use less).
TCP_DEFAULT_RTO_S = 0.2
# The TCP stack LossModel charges unless told: a stock Linux kernel's recovery (see allreduce.sim._tcp); the
# model as it was first written is "rfc6298".
TCP_DEFAULT_STACK = "linux"
# An Ethernet MTU of 1,500 bytes: TCP's packets.
TCP_DEFAULT_MTU_BYTES = 1500
# RoCE's usual 4 KiB path MTU (the largest InfiniBand MTU).
ROCE_DEFAULT_MTU_BYTES = 4096
# The InfiniBand local ACK timeout, 4.096 µs · 2^exponent, at exponent 20 (HCCL's documented default).
ROCE_TIMEOUT_UNIT_S = 4.096e-6
ROCE_DEFAULT_TIMEOUT_EXPONENT = 20
ROCE_DEFAULT_TIMEOUT_S = ROCE_TIMEOUT_UNIT_S * 2**ROCE_DEFAULT_TIMEOUT_EXPONENT
# The longest mean burst of lost packets accepted (packets): beyond it a burst outlasts every timer.
MAX_BURST = 1000.0
# A resent packet lost GIVE_UP_AFTER times in a row is an error in a real stack (the connection is torn down);
# the model stops drawing there, and refuses loss rates at which that is not negligible.
_MAX_RESENDS = GIVE_UP_AFTER


@dataclass(frozen=True)
class LossModel:
    """Packet loss on every link (``probability`` per packet), or ``links``: (link name, probability) overrides;
    ``fabric`` chooses the retransmission model ("roce" go-back-N or "tcp"); ``mtu_bytes`` and ``rto_s`` default to the
    fabric's (4 KiB and the IB ACK timeout for RoCE; 1,500 B and 200 ms for TCP). ``tcp`` names the TCP stack
    (:data:`allreduce.sim._tcp.TCP_STACKS`: "linux", "linux-gro", "linux-paced", "tuned", "rfc6298"), whose
    ``rto_min`` ``rto_s`` replaces if given; ``agreement``: on a RACK-TLP stack, every collective starts with the
    runtime's agreement (an all-gather of small messages, Bruck's, ceil(log2 N) steps), whose losses are charged too;
    ``barrier``: a barrier (one more such all-gather) precedes every collective, as in a benchmark that times each
    repetition from the barrier before it (the emulated clusters' runs); ``burst``: the mean length of a burst of lost
    packets on every lossy link (1: independent; above: a Gilbert–Elliott chain of the same long-run rate, as
    ``allreduce emulate up --loss LINK=ge:p=P,burst=B`` injects, see :func:`allreduce.sim._bursts.gilbert_elliott`);
    ``burst_hold_s``: how long a burst's bad state lasts on a link no packet crosses (0: the chain is clocked by other
    traffic; the emulator's chain, clocked by the link's own packets, holds it up to a second:
    :class:`allreduce.sim._bursts.Bursts`)."""

    probability: float = 0.0
    fabric: str = "roce"
    mtu_bytes: int | None = None
    rto_s: float | None = None
    links: tuple[tuple[str, float], ...] = ()
    tcp: str = TCP_DEFAULT_STACK
    agreement: bool = True
    barrier: bool = False
    burst: float = 1.0
    burst_hold_s: float = 0.0

    def __post_init__(self) -> None:
        if self.tcp not in TCP_STACKS:
            raise ValueError(f"loss: tcp must be one of {', '.join(TCP_STACKS)}, got {self.tcp!r}")
        if self.fabric not in FABRICS:
            raise ValueError(f"loss: fabric must be one of {', '.join(FABRICS)}, got {self.fabric!r}")
        for what, p in [("loss probability", self.probability), *((f"loss on {n}", q) for n, q in self.links)]:
            if not (math.isfinite(p) and 0 <= p < 1):
                raise ValueError(f"{what}: must be a probability in [0, 1), got {p}")
        if not (math.isfinite(self.burst) and 1 <= self.burst <= MAX_BURST):
            raise ValueError(f"loss: the mean burst must be 1 to {MAX_BURST:g} packets, got {self.burst}")
        if not (math.isfinite(self.burst_hold_s) and self.burst_hold_s >= 0):
            raise ValueError(f"loss: a burst's hold must be a finite time >= 0, got {self.burst_hold_s}")
        if self.mtu_bytes is not None and self.mtu_bytes <= 0:
            raise ValueError(f"loss: the MTU must be > 0 bytes, got {self.mtu_bytes}")
        if self.rto_s is not None and not (math.isfinite(self.rto_s) and self.rto_s > 0):
            raise ValueError(f"loss: the retransmission timeout must be a finite time > 0, got {self.rto_s}")

    def __bool__(self) -> bool:
        return self.probability > 0 or any(p > 0 for _, p in self.links)

    @property
    def mtu(self) -> int:
        if self.mtu_bytes is not None:
            return self.mtu_bytes
        return TCP_DEFAULT_MTU_BYTES if self.fabric == "tcp" else ROCE_DEFAULT_MTU_BYTES

    @property
    def rto(self) -> float:
        """The retransmission timeout (RoCE, rfc6298) or the minimum RTO (RACK-TLP stacks)."""
        if self.rto_s is not None:
            return self.rto_s
        if self.fabric == "tcp":
            return float(TCP_STACKS[self.tcp].rto_min_s)
        return float(ROCE_DEFAULT_TIMEOUT_S)

    @property
    def stack(self) -> TcpStack:
        """The TCP stack's settings, with ``rto_s`` as its minimum RTO if given."""
        return TCP_STACKS[self.tcp].with_rto_min(self.rto_s)

    @property
    def rack_tlp(self) -> bool:
        """Whether losses are repaired as Linux's RACK-TLP does (TCP, a stack other than rfc6298)."""
        return self.fabric == "tcp" and self.stack.rack_tlp

    @property
    def held_bursts(self) -> bool:
        """Whether a burst can outlast a lost tail on a silent link and be ended by the next barrier's frames
        (bursty loss on a chain clocked by the link's packets, repetitions timed from a barrier)."""
        return self.burst > 1 and self.burst_hold_s > 0 and self.barrier


def transfer_loss_probability(size_bytes: float, packet_loss: float, mtu_bytes: int) -> float:
    """P(a transfer of ``size_bytes`` loses at least one packet) = 1 − (1 − q)^ceil(B/MTU)."""
    packets = math.ceil(size_bytes / mtu_bytes) if size_bytes > 0 else 0
    return -math.expm1(packets * math.log1p(-packet_loss))


def packet_loss_probability(routes: Routes, link_probability: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Per flow, the probability that one of its packets is lost, and per route entry the hazard
    ``−w·ln(1 − p_l)`` of its link (a flow's packet is dropped at an entry with probability ∝ its hazard)."""
    hazard = -routes.weight * np.log1p(-link_probability[routes.link])
    per_flow = np.bincount(routes.flow_of_entry(), weights=hazard, minlength=routes.num_flows)
    return -np.expm1(-per_flow), hazard


def draw_extra_seconds(
    rng: np.random.Generator, model: LossModel, transfers: LostTransfers
) -> tuple[FloatArray, IntArray]:
    """The delay each of these transfers suffers, given that it lost at least one packet (for a RACK-TLP stack:
    :func:`allreduce.sim._tcp.draw_repair_seconds`). Returns (extra seconds, how many retransmission timeouts
    fired)."""
    if model.rack_tlp:
        return draw_repair_seconds(rng, model.stack, transfers)
    q, packets, rtt_s, packet_s, bursts = (
        transfers.q, transfers.packets, transfers.rtt_s, transfers.packet_s, transfers.bursts
    )  # fmt: skip
    extra = np.zeros(q.size)
    timeout = np.zeros(q.size, dtype=np.int64)
    rto = model.rto
    first = first_loss(rng, q if bursts is None else bursts.entry_q, packets)
    if model.fabric == "tcp":
        lost = np.arange(q.size)
        position = first
        while lost.size:
            tail = position >= packets[lost] - DUPTHRESH
            extra[lost] += np.where(tail, rto + packet_s[lost], rtt_s[lost])
            timeout[lost] += tail
            # The resent packet is lost again with probability q: another timeout, doubled (RFC 6298 §5.5).
            again = rng.geometric(1 - q[lost]) - 1
            again = np.minimum(again, _MAX_RESENDS)
            extra[lost] += rto * (np.exp2(again) - 1)
            timeout[lost] += again
            position = next_loss(rng, q, bursts, position, lost)
            keep = position < packets[lost]
            lost, position = lost[keep], position[keep]
        return extra, timeout
    # RoCE go-back-N: each run from the lost packet on may lose again.
    lost = np.arange(q.size)
    remaining = packets.copy()
    position = first
    for _ in range(_MAX_RESENDS * 64):
        tail = position >= remaining[lost] - 1
        extra[lost] += np.where(tail, rto + packet_s[lost], rtt_s[lost] + 2 * packet_s[lost])
        timeout[lost] += tail
        remaining[lost] -= position
        # The resent run: does it lose a packet, and where first?
        u = rng.random(lost.size)
        at_least_one = -np.expm1(remaining[lost] * np.log1p(-q[lost]))
        lost = lost[u < at_least_one]
        if lost.size == 0:
            break
        position = first_loss(rng, q[lost], remaining[lost])
    return extra, timeout
