"""``allreduce sim --mitigate``: the ring as placed beside the ring re-planning would pick, in text and JSON."""

from __future__ import annotations

import json

import pytest

from allreduce.cli._main import main

DRAGONFLY = ["sim", "-t", "dragonfly:groups=4,routers=2,hosts=2", "--size", "16MiB", "-a", "ring"]


def test_a_degraded_global_cable_is_routed_around_in_the_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*DRAGONFLY, "--degrade", "r0.0->r1.0=0.1", "--mitigate", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)["mitigation"]
    assert m["speedup"] > 3
    assert m["slowest_link_after_GBps"] >= 5 * m["slowest_link_before_GBps"]
    assert sorted(m["order"]) == list(range(16))
    assert m["replanned_seconds"] < m["ring_seconds"]


def test_the_text_says_both_times_and_the_order(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*DRAGONFLY, "--degrade", "r0.0->r1.0=0.1", "--mitigate"]) == 0
    out = capsys.readouterr().out
    assert "re-planning (--mitigate): ring as placed" in out
    assert "  order 0," in out


def test_a_slow_rank_is_said_to_be_beyond_re_planning(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*DRAGONFLY, "--slow-rank", "5=1ms", "--mitigate"]) == 0
    assert "re-planning cannot route around compute" in capsys.readouterr().out


def test_one_rank_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*DRAGONFLY, "--ranks", "1", "--mitigate"]) == 2
    err = capsys.readouterr().err
    assert "--mitigate: re-planning is predicted for 2..4,096 ranks, got 1" in err
    assert "Traceback" not in err


def test_a_slow_port_is_re_planned_into_a_tree_in_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*DRAGONFLY, "--ranks", "8", "--degrade", "gpu5<->r1.0=0.1", "--mitigate"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "re-planned double_binary_tree (32 chunks)" in out
    assert "rank 5: every link slow (its port, not a cable)" in out
    assert main([*args, "--json"]) == 0
    m = json.loads(capsys.readouterr().out)["mitigation"]
    assert (m["algorithm"], m["slow_ranks"]) == ("double_binary_tree", [5])
    assert m["replanned_seconds"] < m["ring_seconds"] / 1.3
