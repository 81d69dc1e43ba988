"""``allreduce tail``: bad input refused up front with its reason, defaults in --help, the TCP stack printed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from allreduce.cli import main

TOPOLOGY = "fat-tree:k=4"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["tail", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("fabric", ["roce", "tcp"])
def test_a_loss_no_stack_recovers_from_is_refused_with_the_reason(
    capsys: pytest.CaptureFixture[str], fabric: str
) -> None:
    code, out, err = run(capsys, "-t", TOPOLOGY, "--size", "1MiB", "--loss", "0.7", "--fabric", fabric, "-k", "20")
    assert code == 2
    assert out == ""
    assert "too lossy to recover from" in err
    assert "gives up" in err


def test_a_moderate_loss_still_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "-t", TOPOLOGY, "--size", "256KiB", "--loss", "0.02", "--fabric", "tcp", "-k", "20")
    assert code == 0, err
    assert "p99" in out


def test_samples_beyond_memory_are_refused_with_an_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "-t", TOPOLOGY, "--size", "1MiB", "--samples", "1e9")
    assert code == 2
    assert "--samples 1,000,000,000" in err
    assert "GiB" in err
    assert "limit of 4 GiB" in err


def test_samples_take_exponent_notation(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "-t", TOPOLOGY, "--size", "1MiB", "--samples", "2e1")
    assert code == 0, err
    assert "20 samples" in out


def test_a_csv_path_that_cannot_be_written_is_refused_before_anything_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The unknown link would fail later, while the noise is parsed: the path is checked first.
    missing = tmp_path / "no" / "samples.csv"
    code, _, err = run(
        capsys, "-t", TOPOLOGY, "--size", "1MiB", "--loss-link", "nosuch->link=0.1", "--csv", str(missing)
    )
    assert code == 2
    assert f"--csv {missing}" in err
    assert "does not exist" in err


def test_a_plot_path_that_is_a_directory_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(
        capsys, "-t", TOPOLOGY, "--size", "1MiB", "--loss-link", "nosuch->link=0.1", "--plot", str(tmp_path)
    )
    assert code == 2
    assert "--plot" in err
    assert "is a directory" in err


def test_help_shows_the_defaults_and_the_distribution_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["tail", "--help"])
    text = " ".join(capsys.readouterr().out.split("options:")[1].split())
    for flag, default in [
        ("--samples", "default 1000"),
        ("--seed", "default 0"),
        ("--chunks", "default 8"),
        ("--loss P", "(default 0)"),
        ("--ecmp-seeds", "default 0"),
        ("--tcp", "default linux"),
    ]:
        section = text[text.index(flag + " ") :]
        assert default in section[:300], flag
    jitter = text[text.index("--jitter-rank DIST") :][:400]
    for kind in ("constant", "exponential", "lognormal", "uniform", "empirical"):
        assert kind in jitter


@pytest.mark.parametrize(
    ("stack", "says"), [("linux", "RACK-TLP"), ("tuned", "HZ=1000"), ("rfc6298", "3 duplicate ACKs")]
)
def test_the_tcp_stack_and_its_settings_are_printed(capsys: pytest.CaptureFixture[str], stack: str, says: str) -> None:
    code, out, err = run(
        capsys, "-t", TOPOLOGY, "--size", "256KiB", "--loss", "1e-4", "--fabric", "tcp", "--tcp", stack, "-k", "20"
    )
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith("tcp stack "))
    assert stack in line
    assert says in line


def test_json_names_the_tcp_stack_and_its_settings(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys,
        "-t",
        TOPOLOGY,
        "--size",
        "256KiB",
        "--loss",
        "1e-4",
        "--fabric",
        "tcp",
        "--tcp",
        "tuned",
        "-k",
        "20",
        "--json",
    )
    assert code == 0, err
    tcp = json.loads(out)["tcp"]
    assert tcp["stack"] == "tuned"
    assert "rto_min 5 ms" in tcp["settings"]
