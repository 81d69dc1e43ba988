"""The window a loss finds: how many packets a TCP flow has in flight when one of them is lost, drawn from the
stationary law of CUBIC's TCP-friendly window under random loss, with Linux's floors. The loss recovery that asks
(:func:`allreduce.sim._tcp.draw_repair_seconds`) needs more than the average: whether anything is sent after a
repair depends on whether the window holds enough packets behind the loss, and at high loss rates windows of 2–4
packets are common although the average is 6–9.

The chain, one step per round trip, a flow with data to send (each rule from the RFC or the kernel function named):

- a round sends ``W = ⌊w⌋`` packets, each lost with probability ``q`` (independent loss);
- no loss: ``w ← w + α`` in congestion avoidance, ``α = 3(1 − β)/(1 + β)`` packets per round (CUBIC's
  TCP-friendly region, RFC 8312 §4.2: at these windows and round trips of milliseconds the cubic term grows far
  slower), or ``w ← min(2w, ssthresh)`` in slow start (RFC 5681 §3.1);
- a loss: ``ssthresh ← max(⌊β·W⌋, 2)`` (``cubictcp_recalc_ssthresh``, β = 0.7) and the recovery ends with the
  window at ``ssthresh`` (``tcp_end_cwnd_reduction``, RFC 6937), no growth in the round it takes;
- unless the repair or its ACK is lost (``1 − (1 − q)(1 − q_ack)``) while nothing follows the repair: with fewer
  than ``DUPTHRESH + 2`` packets in flight, proportional rate reduction lets no new data out after the repair (it
  needs a SACK beyond the three that found the loss, ``tcp_cwnd_reduction``), so the RTO ends the recovery:
  ``w ← 1`` (``tcp_enter_loss``), slow start back to ``ssthresh``.

The window a loss finds is ``W`` of a round with losses, one draw per lost packet. Without the floors and the
RTO this is the AIMD whose average window is ``√(α(1 + β)/(2(1 − β)q)) = √(1.5/q)`` (RFC 8312 §5.1,
:func:`allreduce.sim._tcp_window.loss_window_packets`); the chain is run where that average is at most
:data:`CHAIN_MAX_WINDOW` packets, above which a window below ``DUPTHRESH + 2`` needs several cuts in a row
without a loss-free round between (probability below ``(W·q)^3``, under 1e-3 there) and the average is used.
Checked: the chain's mean against ``√(1.5/q)`` at low loss (``test_tcp_cwnd.py``); its windows at every link
1e-2 against ``tcp_probe`` on the emulated clusters (docs/tail.md, "The window a loss finds").
"""

from __future__ import annotations

import functools
import math

import numpy as np
import numpy.typing as npt

from allreduce.sim._tcp_window import CUBIC_BETA
from allreduce.topology import FloatArray

__all__ = ["CHAIN_MAX_WINDOW", "FOLLOW_MIN_WINDOW", "draw_loss_windows", "loss_window_law"]

# RFC 8312 §4.2: CUBIC's additive increase in its TCP-friendly region, packets per round trip.
CUBIC_ALPHA = 3 * (1 - CUBIC_BETA) / (1 + CUBIC_BETA)
# Linux's floor on ssthresh after a loss (cubictcp_recalc_ssthresh: max(cwnd·β, 2)).
SSTHRESH_MIN = 2
# The least window with data sent after a repair: DUPTHRESH (3) SACKs find the loss, a fourth lets proportional
# rate reduction send past the repair (tcp_cwnd_reduction), so DUPTHRESH + 1 packets behind the loss.
FOLLOW_MIN_WINDOW = 5
# Above this average window the chain is not run (see the module docstring).
CHAIN_MAX_WINDOW = 40.0
# The chain's size: parallel flows, rounds before recording (started at the average), rounds recorded.
_FLOWS = 2000
_BURN_IN_ROUNDS = 150
_ROUNDS = 400


def _key(q: float) -> float:
    """``q`` to three significant digits: the chain's cache key (loss rates are measured to about that)."""
    return 0.0 if q <= 0 else float(f"{q:.3g}")


@functools.lru_cache(maxsize=256)
def loss_window_law(q: float, q_ack: float) -> npt.NDArray[np.float64]:
    """The windows losses found in the chain of the module docstring at data loss ``q`` and ACK loss ``q_ack``,
    sorted (one per lost packet); deterministic: seeded by the two rates."""
    rng = np.random.default_rng([round(q * 1e12), round(q_ack * 1e12), 37])
    w = np.full(_FLOWS, math.sqrt(1.5 / q))
    ssthresh = np.full(_FLOWS, np.inf)
    rto_q = 1 - (1 - q) * (1 - q_ack)
    found: list[npt.NDArray[np.float64]] = []
    for round_ in range(_BURN_IN_ROUNDS + _ROUNDS):
        window = np.maximum(np.floor(w), 1.0)
        lost = rng.binomial(window.astype(np.int64), q)
        hit = lost > 0
        if round_ >= _BURN_IN_ROUNDS:
            found.append(np.repeat(window[hit], lost[hit]))
        cut = np.maximum(np.floor(CUBIC_BETA * window), SSTHRESH_MIN)
        timeout = hit & (window < FOLLOW_MIN_WINDOW) & (rng.random(_FLOWS) < rto_q)
        slow = ~hit & (w < ssthresh)
        w = np.where(hit, np.where(timeout, 1.0, cut), np.where(slow, np.minimum(2 * w, ssthresh), w + CUBIC_ALPHA))
        ssthresh = np.where(hit, cut, ssthresh)
    law = np.sort(np.concatenate(found))
    law.flags.writeable = False
    return law


def draw_loss_windows(rng: np.random.Generator, q: FloatArray, q_ack: FloatArray) -> FloatArray:
    """One window a loss finds per element (:func:`loss_window_law`), where the average ``√(1.5/q)`` is at most
    :data:`CHAIN_MAX_WINDOW`; elsewhere that average (infinite without loss)."""
    q = np.asarray(q, dtype=np.float64)
    q_ack = np.broadcast_to(np.asarray(q_ack, dtype=np.float64), q.shape)
    with np.errstate(divide="ignore"):
        average = np.where(q > 0, np.sqrt(1.5 / np.where(q > 0, q, 1.0)), math.inf)
    out = average.copy()
    chained = average <= CHAIN_MAX_WINDOW
    if not chained.any():
        return out
    u = rng.random(q.shape)[chained]
    # one law per distinct pair of rates (a few: the paths' hop counts), each looked up by its rounded key
    pairs, inverse = np.unique(np.stack([q[chained], q_ack[chained]], axis=1), axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    drawn = np.empty(u.size)
    for i, (qi, ai) in enumerate(pairs):
        law = loss_window_law(_key(float(qi)), _key(float(ai)))
        mine = inverse == i
        drawn[mine] = law[np.minimum((u[mine] * law.size).astype(np.int64), law.size - 1)]
    out[chained] = drawn
    return out
