"""Completing torch futures from allreduce's asynchronous collectives.

DDP hooks and torch.distributed backends hand torch a ``torch.futures.Future``. Each future is completed by a
done callback (:meth:`allreduce.runtime.Work.add_done_callback`) of the last of its collectives, on the group's
worker thread, which has just finished that collective: no thread of our own, no extra wake-up. A group finishes
its collectives in issue order, so the last one's callback sees every earlier one done.

A failure must reach torch's C++ side, where DDP's reducer reads the future. ``Future.set_exception`` from
Python does not do that: it stores the exception as the future's *value* (only Python's ``wait()`` raises it),
so C++ saw a success holding an exception object. The only failure Python can put into a C++ future is an
exception raised by a ``then`` callback; so the future handed out is ``settled.then(_outcome)``, whose callback
returns the value or raises the error ``settled`` was given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["future_of"]


def _identity(exc: BaseException) -> BaseException:
    return exc


def _outcome(settled: torch.futures.Future[Any]) -> Any:
    return settled.value()  # raises what settled.set_exception was given, failing the future `then` made


def future_of(
    works: Sequence[Any],
    value: Callable[[], Any],
    *,
    translate: Callable[[BaseException], BaseException] = _identity,
    on_settled: Callable[[BaseException | None], None] | None = None,
) -> torch.futures.Future[Any]:
    """A future completed with ``value()`` once every one of ``works`` has finished, or failed (for torch's C++
    side too) with the first error, passed through ``translate``. ``on_settled(error or None)`` is called once the
    future is complete (on the thread that completed it)."""
    settled: torch.futures.Future[Any] = torch.futures.Future()
    future = settled.then(_outcome)
    if not works:
        _complete(settled, works, value, translate, on_settled)
        return future
    remaining = [len(works)]
    lock = threading.Lock()

    def on_done(_work: Any) -> None:
        # Works of different groups may finish on different threads: the last to finish completes the future.
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            _complete(settled, works, value, translate, on_settled)

    for work in works:
        work.add_done_callback(on_done)
    return future


def _complete(
    settled: torch.futures.Future[Any],
    works: Sequence[Any],
    value: Callable[[], Any],
    translate: Callable[[BaseException], BaseException],
    on_settled: Callable[[BaseException | None], None] | None,
) -> None:
    error: BaseException | None = None
    try:
        for work in works:
            work.wait()  # all finished: returns at once, or raises the collective's error
        result = value()
    except Exception as exc:
        error = translate(exc)
        settled.set_exception(error)
    else:
        settled.set_result(result)
    if on_settled is not None:
        on_settled(error)
