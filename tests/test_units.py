"""Human units: parsed exactly, bad ones named."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from allreduce.units import (
    UnitError,
    format_bytes,
    parse_bandwidth,
    parse_bytes,
    parse_seconds,
    parse_size_range,
)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4KiB", 4096),
        ("1GiB", 2**30),
        ("1GB", 10**9),
        ("512", 512),
        ("64MiB", 64 * 2**20),
        ("1.5KiB", 1536),
        ("2 MB", 2_000_000),
        ("0", 0),
    ],
)
def test_sizes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("400Gbps", 50e9),
        ("100Gb/s", 12.5e9),
        ("50GB/s", 50e9),
        ("25GBps", 25e9),
        ("1Gbit/s", 1.25e8),
        ("900GB/s", 900e9),
    ],
)
def test_bandwidths(text: str, value: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(value)


@pytest.mark.parametrize(
    ("text", "value"), [("5us", 5e-6), ("5µs", 5e-6), ("2ms", 2e-3), ("100ns", 1e-7), ("1.5s", 1.5)]
)
def test_times(text: str, value: float) -> None:
    assert parse_seconds(text) == pytest.approx(value)


@pytest.mark.parametrize(
    ("parse", "text"),
    [
        (parse_bytes, "4KB/s"),
        (parse_bytes, "1.5B"),
        (parse_bytes, "lots"),
        (parse_bandwidth, "1GB"),
        (parse_bandwidth, "0Gbps"),
        (parse_seconds, "5"),
        (parse_seconds, "5 minutes"),
        (parse_bytes, "-1"),
    ],
)
def test_bad_units_are_quoted(parse, text: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UnitError, match="what-was-it"):
        parse(text, what="what-was-it")


def test_size_ranges() -> None:
    assert parse_size_range("4KiB:64KiB") == [4096, 8192, 16384, 32768, 65536]
    assert parse_size_range("0,1,7") == [0, 1, 7]
    with pytest.raises(UnitError, match="runs backwards"):
        parse_size_range("1MiB:1KiB")


_SCALE = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}


@given(st.integers(min_value=0, max_value=2**52))
def test_formatted_bytes_read_back_within_display_precision(n: int) -> None:
    number, unit = format_bytes(n).split()
    assert float(number) * _SCALE[unit] == pytest.approx(n, rel=1e-3)


@pytest.mark.parametrize("text", ["1e400Gbps", "1e400GB/s"])
def test_a_bandwidth_too_large_for_a_float_says_it_is_not_finite(text: str) -> None:
    with pytest.raises(UnitError, match="not finite"):
        parse_bandwidth(text)


def test_a_zero_bandwidth_says_it_must_be_greater_than_zero() -> None:
    with pytest.raises(UnitError, match="greater than zero"):
        parse_bandwidth("0Gbps")
