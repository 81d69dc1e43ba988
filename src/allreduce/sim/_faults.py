"""Faults injected into a simulation: one class per kind, behind two small interfaces, registered by name.

A :class:`Fault` holds for the whole run (a degraded link, a failed link, a slow rank) and says what it does:
which links it slows and by what factor, which links it removes, which ranks it delays. A :class:`TimedFault` is a
link fault in effect at some times only (a link down for a while, flapping, degraded from some instant) and says
when it is in effect and which static fault it is then. The engines see only these interfaces. A new kind is one
class with a ``kind`` name and a ``parse`` of its text form, handed to :func:`register_fault_kind`;
:func:`parse_fault` then reads it as it reads the built-in ones.

Links are named as the topology names them (``leaf3->spine1``, one direction of a cable); ``leaf3<->spine1``
names both directions, which is what a bad cable or a flapping transceiver does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import numpy as np
import numpy.typing as npt

from allreduce.sim._stochastic import parse_time
from allreduce.topology import Topology
from allreduce.units import format_seconds

__all__ = [
    "DegradedLink",
    "FailedLink",
    "Fault",
    "Faults",
    "LinkDegrade",
    "LinkDown",
    "LinkFlap",
    "SlowRank",
    "TimedFault",
    "apply_faults",
    "fault_kinds",
    "parse_fault",
    "parse_timed_fault",
    "register_fault_kind",
    "resolve_links",
    "unregister_fault_kind",
]

FloatArray = npt.NDArray[np.float64]


def resolve_links(topology: Topology, name: str) -> list[int]:
    """The link indices ``name`` stands for: ``a->b`` is one link, ``a<->b`` both directions."""
    if "<->" in name:
        left, _, right = name.partition("<->")
        return [topology.find_link(f"{left}->{right}"), topology.find_link(f"{right}->{left}")]
    return [topology.find_link(name)]


def _number(text: str, what: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{where!r}: the {what} {text!r} is not a number") from None


def _check_factor(link: str, factor: float) -> None:
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"degraded link {link}: the bandwidth factor must be a finite number > 0, got {factor}")


class Fault:
    """A fault that holds for the whole run. A kind overrides what it changes; by default it changes nothing.

    ``kind`` (a class keyword: ``class SlowNode(Fault, kind="slow_node")``) is the name it is registered under;
    ``parse`` reads its text form (ValueError naming the text)."""

    kind: ClassVar[str] = ""

    def __init_subclass__(cls, *, kind: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.kind = kind or cls.kind

    @classmethod
    def parse(cls, text: str) -> Self:
        raise ValueError(f"fault kind {cls.kind!r} has no text form; build it in code")

    def scaled_links(self, topology: Topology) -> Sequence[tuple[list[int], float]]:
        """(link indices, bandwidth factor) pairs, links resolved on ``topology``."""
        return ()

    def failed_links(self, topology: Topology) -> Sequence[int]:
        """The indices of the links it removes (traffic reroutes), resolved on ``topology``."""
        return ()

    def rank_delays_s(self, world_size: int) -> Sequence[tuple[int, float]]:
        """(rank, seconds) pairs: the delay added to each step in which that rank transfers."""
        return ()

    def describe(self) -> str:
        return self.kind


@dataclass(frozen=True)
class DegradedLink(Fault, kind="degraded"):
    """``link`` runs at ``factor`` x its bandwidth (text: ``LINK=FACTOR``)."""

    link: str
    factor: float

    def __post_init__(self) -> None:
        _check_factor(self.link, self.factor)

    @classmethod
    def parse(cls, text: str) -> Self:
        link, sep, factor = text.rpartition("=")
        if not sep or not link.strip():
            raise ValueError(f"{text!r}: write it as LINK=FACTOR, e.g. leaf0->spine1=0.1")
        return cls(link.strip(), _number(factor, "bandwidth factor", text))

    def scaled_links(self, topology: Topology) -> Sequence[tuple[list[int], float]]:
        return [(resolve_links(topology, self.link), self.factor)]

    def describe(self) -> str:
        return f"{self.link} x{self.factor:g}"


@dataclass(frozen=True)
class FailedLink(Fault, kind="failed"):
    """``link`` is removed; traffic reroutes, or the run fails naming the ranks that lost their path."""

    link: str

    @classmethod
    def parse(cls, text: str) -> Self:
        if not text.strip():
            raise ValueError("a failed link needs its name, e.g. leaf0->spine1")
        return cls(text.strip())

    def failed_links(self, topology: Topology) -> Sequence[int]:
        return resolve_links(topology, self.link)

    def describe(self) -> str:
        return f"{self.link} failed"


@dataclass(frozen=True)
class SlowRank(Fault, kind="slow_rank"):
    """``rank`` adds ``seconds`` to every step in which it transfers (text: ``RANK=SECONDS``, e.g. ``3=50us``)."""

    rank: int
    seconds: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.seconds) and self.seconds >= 0):
            raise ValueError(
                f"slow rank {self.rank}: the delay must be a finite number of seconds >= 0, got {self.seconds}"
            )

    @classmethod
    def parse(cls, text: str) -> Self:
        rank, sep, seconds = text.partition("=")
        try:
            whole = int(rank)
        except ValueError:
            raise ValueError(f"{text!r}: write it as RANK=SECONDS, e.g. 3=50us") from None
        if not sep:
            raise ValueError(f"{text!r}: write it as RANK=SECONDS, e.g. 3=50us")
        return cls(whole, parse_time(seconds, what=f"{text!r}: delay"))

    def rank_delays_s(self, world_size: int) -> Sequence[tuple[int, float]]:
        if not 0 <= self.rank < world_size:
            raise ValueError(f"slow rank {self.rank} is not a rank of a group of {world_size}")
        return [(self.rank, self.seconds)]

    def describe(self) -> str:
        return f"rank {self.rank} +{format_seconds(self.seconds)}/step"


@dataclass(frozen=True)
class Faults:
    """The static faults of a run. ``degraded`` (link, factor), ``failed`` (link) and ``slow_ranks`` (rank,
    seconds) are shorthand for :class:`DegradedLink`, :class:`FailedLink` and :class:`SlowRank`; ``others`` holds
    faults of any kind as objects (a registered kind, or one built in code)."""

    degraded: tuple[tuple[str, float], ...] = ()
    failed: tuple[str, ...] = ()
    slow_ranks: tuple[tuple[int, float], ...] = ()
    others: tuple[Fault, ...] = ()

    def __post_init__(self) -> None:
        self.each()  # a bad shorthand fault is refused here, by its kind

    def each(self) -> tuple[Fault, ...]:
        """Every fault, as an object of its kind."""
        return (
            *(DegradedLink(link, factor) for link, factor in self.degraded),
            *(FailedLink(link) for link in self.failed),
            *(SlowRank(rank, seconds) for rank, seconds in self.slow_ranks),
            *self.others,
        )

    def __bool__(self) -> bool:
        return bool(self.degraded or self.failed or self.slow_ranks or self.others)

    @classmethod
    def union(cls, parts: Iterable[Faults]) -> Faults:
        """All the faults of ``parts`` at once (timed faults in effect together), every kind kept."""
        parts = tuple(parts)
        return cls(
            degraded=tuple(x for p in parts for x in p.degraded),
            failed=tuple(x for p in parts for x in p.failed),
            slow_ranks=tuple(x for p in parts for x in p.slow_ranks),
            others=tuple(x for p in parts for x in p.others),
        )

    def describe(self) -> list[str]:
        return [fault.describe() for fault in self.each()]

    def rank_delay_s(self, world_size: int) -> FloatArray | None:
        """Per-rank delay per step (None when no rank is slow); a rank named twice gets the sum."""
        delays = [delay for fault in self.each() for delay in fault.rank_delays_s(world_size)]
        if not delays:
            return None
        delay = np.zeros(world_size, dtype=np.float64)
        for rank, seconds in delays:
            delay[rank] += seconds
        return delay


def apply_faults(topology: Topology, faults: Faults) -> Topology:
    """The topology with degraded links slowed down and failed links removed (indices then renumber, see
    :meth:`Topology.without`). Link names are resolved on ``topology`` before anything is removed."""
    each = faults.each()
    result = topology
    for fault in each:
        for links, factor in fault.scaled_links(topology):
            result = result.scaled(links, factor)
    failed = sorted({link for fault in each for link in fault.failed_links(topology)})
    if failed:
        result = result.without(np.asarray(failed, dtype=np.int64))
    return result


@dataclass(frozen=True)
class TimedFault:
    """A fault of ``link`` (a topology link name; ``a<->b`` both directions) in effect at some times from
    ``start_s`` on. Its text form is ``LINK@WHEN``; a kind reads ``WHEN`` (:meth:`parse_when`) and says when it is
    in effect (:meth:`active`, :meth:`next_change`) and what it is then (:meth:`as_faults`)."""

    kind: ClassVar[str] = ""
    example: ClassVar[str] = "LINK@START"
    link: str
    start_s: float

    def __init_subclass__(cls, *, kind: str = "", example: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.kind, cls.example = kind or cls.kind, example or cls.example

    def __post_init__(self) -> None:
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ValueError(f"{self.link}: the fault's start must be a finite time >= 0, got {self.start_s}")

    @classmethod
    def parse(cls, text: str) -> Self:
        """The fault ``LINK@WHEN`` describes; ValueError naming the text."""
        link, sep, when = text.rpartition("@")
        if not sep or not link.strip() or not when.strip():
            raise ValueError(f"{text!r}: write it as {cls.example}")
        return cls.parse_when(link.strip(), when, text)

    @classmethod
    def parse_when(cls, link: str, when: str, text: str) -> Self:
        """The fault of ``link`` that ``when`` (the text after ``@``) describes; ``text`` is the whole, for errors."""
        raise ValueError(f"fault kind {cls.kind!r} has no text form; build it in code")

    def active(self, t: FloatArray) -> npt.NDArray[np.bool_]:
        """Whether the fault is in effect at times ``t`` (by default: from ``start_s`` on, for good)."""
        return t >= self.start_s

    def next_change(self, t: FloatArray) -> FloatArray:
        """The first instant after ``t`` at which the fault switches on or off (inf: never)."""
        return np.where(t < self.start_s, self.start_s, math.inf)

    def as_faults(self) -> Faults:
        """The static fault it is while in effect."""
        raise NotImplementedError(f"{type(self).__name__} does not say what it is while in effect")

    def describe(self) -> str:
        return f"{self.link} {self.kind} from {format_seconds(self.start_s)}"


def _start_and_rest(when: str, separator: str, text: str, example: str) -> tuple[float, str]:
    start_text, sep, rest = when.partition(separator)
    if not sep:
        raise ValueError(f"{text!r}: write it as {example}")
    return parse_time(start_text, what=f"{text!r}: start"), rest


@dataclass(frozen=True)
class LinkDown(TimedFault, kind="down", example="LINK@10ms+50ms"):
    """Removed (traffic reroutes, or waits when no other path exists) from ``start_s`` for ``duration_s``."""

    duration_s: float = math.inf

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.duration_s > 0:
            raise ValueError(f"{self.link}: the fault's duration must be > 0, got {self.duration_s}")

    @classmethod
    def parse_when(cls, link: str, when: str, text: str) -> Self:
        start, rest = _start_and_rest(when, "+", text, cls.example)
        return cls(link, start, duration_s=parse_time(rest, what=f"{text!r}: duration"))

    def active(self, t: FloatArray) -> npt.NDArray[np.bool_]:
        return (t >= self.start_s) & (t < self.start_s + self.duration_s)

    def next_change(self, t: FloatArray) -> FloatArray:
        end = self.start_s + self.duration_s
        return np.where(t < self.start_s, self.start_s, np.where(t < end, end, math.inf))

    def as_faults(self) -> Faults:
        return Faults(failed=(self.link,))

    def describe(self) -> str:
        return f"{self.link} down at {format_seconds(self.start_s)} for {format_seconds(self.duration_s)}"


@dataclass(frozen=True)
class LinkFlap(TimedFault, kind="flap", example="LINK@0s/20ms*0.5"):
    """Removed for the first ``duty`` fraction of every ``period_s`` from ``start_s`` on."""

    period_s: float
    duty: float

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.period_s) and self.period_s > 0 and 0 < self.duty < 1):
            raise ValueError(f"{self.link}: a flap needs a finite period > 0 and a duty cycle in (0, 1)")

    @classmethod
    def parse_when(cls, link: str, when: str, text: str) -> Self:
        start, rest = _start_and_rest(when, "/", text, cls.example)
        period_text, sep, duty_text = rest.partition("*")
        if not sep:
            raise ValueError(f"{text!r}: write it as {cls.example} (period, then the fraction of it down)")
        period = parse_time(period_text, what=f"{text!r}: period")
        return cls(link, start, period_s=period, duty=_number(duty_text, "duty cycle", text))

    def _cycle_start(self, t: FloatArray) -> FloatArray:
        return self.start_s + np.floor(np.maximum(t - self.start_s, 0.0) / self.period_s) * self.period_s

    def active(self, t: FloatArray) -> npt.NDArray[np.bool_]:
        return (t >= self.start_s) & (t < self._cycle_start(t) + self.duty * self.period_s)

    def next_change(self, t: FloatArray) -> FloatArray:
        cycle = self._cycle_start(t)
        off = cycle + self.duty * self.period_s
        return np.where(t < self.start_s, self.start_s, np.where(t < off, off, cycle + self.period_s))

    def as_faults(self) -> Faults:
        return Faults(failed=(self.link,))

    def describe(self) -> str:
        period = format_seconds(self.period_s)
        return f"{self.link} flapping from {format_seconds(self.start_s)} (period {period}, down {self.duty:.0%})"


@dataclass(frozen=True)
class LinkDegrade(TimedFault, kind="degrade", example="LINK@10ms=0.25"):
    """At ``factor`` x its bandwidth from ``start_s`` on."""

    factor: float

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_factor(self.link, self.factor)

    @classmethod
    def parse_when(cls, link: str, when: str, text: str) -> Self:
        start, rest = _start_and_rest(when, "=", text, cls.example)
        return cls(link, start, factor=_number(rest, "bandwidth factor", text))

    def as_faults(self) -> Faults:
        return Faults(degraded=((self.link, self.factor),))

    def describe(self) -> str:
        return f"{self.link} at x{self.factor:g} from {format_seconds(self.start_s)}"


# ------------------------------------------------------------------------------------------------------------
# The registry of kinds: the names that text (the command line, a request file) may use.
# ------------------------------------------------------------------------------------------------------------
FaultKind = type[Fault] | type[TimedFault]

_KINDS: dict[str, FaultKind] = {}


def register_fault_kind(cls: FaultKind, *, replace: bool = False) -> FaultKind:
    """Register a fault class under its ``kind``, so :func:`parse_fault` reads it; returns the class (a
    decorator). A name already registered is refused unless ``replace=True``."""
    if not (isinstance(cls, type) and issubclass(cls, Fault | TimedFault)):
        raise TypeError(f"a fault kind is a subclass of Fault or TimedFault, got {cls!r}")
    if not cls.kind.isidentifier():
        raise ValueError(f"{cls.__name__}: its kind {cls.kind!r} must be a Python identifier")
    if cls.kind in _KINDS and not replace:
        raise ValueError(f"a fault kind named {cls.kind!r} is already registered ({_KINDS[cls.kind].__name__})")
    _KINDS[cls.kind] = cls
    return cls


def unregister_fault_kind(kind: str) -> None:
    """Remove a registered kind (tests)."""
    if _KINDS.pop(kind, None) is None:
        raise KeyError(f"no fault kind named {kind!r} is registered")


def fault_kinds(*, timed: bool | None = None) -> tuple[str, ...]:
    """The registered kinds in registration order: all of them, or only the timed (``timed=True``) or static
    ones (``timed=False``)."""
    return tuple(k for k, cls in _KINDS.items() if timed is None or issubclass(cls, TimedFault) == timed)


def parse_fault(kind: str, text: str) -> Fault | TimedFault:
    """The fault of the registered ``kind`` that ``text`` describes; ValueError naming the kind or the text."""
    if kind not in _KINDS:
        raise ValueError(f"fault kind must be one of {', '.join(_KINDS)}, got {kind!r}")
    return _KINDS[kind].parse(text)


def parse_timed_fault(kind: str, text: str) -> TimedFault:
    """A :class:`TimedFault` from ``LINK@START+DURATION`` (down), ``LINK@START/PERIOD*DUTY`` (flap),
    ``LINK@START=FACTOR`` (degrade) or a registered timed kind's form; times take units (``10ms``)."""
    if kind not in fault_kinds(timed=True):
        raise ValueError(f"fault kind must be one of {', '.join(fault_kinds(timed=True))}, got {kind!r}")
    fault = parse_fault(kind, text)
    assert isinstance(fault, TimedFault)
    return fault


for _kind in (DegradedLink, FailedLink, SlowRank, LinkDown, LinkFlap, LinkDegrade):
    register_fault_kind(_kind)
