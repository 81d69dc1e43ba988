"""``allreduce plan``: the printed split and tables, the JSON, and one-line errors with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from allreduce.cli import main

SMALL = ("--params", "5e7", "--gpus", "16", "--topology", "fat-tree:k=4", "--compute-ms", "20")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_prints_the_split_the_scaling_table_the_bottleneck_and_what_ifs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *SMALL)
    assert code == 0, err
    for line in ("step time", "  compute", "  waiting", "  exposed comm", "bottleneck: "):
        assert f"\n{line}" in out
    assert "scaling (same per-GPU batch)" in out
    assert "what if (one change each)" in out
    assert "\n      16 " in out


@pytest.mark.slow
def test_json_numbers_match_the_library(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *SMALL, "--json", "--no-what-if")
    assert code == 0, err
    data = json.loads(out)
    base = data["base"]
    assert base["step_s"] == pytest.approx(base["compute_s"] + base["waiting_s"] + base["exposed_comm_s"], rel=1e-12)
    assert [row["gpus"] for row in data["scaling"]] == [8, 16]
    assert data["what_ifs"] == []


@pytest.mark.slow
def test_compute_from_flops_uses_six_params_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--params", "5e7", "--gpus", "16", "--topology", "fat-tree:k=4")
    flops = ("--gpu-tflops", "100", "--mfu", "0.5", "--tokens-per-gpu", "1000")
    code, out, err = run(capsys, *argv, *flops, "--json", "--no-what-if", "--no-scaling")
    assert code == 0, err
    assert json.loads(out)["base"]["compute_s"] == pytest.approx(6 * 5e7 * 1000 / 50e12, rel=1e-12)


def test_a_torch_module_is_planned(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "plan"))
    argv = ("--module", "plan_test_nets:two_layer", "--gpus", "4", "--topology", "switch:4", "--compute-ms", "1")
    code, out, err = run(capsys, *argv, "--json", "--no-what-if")
    assert code == 0, err
    assert json.loads(out)["base"]["params"] == 10 * 20 + 20 + 20 * 3 + 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--params", "5e7", "--gpus", "16", "--topology", "fat-tree:k=4"), "say how long compute takes"),
        (("--params", "5e7", "--gpus", "64", "--topology", "fat-tree:k=4", "--compute-ms", "1"), "has only 16 GPUs"),
        (("--module", "nope", "--gpus", "4", "--topology", "switch:4", "--compute-ms", "1"), "module:function"),
        (("--model", "resnet50", "--gpus", "4", "--topology", "switch:4", "--gpu-tflops", "100"), "--samples-per-gpu"),
        (("--params", "5e7", "--gpus", "4", "--topology", "nonsense:4", "--compute-ms", "1"), "nonsense"),
        (("--params", "5e7", "--gpus", "4", "--topology", "switch:4", "--compute", "lognormal:median=1ms"), "p99"),
        (
            ("--params", "5e7", "--gpus", "4", "--topology", "switch:4", "--compute", "1ms", "--compute-ms", "1"),
            "not several",
        ),
        (("--params", "5e7", "--gpus", "4", "--topology", "switch:4", "--compute-ms", "1", "--loss", "1.5"), "[0, 1)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("allreduce plan: error: ")
    assert message in err


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "(default: 25)" in out
    assert "(default: auto)" in out


@pytest.mark.slow
def test_the_what_if_table_has_loss_rows_with_p99_and_no_placeholder(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *SMALL, "--no-scaling")
    assert code == 0, err
    assert "p99 ms" in out
    tcp = "loss 1e-06, TCP (linux stack) RTO"
    for change in ("loss 1e-06, RoCE timeout 4.295 s", f"{tcp} 200 ms", f"{tcp} 4 ms"):
        assert f"\n{change}" in out
    assert "packet-loss model" not in out


@pytest.mark.slow
def test_loss_zero_prints_no_loss_rows(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *SMALL, "--no-scaling", "--loss", "0")
    assert code == 0, err
    assert "\nloss " not in out


@pytest.mark.slow
def test_compute_from_a_distribution_adds_p50_and_p99(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    steps = tmp_path / "steps.csv"
    steps.write_text("step_s\n0.020\n0.021\n0.025\n0.040\n")
    argv = ("--params", "5e7", "--gpus", "16", "--topology", "fat-tree:k=4", "--compute", f"empirical:{steps}")
    code, out, err = run(capsys, *argv, "--no-what-if")
    assert code == 0, err
    assert "(p50 " in out
    assert ", p99 " in out
    assert "p50 ms     p99 ms" in out
    code, out, err = run(capsys, *argv, "--no-what-if", "--json")
    data = json.loads(out)
    # 16 GPUs each drawing one of 4 values: the slowest is 40 ms at p50 (1 - 0.75^16 > 0.5) and p99.
    assert data["base"]["compute_distribution"] == f"empirical:{steps}"
    assert data["base"]["micro_batch_s"] == 0.025
    assert data["base"]["p99_step_s"] == data["base"]["p50_step_s"]
    assert data["base"]["p99_step_s"] > data["base"]["step_s"]
