"""``allreduce tail``: percentile and culprit tables, histogram, JSON, CSV, plot, one-line errors (exit 2)."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest

from allreduce.cli import main

TOPOLOGY = "fat-tree:k=4"
NOISE = ("--loss", "1e-4", "--fabric", "tcp", "--rto", "2ms", "--jitter-rank", "lognormal:median=10us,p99=50us")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["tail", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_percentile_table_per_algorithm(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "-t", TOPOLOGY, "--size", "4MiB", "-a", "ring,halving_doubling", "-k", "50", *NOISE)
    assert code == 0, err
    assert "p50" in out
    assert "p99.9" in out
    assert "\nring " in out
    assert "\nhalving_doubling " in out
    assert "stepping" in out


def test_attribution_names_a_rank_or_link(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "-t", TOPOLOGY, "--size", "4MiB", "-k", "50", "--jitter-rank", "exponential:mean=1ms")
    assert code == 0
    assert "what held ring back" in out
    assert "rank " in out
    assert "of samples" in out


def test_histogram_ends_at_every_sample(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "-t", TOPOLOGY, "--size", "4MiB", "-k", "40", *NOISE)
    assert code == 0
    assert "histogram of ring" in out
    assert out.rstrip().splitlines()[-1].endswith("100.00%")


def test_json_has_percentiles_and_culprits(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "-t", TOPOLOGY, "--size", "4MiB", "-k", "30", "--json", *NOISE)
    assert code == 0
    data = json.loads(out)
    (ring,) = data["algorithms"]
    assert ring["samples"] == 30
    assert ring["step_s"]["p50"] <= ring["step_s"]["p99"]
    assert ring["noise_free_s"] > 0
    assert isinstance(ring["attribution"], list)


@pytest.mark.slow
def test_csv_has_every_sample(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "samples.csv"
    code, _, _ = run(capsys, "-t", TOPOLOGY, "--size", "4MiB", "-k", "25", "-a", "ring,direct", "--csv", str(path))
    assert code == 0
    rows = list(csv.DictReader(path.read_text().splitlines()))
    assert len(rows) == 50
    assert {r["algorithm"] for r in rows} == {"ring", "direct"}
    assert all(float(r["step_s"]) > 0 for r in rows)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plot_writes_a_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "cdf.png"
    code, _, _ = run(capsys, "-t", TOPOLOGY, "--size", "4MiB", "-k", "20", "--plot", str(path), *NOISE)
    assert code == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None, reason="matplotlib is installed")
def test_plot_without_matplotlib_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "-t", TOPOLOGY, "--size", "4MiB", "-k", "5", "--plot", str(tmp_path / "x.png"))
    assert code == 2
    assert "needs matplotlib" in err
    assert len(err.strip().splitlines()) == 1


def test_link_down_names_the_link(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "-t", "switch:n=8", "--size", "1MiB", "-k", "1", "--link-down", "gpu2<->switch0@0s+5ms"
    )
    assert code == 0, err
    assert "gpu2<->switch0 down at 0 s for 5 ms" in out
    assert "switch0" in out.split("what held ring back")[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--loss", "-0.1"), "--loss '-0.1': a probability must be in [0, 1)"),
        (("--loss", "often"), "--loss 'often': not a number"),
        (("--jitter-rank", "lognormal:median=1ms"), "--jitter-rank: distribution 'lognormal:median=1ms': missing p99"),
        (("--jitter-link", "gamma:k=2"), "--jitter-link: distribution 'gamma:k=2': unknown kind"),
        (("--link-down", "edge9->agg0@1ms+1ms"), "no node named 'edge9'"),
        (("--loss-link", "gpu0->edge0=2"), "--loss-link gpu0->edge0 '2': a probability must be in [0, 1)"),
        (("--flap", "gpu0->edge0@0s/1ms"), "write it as LINK@0s/20ms*0.5"),
        (("--rto", "soon"), "--rto: cannot read 'soon'"),
        (("--loss-burst", "0.5"), "--loss-burst '0.5': the mean burst is at least 1 packet"),
        (("--loss-burst", "5000"), "--loss-burst '5000': loss: the mean burst must be 1 to 1000 packets"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    code, out, err = run(capsys, "-t", TOPOLOGY, "--size", "4MiB", "-k", "5", *argv)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert message in err


def test_loss_burst_says_the_losses_come_in_bursts(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "-t", TOPOLOGY, "--size", "1MiB", "-k", "20", "--loss", "1e-3", "--fabric", "tcp", "--loss-burst", "4"
    )
    assert code == 0, err
    assert "in bursts of 4 packets" in out
