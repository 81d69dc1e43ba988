"""Delay distributions for the tail simulation: named (constant, exponential, lognormal, uniform) or empirical.

A distribution is a frozen value that draws non-negative delays in seconds from a numpy ``Generator``, and
knows its own mean and quantile function, so tests check Monte Carlo results against closed forms:

- ``constant:VALUE``                      every draw is VALUE;
- ``exponential:mean=M``                  rate λ = 1/M; quantile −M·ln(1−p);
- ``lognormal:median=M,p99=Q``            ln X ~ Normal(ln M, σ) with σ = ln(Q/M) / z₀.₉₉ (z₀.₉₉ = Φ⁻¹(0.99)),
                                          so the median and the 99th percentile are the two given figures;
- ``uniform:low=A,high=B``                a window [A, B);
- ``empirical:FILE``                      draws with replacement from a CSV of measured times (one column of
                                          seconds, or the column named ``seconds`` / ``step_s`` / ``time_s``;
                                          values may carry units: ``1.5ms``). The per-step times that
                                          ``allreduce train`` prints are such a file.

Times in specs take units (``1ms``, ``250us``) or plain seconds.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt

from allreduce.units import parse_seconds

__all__ = ["DISTRIBUTIONS", "Distribution", "parse_distribution", "parse_time"]

FloatArray = npt.NDArray[np.float64]

# Φ⁻¹(0.99): the standard normal's 99th percentile, which ties a lognormal's p99 to its median.
Z_P99 = 2.3263478740408408
DISTRIBUTIONS = ("constant", "exponential", "lognormal", "uniform", "empirical")
# Column names read from an empirical CSV with a header, in order of preference.
_EMPIRICAL_COLUMNS = ("seconds", "step_s", "time_s", "step_seconds")


def parse_time(text: str, *, what: str) -> float:
    """Seconds from ``1ms``, ``250us`` or a plain number of seconds; ValueError naming ``what``."""
    try:
        value = float(text)
    except ValueError:
        value = parse_seconds(text.strip(), what=what)
    if not math.isfinite(value):
        raise ValueError(f"{what}: {text!r} is not a finite time")
    return value


@dataclass(frozen=True, eq=False)
class Distribution:
    """A distribution of non-negative delays (seconds). Build one with :func:`parse_distribution` or the
    class methods; ``kind`` is one of :data:`DISTRIBUTIONS`."""

    kind: str
    a: float = 0.0  # constant: value; exponential: mean; lognormal: median; uniform: low
    b: float = 0.0  # lognormal: σ of ln X; uniform: high
    values: FloatArray = field(default_factory=lambda: np.zeros(0))  # empirical: the measured times, sorted
    spec: str = ""

    @classmethod
    def constant(cls, seconds: float) -> Distribution:
        _check_non_negative(seconds, "constant")
        return cls("constant", a=seconds, spec=f"constant:{seconds:g}")

    @classmethod
    def exponential(cls, mean_s: float) -> Distribution:
        if not (math.isfinite(mean_s) and mean_s > 0):
            raise ValueError(f"exponential: the mean must be a finite time > 0, got {mean_s}")
        return cls("exponential", a=mean_s, spec=f"exponential:mean={mean_s:g}")

    @classmethod
    def lognormal(cls, median_s: float, p99_s: float) -> Distribution:
        if not (math.isfinite(median_s) and median_s > 0):
            raise ValueError(f"lognormal: the median must be a finite time > 0, got {median_s}")
        if not (math.isfinite(p99_s) and p99_s > median_s):
            raise ValueError(f"lognormal: p99 must be a finite time above the median {median_s:g}, got {p99_s}")
        sigma = math.log(p99_s / median_s) / Z_P99
        return cls("lognormal", a=median_s, b=sigma, spec=f"lognormal:median={median_s:g},p99={p99_s:g}")

    @classmethod
    def uniform(cls, low_s: float, high_s: float) -> Distribution:
        _check_non_negative(low_s, "uniform low")
        if not (math.isfinite(high_s) and high_s >= low_s):
            raise ValueError(f"uniform: high must be a finite time >= low {low_s:g}, got {high_s}")
        return cls("uniform", a=low_s, b=high_s, spec=f"uniform:low={low_s:g},high={high_s:g}")

    @classmethod
    def empirical(cls, values_s: npt.ArrayLike, *, source: str = "values") -> Distribution:
        values = np.sort(np.asarray(values_s, dtype=np.float64).reshape(-1))
        if values.size == 0:
            raise ValueError(f"empirical {source}: no values")
        if not np.all(np.isfinite(values)) or values[0] < 0:
            raise ValueError(f"empirical {source}: every value must be a finite time >= 0")
        return cls("empirical", values=values, spec=f"empirical:{source}")

    def __str__(self) -> str:
        return self.spec

    @property
    def is_zero(self) -> bool:
        """Whether every draw is 0 (noise off)."""
        return self.kind == "constant" and self.a == 0.0

    def sample(self, rng: np.random.Generator, shape: int | tuple[int, ...]) -> FloatArray:
        """Independent draws of the given shape."""
        if self.kind == "constant":
            return np.full(shape, self.a, dtype=np.float64)
        if self.kind == "exponential":
            return rng.exponential(self.a, size=shape)
        if self.kind == "lognormal":
            return self.a * np.exp(self.b * rng.standard_normal(size=shape))
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b, size=shape)
        return self.values[rng.integers(0, self.values.size, size=shape)]

    def mean(self) -> float:
        if self.kind == "constant":
            return self.a
        if self.kind == "exponential":
            return self.a
        if self.kind == "lognormal":
            return self.a * math.exp(self.b**2 / 2)
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return float(self.values.mean())

    def quantile(self, p: float) -> float:
        """The p-quantile (0 <= p < 1)."""
        if not 0 <= p < 1:
            raise ValueError(f"quantile: p must be in [0, 1), got {p}")
        if self.kind == "constant":
            return self.a
        if self.kind == "exponential":
            return -self.a * math.log1p(-p)
        if self.kind == "lognormal":
            from statistics import NormalDist

            return self.a * math.exp(self.b * NormalDist().inv_cdf(p)) if p > 0 else 0.0
        if self.kind == "uniform":
            return self.a + p * (self.b - self.a)
        # Draws are uniform over the stored values: the smallest value with at least a fraction p below or at it.
        return float(self.values[min(self.values.size - 1, math.floor(p * self.values.size))])


def _check_non_negative(value: float, what: str) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{what}: must be a finite time >= 0, got {value}")


def _parameters(body: str, spec: str, allowed: tuple[str, ...]) -> dict[str, float]:
    values: dict[str, float] = {}
    for part in body.split(","):
        key, sep, text = part.partition("=")
        key = key.strip()
        if not sep or key not in allowed:
            raise ValueError(f"distribution {spec!r}: expected {', '.join(f'{a}=TIME' for a in allowed)}")
        values[key] = parse_time(text, what=f"distribution {spec!r}: {key}")
    missing = [a for a in allowed if a not in values]
    if missing:
        raise ValueError(f"distribution {spec!r}: missing {', '.join(missing)}")
    return values


def parse_distribution(spec: str) -> Distribution:
    """See :func:`_parse_distribution`; the result prints as the spec it was written as."""
    return replace(_parse_distribution(spec), spec=spec.strip())


def _parse_distribution(spec: str) -> Distribution:
    """A :class:`Distribution` from a spec: ``constant:1ms``, ``exponential:mean=1ms``,
    ``lognormal:median=1ms,p99=5ms``, ``uniform:low=0,high=2ms``, ``empirical:FILE.csv``; a bare time
    (``2ms``) is a constant. ValueError naming the spec (and for files, the file and line)."""
    text = spec.strip()
    kind, sep, body = text.partition(":")
    kind = kind.strip().lower()
    if not sep:
        try:
            return Distribution.constant(parse_time(text, what=f"distribution {spec!r}"))
        except ValueError:
            raise ValueError(
                f"distribution {spec!r}: not a time or KIND:PARAMETERS with KIND one of {', '.join(DISTRIBUTIONS)}"
            ) from None
    if kind == "constant":
        return Distribution.constant(parse_time(body, what=f"distribution {spec!r}"))
    if kind == "exponential":
        return Distribution.exponential(_parameters(body, spec, ("mean",))["mean"])
    if kind == "lognormal":
        values = _parameters(body, spec, ("median", "p99"))
        return Distribution.lognormal(values["median"], values["p99"])
    if kind == "uniform":
        values = _parameters(body, spec, ("low", "high"))
        return Distribution.uniform(values["low"], values["high"])
    if kind == "empirical":
        return read_empirical(body.strip())
    raise ValueError(f"distribution {spec!r}: unknown kind {kind!r}; choose from {', '.join(DISTRIBUTIONS)}")


def read_empirical(path_text: str) -> Distribution:
    """An empirical distribution from a CSV file of measured times (see the module docstring)."""
    path = Path(path_text)
    try:
        content = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"empirical:{path_text}: cannot read it ({exc})") from None
    rows = [
        (lineno, row)
        for lineno, line in enumerate(content.splitlines(), start=1)
        for row in csv.reader([line])
        if row and any(cell.strip() for cell in row)
    ]
    if not rows:
        raise ValueError(f"{path_text}: no values")
    column = 0
    header_line, header_row = rows[0]
    try:
        parse_time(header_row[0], what="")
    except ValueError:
        header = [cell.strip().lower() for cell in header_row]
        named = [name for name in _EMPIRICAL_COLUMNS if name in header]
        if not named and len(header) != 1:
            raise ValueError(
                f"{path_text}:{header_line}: no column named {' or '.join(_EMPIRICAL_COLUMNS)} in the header"
            ) from None
        column = header.index(named[0]) if named else 0
        rows = rows[1:]
    values = []
    for lineno, row in rows:
        if column >= len(row):
            raise ValueError(f"{path_text}:{lineno}: no column {column + 1}")
        try:
            values.append(parse_time(row[column], what=f"{path_text}:{lineno}"))
        except ValueError:
            raise ValueError(f"{path_text}:{lineno}: {row[column]!r} is not a time") from None
    return Distribution.empirical(values, source=path_text)
