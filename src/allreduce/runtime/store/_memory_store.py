"""A store in this process's memory: what the ranks of an in-process group (threads) share instead of a server."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Sequence

from allreduce.runtime._errors import CollectiveTimeoutError

__all__ = ["MemoryStore"]


class MemoryStore:
    """The :class:`~allreduce.runtime.Store` of ranks that are threads of one process: a dict under a condition.
    No rank dies on its own here (a thread that stops is seen as a closed peer), so ``dead_ranks`` is empty."""

    host_lost = False
    lease_s = 0.0

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._values: dict[str, bytes] = {"__secret__": secrets.token_bytes(32)}

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._values[key] = bytes(value)
            self._cond.notify_all()

    def get(self, key: str, *, timeout_s: float | None = None) -> bytes:
        self.wait([key], timeout_s=timeout_s)
        with self._cond:
            return self._values[key]

    def wait(self, keys: Sequence[str], *, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            while not all(k in self._values for k in keys):
                if not self._cond.wait(deadline - time.monotonic()):
                    missing = [k for k in keys if k not in self._values]
                    raise CollectiveTimeoutError(f"the in-process store: nobody set {', '.join(missing)} in time")

    def check(self, keys: Sequence[str]) -> bool:
        with self._cond:
            return all(k in self._values for k in keys)

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            value = int(self._values.get(key, b"0")) + amount
            self._values[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def delete(self, key: str) -> bool:
        with self._cond:
            return self._values.pop(key, None) is not None

    def dead_ranks(self, *, answer_s: float | None = None) -> list[int]:
        return []

    def group_secret(self) -> bytes:
        return self._values["__secret__"]

    def fail(self, reason: str) -> None:
        """Nothing waits on a rendezvous here."""

    def close(self) -> None:
        """The store lives as long as its groups."""
