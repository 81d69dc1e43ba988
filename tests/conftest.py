"""Shared test configuration, and the fixture that runs the command line as a user does."""

import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping

import pytest
from hypothesis import HealthCheck, settings

from allreduce.schedules import Collective, algorithms, unregister_algorithm

# CI runs on 2 shared cores: no per-example deadline, a fixed number of examples, deterministic seeds.
settings.register_profile(
    "ci", deadline=None, max_examples=60, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _registry_as_it_was() -> Iterator[None]:
    """Algorithms a test registers (``-a FILE.py:function``) are removed after it, so that `all` means the same
    registry in every test of the session."""
    before = {c: set(algorithms(c)) for c in Collective}
    yield
    for collective, names in before.items():
        for name in set(algorithms(collective)) - names:
            unregister_algorithm(collective, name)


def _run_allreduce(
    *args: str, timeout_s: float = 240, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m allreduce ARGS`` in a new process (``env``: its whole environment, else this one's): its exit
    status and its output as text. A non-zero status is the test's to judge, so that it can print stderr."""
    return subprocess.run(
        [sys.executable, "-m", "allreduce", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
        check=False,
    )


@pytest.fixture(scope="session")
def run_allreduce() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Runs the command line in a new process: ``run_allreduce("train", "-n", "2", timeout_s=300)``."""
    return _run_allreduce
