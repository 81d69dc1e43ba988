"""The simulator's section of `allreduce demo`."""

from __future__ import annotations

import re

from allreduce.sim import demo_report


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
