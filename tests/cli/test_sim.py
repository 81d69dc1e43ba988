"""``allreduce sim``: output, JSON shape, trace file, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from allreduce.cli import main
from allreduce.sim import FAST_ERROR_RANGE

CLOS = "clos:leaves=2,spines=1,hosts_per_leaf=4,bw=400Gbps,lat=1us"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["sim", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_every_algorithm_with_time_bandwidth_and_the_bottleneck(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--topology", CLOS, "--size", "64MiB")
    assert code == 0, err
    for name in ("ring", "halving_doubling", "recursive_doubling", "double_binary_tree", "direct", "hierarchical"):
        assert f"\n{name} " in out
    assert "best: " in out
    assert "links the critical path of" in out


def test_json_has_the_explain_shape_and_names_the_degraded_link(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "--topology", CLOS, "--size", "64MiB", "--algorithm", "ring", "--degrade", "leaf0->spine0=0.1", "--json"
    )
    assert code == 0, err
    data = json.loads(out)
    (ring,) = data["algorithms"]
    assert set(ring) >= {"name", "seconds", "algbw_GBps", "busbw_GBps"}
    assert ring["name"] == "ring"
    assert data["best"] == "ring"
    # Hand-computed (see tests/sim/test_accuracy.py): 14 steps of 4 µs path latency + 4.375 S/B at 400 Gb/s.
    size = 2**26
    assert ring["seconds"] == pytest.approx(14 * 4e-6 + 4.375 * size / 50e9, rel=1e-6)
    assert ring["algbw_GBps"] == pytest.approx(size / ring["seconds"] / 1e9, rel=1e-9)
    assert ring["busbw_GBps"] == pytest.approx(ring["algbw_GBps"] * 2 * 7 / 8, rel=1e-9)
    assert data["bottlenecks"][0]["link"] == "leaf0->spine0"
    assert 0 < data["bottlenecks"][0]["utilization"] <= 1


def test_slow_rank_and_failed_link_reroute(capsys: pytest.CaptureFixture[str]) -> None:
    # A fat-tree k=4 has two uplinks per edge switch: failing one reroutes over the other.
    base = ["--topology", "fat-tree:k=4", "--size", "1MiB", "--algorithm", "ring", "--json"]
    _, healthy, _ = run(capsys, *base)
    code, failed, err = run(capsys, *base, "--fail", "edge0<->agg0")
    assert code == 0, err
    assert json.loads(failed)["algorithms"][0]["seconds"] >= json.loads(healthy)["algorithms"][0]["seconds"]
    code, slow, err = run(capsys, *base, "--slow-rank", "3=10us", "--engine", "event")
    assert code == 0, err
    # Rank 3 adds 10 µs to each of its 30 steps, and every ring step waits for it.
    extra = json.loads(slow)["algorithms"][0]["seconds"] - json.loads(healthy)["algorithms"][0]["seconds"]
    assert extra == pytest.approx(30 * 10e-6, rel=1e-6)


def test_trace_file_has_one_track_per_rank(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "sim.json"
    code, out, err = run(
        capsys,
        "--topology",
        "switch:8",
        "--size",
        "1MiB",
        "--algorithm",
        "ring",
        "--engine",
        "event",
        "--trace",
        str(trace),
    )
    assert code == 0, err
    assert str(trace) in out
    events = json.loads(trace.read_text())["traceEvents"]
    threads = {e["tid"] for e in events if e["name"] == "thread_name"}
    assert threads == set(range(8))
    slices = [e for e in events if e["ph"] == "X"]
    # Event engine: one slice per rank per step (2(N-1) = 14 steps), each with a positive duration.
    assert len(slices) == 8 * 14
    assert all(e["dur"] > 0 for e in slices)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--topology", "fat-tree:k=3", "--size", "1MiB"], "k"),
        (["--topology", "nosuch:4", "--size", "1MiB"], "nosuch"),
        (["--topology", "/nonexistent/topo.yaml", "--size", "1MiB"], "topo.yaml"),
        (["--topology", "switch:8", "--size", "lots"], "--size"),
        (["--topology", "switch:8", "--size", "1MiB", "--ranks", "9"], "--ranks 9"),
        (["--topology", "switch:8", "--size", "1MiB", "--algorithm", "bogus"], "bogus"),
        (["--topology", "switch:8", "--size", "1MiB", "--degrade", "gpu0->leaf9=0.5"], "leaf9"),
        (["--topology", "switch:8", "--size", "1MiB", "--degrade", "gpu0->switch0=fast"], "'fast'"),
        (["--topology", "switch:8", "--size", "1MiB", "--degrade", "gpu0->switch0=0"], "> 0"),
        (["--topology", "switch:8", "--size", "1MiB", "--slow-rank", "12=1us"], "rank 12"),
        (["--topology", "switch:8", "--size", "1MiB", "--slow-rank", "3"], "R=SECONDS"),
        (["--topology", "switch:8", "--size", "1MiB", "--group-size", "3"], "--group-size 3"),
        (["--topology", "switch:8", "--size", "1MiB", "--fail", "gpu2<->switch0"], "rank 2"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("allreduce sim: error: ")
    assert message in lines[0]


def test_placement_file_errors_name_file_and_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    good = tmp_path / "good.txt"
    good.write_text("# rank -> GPU\n7 6 5 4\n3, 2, 1, 0\n")
    code, _, err = run(capsys, "--topology", "switch:8", "--size", "1MiB", "-a", "ring", "--placement", str(good))
    assert code == 0, err
    bad = tmp_path / "bad.txt"
    bad.write_text("0 1 2 3\n4 five 6 7\n")
    code, _, err = run(capsys, "--topology", "switch:8", "--size", "1MiB", "--placement", str(bad))
    assert code == 2
    assert f"{bad}:2" in err
    assert "'five'" in err
    dup = tmp_path / "dup.json"
    dup.write_text("[0, 1, 2, 3, 4, 5, 6, 6]")
    code, _, err = run(capsys, "--topology", "switch:8", "--size", "1MiB", "--placement", str(dup))
    assert code == 2
    assert "6" in err


@pytest.mark.slow
def test_the_installed_command_exits_2_without_a_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "allreduce", "sim", "--topology", "torus:0x4", "--size", "1MiB"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("allreduce sim: error: ")


@pytest.mark.parametrize("seed", ["-1", "x"])
def test_a_bad_seed_is_named(capsys: pytest.CaptureFixture[str], seed: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["sim", "--topology", "switch:8", "--size", "1MiB", "--placement", "random", "--seed", seed])
    assert exc.value.code == 2
    assert "argument --seed: --seed must be" in capsys.readouterr().err


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "algorithms"


@pytest.mark.slow
def test_naive_and_a_user_algorithm_from_pythonpath_are_simulated_beside_ring() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "allreduce", "sim", "--topology", "fat-tree:k=4", "--size", "16MiB", "--json",
         "--algorithm", "my_ring:bidirectional_ring,ring,naive"],
        capture_output=True, text=True, timeout=300, check=False, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    by_name = {a["name"]: a for a in json.loads(proc.stdout)["algorithms"]}
    assert set(by_name) == {"bidirectional_ring", "ring", "naive"}
    # Naive sends 15 times the buffer from every rank; ring sends under twice: naive cannot win.
    assert by_name["naive"]["seconds"] > 4 * by_name["ring"]["seconds"]


def test_naive_is_left_out_of_all_on_many_ranks_with_a_note(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--topology", "fat-tree:k=16", "--ranks", "512", "--size", "1MiB", "-a", "all")
    assert code == 0, err
    assert "(note: naive: left out above 256 ranks" in out


def test_an_uncertified_fast_answer_says_the_measured_error_range(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--topology", "torus:4x4", "--size", "16MiB", "--placement", "random", "--engine", "fast")
    code, out, err = run(capsys, *argv, "-a", "halving_doubling")
    assert code == 0, err
    low, high = FAST_ERROR_RANGE["halving_doubling"]
    assert f"(~ halving_doubling: {low:+.0%} to {high:+.0%} of the exact time" in out


def test_an_exact_answer_says_no_error_range(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--topology", "torus:4x4", "--size", "16MiB", "-a", "halving_doubling")
    assert code == 0, err
    assert "of the exact time" not in out
