"""The store interfaces: what the runtime asks of the rendezvous store every rank of a group shares.

After Gloo's ``Store`` (set, get, wait with a timeout): :class:`Store` is what the group, its transports and a
shrink use, and what :class:`~allreduce.runtime.store._store.TCPStore` and the renumbered view a shrunk group gets
implement; :class:`KeyValueStore` is the least a job's own store (torch's, passed as ``init(rendezvous_store=...)``)
must offer for allreduce to publish where its store is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["KeyValueStore", "Store"]


class KeyValueStore(Protocol):
    """A job's key-value store: ``set`` a value (allreduce sets text), ``get`` it (waiting until some rank sets
    it)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...


class Store(Protocol):
    """The rendezvous store of a group: keys every rank reads and writes, waits with timeouts, and what the store
    knows about the ranks (the ones that died, whether the hosting rank was lost)."""

    host_lost: bool
    """Whether this rank's connection to the store's host (rank 0) dropped."""

    lease_s: float
    """How long a rank may go unheard before the store declares it dead (0: only a dropped connection is a death);
    see :mod:`allreduce.runtime._liveness`."""

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``."""

    def get(self, key: str, *, timeout_s: float | None = None) -> bytes:
        """The value of ``key``, waiting until some rank sets it (``timeout_s`` None: the store's default)."""
        ...

    def wait(self, keys: Sequence[str], *, timeout_s: float | None = None) -> None:
        """Block until every key in ``keys`` exists."""

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` exists, without waiting."""
        ...

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if unset); the new value."""
        ...

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it existed."""
        ...

    def dead_ranks(self, *, answer_s: float | None = None) -> list[int]:
        """The ranks whose connection to the store dropped without a close, or that were silent for a lease;
        ``answer_s``: how long to wait for the answer (default: the store's own bound)."""
        ...

    def group_secret(self) -> bytes:
        """A secret only the ranks the store admitted know (authenticates their connections to each other)."""
        ...

    def fail(self, reason: str) -> None:
        """This rank gives up during the rendezvous: the ranks waiting on it are told ``reason``."""

    def close(self) -> None:
        """Leave the store."""
