"""Shared test configuration."""

from collections.abc import Iterator

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
