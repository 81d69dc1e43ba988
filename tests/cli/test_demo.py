"""The simulator's section of `allreduce demo`."""

from __future__ import annotations

import re

from allreduce.cli._demo_sim import demo_report


def test_demo_report_shows_oversubscription_placement_and_the_degraded_link() -> None:
    text = demo_report()
    assert "fat-tree:k=16" in text
    assert "oversub=4" in text
    # Random placement on the 4:1 fabric and the degraded link are both slower, by the factor printed.
    costs = [float(x) for x in re.findall(r"costs (\d+\.\d)x", text)]
    slower = [float(x) for x in re.findall(r"(\d+\.\d)x slower", text)]
    assert costs
    assert costs[0] > 2
    assert slower
    assert slower[0] > 2
    assert "the simulator names it: gpu5->edge0" in text


def test_demo_marks_the_fast_engines_estimates_and_nothing_else() -> None:
    rows = [line for line in demo_report().splitlines() if " busbw " in line]
    assert len(rows) == 8
    marked = {line.split("  ")[1].strip() for line in rows if re.search(r"\d \w?s~ busbw", line)}
    # Contention-free rings (linear placement, and the degraded link) are certified exact; halving-doubling
    # runs on the event engine; the randomly placed rings are the fast engine's estimate.
    assert "ring, random placement" in marked
    assert "ring, random placement (most hops cross)" in marked
    assert not any(name.startswith(("ring, linear", "ring, healthy", "ring, degraded", "halving")) for name in marked)
    assert "~ the fast engine's estimate" in demo_report()
