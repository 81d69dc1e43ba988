"""``allreduce report``: from a saved plan to an HTML page and PNG figures; bad files are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from allreduce.cli import main
from allreduce.schedules import all_reduce
from allreduce.sim import LossModel, TailConfig, simulate_tail
from allreduce.topology import parse_topology

SMALL = ("--params", "5e7", "--gpus", "16", "--topology", "fat-tree:k=4", "--compute-ms", "20")


@pytest.mark.slow
def test_plan_json_to_html_and_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["plan", *SMALL, "--json", "--no-what-if"]) == 0
    saved = tmp_path / "plan.json"
    saved.write_text(capsys.readouterr().out)
    page = tmp_path / "report.html"
    code = main(["report", str(saved), "-o", str(page), "--png", str(tmp_path / "png")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"report: {page}" in out
    assert "<svg" in page.read_text()
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == [
        "d0-breakdown.png",
        "d0-busbw.png",
        "d0-goodput.png",
        "d0-links.png",
        "d0-scaling.png",
    ]


@pytest.mark.slow
def test_plan_writes_the_report_itself(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    page = tmp_path / "r.html"
    assert main(["plan", *SMALL, "--no-what-if", "--report", str(page)]) == 0
    assert f"report: {page}" in capsys.readouterr().out
    assert page.read_text().startswith("<!DOCTYPE html>")


def test_a_file_that_is_not_json_is_named_with_its_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{\n  nope\n}")
    code = main(["report", str(bad), "-o", str(tmp_path / "x.html")])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{bad}:2: not valid JSON" in err


def test_a_tail_json_gets_its_cdf_as_html_and_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    topology = parse_topology("fat-tree:k=4")
    config = TailConfig(samples=200, seed=3, loss=LossModel(1e-5, fabric="tcp", rto_s=4e-3))
    result = simulate_tail(all_reduce("ring", 16), topology, size_bytes=2**24, config=config)
    saved = tmp_path / "tail.json"  # the document of `allreduce tail --json`
    saved.write_text(
        json.dumps(
            {
                "topology": topology.name,
                "ranks": 16,
                "size_bytes": 2**24,
                "samples": 200,
                "seed": 3,
                "algorithms": [result.to_json()],
                "skipped": [],
            }
        )
    )
    page = tmp_path / "tail.html"
    code = main(["report", str(saved), "-o", str(page), "--png", str(tmp_path / "png")])
    _out, err = capsys.readouterr()
    assert code == 0, err
    assert 'id="d0-tail"' in page.read_text()
    assert [p.name for p in (tmp_path / "png").iterdir()] == ["d0-tail.png"]
