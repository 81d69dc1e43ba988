"""``allreduce report`` on malformed results: one line naming the file and the field, exit status 2, no page."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from allreduce.cli import main

SIM_ALGORITHM = {"name": "ring", "busbw_GBps": 8.9}  # no seconds
CASES = [
    ("plan.json", json.dumps({"kind": "plan"}), "not a valid plan result: base: missing"),
    ("sweep.json", json.dumps({"kind": "sweep", "rows": "x"}), "not a valid sweep result: rows: expected a list"),
    (
        "sim.json",
        json.dumps({"topology": "switch:8", "ranks": 8, "size_bytes": 1024, "algorithms": [SIM_ALGORITHM]}),
        "not a valid sim result: algorithms[0].seconds: missing",
    ),
    ("other.csv", "name,age\nada,36\n", "not a sweep's CSV (no column 'case_id'"),
    ("deep.json", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("list.json", "[1, 2]", "expected the JSON of plan --json"),
]


@pytest.mark.parametrize(("name", "content", "message"), CASES, ids=[c[0] for c in CASES])
def test_a_malformed_result_is_one_line_naming_file_and_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, content: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(content)
    page = tmp_path / "out.html"
    code = main(["report", str(path), "-o", str(page)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1, err
    assert "internal error" not in err
    assert f"{path}: {message}" in err
    assert not page.exists()


def test_a_sweep_csv_with_its_columns_is_reported(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "sweep.csv"
    path.write_text(
        "case_id,gpus,topology,algorithm,step_s,error\n"
        "a,8,switch:8,ring,0.02,\n"
        "b,16,switch:8,ring,0.03,\n"
        "c,64,switch:8,ring,,has only 8 GPUs\n"
    )
    page = tmp_path / "out.html"
    assert main(["report", str(path), "-o", str(page)]) == 0, capsys.readouterr().err
    assert "Sweep: 3 cases, 1 failed" in page.read_text()


def test_a_sweep_csv_with_a_word_for_gpus_names_the_row(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "sweep.csv"
    path.write_text("case_id,gpus,topology,algorithm,step_s,error\na,<b>8</b>,switch:8,ring,0.02,\n")
    code = main(["report", str(path), "-o", str(tmp_path / "out.html")])
    err = capsys.readouterr().err
    assert code == 2
    assert "rows[0].gpus: expected a whole number" in err


def test_a_null_bandwidth_of_a_one_rank_run_is_reported(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # sim --json writes the bandwidth of a run that takes no time as null
    assert main(["sim", "-t", "fat-tree:k=4", "-n", "1", "--size", "1MiB", "-a", "ring", "--json"]) == 0
    saved = tmp_path / "sim.json"
    saved.write_text(capsys.readouterr().out)
    assert json.loads(saved.read_text())["algorithms"][0]["busbw_GBps"] is None
    page = tmp_path / "out.html"
    assert main(["report", str(saved), "-o", str(page)]) == 0, capsys.readouterr().err
    assert "Simulation: 1 ranks" in page.read_text()


def test_a_json_file_beyond_the_cap_is_refused_unread(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from allreduce.report import MAX_JSON_BYTES

    huge = tmp_path / "huge.json"
    with huge.open("wb") as f:
        f.truncate(MAX_JSON_BYTES + 1)  # sparse: no disk used
    code = main(["report", str(huge), "-o", str(tmp_path / "out.html")])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{huge}: larger than 64 MiB" in err
