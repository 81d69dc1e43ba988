"""``allreduce run -- python ...`` runs the ranks with allreduce's own interpreter, activated or not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")
CHECK = "import sys, allreduce, numpy; print('interpreter', sys.executable)"
RUN_TIMEOUT_S = 120


@pytest.mark.slow
@pytest.mark.parametrize("python", ["python", "python3"])
def test_python_on_a_path_without_the_venv_is_this_interpreter(python: str) -> None:
    # PATH as in a shell where the venv is not activated: the system's python3 lacks numpy and allreduce
    env = {**os.environ, "PATH": "/usr/bin:/bin", "PYTHONPATH": SRC}
    command = [sys.executable, "-m", "allreduce", "run", "-n", "2", "--", python, "-c", CHECK]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr
    assert "ModuleNotFoundError" not in done.stderr
    assert done.stdout.count(f"interpreter {sys.executable}") == 2


@pytest.mark.slow
def test_a_path_to_another_python_is_left_as_given() -> None:
    system = shutil.which("python3", path="/usr/bin:/bin")
    if system is None or Path(system).resolve() == Path(sys.executable).resolve():
        pytest.skip("no second interpreter on /usr/bin:/bin")
    env = {**os.environ, "PYTHONPATH": SRC}
    show = "import sys; print(sys.executable)"
    command = [sys.executable, "-m", "allreduce", "run", "-n", "1", "--", system, "-c", show]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr
    assert system in done.stdout
