"""Fault injection for tests and demos: ``ALLREDUCE_INJECT`` names a rank or a link and what to do to it.

Off unless the variable is set; when it is, every rank of the job prints a warning on stderr at init. Effects
are separated by ``;``, their fields by ``:``:

- ``delay:rank=R:DIST`` — rank R sleeps a draw of DIST before each collective (a straggler: it arrives late);
- ``pace:link=S->D:rate=50MB/s`` — the receiver D takes at least ``bytes / rate`` to move each transfer from S
  (a slow link);
- ``hold:rank=R:p=0.01:ms=20`` — before each step, rank R holds its sends for ``ms`` with probability ``p`` (a
  retransmission timeout);
- ``kill:rank=R:call=K:step=S`` — rank R SIGKILLs itself at the start of step S (from 0) of its K-th collective
  (from 0, counting the collectives that run a plan, the barrier not among them): a death at a chosen point of a
  schedule, where the survivors stand is then fixed by the schedule, not by a timer. Every group made from the
  environment applies it to its rank R, counting its own collectives (a group shrunk to R ranks or fewer has none).

Optional ``seed=N`` on any effect seeds its draws (default: the rank). DIST is ``constant:1ms`` (or ``1ms``),
``exponential:mean=1ms``, ``lognormal:median=1ms,p99=5ms`` or ``uniform:low=0.5ms,high=1.5ms``. The simulator has
the same distributions; the runtime must not import the simulator, so these four are implemented here again.

Everything is checked when the group starts, never inside a collective: anything not understood is refused with
one line naming the variable, the effect and the field; every time is at most :data:`MAX_FAULT_S` (and every draw
is cut there), every pacing rate at least :data:`MIN_PACE_BPS`. A value with no effect in it (blank, ``;``) is as
if the variable were not set.
"""

from __future__ import annotations

import math
import os
import random
import re
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from allreduce.units import parse_bandwidth, parse_seconds

__all__ = [
    "ENV_VAR",
    "MAX_FAULT_S",
    "MIN_PACE_BPS",
    "Distribution",
    "Injection",
    "has_effects",
    "injection_from_env",
    "parse_distribution",
    "parse_injection",
]

ENV_VAR = "ALLREDUCE_INJECT"

MAX_FAULT_S = 3600.0
"""The longest time an effect may name (a delay, a hold, a distribution's figure), and where every draw is cut:
an hour outlasts any collective's timeout (the group's default is 300 s), so a timeout can always be provoked,
while a slip of the unit (``ms=1e12``: 31 years) is refused instead of sleeping in a collective."""

MIN_PACE_BPS = 1e3
"""The slowest pacing rate (bytes/s): 1 MiB then takes 17 minutes; slower would only be a hang with extra steps,
and a rate near zero overflows the sleep it asks for."""

_MAX_DIGITS = 18
"""Digits of an integer field (rank, seed): below 2**63, so it is a number, not a test of the int parser."""

_Z99 = 2.3263478740408408
"""Φ⁻¹(0.99): a lognormal with median M and 99th percentile Q has σ = ln(Q/M) / Φ⁻¹(0.99)."""


@dataclass(frozen=True)
class Distribution:
    """A distribution of seconds: ``kind`` in constant, exponential, lognormal, uniform, and its two figures."""

    kind: str
    a_s: float
    b_s: float = 0.0

    def draw(self, rng: random.Random) -> float:
        """A draw in seconds, at most :data:`MAX_FAULT_S` (the tails of exponential and lognormal are unbounded)."""
        if self.kind == "constant":
            return self.a_s
        if self.kind == "exponential":
            return min(rng.expovariate(1.0 / self.a_s), MAX_FAULT_S)
        if self.kind == "lognormal":
            exponent = rng.gauss(0.0, math.log(self.b_s / self.a_s) / _Z99)
            return min(self.a_s * math.exp(min(exponent, math.log(MAX_FAULT_S / self.a_s))), MAX_FAULT_S)
        return rng.uniform(self.a_s, self.b_s)


def _seconds(text: str, what: str, field: str) -> float:
    """A time field of a distribution or an effect: finite, >= 0 and at most :data:`MAX_FAULT_S`."""
    value = parse_seconds(text, what=f"{what}: {field}")
    if not 0 <= value <= MAX_FAULT_S:
        raise ValueError(
            f"{what}: {field} {text!r} is outside 0 to {MAX_FAULT_S:g} s (an injected fault that long would be a "
            "hang: a collective's timeout is shorter)"
        )
    return value


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


def parse_distribution(text: str, *, what: str = "") -> Distribution:
    """``constant:1ms`` / ``1ms``, ``exponential:mean=M``, ``lognormal:median=M,p99=Q``, ``uniform:low=A,high=B``;
    every figure at most :data:`MAX_FAULT_S`. ``what`` names where ``text`` came from in errors."""
    kind, sep, rest = text.partition(":")
    what = f"{what}distribution {text!r}"
    if not sep:
        return Distribution("constant", _seconds(text, what, "the time"))
    if kind == "constant":
        return Distribution("constant", _seconds(rest, what, "the time"))
    if kind == "exponential":
        mean = _seconds(_fields(rest, {"mean"}, what)["mean"], what, "mean")
        if mean <= 0:
            raise ValueError(f"{what}: the mean must be positive")
        return Distribution("exponential", mean)
    if kind == "lognormal":
        f = _fields(rest, {"median", "p99"}, what)
        median, p99 = _seconds(f["median"], what, "median"), _seconds(f["p99"], what, "p99")
        if not 0 < median < p99:
            raise ValueError(f"{what}: needs 0 < median < p99")
        return Distribution("lognormal", median, p99)
    if kind == "uniform":
        f = _fields(rest, {"low", "high"}, what)
        low, high = _seconds(f["low"], what, "low"), _seconds(f["high"], what, "high")
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
    kill_at: tuple[int, int] | None = None
    """``(call, step)``: SIGKILL this process at the start of that step of that collective."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_rng", random.Random(self.seed))
        object.__setattr__(self, "_pace", dict(self.pace_Bps))
        object.__setattr__(self, "_at", [-1, 0])  # the collective running (from 0), and its next step

    @property
    def active(self) -> bool:
        return self.delay is not None or bool(self.pace_Bps) or self.hold_probability > 0 or self.kill_at is not None

    def sleep_before_call(self) -> None:
        at = self._at  # type: ignore[attr-defined]
        at[0] += 1
        at[1] = 0
        if self.delay is not None:
            time.sleep(self.delay.draw(self._rng))  # type: ignore[attr-defined]

    def hold_step(self) -> None:
        """Before a step's sends: hold them with the configured probability; die there if asked to."""
        if self.kill_at is not None:
            at = self._at  # type: ignore[attr-defined]
            if (at[0], at[1]) == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            at[1] += 1
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
            time.sleep(min(remaining_s, MAX_FAULT_S))


_LINK = re.compile(r"^(\d+)->(\d+)$")


def _int(text: str, effect: str, field: str) -> int:
    # isdigit() alone admits '²' and other digits int() refuses; ASCII digits only, and few enough for an int64
    if not (text.isascii() and text.isdigit() and len(text) <= _MAX_DIGITS):
        raise ValueError(
            f"{ENV_VAR}: {effect!r}: {field} must be a non-negative integer of at most {_MAX_DIGITS} digits "
            f"(0-9), got {text!r}"
        )
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
    kill_at: tuple[int, int] | None = None
    seed = rank
    for effect in filter(None, (e.strip() for e in spec.split(";"))):
        kind, _, rest = effect.partition(":")
        parts = rest.split(":")
        keyed: dict[str, str] = {}
        loose: list[str] = []
        for part in parts:
            key, sep, value = part.partition("=")
            if sep and key in {"rank", "link", "rate", "p", "ms", "seed", "call", "step"}:
                keyed[key] = value
            else:
                loose.append(part)
        if "seed" in keyed:
            seed = _int(keyed.pop("seed"), effect, "seed")

        if kind == "delay":
            _check(effect, keyed, loose, {"rank"}, loose_ok=True)
            who = _int(keyed["rank"], effect, "rank")
            if who >= world_size:
                raise ValueError(f"{ENV_VAR}: {effect!r}: rank {who} is not in a group of {world_size}")
            if not loose:
                raise ValueError(f"{ENV_VAR}: {effect!r}: missing the distribution (e.g. 1ms)")
            dist = parse_distribution(":".join(loose), what=f"{ENV_VAR}: {effect!r}: ")
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
            rate = parse_bandwidth(keyed["rate"], what=f"{ENV_VAR}: {effect!r}: rate")
            if not (math.isfinite(rate) and rate >= MIN_PACE_BPS):
                raise ValueError(
                    f"{ENV_VAR}: {effect!r}: rate {keyed['rate']!r} is below {MIN_PACE_BPS:g} B/s (1 MiB would take "
                    "17 minutes; slower is a hang, not a slow link) or not finite"
                )
            if dst == rank:
                pace.append((src, rate))
        elif kind == "hold":
            _check(effect, keyed, loose, {"rank", "p", "ms"})
            who = _int(keyed["rank"], effect, "rank")
            if who >= world_size:
                raise ValueError(f"{ENV_VAR}: {effect!r}: rank {who} is not in a group of {world_size}")
            try:
                p, ms = float(keyed["p"]), float(keyed["ms"])
            except ValueError:
                raise ValueError(f"{ENV_VAR}: {effect!r}: p and ms must be numbers") from None
            if not 0 < p <= 1:
                raise ValueError(f"{ENV_VAR}: {effect!r}: p {keyed['p']!r} must be in (0, 1]")
            if not 0 < ms <= MAX_FAULT_S * 1e3:
                raise ValueError(
                    f"{ENV_VAR}: {effect!r}: ms {keyed['ms']!r} must be > 0 and at most {MAX_FAULT_S * 1e3:g} (an "
                    "hour: a hold that long would be a hang; a collective's timeout is shorter)"
                )
            if who == rank:
                hold_p, hold_s = p, ms * 1e-3
        elif kind == "kill":
            _check(effect, keyed, loose, {"rank", "call", "step"})
            # not checked against world_size: a group shrunk after the kill has no rank R, and none dies
            if _int(keyed["rank"], effect, "rank") == rank:
                kill_at = (_int(keyed["call"], effect, "call"), _int(keyed["step"], effect, "step"))
        else:
            raise ValueError(f"{ENV_VAR}: unknown effect {kind!r} in {effect!r}; use delay, pace, hold or kill")
    return Injection(delay, tuple(pace), hold_p, hold_s, seed, kill_at)


def has_effects(spec: str) -> bool:
    """Whether ``spec`` names any effect (blank, or only ``;``: as if the variable were not set)."""
    return any(effect.strip() for effect in spec.split(";"))


def injection_from_env(environ: Mapping[str, str] | None, rank: int, world_size: int) -> Injection | None:
    """The injection for ``rank`` from the environment, with a warning on stderr; None when not set."""
    spec = (os.environ if environ is None else environ).get(ENV_VAR, "")
    if not has_effects(spec):
        return None
    injection = parse_injection(spec, rank, world_size)
    print(
        f"[allreduce rank {rank}] WARNING: {ENV_VAR} is set: injecting faults ({spec.strip()})",
        file=sys.stderr,
        flush=True,
    )
    return injection if injection.active else None
