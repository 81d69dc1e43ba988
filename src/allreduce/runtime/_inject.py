"""Fault injection for tests and demos: ``ALLREDUCE_INJECT`` names a rank or a link and what to do to it.

Off unless the variable is set; when it is, every rank of the job prints a warning on stderr at init. Effects
are separated by ``;``, their fields by ``:``:

- ``delay:rank=R:DIST`` — rank R sleeps a draw of DIST before each collective (a straggler: it arrives late);
- ``pace:link=S->D:rate=50MB/s`` — the receiver D takes at least ``bytes / rate`` to move each transfer from S
  (a slow link);
- ``hold:rank=R:p=0.01:ms=20`` — before each step, rank R holds its sends for ``ms`` with probability ``p`` (a
  retransmission timeout).

Optional ``seed=N`` on any effect seeds its draws (default: the rank). DIST is ``constant:1ms`` (or ``1ms``),
``exponential:mean=1ms``, ``lognormal:median=1ms,p99=5ms`` or ``uniform:low=0.5ms,high=1.5ms``. The simulator has
the same distributions; the runtime must not import the simulator, so these four are implemented here again.
Anything not understood is refused with one line naming it.
"""

from __future__ import annotations

import math
import os
import random
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from allreduce.units import parse_bandwidth, parse_seconds

__all__ = ["ENV_VAR", "Distribution", "Injection", "injection_from_env", "parse_distribution", "parse_injection"]

ENV_VAR = "ALLREDUCE_INJECT"

_Z99 = 2.3263478740408408
"""Φ⁻¹(0.99): a lognormal with median M and 99th percentile Q has σ = ln(Q/M) / Φ⁻¹(0.99)."""


@dataclass(frozen=True)
class Distribution:
    """A distribution of seconds: ``kind`` in constant, exponential, lognormal, uniform, and its two figures."""

    kind: str
    a_s: float
    b_s: float = 0.0

    def draw(self, rng: random.Random) -> float:
        if self.kind == "constant":
            return self.a_s
        if self.kind == "exponential":
            return rng.expovariate(1.0 / self.a_s)
        if self.kind == "lognormal":
            return self.a_s * math.exp(rng.gauss(0.0, math.log(self.b_s / self.a_s) / _Z99))
        return rng.uniform(self.a_s, self.b_s)


def _fields(text: str, allowed: set[str], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in allowed:
            raise ValueError(f"{what}: unknown field {item!r}; expected {', '.join(sorted(allowed))}")
        out[key.strip()] = value.strip()
    if set(out) != allowed:
        raise ValueError(f"{what}: needs {', '.join(sorted(allowed))}, got {text!r}")
    return out


def parse_distribution(text: str) -> Distribution:
    """``constant:1ms`` / ``1ms``, ``exponential:mean=M``, ``lognormal:median=M,p99=Q``, ``uniform:low=A,high=B``."""
    kind, sep, rest = text.partition(":")
    what = f"distribution {text!r}"
    if not sep:
        return Distribution("constant", parse_seconds(text, what=what))
    if kind == "constant":
        return Distribution("constant", parse_seconds(rest, what=what))
    if kind == "exponential":
        mean = parse_seconds(_fields(rest, {"mean"}, what)["mean"], what=what)
        if mean <= 0:
            raise ValueError(f"{what}: the mean must be positive")
        return Distribution("exponential", mean)
    if kind == "lognormal":
        f = _fields(rest, {"median", "p99"}, what)
        median, p99 = parse_seconds(f["median"], what=what), parse_seconds(f["p99"], what=what)
        if not 0 < median < p99:
            raise ValueError(f"{what}: needs 0 < median < p99")
        return Distribution("lognormal", median, p99)
    if kind == "uniform":
        f = _fields(rest, {"low", "high"}, what)
        low, high = parse_seconds(f["low"], what=what), parse_seconds(f["high"], what=what)
        if not 0 <= low <= high:
            raise ValueError(f"{what}: needs 0 <= low <= high")
        return Distribution("uniform", low, high)
    raise ValueError(f"{what}: unknown kind {kind!r}; use constant, exponential, lognormal or uniform")


@dataclass(frozen=True)
class Injection:
    """What ``ALLREDUCE_INJECT`` asks of one rank (empty fields: nothing)."""

    delay: Distribution | None = None
    pace_Bps: tuple[tuple[int, float], ...] = ()
    """``(src, rate)``: transfers from ``src`` into this rank take at least ``bytes / rate``."""
    hold_probability: float = 0.0
    hold_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "_rng", random.Random(self.seed))
        object.__setattr__(self, "_pace", dict(self.pace_Bps))

    @property
    def active(self) -> bool:
        return self.delay is not None or bool(self.pace_Bps) or self.hold_probability > 0

    def sleep_before_call(self) -> None:
        if self.delay is not None:
            time.sleep(self.delay.draw(self._rng))  # type: ignore[attr-defined]

    def hold_step(self) -> None:
        """Before a step's sends: hold them with the configured probability."""
        if self.hold_probability > 0 and self._rng.random() < self.hold_probability:  # type: ignore[attr-defined]
            time.sleep(self.hold_s)

    def paces(self, src: int) -> bool:
        """Whether transfers from ``src`` into this rank are paced."""
        return src in self._pace  # type: ignore[attr-defined]

    def pace(self, src: int, size_bytes: int, started_ns: int) -> None:
        """After moving ``size_bytes`` from ``src`` since ``started_ns``: sleep until the paced rate is met."""
        rate = self._pace.get(src)  # type: ignore[attr-defined]
        if rate is None:
            return
        remaining_s = size_bytes / rate - (time.perf_counter_ns() - started_ns) * 1e-9
        if remaining_s > 0:
            time.sleep(remaining_s)


_LINK = re.compile(r"^(\d+)->(\d+)$")


def _int(text: str, what: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{ENV_VAR}: {what} must be a non-negative integer, got {text!r}")
    return int(text)


def _check(effect: str, keyed: dict[str, str], loose: list[str], allowed: set[str], *, loose_ok: bool = False) -> None:
    unknown = sorted(set(keyed) - allowed) + ([] if loose_ok else loose)
    if unknown:
        raise ValueError(f"{ENV_VAR}: {effect!r}: unknown field(s) {', '.join(unknown)}")
    missing = sorted(allowed - set(keyed))
    if missing:
        raise ValueError(f"{ENV_VAR}: {effect!r}: missing {', '.join(missing)}")


def parse_injection(spec: str, rank: int, world_size: int) -> Injection:
    """The part of ``spec`` (the variable's value) that applies to ``rank``; ``ValueError`` naming what is wrong."""
    delay: Distribution | None = None
    pace: list[tuple[int, float]] = []
    hold_p, hold_s = 0.0, 0.0
    seed = rank
    for effect in filter(None, (e.strip() for e in spec.split(";"))):
        kind, _, rest = effect.partition(":")
        parts = rest.split(":")
        keyed: dict[str, str] = {}
        loose: list[str] = []
        for part in parts:
            key, sep, value = part.partition("=")
            if sep and key in {"rank", "link", "rate", "p", "ms", "seed"}:
                keyed[key] = value
            else:
                loose.append(part)
        if "seed" in keyed:
            seed = _int(keyed.pop("seed"), "seed")

        if kind == "delay":
            _check(effect, keyed, loose, {"rank"}, loose_ok=True)
            who = _int(keyed["rank"], "rank")
            if who >= world_size:
                raise ValueError(f"{ENV_VAR}: {effect!r}: rank {who} is not in a group of {world_size}")
            if not loose:
                raise ValueError(f"{ENV_VAR}: {effect!r}: missing the distribution (e.g. 1ms)")
            dist = parse_distribution(":".join(loose))
            if who == rank:
                delay = dist
        elif kind == "pace":
            _check(effect, keyed, loose, {"link", "rate"})
            match = _LINK.match(keyed["link"])
            if match is None:
                raise ValueError(f"{ENV_VAR}: {effect!r}: link must be SRC->DST, got {keyed['link']!r}")
            src, dst = int(match[1]), int(match[2])
            if max(src, dst) >= world_size or src == dst:
                raise ValueError(f"{ENV_VAR}: {effect!r}: {src}->{dst} is not a link of a group of {world_size}")
            rate = parse_bandwidth(keyed["rate"], what=f"{ENV_VAR} rate")
            if rate <= 0:
                raise ValueError(f"{ENV_VAR}: {effect!r}: the rate must be positive")
            if dst == rank:
                pace.append((src, rate))
        elif kind == "hold":
            _check(effect, keyed, loose, {"rank", "p", "ms"})
            who = _int(keyed["rank"], "rank")
            if who >= world_size:
                raise ValueError(f"{ENV_VAR}: {effect!r}: rank {who} is not in a group of {world_size}")
            try:
                p, ms = float(keyed["p"]), float(keyed["ms"])
            except ValueError:
                raise ValueError(f"{ENV_VAR}: {effect!r}: p and ms must be numbers") from None
            if not (0 < p <= 1 and ms > 0):
                raise ValueError(f"{ENV_VAR}: {effect!r}: needs 0 < p <= 1 and ms > 0")
            if who == rank:
                hold_p, hold_s = p, ms * 1e-3
        else:
            raise ValueError(f"{ENV_VAR}: unknown effect {kind!r} in {effect!r}; use delay, pace or hold")
    return Injection(delay, tuple(pace), hold_p, hold_s, seed)


def injection_from_env(environ: Mapping[str, str] | None, rank: int, world_size: int) -> Injection | None:
    """The injection for ``rank`` from the environment, with a warning on stderr; None when not set."""
    spec = (os.environ if environ is None else environ).get(ENV_VAR, "")
    if not spec:
        return None
    injection = parse_injection(spec, rank, world_size)
    print(f"[allreduce rank {rank}] WARNING: {ENV_VAR} is set: injecting faults ({spec})", file=sys.stderr, flush=True)
    return injection if injection.active else None
