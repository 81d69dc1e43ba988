"""``allreduce sweep``: a grid file to CSV and a report; a re-run skips what is done; bad grids exit 2."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from allreduce.cli import main

GRID = """\
base: {params: 2e7, compute_ms: 20, topology: 'fat-tree:k=4', algorithm: ring}
grid:
  gpus: [4, 8, 64]
"""


def test_a_grid_runs_to_csv_and_report_and_a_rerun_runs_only_the_failed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    grid = tmp_path / "grid.yaml"
    grid.write_text(GRID)
    out_csv, page = tmp_path / "out.csv", tmp_path / "sweep.html"
    argv = ["sweep", str(grid), "-o", str(out_csv), "--workers", "2", "--report", str(page)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "3 cases: 3 ran (1 failed), 0 already in" in out
    with out_csv.open() as f:
        rows = list(csv.DictReader(f))
    assert sorted(int(r["gpus"]) for r in rows) == [4, 8, 64]
    assert 'id="d0-sweep"' in page.read_text()
    assert main(argv) == 0
    assert "3 cases: 1 ran (1 failed), 2 already in" in capsys.readouterr().out  # the failed case again


def test_a_bad_grid_is_one_line_naming_the_parameter(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    grid = tmp_path / "grid.yaml"
    grid.write_text("grid:\n  gpuz: [4]\n")
    code = main(["sweep", str(grid), "-o", str(tmp_path / "o.csv")])
    err = capsys.readouterr().err
    assert code == 2
    assert "unknown parameter 'gpuz'" in err
    assert err.count("\n") == 1


def test_more_workers_than_the_cap_is_one_line_naming_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from allreduce.plan import max_workers

    grid = tmp_path / "grid.yaml"
    grid.write_text(GRID)
    code = main(["sweep", str(grid), "-o", str(tmp_path / "o.csv"), "--workers", "100000"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1
    assert f"--workers 100000: more than the cap of {max_workers()}" in err
    assert not (tmp_path / "o.csv").exists()
