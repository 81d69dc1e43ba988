"""Faults injected into a simulation: degraded links, failed links, slow ranks.

Links are named as the topology names them (``leaf3->spine1``, one direction of a cable); ``leaf3<->spine1``
names both directions, which is what a bad cable or a flapping transceiver does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from allreduce.topology import Topology

__all__ = ["TIMED_FAULT_KINDS", "Faults", "TimedFault", "apply_faults", "parse_timed_fault", "resolve_links"]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Faults:
    """``degraded``: (link, bandwidth factor) pairs; ``failed``: links removed (traffic is rerouted);
    ``slow_ranks``: (rank, seconds) pairs, the delay added to each step in which that rank transfers."""

    degraded: tuple[tuple[str, float], ...] = ()
    failed: tuple[str, ...] = ()
    slow_ranks: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for link, factor in self.degraded:
            if not (math.isfinite(factor) and factor > 0):
                raise ValueError(
                    f"degraded link {link}: the bandwidth factor must be a finite number > 0, got {factor}"
                )
        for rank, seconds in self.slow_ranks:
            if not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"slow rank {rank}: the delay must be a finite number of seconds >= 0, got {seconds}")

    def __bool__(self) -> bool:
        return bool(self.degraded or self.failed or self.slow_ranks)

    def rank_delay_s(self, world_size: int) -> FloatArray | None:
        """Per-rank delay per step (None when no rank is slow); a rank named twice gets the sum."""
        if not self.slow_ranks:
            return None
        delay = np.zeros(world_size, dtype=np.float64)
        for rank, seconds in self.slow_ranks:
            if not 0 <= rank < world_size:
                raise ValueError(f"slow rank {rank} is not a rank of a group of {world_size}")
            delay[rank] += seconds
        return delay


def resolve_links(topology: Topology, name: str) -> list[int]:
    """The link indices ``name`` stands for: ``a->b`` is one link, ``a<->b`` both directions."""
    if "<->" in name:
        left, _, right = name.partition("<->")
        return [topology.find_link(f"{left}->{right}"), topology.find_link(f"{right}->{left}")]
    return [topology.find_link(name)]


def apply_faults(topology: Topology, faults: Faults) -> Topology:
    """The topology with degraded links slowed down and failed links removed (indices then renumber, see
    :meth:`Topology.without`). Link names are resolved on ``topology`` before anything is removed."""
    result = topology
    for name, factor in faults.degraded:
        result = result.scaled(resolve_links(topology, name), factor)
    if faults.failed:
        failed = sorted({link for name in faults.failed for link in resolve_links(topology, name)})
        result = result.without(np.asarray(failed, dtype=np.int64))
    return result


# ------------------------------------------------------------------------------------------------------------
# Faults that change with time: a link down for a while, a flapping link, a link degraded from some instant.
# ------------------------------------------------------------------------------------------------------------
TIMED_FAULT_KINDS = ("down", "flap", "degrade")


@dataclass(frozen=True)
class TimedFault:
    """A fault of ``link`` (a topology link name; ``a<->b`` both directions) that is active at some times:

    - ``down``: removed (traffic reroutes, or waits when no other path exists) from ``start_s`` for
      ``duration_s``;
    - ``flap``: removed for the first ``duty`` fraction of every ``period_s`` from ``start_s`` on;
    - ``degrade``: at ``factor`` x its bandwidth from ``start_s`` on.
    """

    link: str
    kind: str
    start_s: float
    duration_s: float = math.inf
    period_s: float = 0.0
    duty: float = 0.0
    factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in TIMED_FAULT_KINDS:
            raise ValueError(f"{self.link}: fault kind must be one of {', '.join(TIMED_FAULT_KINDS)}")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ValueError(f"{self.link}: the fault's start must be a finite time >= 0, got {self.start_s}")
        if not self.duration_s > 0:
            raise ValueError(f"{self.link}: the fault's duration must be > 0, got {self.duration_s}")
        if self.kind == "flap" and not (math.isfinite(self.period_s) and self.period_s > 0 and 0 < self.duty < 1):
            raise ValueError(f"{self.link}: a flap needs a finite period > 0 and a duty cycle in (0, 1)")
        if self.kind == "degrade" and not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"{self.link}: the bandwidth factor must be a finite number > 0, got {self.factor}")

    def active(self, t: FloatArray) -> npt.NDArray[np.bool_]:
        """Whether the fault is in effect at times ``t``."""
        started = t >= self.start_s
        if self.kind == "flap":
            cycle = np.floor(np.maximum(t - self.start_s, 0.0) / self.period_s)
            return started & (t < self.start_s + cycle * self.period_s + self.duty * self.period_s)
        return started & (t < self.start_s + self.duration_s)

    def next_change(self, t: FloatArray) -> FloatArray:
        """The first instant after ``t`` at which the fault switches on or off (inf: never)."""
        if self.kind == "flap":
            since = np.maximum(t - self.start_s, 0.0)
            cycle = np.floor(since / self.period_s)
            off = self.start_s + cycle * self.period_s + self.duty * self.period_s
            on = self.start_s + (cycle + 1) * self.period_s
            return np.where(t < self.start_s, self.start_s, np.where(t < off, off, on))
        end = self.start_s + self.duration_s
        return np.where(t < self.start_s, self.start_s, np.where(t < end, end, math.inf))

    def as_faults(self) -> Faults:
        """The static fault it is while active."""
        if self.kind == "degrade":
            return Faults(degraded=((self.link, self.factor),))
        return Faults(failed=(self.link,))

    def describe(self) -> str:
        from allreduce.units import format_seconds

        at = format_seconds(self.start_s)
        if self.kind == "down":
            return f"{self.link} down at {at} for {format_seconds(self.duration_s)}"
        if self.kind == "flap":
            return f"{self.link} flapping from {at} (period {format_seconds(self.period_s)}, down {self.duty:.0%})"
        return f"{self.link} at x{self.factor:g} from {at}"


def parse_timed_fault(kind: str, text: str) -> TimedFault:
    """A :class:`TimedFault` from ``LINK@START+DURATION`` (down), ``LINK@START/PERIOD*DUTY`` (flap) or
    ``LINK@START=FACTOR`` (degrade); times take units (``10ms``). ValueError naming the text."""
    from allreduce.sim._stochastic import parse_time

    examples = {"down": "LINK@10ms+50ms", "flap": "LINK@0s/20ms*0.5", "degrade": "LINK@10ms=0.25"}
    if kind not in examples:
        raise ValueError(f"fault kind must be one of {', '.join(TIMED_FAULT_KINDS)}, got {kind!r}")
    link, sep, when = text.rpartition("@")
    if not sep or not link.strip() or not when.strip():
        raise ValueError(f"{text!r}: write it as {examples[kind]}")
    link = link.strip()
    separator = {"down": "+", "flap": "/", "degrade": "="}[kind]
    start_text, sep, rest = when.partition(separator)
    if not sep:
        raise ValueError(f"{text!r}: write it as {examples[kind]}")
    start = parse_time(start_text, what=f"{text!r}: start")
    if kind == "down":
        return TimedFault(link, "down", start, duration_s=parse_time(rest, what=f"{text!r}: duration"))
    if kind == "flap":
        period_text, sep, duty_text = rest.partition("*")
        if not sep:
            raise ValueError(f"{text!r}: write it as {examples[kind]} (period, then the fraction of it down)")
        try:
            duty = float(duty_text)
        except ValueError:
            raise ValueError(f"{text!r}: the duty cycle {duty_text!r} is not a number") from None
        return TimedFault(link, "flap", start, period_s=parse_time(period_text, what=f"{text!r}: period"), duty=duty)
    try:
        factor = float(rest)
    except ValueError:
        raise ValueError(f"{text!r}: the bandwidth factor {rest!r} is not a number") from None
    return TimedFault(link, "degrade", start, factor=factor)
