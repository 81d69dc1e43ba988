"""``allreduce emulate run --algorithm FILE.py:function``: a user algorithm is verified, registered in every rank
and run across emulated hosts, as ``allreduce run --algorithm`` does.

Needs root and iproute2 (skipped otherwise); the emulation has a name and a state directory of its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MY_RING = str(ROOT / "examples" / "algorithms" / "my_ring.py") + ":bidirectional_ring"
RUN_TIMEOUT_S = 600

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
        reason="needs root and iproute2 (ip, tc) to build network namespaces",
    ),
    pytest.mark.serial,  # paced links
    pytest.mark.slow,
]


def _ours(name: str) -> list[str]:
    out = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [entry["name"] for entry in json.loads(out or "[]") if entry["name"].startswith(f"ar{name}-")]


def test_a_user_algorithm_from_a_file_runs_across_emulated_hosts(tmp_path: Path) -> None:
    name = uuid.uuid4().hex[:6]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "ALLREDUCE_EMULATE_STATE_DIR": str(tmp_path),
    }
    command = [
        sys.executable, "-m", "allreduce", "emulate", "run", "--topology", "clos:leaves=2,spines=2,hosts_per_leaf=2",
        "--name", name, "--algorithm", MY_RING, "--sizes", "64KiB", "--reps", "1", "--json",
    ]  # fmt: skip
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    finally:
        for namespace in _ours(name):  # a failed run must not leave its namespaces behind
            subprocess.run(["ip", "netns", "delete", namespace], check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["algorithm"] == "bidirectional_ring"
    assert all(row["exact"] for row in result["rows"])
