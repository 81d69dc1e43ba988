"""Fixtures for the process group's semantics on the in-process transport: N groups, one thread per rank.

``ranks(n)`` makes ``n`` connected groups (closed after the test); ``on_ranks(groups, fn)`` runs ``fn(group)``
on every rank's own thread (a group, handed over to that thread, or a transport: anything with a ``rank``) and
returns each rank's result, or the exception it raised, indexed by rank. A thread still running after
``JOIN_TIMEOUT_S`` fails the test naming the ranks (a hang, never a silent pass).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from allreduce.runtime import ProcessGroup, local_groups

JOIN_TIMEOUT_S = 60.0
"""How long a test waits for its rank threads; far above any collective's timeout in these tests."""

COLLECTIVE_TIMEOUT_S = 10.0
"""Each group's default collective timeout: long enough for a loaded machine, short enough to fail fast."""

RunOnRanks = Callable[..., list[Any]]


def _on_ranks(groups: list[Any], fn: Callable[[Any], Any]) -> list[Any]:
    results: list[Any] = [None] * len(groups)

    def body(group: Any) -> None:
        try:
            results[group.rank] = fn(group)
        except BaseException as exc:  # returned to the test, which asserts on it
            results[group.rank] = exc

    threads = [threading.Thread(target=body, args=(g,), name=f"rank{g.rank}", daemon=True) for g in groups]
    for g, t in zip(groups, threads, strict=True):
        if isinstance(g, ProcessGroup):
            g.hand_over(t)  # the test's thread made the groups; each rank's thread calls its own
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
    hung = [g.rank for g, t in zip(groups, threads, strict=True) if t.is_alive()]
    assert hung == [], f"ranks {hung} did not finish within {JOIN_TIMEOUT_S} s"
    return results


@pytest.fixture
def on_ranks() -> RunOnRanks:
    return _on_ranks


@pytest.fixture
def ranks() -> Iterator[Callable[..., list[ProcessGroup]]]:
    made: list[ProcessGroup] = []

    def make(n: int, **options: Any) -> list[ProcessGroup]:
        options.setdefault("timeout_s", COLLECTIVE_TIMEOUT_S)
        groups = local_groups(n, **options)
        made.extend(groups)
        return groups

    yield make
    for group in made:
        group.close()
