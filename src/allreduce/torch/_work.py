"""How the backend reports to torch: a torch ``Work`` over allreduce's collectives, and errors torch can carry.

torch reads a backend's outcome in two places. Python code (``dist.all_reduce``, ``work.wait()``) calls the
``Work``'s ``wait``; a Python subclass of ``dist._Work`` is called back there, so its ``wait`` raises allreduce's
own error, unchanged. DDP's reducer, in C++, reads the work's future instead: a future whose Python
``set_exception`` was called looks like a success to C++ (torch stores the exception object as the future's
value), which is how errors were lost and why DDP crashed parsing an exception as its bucket. The futures made
here are failed at the C++ level, so the reducer raises (see :func:`allreduce.torch._futures.future_of`).

The errors raised are allreduce's own classes, made also :class:`torch.distributed.DistBackendError` (what
torch raises for a backend's failure), so ``except PeerFailureError``, ``except dist.DistBackendError`` and
``except RuntimeError`` all catch them; the message names the culprit rank, the step and the peers waited for.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

import torch
from allreduce.runtime import (
    ChecksumError,
    CollectiveError,
    CollectiveTimeoutError,
    MismatchError,
    PeerFailureError,
    ProtocolError,
)
from allreduce.torch._futures import future_of

__all__ = [
    "BackendChecksumError",
    "BackendCollectiveError",
    "BackendCollectiveTimeoutError",
    "BackendMismatchError",
    "BackendPeerFailureError",
    "BackendProtocolError",
    "BackendWork",
    "torch_error",
]

_DistBackendError: Any = dist.DistBackendError
# Typed as Any: torch ships no stubs for subclassing its Work from Python.
_WorkBase: Any = dist._Work  # type: ignore[attr-defined]


class BackendCollectiveError(CollectiveError, _DistBackendError):  # type: ignore[misc]
    """A collective of the ``"allreduce"`` backend failed (also a ``dist.DistBackendError``)."""


class BackendCollectiveTimeoutError(CollectiveTimeoutError, _DistBackendError):  # type: ignore[misc]
    """A collective of the backend did not finish in time; the message names the peers waited for."""


class BackendPeerFailureError(PeerFailureError, _DistBackendError):  # type: ignore[misc]
    """A peer of the backend's group died or left mid-collective; ``peer`` is that rank."""


class BackendMismatchError(MismatchError, _DistBackendError):  # type: ignore[misc]
    """Ranks called different collectives on the backend's group; nothing moved."""


class BackendChecksumError(ChecksumError, _DistBackendError):  # type: ignore[misc]
    """Data arrived corrupted on the backend's group."""


class BackendProtocolError(ProtocolError, _DistBackendError):  # type: ignore[misc]
    """A frame of the backend's group could not be decoded, or came from a peer that did not authenticate."""


_TRANSLATED: tuple[tuple[type[CollectiveError], type[CollectiveError]], ...] = (
    (CollectiveTimeoutError, BackendCollectiveTimeoutError),
    (PeerFailureError, BackendPeerFailureError),
    (MismatchError, BackendMismatchError),
    (ChecksumError, BackendChecksumError),
    (ProtocolError, BackendProtocolError),
    (CollectiveError, BackendCollectiveError),
)


def torch_error(exc: BaseException) -> BaseException:
    """``exc`` as the backend raises it: an allreduce collective error becomes its ``DistBackendError`` form (same
    message, a timeout's saying so in Gloo's word; rank, peer and step; the original as its cause); anything else
    (a ``ValueError`` for a bad argument, ``WrongThreadError`` for a misuse) is returned unchanged."""
    if not isinstance(exc, CollectiveError) or isinstance(exc, _DistBackendError):
        return exc
    for runtime_class, backend_class in _TRANSLATED:
        # Exact classes: a subclass of the runtime's own (WrongThreadError, a misuse) keeps its type.
        if type(exc) is runtime_class:
            message = str(exc)
            if runtime_class is CollectiveTimeoutError:
                # torch's suite and users' scripts look for Gloo's words around a timeout ("... timeout ...")
                message += " (the call's timeout ran out)"
            translated = backend_class(message, rank=exc.rank, peer=exc.peer, step=exc.step)
            translated.__cause__ = exc
            return translated
    return exc


def _seconds(timeout: Any) -> float | None:
    """torch passes ``wait``'s timeout as a timedelta, zero meaning none (its ``kNoTimeout``)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return seconds if seconds > 0 else None


class BackendWork(_WorkBase):  # type: ignore[misc]
    """The torch ``Work`` the backend returns: done when every one of ``works`` (allreduce :class:`Work` handles,
    in issue order) has finished and ``value()`` (which copies results out) has run; ``description`` names the
    call in errors; ``source()``, of a receive, the rank that sent."""

    def __init__(
        self,
        works: Sequence[Any],
        value: Callable[[], Any],
        description: str,
        *,
        source: Callable[[], int] | None = None,
    ) -> None:
        super().__init__()
        self._description = description
        self._source = source
        self._settled = threading.Event()
        self._error: BaseException | None = None
        self._future = future_of(works, value, translate=torch_error, on_settled=self._settle)

    def _settle(self, error: BaseException | None) -> None:
        self._error = error
        self._settled.set()

    def wait(self, timeout: Any = None) -> bool:
        """Block until done and return True, or raise the collective's error (its ``DistBackendError`` form). A
        ``timeout`` (timedelta) that passes first raises ``DistBackendError``; the collective goes on."""
        limit_s = _seconds(timeout)
        if not self._settled.wait(limit_s):
            raise _DistBackendError(
                f"allreduce backend: {self._description} has not finished within wait(timeout={limit_s} s); "
                f"it goes on, and a later wait() returns its outcome"
            )
        if self._error is not None:
            raise self._error
        return True

    def end_record(self, record: Any) -> None:
        """End the profiler's ``record`` (a ``record_function`` entered for this call) when the work completes."""
        self._future = record._call_end_callbacks_on_future(self._future)

    def _source_rank(self) -> int:
        """The rank a receive's message came from (what ``dist.recv(src=None)`` returns), once it is done."""
        if self._source is None:
            raise ValueError(f"allreduce backend: {self._description} is not a receive: it has no source rank")
        self.wait()
        return int(self._source())

    source_rank = _source_rank

    def get_future(self) -> torch.futures.Future[Any]:
        """The future torch's C++ side (DDP) reads: its value, or failed with the collective's error."""
        return self._future

    def is_completed(self) -> bool:
        return self._settled.is_set()

    def is_success(self) -> bool:
        return self._settled.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._future.value()

    def __repr__(self) -> str:
        state = "done" if self._settled.is_set() else "pending"
        return f"<allreduce backend work {self._description} {state}>"
