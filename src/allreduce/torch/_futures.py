"""Completing torch futures from allreduce's asynchronous collectives.

allreduce's :class:`~allreduce.runtime.Work` has ``wait()`` but no callbacks, while DDP hooks and torch.distributed
backends hand torch a ``torch.futures.Future``. One daemon thread per process waits on the works in the order
they were issued (a group completes its collectives in that order anyway) and completes each future with its
value, or with the collective's error.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["future_of"]

_Item = tuple[Sequence[Any], Callable[[], Any], "torch.futures.Future[Any]"]


def _run(items: queue.SimpleQueue[_Item]) -> None:
    while True:
        works, value, future = items.get()
        try:
            for work in works:
                work.wait()
            result = value()
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)


@functools.cache
def _items() -> queue.SimpleQueue[_Item]:
    # Started on first use. Two threads racing here may each start a waiter on its own queue; both serve
    # their futures, so that is harmless.
    items: queue.SimpleQueue[_Item] = queue.SimpleQueue()
    threading.Thread(target=_run, args=(items,), name="allreduce-torch-futures", daemon=True).start()
    return items


def future_of(works: Sequence[Any], value: Callable[[], Any]) -> torch.futures.Future[Any]:
    """A future completed with ``value()`` once every one of ``works`` has finished (or with the first error)."""
    items = _items()
    future: torch.futures.Future[Any] = torch.futures.Future()
    items.put((works, value, future))
    return future
