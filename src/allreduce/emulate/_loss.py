"""Packet loss on an emulated cluster's links, with the kernel's own firewall, and the rate it really dropped.

A lossy direction ``a->b`` drops TCP packets as they arrive at ``b``, on the veth end in ``b``'s namespace, in
the ``raw`` table's PREROUTING chain (before routing: a router and a host alike):

- independent loss, probability P per packet: ``-m statistic --mode random --probability P -j DROP``;
- bursty loss, a Gilbert–Elliott chain with a loss-free good state and a bad state that drops every packet:
  a packet in the good state moves the chain to the bad state with probability ``g``; every packet in the
  bad state (the one that moved it there included) is dropped, and the chain leaves after it with probability
  ``1/burst`` (the next packet may enter again, probability ``g``), so the chain goes bad → good with probability
  ``r = (1 − g)/burst`` per packet, bursts last ``1/r = burst/(1 − g) ≈ burst`` packets on average, and the
  long-run rate is ``p = g / (g + r) = g·burst / (g·burst + 1 − g)``, i.e. ``g = p / (burst·(1 − p) + p)``.
  The state is one entry of the ``recent`` match whose address mask is 0.0.0.0 (every packet maps to it):
  present means bad. A bad state also ends :data:`BAD_STATE_MAX_S` after it began: the chain advances only with
  packets, and a connection waiting out its retransmission timer sends none (at 100 Mbit/s a burst of a few packets
  lasts well under a millisecond, so the limit changes nothing while packets flow).

Only TCP is dropped: the collective's data, its ACKs and its control messages. The UDP echo that measures the
hop latency is left alone. A counting rule before the drops counts every TCP packet that arrives, so the
realised rate is drops / arrivals, read back from the rules' counters (:func:`read_counters`).

Wire-true packets: TCP hands the device segments of up to 64 KiB (GSO) that a veth forwards whole, so a drop
would lose ~20 segments at once and a token bucket would count one packet for them. Every veth end is built
with ``gso_max_segs 1`` (:data:`GSO_MAX_SEGS`): TCP then sends one MSS per packet and every hop sees the packets
a wire would carry.
"""

from __future__ import annotations

import math
import re
import subprocess
from dataclasses import dataclass

from allreduce.emulate._layout import Layout

__all__ = ["BAD_STATE_MAX_S", "GSO_MAX_SEGS", "LossSpec", "loss_commands", "read_counters"]

BAD_STATE_MAX_S = 1
"""The longest a bursty link's bad state lasts, in seconds (the ``recent`` match counts whole seconds)."""

GSO_MAX_SEGS = 1
"""Segments per packet a veth end accepts: one, so every packet is one MSS on the wire."""

MAX_BURST = 1000.0
"""Longest mean burst accepted (packets): beyond it a burst outlasts every retransmission timer."""

_COMMAND_TIMEOUT_S = 30.0
_COMMENT = re.compile(r"/\* arloss(\d+):(in|drop) \*/")


@dataclass(frozen=True)
class LossSpec:
    """Loss on one direction of a cable: the long-run ``probability`` per packet, in bursts of ``burst``
    packets on average (1: independent)."""

    probability: float
    burst: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.probability) and 0 < self.probability < 1):
            raise ValueError(f"loss {self.probability}: a probability must be in (0, 1)")
        if not (math.isfinite(self.burst) and 1 <= self.burst <= MAX_BURST):
            raise ValueError(f"loss burst {self.burst}: the mean burst must be 1 to {MAX_BURST:g} packets")

    @property
    def bursty(self) -> bool:
        return self.burst > 1

    def enter_probability(self) -> float:
        """The Gilbert–Elliott chain's probability of going bad per good packet (see the module docstring)."""
        p, b = self.probability, self.burst
        return p / (b * (1 - p) + p)

    def leave_probability(self) -> float:
        """The chain's probability of going from bad to good per packet: ``(1 − g)/burst``."""
        return (1 - self.enter_probability()) / self.burst

    def describe(self) -> str:
        return f"ge:p={self.probability:g},burst={self.burst:g}" if self.bursty else f"{self.probability:g}"

    @classmethod
    def parse(cls, text: str, *, what: str) -> LossSpec:
        """``1e-3`` (independent) or ``ge:p=1e-3,burst=4`` (Gilbert–Elliott); ValueError naming ``what``."""
        body = text.strip()
        try:
            if not body.startswith("ge:"):
                return cls(float(body))
            fields = dict(part.split("=", 1) for part in body[3:].split(","))
            if set(fields) != {"p", "burst"}:
                raise ValueError("expected ge:p=P,burst=B")
            return cls(float(fields["p"]), float(fields["burst"]))
        except ValueError as exc:
            raise ValueError(
                f"{what} {text!r}: {exc}; write P (e.g. 1e-3) or ge:p=P,burst=B (e.g. ge:p=1e-3,burst=4)"
            ) from None

    def to_json(self) -> list[float]:
        return [self.probability, self.burst]


def _receiving_end(built: Layout, link: int) -> tuple[str, str]:
    """(namespace, device) where packets of directed ``link`` arrive."""
    for cable in built.cables:
        if cable.link_ab == link:
            return built.namespaces[cable.b], cable.b_dev
        if cable.link_ba == link:
            return built.namespaces[cable.a], cable.a_dev
    raise ValueError(f"link {built.topology.link_name(link)} is not a cable of this emulation")


def loss_commands(built: Layout, losses: dict[int, LossSpec]) -> list[list[str]]:
    """The iptables commands that make every link in ``losses`` (directed link index -> spec) drop packets."""
    commands = []
    for link, spec in sorted(losses.items()):
        ns, dev = _receiving_end(built, link)
        ipt = ["ip", "netns", "exec", ns, "iptables", "-w", "-t", "raw"]
        arrive = [*ipt, "-A", "PREROUTING", "-i", dev, "-p", "tcp"]
        drop = ["-m", "comment", "--comment", f"arloss{link}:drop", "-j", "DROP"]
        commands.append([*arrive, "-m", "comment", "--comment", f"arloss{link}:in"])
        if not spec.bursty:
            commands.append(
                [*arrive, "-m", "statistic", "--mode", "random", "--probability", f"{spec.probability:.9g}", *drop]
            )
            continue
        chain, state = f"ARGE{link}", ["-m", "recent", "--name", f"arge{link}", "--mask", "0.0.0.0"]
        commands += [
            [*ipt, "-N", chain],
            # bad: every packet dropped; the chain leaves the bad state after it with probability 1/burst
            [*ipt, "-A", chain, "-m", "statistic", "--mode", "random", "--probability", f"{1 / spec.burst:.9g}",
             *state, "--remove", *drop],
            [*ipt, "-A", chain, *drop],
            # good: a packet turns the chain bad with probability g (and the next rule drops it, the burst's first)
            [*arrive, "-m", "statistic", "--mode", "random", "--probability", f"{spec.enter_probability():.9g}",
             *state, "--set"],
            # bad for at most BAD_STATE_MAX_S: the chain is clocked by packets, and a TCP waiting out its
            # retransmission timeout sends none, so without a time limit a lost retransmission finds the chain
            # still bad three times in four (burst 4), backing off until the collective times out
            [*arrive, *state, "--rcheck", "--seconds", str(BAD_STATE_MAX_S), "-j", chain],
        ]  # fmt: skip
    return commands


def read_counters(built: Layout, links: list[int]) -> dict[int, tuple[int, int]]:
    """(TCP packets that arrived, packets dropped) so far on every lossy link in ``links``, by link index."""
    out: dict[int, tuple[int, int]] = {}
    for ns in sorted({_receiving_end(built, link)[0] for link in links}):
        listing = subprocess.run(
            ["ip", "netns", "exec", ns, "iptables", "-w", "-t", "raw", "-L", "-v", "-x", "-n"],
            capture_output=True,
            text=True,
            timeout=_COMMAND_TIMEOUT_S,
            check=True,
        ).stdout
        for line in listing.splitlines():
            match = _COMMENT.search(line)
            fields = line.split()
            if match is None or not fields or not fields[0].isdigit():
                continue
            link, kind = int(match.group(1)), match.group(2)
            arrived, dropped = out.get(link, (0, 0))
            if kind == "in":
                arrived += int(fields[0])
            else:
                dropped += int(fields[0])
            out[link] = (arrived, dropped)
    return {link: out.get(link, (0, 0)) for link in links}
