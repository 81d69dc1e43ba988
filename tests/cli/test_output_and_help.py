"""What the CLI prints is valid: JSON without NaN or Infinity (RFC 8259), no inf/nan in tables, messages that say
what is wrong, and help that shows defaults and documents the spec strings and environment variables."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from allreduce.cli._main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
ONE_RANK = {
    "explain": ("explain", "--ranks", "1", "--size", "1MiB", "--bandwidth", "1Gbps", "--latency", "1us"),
    "sim": ("sim", "-t", "switch:1", "--size", "1MiB", "-a", "ring"),
    "tail": ("tail", "-t", "switch:1", "--size", "1MiB", "-k", "5"),
}


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise AssertionError(f"{constant} is not JSON (RFC 8259)")

    return json.loads(text, parse_constant=refuse)


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("command", list(ONE_RANK))
def test_json_of_one_rank_has_no_nan_or_infinity(capsys: pytest.CaptureFixture[str], command: str) -> None:
    code, out, err = _run(capsys, *ONE_RANK[command], "--json")
    assert code == 0, err
    _strict_json(out)


@pytest.mark.parametrize("command", ["explain", "sim", "tail"])
def test_tables_of_one_rank_show_no_inf_or_nan(capsys: pytest.CaptureFixture[str], command: str) -> None:
    code, out, err = _run(capsys, *ONE_RANK[command])
    assert code == 0, err
    words = out.lower().replace("(", " ").replace(")", " ").split()
    assert not {"inf", "nan", "infx", "nanx"} & set(words)


@pytest.mark.parametrize(
    "args",
    [
        ("explain", "--ranks", "8", "--size", "1MiB", "--bandwidth", "1Gbps", "--latency", "1us"),
        ("sim", "-t", "fat-tree:k=4", "--size", "1MiB", "-a", "ring,direct"),
        ("tail", "-t", "fat-tree:k=4", "--size", "1MiB", "-k", "5"),
        ("plan", "--model", "resnet50", "--gpus", "1", "--topology", "fat-tree:k=4", "--compute-ms", "10"),
    ],
)
def test_every_json_output_is_strict_json(capsys: pytest.CaptureFixture[str], args: tuple[str, ...]) -> None:
    code, out, err = _run(capsys, *args, "--json")
    assert code == 0, err
    _strict_json(out)


@pytest.mark.slow
def test_bench_json_of_one_rank_is_strict_json(run_allreduce: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    done = run_allreduce("bench", "-n", "1", "--sizes", "4KiB", "--iters", "2", "--json")
    assert done.returncode == 0, done.stderr
    (row,) = _strict_json(done.stdout)
    assert row["busbw_Bps"] == 0  # nccl-tests: the bus factor of one rank is 0


def test_a_bandwidth_that_overflows_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, *ONE_RANK["explain"][:-4], "--bandwidth", "1e400Gbps", "--latency", "1us")
    assert code == 2
    assert "not finite" in err
    assert "greater than zero" not in err


def test_sim_finds_the_group_size_of_a_file_topology(capsys: pytest.CaptureFixture[str]) -> None:
    topology = str(ROOT / "examples" / "topologies" / "two_racks.yaml")
    code, out, err = _run(capsys, "sim", "-t", topology, "--size", "1MiB", "-a", "hierarchical")
    assert code == 0, err
    assert "hierarchical" in out


def test_top_0_lists_no_links(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "sim", "-t", "fat-tree:k=4", "--size", "1MiB", "-a", "ring", "--top", "0", "--json")
    assert code == 0, err
    assert _strict_json(out)["bottlenecks"] == []


def _help(*path: str) -> str:
    parser = build_parser()
    if not path:
        return parser.format_help()
    subparsers = next(a for a in parser._actions if a.dest == "subcommand")
    return subparsers.choices[path[0]].format_help()  # type: ignore[attr-defined, no-any-return]


@pytest.mark.parametrize(
    ("command", "option", "default"),
    [
        ("bench", "--sizes", "4KiB:256MiB"),
        ("bench", "--timeout", "300"),
        ("train", "--batch-size", "32"),
        ("sim", "--seed", "0"),
        ("sim", "--chunks", "8"),
    ],
)
def test_help_shows_the_default(command: str, option: str, default: str) -> None:
    text = " ".join(_help(command).split())
    after = text.split(option, 2)[2] if text.count(option) > 1 else text.split(option, 1)[1]
    assert f"default {default}" in after.split(" --", 1)[0] or f"default: {default}" in after.split(" --", 1)[0]


def test_tune_transport_has_help() -> None:
    text = " ".join(_help("tune").split())
    after = text.split("--transport {shm,tcp,both}", 2)[-1].split(" --", 1)[0]
    assert "default both" in after


def test_sim_help_documents_topology_specs_and_link_names() -> None:
    text = _help("sim")
    for kind in ("fat-tree", "clos", "rail", "torus", "dragonfly", "switch", "ring", "full"):
        assert f"{kind}:" in text
    for parameter in ("hosts_per_leaf", "oversub", "nvlink", "global_links"):
        assert parameter in text
    assert "gpu0->edge0" in text
    assert "docs/topology-files.md" in text


def test_main_help_documents_the_environment() -> None:
    text = _help()
    for variable in ("ALLREDUCE_TOKEN", "ALLREDUCE_DEBUG", "ALLREDUCE_ALGORITHMS", "ALLREDUCE_TUNE_FILE"):
        assert variable in text
