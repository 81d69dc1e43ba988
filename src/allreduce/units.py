"""Human units for sizes, bandwidths and times: parse ``4KiB``, ``400Gbps``, ``5us``; format them back.

Decimal prefixes (K, M, G, T, P) are powers of 1000, binary ones (Ki, Mi, Gi, Ti, Pi) powers of 1024. For
bandwidth, a lower-case ``b`` (``Gbps``, ``Gb/s``, ``Gbit/s``) means bits and ``B`` (``GB/s``, ``GBps``) bytes.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "NOT_A_NUMBER",
    "UnitError",
    "format_bandwidth",
    "format_bytes",
    "format_seconds",
    "parse_bandwidth",
    "parse_bytes",
    "parse_seconds",
    "parse_size_range",
]


NOT_A_NUMBER = "n/a"
"""How the formatters show a value that is not finite (inf or nan), instead of Python's 'inf' and 'nan'."""


class UnitError(ValueError):
    """A quantity could not be read; the message quotes it and says what is accepted."""


_PREFIX = {
    "": 1.0,
    "k": 1e3,
    "K": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "Ki": 2.0**10,
    "KI": 2.0**10,
    "ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
    "Pi": 2.0**50,
}
_NUMBER = r"(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_SIZE_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<prefix>(?:[kKMGTP]i?)?)(?P<unit>B?)\s*$")
_BW_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<prefix>(?:[kKMGTP]i?)?)(?P<unit>B/s|Bps|b/s|bps|bit/s|bits/s)\s*$")
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ns": 1e-9}
_TIME_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>s|ms|us|µs|μs|ns)\s*$")


def _read(pattern: re.Pattern[str], text: str, what: str, expected: str) -> tuple[re.Match[str], float]:
    """The match of ``text`` and its number, or UnitError naming ``what`` and ``expected`` (what to write)."""
    m = pattern.match(str(text))
    if not m:
        raise UnitError(f"{what}: cannot read {text!r} as {expected}")
    return m, float(m["num"])


def _finite(value: float, text: str, what: str) -> float:
    if not math.isfinite(value):
        raise UnitError(f"{what}: {text!r} is not finite (it overflows a 64-bit float)")
    return value


def parse_bytes(text: str, *, what: str = "size") -> int:
    """``4KiB`` → 4096, ``1GB`` → 10**9, ``512`` → 512. Whole bytes only."""
    m, number = _read(_SIZE_RE, text, what, "a size; use e.g. 4KiB, 64MiB, 1GB or 512 (bytes)")
    value = _finite(number * _PREFIX[m["prefix"]], text, what)
    if value != math.floor(value):
        raise UnitError(f"{what}: {text!r} is not a whole number of bytes")
    return int(value)


def parse_bandwidth(text: str, *, what: str = "bandwidth") -> float:
    """``400Gbps`` → 5e10 bytes/s, ``50GB/s`` → 5e10 bytes/s."""
    expected = "a bandwidth; use e.g. 400Gbps, 100Gb/s (bits) or 50GB/s, 25GBps (bytes)"
    m, number = _read(_BW_RE, text, what, expected)
    bits = m["unit"].startswith("b")
    value = _finite(number * _PREFIX[m["prefix"]] / (8.0 if bits else 1.0), text, what)
    if value <= 0:
        raise UnitError(f"{what}: {text!r} must be greater than zero")
    return value


def parse_seconds(text: str, *, what: str = "time") -> float:
    """``5us`` → 5e-6, ``2ms`` → 2e-3, ``1.5s`` → 1.5."""
    m, number = _read(_TIME_RE, text, what, "a time; use e.g. 5us, 2ms, 100ns or 1.5s")
    return _finite(number * _TIME_UNITS[m["unit"]], text, what)


def parse_size_range(text: str, *, what: str = "sizes") -> list[int]:
    """``4KiB:256MiB`` → powers of two from 4 KiB to 256 MiB; ``1KiB,3,1MiB`` → that list."""
    if ":" in text:
        lo_text, _, hi_text = text.partition(":")
        lo, hi = parse_bytes(lo_text, what=what), parse_bytes(hi_text, what=what)
        if lo > hi:
            raise UnitError(f"{what}: range {text!r} runs backwards")
        sizes = []
        size = lo
        while size <= hi:
            sizes.append(size)
            size = size * 2 if size else 1
        return sizes
    return [parse_bytes(part, what=what) for part in text.split(",") if part.strip()]


def format_bytes(n: float) -> str:
    """4096 → '4 KiB', 1.5 * 2**30 → '1.5 GiB'; 'n/a' for a non-finite value."""
    if not math.isfinite(n):
        return NOT_A_NUMBER
    for unit, scale in (
        ("PiB", 2.0**50),
        ("TiB", 2.0**40),
        ("GiB", 2.0**30),
        ("MiB", 2.0**20),
        ("KiB", 2.0**10),
    ):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.4g} B"


def format_seconds(s: float) -> str:
    """0.0000052 → '5.2 µs'; 'n/a' for a non-finite value."""
    if not math.isfinite(s):
        return NOT_A_NUMBER
    if s == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.4g} {unit}"
    return f"{s / 1e-9:.4g} ns"


def format_bandwidth(bytes_per_s: float) -> str:
    """5e10 → '50 GB/s' (decimal, as nccl-tests reports); 'n/a' for a non-finite value (the bandwidth of a run
    that takes no time: one rank)."""
    if not math.isfinite(bytes_per_s):
        return NOT_A_NUMBER
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if abs(bytes_per_s) >= scale:
            return f"{bytes_per_s / scale:.4g} {unit}"
    return f"{bytes_per_s:.4g} B/s"
