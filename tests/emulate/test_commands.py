"""The ``ip``/``tc`` command runner of the emulation: a stop signal never cuts a command short (an interrupted
``ip netns add`` could finish after the cleanup listed what exists, and leave its namespace behind)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType

import pytest

from allreduce.emulate._netns import _run


def _raise(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@pytest.mark.slow
def test_a_stop_signal_during_a_command_is_raised_once_the_command_finished(tmp_path: Path) -> None:
    done = tmp_path / "done"
    previous = signal.signal(signal.SIGTERM, _raise)
    timer = threading.Timer(0.1, signal.pthread_kill, (threading.main_thread().ident, signal.SIGTERM))
    try:
        timer.start()
        # subprocess waits 0.25 s for a child after an interrupt, then kills it: this one needs longer
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            _run(["sh", "-c", f"sleep 0.6; touch {done}"])
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
    assert done.exists()
