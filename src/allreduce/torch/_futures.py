"""Completing torch futures from allreduce's asynchronous collectives.

DDP hooks and torch.distributed backends hand torch a ``torch.futures.Future``. Each future is completed by a
done callback (:meth:`allreduce.runtime.Work.add_done_callback`) of the last of its collectives, on the group's
worker thread, which has just finished that collective: no thread of our own, no extra wake-up. A group finishes
its collectives in issue order, so the last one's callback sees every earlier one done.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["future_of"]


def future_of(works: Sequence[Any], value: Callable[[], Any]) -> torch.futures.Future[Any]:
    """A future completed with ``value()`` once every one of ``works`` has finished (or with the first error)."""
    future: torch.futures.Future[Any] = torch.futures.Future()
    if not works:
        _complete(future, works, value)
        return future
    remaining = [len(works)]
    lock = threading.Lock()

    def on_done(_work: Any) -> None:
        # Works of different groups may finish on different threads: the last to finish completes the future.
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            _complete(future, works, value)

    for work in works:
        work.add_done_callback(on_done)
    return future


def _complete(future: torch.futures.Future[Any], works: Sequence[Any], value: Callable[[], Any]) -> None:
    try:
        for work in works:
            work.wait()  # all finished: returns at once, or raises the collective's error
        result = value()
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(result)
