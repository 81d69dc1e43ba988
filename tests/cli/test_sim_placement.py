"""``allreduce sim --placement``: linear, random, a file of GPU indices, or the indices inline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from allreduce.cli import main

SIM = ("sim", "--topology", "fat-tree:k=4", "--size", "1MiB", "-a", "ring", "--json")
REVERSED = ",".join(str(g) for g in range(15, -1, -1))


def _sim(capsys: pytest.CaptureFixture[str], placement: str) -> tuple[int, str, str]:
    code = main([*SIM, "--placement", placement])
    out, err = capsys.readouterr()
    return code, out, err


def test_an_inline_list_is_the_same_placement_as_that_list_in_a_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    file = tmp_path / "placement.txt"
    file.write_text(REVERSED)
    code, inline, err = _sim(capsys, REVERSED)
    assert code == 0, err
    code, from_file, err = _sim(capsys, str(file))
    assert code == 0, err
    assert json.loads(inline)["algorithms"] == json.loads(from_file)["algorithms"]


def test_a_long_inline_list_with_a_typo_names_the_item_not_the_file_system(capsys: pytest.CaptureFixture[str]) -> None:
    text = ",".join(str(g) for g in range(3000)) + ",7x"
    code, _, err = _sim(capsys, text)
    assert code == 2
    assert "File name too long" not in err
    assert "internal error" not in err
    assert err.count("\n") == 1
    assert "item 3000 ('7x')" in err


def test_a_long_inline_list_of_too_many_gpus_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _sim(capsys, ",".join(str(g) for g in range(3000)))
    assert code == 2
    assert "3000 GPUs for 16 ranks" in err


def test_a_name_that_is_neither_says_what_is_expected(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _sim(capsys, "nofile")
    assert code == 2
    assert "'nofile'" in err
    assert "a list of GPU indices" in err
    assert "file" in err
