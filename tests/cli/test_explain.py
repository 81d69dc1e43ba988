"""`allreduce explain` as a user runs it: a real subprocess, its output and exit status."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "allreduce", *args], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.slow
def test_json_matches_the_closed_forms_of_the_issue() -> None:
    out = run_cli("explain", "--ranks", "1024", "--size", "1GiB", "--bandwidth", "50GB/s", "--latency", "5us", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    by_name = {a["name"]: a for a in doc["algorithms"]}
    n, s, a, b = 1024, 2.0**30, 5e-6, 1 / 50e9
    assert by_name["ring"]["seconds"] == pytest.approx(2 * (n - 1) * a + 2 * (n - 1) / n * s * b, rel=1e-6)
    assert by_name["halving_doubling"]["seconds"] == pytest.approx(
        2 * math.log2(n) * a + 2 * (n - 1) / n * s * b, rel=1e-6
    )
    assert by_name["recursive_doubling"]["seconds"] == pytest.approx(math.log2(n) * (a + s * b), rel=1e-6)
    for row in doc["algorithms"]:
        assert set(row) >= {"name", "seconds", "algbw_GBps", "busbw_GBps", "steps", "bytes_sent_per_rank"}
        assert row["algbw_GBps"] == pytest.approx(s / row["seconds"] / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (n - 1) / n)
    assert doc["best"] == doc["algorithms"][0]["name"]
    assert doc["algorithms"][0]["seconds"] == min(r["seconds"] for r in doc["algorithms"])
    assert by_name["ring"]["steps"] == 2 * (n - 1)
    assert by_name["ring"]["bytes_sent_per_rank"] == pytest.approx(2 * (n - 1) / n * s)


@pytest.mark.slow
def test_best_changes_with_size_and_the_table_says_why() -> None:
    common = ("--ranks", "1024", "--bandwidth", "400Gbps", "--latency", "5us", "--group-size", "8")
    big = run_cli("explain", "--size", "1GiB", *common)
    small = run_cli("explain", "--size", "64KiB", *common)
    assert big.returncode == 0
    assert small.returncode == 0
    best_big = next(line for line in big.stdout.splitlines() if line.startswith("* ") and "GB/s" in line).split()[1]
    best_small = next(line for line in small.stdout.splitlines() if line.startswith("* ") and "GB/s" in line).split()[1]
    assert best_big != best_small
    assert "bandwidth-bound" in big.stdout
    assert "latency-bound" in small.stdout
    assert "Crossover with the runner-up" in small.stdout


@pytest.mark.parametrize(
    ("args", "culprit"),
    [
        (("--ranks", "0", "--size", "1GiB", "--bandwidth", "1GB/s", "--latency", "1us"), "--ranks"),
        (("--ranks", "8", "--size", "0", "--bandwidth", "1GB/s", "--latency", "1us"), "--size"),
        (("--ranks", "8", "--size", "-4KiB", "--bandwidth", "1GB/s", "--latency", "1us"), "--size"),
        (("--ranks", "8", "--size", "1XB", "--bandwidth", "1GB/s", "--latency", "1us"), "--size"),
        (("--ranks", "8", "--size", "1GiB", "--bandwidth", "fast", "--latency", "1us"), "--bandwidth"),
        (("--ranks", "8", "--size", "1GiB", "--bandwidth", "1GB/s", "--latency", "1 fortnight"), "--latency"),
        (
            ("--ranks", "10", "--size", "1GiB", "--bandwidth", "1GB/s", "--latency", "1us", "--group-size", "4"),
            "--group-size",
        ),
        (
            (
                "--ranks",
                "8",
                "--size",
                "1GiB",
                "--bandwidth",
                "1GB/s",
                "--latency",
                "1us",
                "--reduce-bandwidth",
                "0GB/s",
            ),
            "--reduce-bandwidth",
        ),
        (("--ranks", "eight", "--size", "1GiB", "--bandwidth", "1GB/s", "--latency", "1us"), "--ranks"),
        (("--size", "1GiB", "--bandwidth", "1GB/s", "--latency", "1us"), "--ranks"),
    ],
)
@pytest.mark.slow
def test_bad_input_is_one_line_naming_the_argument_exit_2(args: tuple[str, ...], culprit: str) -> None:
    out = run_cli("explain", *args)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("allreduce explain: error:")
    assert culprit in last


@pytest.mark.slow
def test_help_and_no_command() -> None:
    out = run_cli("explain", "--help")
    assert out.returncode == 0
    assert "--reduce-bandwidth" in out.stdout
    bare = run_cli()
    assert bare.returncode == 2
    assert "explain" in bare.stdout


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "algorithms" / "my_ring.py"
COMMON = ("--bandwidth", "50GB/s", "--latency", "5us")


@pytest.mark.slow
def test_naive_beside_ring_at_1024_ranks_matches_both_closed_forms() -> None:
    out = run_cli("explain", "--ranks", "1024", "--size", "1GiB", *COMMON, "--algorithm", "naive,ring", "--json")
    assert out.returncode == 0, out.stderr
    by_name = {a["name"]: a for a in json.loads(out.stdout)["algorithms"]}
    assert set(by_name) == {"naive", "ring"}
    n, s, a, b = 1024, 2.0**30, 5e-6, 1 / 50e9
    assert by_name["naive"]["seconds"] == pytest.approx(a + (n - 1) * s * b, rel=1e-9)
    assert by_name["naive"]["bytes_sent_per_rank"] == pytest.approx((n - 1) * s)
    assert by_name["naive"]["steps"] == 1
    assert by_name["ring"]["seconds"] == pytest.approx(2 * (n - 1) * a + 2 * (n - 1) / n * s * b, rel=1e-9)


@pytest.mark.slow
def test_all_includes_naive_and_a_loaded_user_algorithm() -> None:
    spec = f"{EXAMPLE}:bidirectional_ring"
    out = run_cli("explain", "--ranks", "16", "--size", "64MiB", *COMMON, "--algorithm", f"all,{spec}", "--json")
    assert out.returncode == 0, out.stderr
    names = {a["name"] for a in json.loads(out.stdout)["algorithms"]}
    assert {"ring", "naive", "bidirectional_ring"} <= names


@pytest.mark.slow
def test_a_module_spec_on_pythonpath_is_explained() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLE.parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-m", "allreduce", "explain", "-n", "8", "--size", "1MiB", *COMMON, "-a",
         "my_ring:bidirectional_ring,ring"],
        capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [line.lstrip("* ").split()[0] for line in out.stdout.splitlines() if line.endswith(("bandwidth", "latency"))]
    assert sorted(rows) == ["bidirectional_ring", "ring"]


@pytest.mark.parametrize(
    ("algorithm", "culprit"),
    [
        ("bogus", "unknown all-reduce algorithm 'bogus'"),
        ("no_such_module_q:fn", "no_such_module_q:fn: no module named 'no_such_module_q'"),
        (f"{EXAMPLE}:nope", "has no attribute 'nope'"),
    ],
)
@pytest.mark.slow
def test_a_bad_algorithm_is_one_line_exit_2(algorithm: str, culprit: str) -> None:
    out = run_cli("explain", "-n", "8", "--size", "1MiB", *COMMON, "--algorithm", algorithm)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("allreduce explain: error: --algorithm: ")
    assert culprit in lines[0]


@pytest.mark.slow
def test_naive_is_left_out_of_all_above_its_bound_with_a_note() -> None:
    out = run_cli("explain", "--ranks", "4096", "--size", "1GiB", *COMMON)
    assert out.returncode == 0, out.stderr
    assert "(note: naive: left out above 512 ranks" in out.stdout
    assert "(note: direct: left out above 1024 ranks" in out.stdout


@pytest.mark.slow
def test_two_algorithms_of_equal_cost_are_a_tie_not_a_crossover() -> None:
    spec = f"{Path(__file__).parents[2] / 'examples' / 'algorithms' / 'my_ring.py'}:bidirectional_ring"
    out = run_cli("explain", "--ranks", "64", "--size", "1GiB", "--bandwidth", "50GB/s", "--latency", "5us",
                  "--algorithm", f"ring,{spec}")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "takes the same time in this model" in out.stdout
    assert "Crossover" not in out.stdout
