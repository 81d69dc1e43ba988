"""Algorithms a test registers (``-a FILE.py:function``) are removed after it, so that `all` means the same
registry in every test of the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from allreduce.schedules import Collective, algorithms, unregister_algorithm


@pytest.fixture(autouse=True)
def _registry_as_it_was() -> Iterator[None]:
    before = {c: set(algorithms(c)) for c in Collective}
    yield
    for collective, names in before.items():
        for name in set(algorithms(collective)) - names:
            unregister_algorithm(collective, name)
