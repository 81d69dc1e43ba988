"""Packet loss on an emulated cluster's links, with the kernel's own firewall (nftables), and the rate it really
dropped.

A lossy direction ``a->b`` drops TCP packets as they arrive at ``b``, on the veth end in ``b``'s namespace. Each
namespace with a lossy end gets one nftables table, ``ip arloss`` (:data:`LOSS_TABLE`), whose base chain ``arrive``
hooks prerouting at the ``raw`` priority (before conntrack and routing: a router and a host alike) and sends every
TCP packet that arrives on a lossy device, counted by the named counter ``in<link>``, to that link's chain
``link<link>``, whose drops the counter ``drop<link>`` counts. A random draw is ``numgen random mod M < x·M``
(:data:`RANDOM_MOD`: probabilities in steps of 1e-9, enough for a burst's entry ``g`` of 2.5e-5 at 1e-4).

- independent loss, probability P per packet: the draw ``< P·M`` drops it;
- bursty loss, a Gilbert–Elliott chain with a loss-free good state and a bad state that drops every packet:
  a packet in the good state moves the chain to the bad state with probability ``g``; every packet in the
  bad state (the one that moved it there included) is dropped, and the chain leaves after it with probability
  ``1/burst`` (the next packet may enter again, probability ``g``), so the chain goes bad → good with probability
  ``r = (1 − g)/burst`` per packet, bursts last ``1/r = burst/(1 − g) ≈ burst`` packets on average, and the
  long-run rate is ``p = g / (g + r) = g·burst / (g·burst + 1 − g)``, i.e. ``g = p / (burst·(1 − p) + p)``.
  The state is the one element of a set with timeouts, ``bad<link>`` (its key is the packet's protocol, TCP for
  every packet the chain sees): present means bad. The entering rule adds it (``add @bad…``, which neither
  refreshes nor extends an element already there), the leaving rule deletes it (``delete @bad…``), and it
  expires on its own ``T`` after the packet that began the burst (:func:`bad_state_timeout_s`).

Why the bad state expires, and when. The chain is clocked by the link's packets, and a connection waiting out its
probe timer or its RTO sends none across the link, so a bad state nothing ends would take the resend 200 ms later,
and each backed-off one after it, with ``1 − 1/burst``. No real link does that: a burst of losses is a stretch of
wire time (interference, a flapping optic, a full buffer), microseconds to a few milliseconds, and a repair 200 ms
later finds it long over (what the simulator's default :class:`allreduce.sim.LossModel` charges). So ``T`` is the
shortest the kernel's timers allow that never cuts a burst of the chain's law short while the link's packets flow:
the burst only one in :data:`BURST_TAIL` (10^4) outlasts, ``n`` packets after its first where ``(1 − 1/burst)^n ≤
1e-4`` (33 at bursts of 4), arriving back to back at the link's shaped rate in full frames (:data:`FRAME_BYTES`:
121 µs each at 100 Mbit/s, 4.0 ms for the 33), and one jiffy more, rounded up to whole jiffies. A set element's
timeout is kept in jiffies (``nf_msecs_to_jiffies64`` truncates the milliseconds asked) and the element expires
at the tick that completes it (``nft_set_elem_expired``: ``jiffies >= expiration``), so it lives between ``T − J``
and ``T``, ``J`` the jiffy (4 ms at HZ=250, read from the coarse clock's resolution: :func:`jiffy_s`). At HZ=250
and 100 Mbit/s, bursts of 4: ``T`` = 8 ms, a bad state that ends 4–8 ms after its burst began (``T`` = 12 ms on
a 50 Mbit/s link, the 4:1 Clos's uplinks). Measured on the ring's own packets, the packet after a dropped one is
dropped too with the chain's ``stay`` within 4 ms of it and never after 8 ms (docs/tail.md). An ``xt_recent``
entry, the earlier chain's state, counts whole seconds: its bad state lasted up to 1 s, and a resent packet met
it one RTO and more after the loss, 1–4.5 s chains of backed-off RTOs no link has.

What ``T`` still holds: a repair sent within it meets the state the burst left. RACK's reordering timer
(``min_rtt/4 + 2 ms``, 4–8 ms after the loss at HZ=250) and the loss probe armed with several packets out
(``2·srtt + 2 ms``, also 4–8 ms) may; the one-packet probe (``2·srtt + rto_min``, 200 ms and more) and every
RTO never do. The predictions of ``emulate run`` pass the bad state's mean life, ``T − J/2``, as the tail model's hold
(:func:`burst_hold_s`).

Only TCP is dropped: the collective's data, its ACKs and its control messages. The UDP echo that measures the
hop latency is left alone. The realised rate is drops / arrivals, read back from the named counters
(:func:`read_counters`). Removing a namespace removes its table with it.

Wire-true packets: TCP hands the device segments of up to 64 KiB (GSO) that a veth forwards whole, so a drop
would lose ~20 segments at once and a token bucket would count one packet for them. Every veth end is built
with ``gso_max_segs 1`` (:data:`GSO_MAX_SEGS`): TCP then sends one MSS per packet and every hop sees the packets
a wire would carry.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

from allreduce.emulate._layout import Layout

__all__ = [
    "BURST_TAIL",
    "FRAME_BYTES",
    "GSO_MAX_SEGS",
    "LOSS_TABLE",
    "RANDOM_MOD",
    "LossSpec",
    "bad_state_timeout_s",
    "burst_hold_s",
    "jiffy_s",
    "loss_commands",
    "lossy_end",
    "read_counters",
]

GSO_MAX_SEGS = 1
"""Segments per packet a veth end accepts: one, so every packet is one MSS on the wire."""

MAX_BURST = 1000.0
"""Longest mean burst accepted (packets): beyond it a burst outlasts every retransmission timer."""

LOSS_TABLE = "arloss"
"""The nftables table (family ``ip``) of the loss rules in every namespace that has a lossy link's far end."""

RANDOM_MOD = 1_000_000_000
"""The range of the rules' random draws (``numgen random mod``): a probability is kept in steps of 1e-9."""

BURST_TAIL = 1e-4
"""The share of a chain's bursts that may outlast its bad state's timeout while the link's packets flow."""

FRAME_BYTES = 1514
"""A full packet on a lossy link as its token bucket counts it: one MSS (1,448 bytes), 52 bytes of TCP/IP headers
(timestamps on) and the 14-byte Ethernet header."""

_CLOCK_MONOTONIC_COARSE = 6  # <linux/time.h>; the os module does not name it
_COMMAND_TIMEOUT_S = 30.0


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

    def longest_burst(self) -> int:
        """Packets after a burst's first that only :data:`BURST_TAIL` of the chain's bursts outlast: the least
        ``n`` with ``(1 − 1/burst)^n ≤ BURST_TAIL`` (0 for independent loss)."""
        if not self.bursty:
            return 0
        return math.ceil(math.log(BURST_TAIL) / math.log1p(-1 / self.burst))

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


def jiffy_s() -> float:
    """The kernel's timer tick, ``1/HZ`` seconds: the resolution of ``CLOCK_MONOTONIC_COARSE``, which advances
    once per tick (``posix_get_coarse_res`` returns ``TICK_NSEC``)."""
    return time.clock_getres(_CLOCK_MONOTONIC_COARSE)


def _jiffies(spec: LossSpec, rate_bps: float, jiffy: float) -> int:
    """The bad state's timeout in whole jiffies (the module docstring): the chain's longest burst at the link's
    rate, and one jiffy more, rounded up."""
    flowing_s = spec.longest_burst() * FRAME_BYTES * 8 / rate_bps
    return math.ceil(flowing_s / jiffy - 1e-9) + 1


def bad_state_timeout_s(spec: LossSpec, rate_bps: float, jiffy: float | None = None) -> float:
    """``T``: the timeout of a bursty link's bad state, shaped at ``rate_bps``, a whole number of jiffies
    (``jiffy``: :func:`jiffy_s` if None). The state lives between ``T − J`` and ``T`` after its burst began."""
    j = jiffy_s() if jiffy is None else jiffy
    return _jiffies(spec, rate_bps, j) * j


def lossy_end(built: Layout, link: int) -> tuple[str, str, float]:
    """(namespace, device, shaped rate in bit/s) of directed ``link``: where its packets arrive."""
    for cable in built.cables:
        if cable.link_ab == link:
            return built.namespaces[cable.b], cable.b_dev, cable.rate_ab_bps
        if cable.link_ba == link:
            return built.namespaces[cable.a], cable.a_dev, cable.rate_ba_bps
    raise ValueError(f"link {built.topology.link_name(link)} is not a cable of this emulation")


def burst_hold_s(built: Layout, losses: Mapping[int, LossSpec], jiffy: float | None = None) -> float:
    """The tail model's hold of a burst on a silent link (``LossModel.burst_hold_s``) for these rules: the mean
    life of a bad state, ``T − J/2`` (it is added at a uniform phase of a jiffy), the longest of the bursty links'
    (the model takes one for all); 0 if no link is bursty."""
    j = jiffy_s() if jiffy is None else jiffy
    timeouts = [bad_state_timeout_s(spec, lossy_end(built, link)[2], j) for link, spec in losses.items() if spec.bursty]
    return max(timeouts) - j / 2 if timeouts else 0.0


def _draw(probability: float) -> str:
    """The nft expression true with ``probability`` (in steps of 1/RANDOM_MOD, at least one)."""
    return f"numgen random mod {RANDOM_MOD} < {max(1, round(probability * RANDOM_MOD))}"


def _link_rules(link: int, spec: LossSpec, rate_bps: float, jiffy: float) -> list[str]:
    drop = f'counter name "drop{link}" drop'
    out = [f"add counter ip {LOSS_TABLE} in{link}", f"add counter ip {LOSS_TABLE} drop{link}"]
    chain = f"ip {LOSS_TABLE} link{link}"
    out.append(f"add chain {chain}")
    if not spec.bursty:
        return [*out, f"add rule {chain} {_draw(spec.probability)} {drop}"]
    timeout_ms = math.ceil(round(_jiffies(spec, rate_bps, jiffy) * jiffy * 1e3, 6))
    return [
        *out,
        f"add set ip {LOSS_TABLE} bad{link} {{ type inet_proto; flags dynamic,timeout; timeout {timeout_ms}ms; }}",
        # good: a packet turns the chain bad with probability g (an element already there is left as it is)
        f"add rule {chain} {_draw(spec.enter_probability())} add @bad{link} {{ ip protocol }}",
        f"add rule {chain} ip protocol != @bad{link} return",
        # bad: every packet dropped; the chain leaves the bad state after it with probability 1/burst
        f"add rule {chain} {_draw(1 / spec.burst)} delete @bad{link} {{ ip protocol }}",
        f"add rule {chain} {drop}",
    ]


def loss_commands(built: Layout, losses: Mapping[int, LossSpec], jiffy: float | None = None) -> list[list[str]]:
    """The commands that make every link in ``losses`` (directed link index -> spec) drop packets: one ``nft``
    script per namespace, loaded at once (the module docstring). ``jiffy``: :func:`jiffy_s` if None."""
    j = jiffy_s() if jiffy is None else jiffy
    scripts: dict[str, list[str]] = {}
    arrivals: dict[str, list[str]] = {}
    for link, spec in sorted(losses.items()):
        ns, dev, rate_bps = lossy_end(built, link)
        if ns not in scripts:
            scripts[ns] = [f"add table ip {LOSS_TABLE}"]
            arrivals[ns] = [
                f"add chain ip {LOSS_TABLE} arrive {{ type filter hook prerouting priority raw; policy accept; }}"
            ]
        scripts[ns] += _link_rules(link, spec, rate_bps, j)
        arrivals[ns].append(
            f'add rule ip {LOSS_TABLE} arrive iifname "{dev}" ip protocol tcp counter name "in{link}" jump link{link}'
        )
    return [["ip", "netns", "exec", ns, "nft", "\n".join([*scripts[ns], *arrivals[ns]])] for ns in sorted(scripts)]


def read_counters(built: Layout, links: list[int]) -> dict[int, tuple[int, int]]:
    """(TCP packets that arrived, packets dropped) so far on every lossy link in ``links``, by link index."""
    counts: dict[str, int] = {}
    for ns in sorted({lossy_end(built, link)[0] for link in links}):
        listing = subprocess.run(
            ["ip", "netns", "exec", ns, "nft", "-j", "list", "counters", "table", "ip", LOSS_TABLE],
            capture_output=True,
            text=True,
            timeout=_COMMAND_TIMEOUT_S,
            check=True,
        ).stdout
        for entry in json.loads(listing)["nftables"]:
            if "counter" in entry:
                counts[entry["counter"]["name"]] = int(entry["counter"]["packets"])
    return {link: (counts.get(f"in{link}", 0), counts.get(f"drop{link}", 0)) for link in links}
