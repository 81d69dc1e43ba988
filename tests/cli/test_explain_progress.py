"""``allreduce explain`` says what it is modelling as it goes (at 131,072 ranks every algorithm takes about 20 s in
all), on a terminal only."""

from __future__ import annotations

import pytest

from allreduce.cli._explain import explain
from allreduce.cli._main import main
from allreduce.schedules import Collective, CostModel, algorithms

MODEL = CostModel(latency_s=5e-6, bandwidth_Bps=12.5e9)


def test_progress_names_every_algorithm_in_turn_then_the_prediction() -> None:
    said: list[str] = []
    explain(64, 1 << 20, MODEL, progress=said.append)
    names = algorithms(Collective.ALL_REDUCE)
    turns = [s for s in said if s.endswith(")")]
    assert turns == [f"{name} ({i + 1} of {len(names)})" for i, name in enumerate(names)]
    assert "double_binary_tree, 256 chunks" in said
    assert said.index("predicting each algorithm") > said.index(turns[-1])


def test_without_a_terminal_stderr_stays_empty(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--ranks", "64", "--size", "1MiB", "--bandwidth", "100Gbps", "--latency", "5us"]) == 0
    assert capsys.readouterr().err == ""
