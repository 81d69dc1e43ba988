"""The simulator's section of `allreduce demo`."""

from __future__ import annotations

import re

import pytest

from allreduce.cli._demo_sim import demo_report


@pytest.fixture(scope="module")
def report() -> str:
    """One run of the report (about a second), shared by the tests that read it."""
    return demo_report()


@pytest.mark.slow
def test_demo_names_the_fabrics_it_simulates(report: str) -> None:
    assert "fat-tree:k=16" in report
    assert "oversub=4" in report


def test_random_placement_costs_more_than_twice_on_the_oversubscribed_fabric(report: str) -> None:
    costs = [float(x) for x in re.findall(r"costs (\d+\.\d)x", report)]
    assert costs
    assert costs[0] > 2


def test_the_degraded_link_slows_the_ring_and_is_named(report: str) -> None:
    slower = [float(x) for x in re.findall(r"(\d+\.\d)x slower", report)]
    assert slower
    assert slower[0] > 2
    assert "the simulator names it: gpu5->edge0" in report


def test_demo_marks_the_fast_engines_estimates_and_nothing_else(report: str) -> None:
    rows = [line for line in report.splitlines() if " busbw " in line]
    assert len(rows) == 8
    marked = {line.split("  ")[1].strip() for line in rows if re.search(r"\d \w?s~ busbw", line)}
    # Contention-free rings (linear placement, and the degraded link) are certified exact; halving-doubling
    # runs on the event engine; the randomly placed rings are the fast engine's estimate.
    assert "ring, random placement" in marked
    assert "ring, random placement (most hops cross)" in marked
    assert not any(name.startswith(("ring, linear", "ring, healthy", "ring, degraded", "halving")) for name in marked)
    assert "~ the fast engine's estimate" in report
