"""What a failing rank tells the launcher that started it: its error, and whether that error was a reaction.

When rank 1 raises, its peers soon raise :class:`~allreduce.runtime.PeerFailureError` naming rank 1, and they may
exit before rank 1 has finished unwinding. The order of exits therefore does not say who failed first; the errors
do. A launcher names a directory in ``ALLREDUCE_FAILURE_DIR``; a rank whose main thread ends with an uncaught
exception writes ``rank-<RANK>.json`` there (its error's first line, and the peer it reacted to, if any) before
the interpreter exits, so the file exists when the launcher sees the exit. The hook is installed when ``allreduce``
is imported and only if that variable is set, i.e. only in processes started by ``allreduce run``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from dataclasses import dataclass
from types import TracebackType

from allreduce.runtime._errors import PeerFailureError

__all__ = ["FAILURE_DIR_ENV", "FailureReport", "install_failure_report", "reacted_to", "read_report", "write_report"]

FAILURE_DIR_ENV = "ALLREDUCE_FAILURE_DIR"
"""The directory a launcher reads its ranks' failure reports from (set by ``allreduce run`` for its ranks)."""

MAX_ERROR_CHARS = 500
"""The part of an error's message a report keeps: one line of the launcher's message, not a traceback."""
MAX_REPORT_BYTES = 4096
"""A report is a few hundred bytes; a larger file in the directory was not written by a rank and is ignored."""
MAX_CAUSE_DEPTH = 32
"""How far along ``__cause__``/``__context__`` a reaction is looked for (chains are short; this bounds a cycle)."""


@dataclass(frozen=True)
class FailureReport:
    """``error``: "Type: message" (first line); ``reacted_to``: the peer whose failure this one followed, if any."""

    error: str
    reacted_to: int | None


def reacted_to(error: BaseException, rank: int | None) -> int | None:
    """The peer whose failure ``error`` reacts to: a :class:`PeerFailureError` naming another rank, raised or
    being handled when ``error`` was raised. None when the error is the rank's own."""
    current: BaseException | None = error
    for _ in range(MAX_CAUSE_DEPTH):
        if current is None:
            return None
        if isinstance(current, PeerFailureError) and current.peer is not None and current.peer != rank:
            return current.peer
        current = current.__cause__ or current.__context__
    return None


def error_line(error: BaseException) -> str:
    """``ValueError: the first line of its message`` (at most :data:`MAX_ERROR_CHARS` characters)."""
    message = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {message[0]}" if message else type(error).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def _report_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}.json")


def write_report(directory: str, rank: int, error: BaseException) -> None:
    """Write rank ``rank``'s report on ``error`` (atomically: the launcher never reads half a file)."""
    report = {"error": error_line(error), "reacted_to": reacted_to(error, rank)}
    path = _report_path(directory, rank)
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(report, f)
    os.replace(partial, path)


def remove_report(directory: str, rank: int) -> None:
    """Forget rank ``rank``'s report (before a restart: the new process's failure must not read as the old's)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_report_path(directory, rank))


def read_report(directory: str, rank: int, world_size: int) -> FailureReport | None:
    """Rank ``rank``'s report, or None when it wrote none (it did not raise, or is not a Python program of ours)
    or the file is not a valid report."""
    try:
        with open(_report_path(directory, rank), "rb") as f:
            raw = f.read(MAX_REPORT_BYTES + 1)
        data = json.loads(raw) if len(raw) <= MAX_REPORT_BYTES else None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("error"), str):
        return None
    peer = data.get("reacted_to")
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < world_size or peer == rank:
        peer = None
    return FailureReport(error=data["error"][:MAX_ERROR_CHARS], reacted_to=peer)


_hook_installed = threading.Event()  # set once: the hook wraps the interpreter's hook exactly once


def install_failure_report() -> None:
    """In a rank of ``allreduce run`` (``ALLREDUCE_FAILURE_DIR`` and ``RANK`` set): report an uncaught exception
    of the main thread, then let the previous hook print it as usual. Elsewhere, and on a second call, nothing."""
    directory = os.environ.get(FAILURE_DIR_ENV)
    rank_text = os.environ.get("RANK", "")
    if _hook_installed.is_set() or not directory or not rank_text.isdigit():
        return
    _hook_installed.set()
    rank = int(rank_text)
    previous = sys.excepthook

    def report_then_print(
        error_type: type[BaseException], error: BaseException, traceback: TracebackType | None
    ) -> None:
        with contextlib.suppress(Exception):  # the report is a hint for the launcher, never a second failure
            write_report(directory, rank, error)
        previous(error_type, error, traceback)

    sys.excepthook = report_then_print
