"""Fixtures shared by the runtime's process tests."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest


@pytest.fixture
def stop_signals_not_ignored() -> Iterator[None]:
    """For tests that model a terminal, where Ctrl-C and hang-ups reach the launcher. A launcher started with SIGINT
    or SIGHUP ignored (a background job of a non-interactive shell, ``nohup``; children inherit it, and so does a
    test runner started that way) keeps ignoring them, as `allreduce run` promises: so the launchers these tests
    start get the default disposition, whatever the test runner was started with. (Without this, the Ctrl-C tests
    hung whenever the suite ran in the background and no earlier test in that worker had reset SIGINT.)"""
    ignored = [s for s in (signal.SIGINT, signal.SIGHUP) if signal.getsignal(s) is signal.SIG_IGN]
    for stop in ignored:
        signal.signal(stop, signal.SIG_DFL)
    try:
        yield
    finally:
        for stop in ignored:
            signal.signal(stop, signal.SIG_IGN)
