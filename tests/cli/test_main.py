"""Every subcommand reports bad input as one line that names it, exit status 2, never a traceback."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pytest


@pytest.mark.parametrize(
    ("args", "prefix"),
    [
        (("run", "-n", "2"), "allreduce run: error:"),
        (("bench", "-n", "0"), "allreduce bench: error:"),
        (("sim", "--topology", "fat-tree:k=3", "--size", "1MiB"), "allreduce sim: error:"),
        (("train", "--epochs", "0"), "allreduce train: error:"),
        (
            ("explain", "--ranks", "2", "--size", "0", "--bandwidth", "1GB/s", "--latency", "1us"),
            "allreduce explain: error:",
        ),
    ],
)
@pytest.mark.slow
def test_errors_name_the_subcommand(
    args: tuple[str, ...], prefix: str, run_allreduce: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    out = run_allreduce(*args, timeout_s=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(prefix), out.stderr
