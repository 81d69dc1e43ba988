"""The transport protocol: what the process group needs from a way of moving bytes between ranks.

A transport is created once per group and lives until ``close()``. The group calls, for every collective:

1. ``agree(seq, descriptor)`` — a tiny all-gather of a few dozen bytes (the collective's kind, size, dtype, op,
   root, algorithm) so that every rank compares all N descriptors and raises :class:`MismatchError` *before* any
   data moves. ``seq`` is the collective's sequence number (0, 1, 2, ... identical on every rank).
2. ``execute(plan, buffer, reduce_into, seq=...)`` — walk ``plan.steps`` in order on ``buffer`` (a 1-D contiguous
   numpy array of ``plan.count`` elements), honouring the plan semantics of :mod:`allreduce.runtime._plan`: sends
   read the step-start state, receives land at step end (staged when a range is both sent and received in one
   step). ``reduce_into(dst_view, incoming)`` reduces ``incoming`` into ``dst_view`` in place (the group passes the
   op's ufunc; ``incoming`` may be a view of a peer's shared memory or of a receive buffer, valid only during the
   call). Receives without ``reduce`` copy.

Both calls raise :class:`CollectiveTimeoutError` after ``timeout_s`` naming the peer(s) waited for and the step,
:class:`PeerFailureError` naming a rank that died, and (``execute`` with ``checksum=True``)
:class:`ChecksumError` naming the link ``src -> dst`` whose block arrived with a wrong crc32.
After any such error the transport is unusable; the group closes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from allreduce.runtime._plan import RankPlan

__all__ = ["ReduceInto", "Transport"]

ReduceInto = Callable[[npt.NDArray[Any], npt.NDArray[Any]], None]
"""``reduce_into(dst_view, incoming)``: reduce ``incoming`` into ``dst_view`` in place (same dtype, same length)."""


@runtime_checkable
class Transport(Protocol):
    """Moves the data of compiled plans between the ranks of one group (see the module docstring)."""

    rank: int
    world_size: int

    def agree(self, seq: int, descriptor: bytes, *, timeout_s: float) -> list[bytes]:
        """Every rank's ``descriptor`` for collective ``seq``, indexed by rank (a tiny all-gather)."""
        ...

    def execute(
        self,
        plan: RankPlan,
        buffer: np.ndarray[Any, Any],
        reduce_into: ReduceInto,
        *,
        seq: int,
        timeout_s: float,
        checksum: bool,
    ) -> None:
        """Run ``plan`` on ``buffer`` (1-D, contiguous, ``plan.count`` elements) in place."""
        ...

    def close(self) -> None:
        """Release every resource (sockets, shared memory); idempotent."""
        ...
