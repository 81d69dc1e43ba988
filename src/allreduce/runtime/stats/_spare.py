"""The memory every recorder of a process grows into: placeholder ints, taken once and shared.

What recording costs at 1 MiB is mostly cache misses and the allocator: a recorder whose new ints came from fresh
memory measured 0.3-0.6% more per call than one whose ints reused freed blocks (``benchmarks/bench_stats.py``,
docs/tail.md). So recording does not grow into fresh memory: a process takes one store of placeholders the first
time recording is turned on, and a recorder, as it grows, frees as many placeholders as it adds entries, whose
blocks its next ints take. A recorder that is released gives its entries back as placeholders for the next. One
store per process, not per group: a process with 200 groups holds it once, and each group only what it recorded.
The price: once one busy group has taken the whole store, a second busy group grows into fresh memory for its
first ~26,000 calls (the 0.3-0.6% above), unless a closed group gave its entries back meanwhile.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable

__all__ = ["SpareInts"]


class SpareInts:
    """Up to ``capacity`` distinct int objects (never read), in chunks of ``chunk``, from ``base`` up (above the
    small-int cache, so each is an object of its own, of the size a clock reading takes). Recorders of groups in
    different threads take from it and give back to it under a lock, between calls only."""

    def __init__(self, capacity: int, chunk: int, base: int) -> None:
        self._capacity = capacity
        self._chunk = chunk
        self._base = base
        self._lock = threading.Lock()
        self._chunks: collections.deque[list[int]] = collections.deque()
        self._entries = 0
        self._filled = False

    @property
    def entries(self) -> int:
        """Placeholders held now."""
        return self._entries

    def fill_once(self) -> None:
        """Take the whole store, the first time only (later, released recorders refill it)."""
        with self._lock:
            if self._filled:
                return
            self._filled = True
            for first in range(self._entries, self._capacity, self._chunk):
                self._chunks.append(list(range(self._base + first, self._base + first + self._chunk)))
                self._entries += self._chunk

    def drop(self) -> bool:
        """Free one chunk of placeholders, if any are held, for the caller's next ints; whether there was one."""
        with self._lock:
            if not self._chunks:
                return False
            self._entries -= len(self._chunks.popleft())
        return True

    def give(self, chunks: Iterable[list[int]]) -> None:
        """Keep a released recorder's chunks as placeholders, up to the capacity (the rest are freed)."""
        with self._lock:
            for chunk in chunks:
                if self._entries + len(chunk) > self._capacity:
                    break
                self._chunks.append(chunk)
                self._entries += len(chunk)
