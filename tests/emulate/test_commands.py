"""The ``ip``/``tc`` command runner of the emulation: a stop signal never cuts a command short (an interrupted
``ip netns add`` could finish after the cleanup listed what exists, and leave its namespace behind)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest

from allreduce.emulate._netns import _run, _stop


def _raise(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _run_signalled(command: str, started: Path, sent: Path, send: Callable[[], None]) -> None:
    """Run ``command`` with :func:`_run`; once it has created ``started``, ``send()`` a SIGTERM from another thread
    and create ``sent``. The KeyboardInterrupt the signal becomes must come out of ``_run``."""

    def signal_while_it_runs() -> None:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:  # the command is running
            time.sleep(0.005)
        send()
        sent.touch()

    sender = threading.Thread(target=signal_while_it_runs)
    try:
        sender.start()
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            _run(["sh", "-c", command])
    finally:
        sender.join()


@pytest.mark.slow
def test_a_stop_signal_during_a_command_is_raised_once_the_command_finished(tmp_path: Path) -> None:
    started, sent, done = tmp_path / "started", tmp_path / "sent", tmp_path / "done"
    main = threading.main_thread().ident
    assert main is not None

    # The command outlives its signal by 0.5 s, longer than the 0.25 s subprocess waits for a child after an
    # interrupt before it kills it: without the fix it never gets to `touch done`.
    command = f"touch {started}; while [ ! -e {sent} ]; do sleep 0.01; done; sleep 0.5; touch {done}"
    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        _run_signalled(command, started, sent, lambda: signal.pthread_kill(main, signal.SIGTERM))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert done.exists()


@pytest.mark.slow
def test_a_stop_signal_another_thread_takes_during_a_command_is_raised_once_the_command_finished(
    tmp_path: Path,
) -> None:
    # Sent to the process, not to the main thread: the kernel gives it to a thread that does not block it (here the
    # sender; in `allreduce emulate run`, numpy's BLAS threads), and Python then runs running()'s handler in the main
    # thread at its next bytecode, mid-command, whatever the main thread's mask says. The handler must defer it.
    started, sent, done = tmp_path / "started", tmp_path / "sent", tmp_path / "done"

    # It prints while it runs, so the main thread runs Python (subprocess's read loop) during the command: where
    # the handler would otherwise raise, and subprocess kill the command before its `touch done`.
    command = (
        f"touch {started}; while [ ! -e {sent} ]; do echo waiting; sleep 0.01; done; "
        f"for i in $(seq 50); do echo after; sleep 0.01; done; touch {done}"
    )
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        _run_signalled(command, started, sent, lambda: os.kill(os.getpid(), signal.SIGTERM))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert done.exists()
