"""Asynchronous collectives: the :class:`Work` handle, and the ordered executor that runs a group's collectives.

Sequence numbers must follow call order on every rank, so a group runs its collectives one at a time, in the
order they were called. A blocking call with nothing pending runs at once in the caller's thread (no handoff);
anything else goes to the group's one worker thread, started on first need, and a blocking call behind pending
ones waits for its own turn.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["OrderedExecutor", "Work"]


class Work:
    """Handle of an asynchronous collective: ``wait()`` blocks and returns the result (or raises)."""

    def __init__(self, description: str) -> None:
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._description = description
        self._callbacks: list[Callable[[Work], None]] = []
        self._callbacks_lock = threading.Lock()

    def _finish(self, result: Any, error: BaseException | None) -> None:
        self._result, self._error = result, error
        with self._callbacks_lock:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            self._call(fn)

    def add_done_callback(self, fn: Callable[[Work], None]) -> None:
        """Call ``fn(work)`` once the collective has finished (at once, in this thread, if it already has).

        Callbacks run on the group's worker thread in the order they were added, so they must be quick and
        must not wait for a later collective of the same group; ``fn`` reads the outcome with ``wait()``,
        which then returns (or raises) at once. An exception from ``fn`` is reported on stderr, never lost
        and never allowed to stop the group's worker.
        """
        if not callable(fn):
            raise TypeError(f"add_done_callback: expected a callable, got {type(fn).__name__}")
        with self._callbacks_lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        self._call(fn)

    def _call(self, fn: Callable[[Work], None]) -> None:
        try:
            fn(self)
        except Exception as exc:  # a user callback must not kill the worker that runs later collectives
            print(f"allreduce: done callback {fn!r} of {self._description} raised {exc!r}", file=sys.stderr)

    def done(self) -> bool:
        """Whether the collective has finished (successfully or not)."""
        return self._event.is_set()

    def wait(self, timeout_s: float | None = None) -> Any:
        """Block until the collective finishes; return its result or raise its error."""
        if not self._event.wait(timeout_s):
            raise TimeoutError(f"{self._description} has not finished after {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self._result

    def result(self) -> Any:
        """The result (the array or tensor), waiting for it."""
        return self.wait()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<Work {self._description} {state}>"


def _barrier_description() -> str:
    return "barrier"


class OrderedExecutor:
    """Runs functions one at a time in submission order; ``name`` names the worker thread."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()  # guards _pending and the start of the worker
        self._exec_lock = threading.Lock()  # held while a function runs
        self._pending = 0
        self._queue: queue.SimpleQueue[Callable[[], None] | None] | None = None
        self._worker: threading.Thread | None = None

    def run(
        self, fn: Callable[[], Any], *, async_op: bool = False, describe: Callable[[], str] = _barrier_description
    ) -> Any:
        """Run ``fn`` after everything submitted before it; a :class:`Work` if ``async_op``, else its result.

        ``describe()`` names the call in a :class:`Work`; it is called only when one is made.
        """
        with self._lock:
            if not async_op and self._pending == 0:
                with self._exec_lock:
                    return fn()
            self._pending += 1
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                self._worker = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._worker.start()
            work = Work(describe())

            def job() -> None:
                try:
                    result, error = fn(), None
                except BaseException as exc:
                    result, error = None, exc
                with self._lock:
                    self._pending -= 1
                work._finish(result, error)

            self._queue.put(job)
        return work if async_op else work.wait()

    def enter(self) -> bool:
        """Take the executor for one call the caller runs itself, if nothing is pending: True when taken (the
        caller then runs its call and calls :meth:`leave`), False to submit it with :meth:`run` instead."""
        with self._lock:
            if self._pending:
                return False
            self._exec_lock.acquire()
            return True

    def leave(self) -> None:
        """Give back what :meth:`enter` took."""
        self._exec_lock.release()

    def close(self) -> None:
        """Finish what is pending, then stop the worker (if one was started)."""
        if self._worker is not None and self._queue is not None:
            self._queue.put(None)
            self._worker.join()
            self._worker = None

    def _loop(self) -> None:
        assert self._queue is not None
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._exec_lock:
                job()
