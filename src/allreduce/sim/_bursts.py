"""Where a transfer's packets are lost: independently at a packet loss rate, or in bursts as a Gilbert–Elliott
chain drops them (the emulator's firewall runs one per link). What a loss then costs is :mod:`allreduce.sim._tcp`'s
(TCP's recovery) and :mod:`allreduce.sim._loss`'s (RoCE, RFC 6298)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from allreduce.topology import FloatArray, IntArray

__all__ = ["Bursts", "chain_loss", "first_loss", "gilbert_elliott", "next_loss", "resend_loss"]


@dataclass(frozen=True, eq=False)
class Bursts:
    """Losses in bursts, as a Gilbert–Elliott chain drops them (a loss-free good state, a bad state that drops
    every packet, left after each packet with probability ``1/burst``): per transfer, the probability
    ``entry_q`` that a packet of the good state starts a burst, and ``stay`` that the packet after a lost one
    is lost too (:func:`gilbert_elliott`). ``hold_s``: how long a bad state lasts on a link no packet crosses
    (a chain clocked by the link's packets, as the emulator's firewall runs it, ends a bad state only with a
    packet, or ``hold_s`` after it began); 0: the chain is clocked by other traffic, and a packet sent after
    a pause finds it as any packet does. ``cleared``: per transfer, the packets of other connections that cross
    the held link after the burst and before the probe's resend (None: none), each ending the bad state with
    ``1/burst`` (:func:`chain_loss`)."""

    entry_q: FloatArray
    stay: FloatArray
    hold_s: float = 0.0
    cleared: FloatArray | None = None


def gilbert_elliott(p: FloatArray, burst: float) -> tuple[FloatArray, FloatArray]:
    """A Gilbert–Elliott chain of long-run loss ``p`` and mean burst ``burst`` packets, as the emulator's
    firewall runs it: per good packet it goes bad with ``g = p/(burst(1 − p) + p)``; after a bad (lost) packet
    it stays bad with ``1 − 1/burst``, and if it left, the next packet may start a burst at once (``g``). So
    the packet after a lost one is lost with ``stay = 1 − 1/burst + g/burst``; the long-run rate is
    ``g/(g + (1 − g)/burst) = p``. Returns (g, stay)."""
    p = np.asarray(p, dtype=np.float64)
    entry = p / (burst * (1 - p) + p)
    return entry, (1 - 1 / burst) + entry / burst


def chain_loss(bursts: Bursts, packets_between: FloatArray, *, after_loss: bool) -> FloatArray:
    """The probability that a packet is lost on a Gilbert–Elliott chain clocked by every packet that crosses the
    link (:func:`gilbert_elliott`), ``packets_between`` packets after a delivered one (``after_loss`` False) or a
    lost one (True). A packet finds the chain bad with ``b_k`` and is lost with ``L_k = b_k + (1 − b_k)·g``, and
    the chain stays bad after it with ``a = 1 − 1/burst`` (``a = (stay − g)/(1 − g)``), so ``b_(k+1) = a·L_k``:
    ``b_n = b* + (b_0 − b*)·λ^n`` with ``λ = a(1 − g)``, ``b* = a·g/(1 − λ)``, and ``b_0`` 0 behind a delivered
    packet (it left the chain good), ``a`` behind a lost one. The packet is lost with ``L_n``: ``g`` right behind
    a delivered packet, ``stay`` right behind a lost one, the long-run rate after many."""
    g = bursts.entry_q
    stay_bad = (bursts.stay - g) / (1 - g)
    decay = stay_bad * (1 - g)
    settled = stay_bad * g / (1 - decay)
    start = stay_bad if after_loss else 0.0
    bad = settled + (start - settled) * decay ** np.maximum(packets_between, 0.0)
    return np.asarray(bad + (1 - bad) * g, dtype=np.float64)


def resend_loss(bursts: Bursts, packets_between: FloatArray) -> FloatArray:
    """The probability that a resend sent on SACKs is lost, ``packets_between`` packets after the delivered one
    whose SACK revealed the loss (:func:`chain_loss`): ``g`` right behind it, the long-run rate after many. A
    chain that went bad within the burst's own packets is that burst, already drawn; this is a new one."""
    return chain_loss(bursts, packets_between, after_loss=False)


def next_loss(
    rng: np.random.Generator, q: FloatArray, bursts: Bursts | None, after: IntArray, which: IntArray
) -> IntArray:
    """Position of the next lost packet after ``after`` in transfers ``which`` (unconditioned: may be beyond
    the transfer): a geometric gap at ``q``, or with ``bursts`` the next packet with probability ``stay`` and
    else a geometric gap at ``entry_q``."""
    if bursts is None:
        return after + rng.geometric(q[which]).astype(np.int64)
    gap = rng.geometric(bursts.entry_q[which]).astype(np.int64)
    return after + np.where(rng.random(which.size) < bursts.stay[which], 1, gap)


def first_loss(rng: np.random.Generator, q: FloatArray, packets: IntArray) -> IntArray:
    """Position of the first lost packet among ``packets`` iid Bernoulli(q) ones, given at least one is lost
    (inverse CDF of the truncated geometric distribution)."""
    u = rng.random(q.size)
    log_keep = np.log1p(-q)
    at_least_one = -np.expm1(packets * log_keep)
    position = np.floor(np.log1p(-u * at_least_one) / log_keep).astype(np.int64)
    return np.minimum(position, packets - 1)
