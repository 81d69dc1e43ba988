"""The transport interface: what the process group may call, and what every transport does the same way.

A transport is created once per group and lives until :meth:`Transport.close`. For every collective the group
calls, in this order:

1. :meth:`Transport.prepare` (optional capability; the default does nothing): a transport may publish a small
   buffer's first data together with the descriptor;
2. :meth:`Transport.agree`: a tiny all-gather of a few dozen bytes (the collective's kind, size, dtype, op, root,
   algorithm), so that every rank compares all N descriptors and raises :class:`MismatchError` *before* any data
   moves. ``seq`` is the collective's sequence number (0, 1, 2, ... identical on every rank);
3. :meth:`Transport.execute`: walk ``plan.steps`` in order on ``buffer`` (a 1-D contiguous numpy array of
   ``plan.count`` elements), honouring the plan semantics of :mod:`allreduce.runtime.transport._plan`: sends read the
   step-start state, receives land at step end (staged when a range is both sent and received in one step).
   ``reduce_into(dst_view, incoming)`` reduces ``incoming`` into ``dst_view`` in place; receives without
   ``reduce`` copy.

:meth:`Transport.allocate` (optional capability; the default returns ``None``) hands out memory that the
transport can move without a copy (shared memory for shm); the group falls back to ``numpy.empty``.

Every transport owns a :class:`~allreduce.runtime.stats._stats.Recorder` (``recorder``): while it is enabled,
``_execute`` records each received transfer - how long it waited for the peer's data, how long moving it took -
where it already knows (shm: its counter wait; tcp: the first and last byte of the peer's frames).
``injection`` (``ALLREDUCE_INJECT``; None in production) holds a step's sends and paces slow links there too.

The base class does once what every transport needs: it checks that the transport is usable and that the plan
fits the buffer, turns ``timeout_s`` into a deadline, latches the first failure (after which every call raises
an error of the same class, naming the original), maps failures to the small integer *kinds* that transports
send to their peers and back (:func:`abort_kind`, :func:`error_class`), and raises the same
:class:`CollectiveError` when a closed transport is used. A subclass implements :meth:`Transport._agree`,
:meth:`Transport._execute`, :meth:`Transport._release` and, to tell its peers that it gave up,
:meth:`Transport._abort`.

Errors: :class:`CollectiveTimeoutError` names the peer(s) waited for and the step, :class:`PeerFailureError`
names a rank that died, :class:`ChecksumError` (``checksum=True``) names the link ``src -> dst`` whose block
arrived with a wrong crc32. ``ValueError`` and ``TypeError`` are input errors raised before any data moves and
leave the transport usable; any other error leaves it unusable.
"""

from __future__ import annotations

import abc
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from typing import Any, ClassVar, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from allreduce.runtime._errors import ABORT_KINDS, CollectiveError, abort_kind, error_class
from allreduce.runtime.stats._stats import Recorder
from allreduce.runtime.transport._inject import Injection
from allreduce.runtime.transport._plan import RankPlan

__all__ = [
    "ABORT_KINDS",
    "MAX_DESCRIPTOR_BYTES",
    "PLAN_CACHE_ENTRIES",
    "Call",
    "PlanCache",
    "ReduceInto",
    "Transport",
    "abort_kind",
    "error_class",
]

ReduceInto = Callable[[npt.NDArray[Any], npt.NDArray[Any]], None]
"""``reduce_into(dst_view, incoming)``: reduce ``incoming`` into ``dst_view`` in place (same dtype, same length)."""

MAX_DESCRIPTOR_BYTES = 240
"""The longest descriptor :meth:`Transport.agree` carries (the group's are 60 bytes)."""

PLAN_CACHE_ENTRIES = 256
"""How many compiled plans one group keeps (schedules, per-rank plans and each transport's compiled form)."""

_T = TypeVar("_T")


class Call(NamedTuple):
    """One collective as a transport runs it: the compiled plan, the buffer and how to reduce into it, the
    sequence number every rank shares, when to give up (``deadline`` on ``time.monotonic()``, and the
    ``timeout_s`` it came from, for messages) and whether blocks travel with a crc32 (``checksum``)."""

    plan: RankPlan
    buffer: npt.NDArray[Any]
    reduce_into: ReduceInto
    seq: int
    deadline: float
    timeout_s: float
    checksum: bool


class PlanCache:
    """Recently used compiled forms, least recently used dropped first. One per group, shared by its transport.

    Keys are any hashable (a transport prefixes its own with a name of its own, so entries never collide).
    """

    def __init__(self, capacity: int = PLAN_CACHE_ENTRIES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], _T]) -> _T:
        """The entry for ``key``, built by ``build()`` on a miss."""
        try:
            value: _T = self._entries[key]
        except KeyError:
            value = build()
            self._entries[key] = value
            if len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            return value
        self._entries.move_to_end(key)
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


class Transport(abc.ABC):
    """Moves the data of compiled plans between the ranks of one group (see the module docstring)."""

    name: ClassVar[str] = "transport"
    """Short name used in messages and by the group (``"shm"``, ``"tcp"``, ...)."""

    def __init__(self, rank: int, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank!r} is not in a group of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.plans = PlanCache()
        self._closed = False
        self._failure: CollectiveError | None = None
        self.recorder = Recorder()
        """Per-transfer wait records (:mod:`allreduce.runtime.stats._stats`), kept while ``recorder.enabled`` (the group
        sets it)."""
        self.injection: Injection | None = None
        """Faults to inject (``ALLREDUCE_INJECT``, set by the group); None in production."""

    # ------------------------------------------------------------------------------------------------
    # What the group may call
    # ------------------------------------------------------------------------------------------------
    def prepare(self, seq: int, buffer: npt.NDArray[Any], *, checksum: bool) -> None:  # noqa: B027 (optional hook)
        """Before ``agree(seq)``: an optional head start for a small buffer (default: nothing)."""

    def small_bytes(self, seq: int) -> int:
        """The largest buffer :meth:`run_small` takes for collective ``seq`` (default: none, the transport has no
        such path)."""
        return 0

    def run_small(self, call: Call, descriptor: bytes) -> list[bytes] | None:
        """prepare + agree + execute of an all-reduce of a small buffer (1-D, C-contiguous, at most
        :meth:`small_bytes`) in one pass: None when done, or every rank's descriptor when they differ (nothing was
        read: the group raises or runs rank 0's plan with :meth:`execute`). Only transports whose
        :meth:`small_bytes` says so have it."""
        raise NotImplementedError(f"the {self.name} transport has no small-call path")

    def fuses(self, buffer: npt.NDArray[Any]) -> bool:
        """Whether every call on ``buffer`` moves and reduces each step in one pass whatever its size, which
        ``algorithm="auto"`` then tells the cost model (:attr:`~allreduce.schedules.CostModel.fused_bytes`);
        default: no, the model's own ``fused_bytes`` decides by size."""
        return False

    def allocate(self, size_bytes: int) -> npt.NDArray[np.uint8] | None:
        """``size_bytes`` of memory this transport moves without a copy, or ``None`` (use ``numpy.empty``)."""
        return None

    def agree(self, seq: int, descriptor: bytes, *, timeout_s: float) -> list[bytes]:
        """Every rank's ``descriptor`` for collective ``seq``, indexed by rank (a tiny all-gather)."""
        self.check_usable()
        if len(descriptor) > MAX_DESCRIPTOR_BYTES:
            raise ValueError(f"descriptor of {len(descriptor)} bytes exceeds {MAX_DESCRIPTOR_BYTES}")
        if self.world_size == 1:
            return [bytes(descriptor)]
        deadline = time.monotonic() + timeout_s
        try:
            return self._agree(seq, bytes(descriptor), deadline=deadline, timeout_s=timeout_s)
        except (ValueError, TypeError):
            raise
        except BaseException as exc:
            self._record_failure(exc, seq)
            raise

    def execute(
        self,
        plan: RankPlan,
        buffer: npt.NDArray[Any],
        reduce_into: ReduceInto,
        *,
        seq: int,
        timeout_s: float,
        checksum: bool,
    ) -> None:
        """Run ``plan`` on ``buffer`` (1-D, contiguous, ``plan.count`` elements) in place."""
        self.check_usable()
        plan.check_fits(self.rank, self.world_size, buffer)
        if not plan.steps:
            return
        call = Call(plan, buffer, reduce_into, seq, time.monotonic() + timeout_s, timeout_s, checksum)
        try:
            self._execute(call)
        except (ValueError, TypeError):
            raise
        except BaseException as exc:
            self._record_failure(exc, seq)
            raise

    def close(self) -> None:
        """Release every resource (sockets, shared memory, threads); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._release()
        self.recorder.release()  # its entries go back to the process's spare memory for the next group

    def inject_corruption(self, *, peer: int, step: int = 0) -> None:
        """Fault injection for tests: flip one byte of the next block this rank sends to ``peer`` at ``step``,
        after its checksum was computed (so ``checksum=True`` must catch it). Off unless called."""
        raise NotImplementedError(f"the {self.name} transport cannot inject corruption")

    def statistics(self) -> Mapping[str, int]:
        """Counters a transport keeps about its own paths (for tests and tuning; default: none)."""
        return {}

    def sent_counters(self) -> Mapping[int, tuple[int, float]]:
        """Per peer this rank sends to, what the operating system measured since the connection opened: (bytes the
        peer acknowledged, seconds the network limited sending). Default: none (re-planning then reads the
        receivers' records); the tcp transport reads them from the kernel (runtime/tcp/_tcpinfo.py)."""
        return {}

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failure(self) -> CollectiveError | None:
        """The first error that made this transport unusable, if any."""
        return self._failure

    def check_usable(self) -> None:
        """Raise :class:`CollectiveError` if closed, or an error of the first failure's class if one happened."""
        if self._closed:
            raise CollectiveError(f"rank {self.rank}: the {self.name} transport is closed", rank=self.rank)
        if self._failure is not None:
            raise type(self._failure)(
                f"rank {self.rank}: the {self.name} transport is unusable after an earlier failure: {self._failure}",
                rank=self.rank,
                peer=self._failure.peer,
                step=self._failure.step,
            )

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"

    # ------------------------------------------------------------------------------------------------
    # What a transport implements
    # ------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _agree(self, seq: int, descriptor: bytes, *, deadline: float, timeout_s: float) -> list[bytes]:
        """Every rank's descriptor by rank (``world_size`` > 1; raise by ``deadline``, ``time.monotonic()``)."""

    @abc.abstractmethod
    def _execute(self, call: Call) -> None:
        """Run ``call``'s non-empty plan, which fits its buffer; raise by its ``deadline``."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Free every resource; called once, by :meth:`close`."""

    def _abort(self, error: CollectiveError, seq: int) -> None:  # noqa: B027 (optional hook)
        """Tell the peers this rank gave up on collective ``seq`` because of ``error`` (default: nothing).

        ``abort_kind(error)`` and ``error.peer`` (the culprit) are what peers need to raise the same error."""

    # ------------------------------------------------------------------------------------------------
    def _record_failure(self, exc: BaseException, seq: int) -> CollectiveError:
        """Latch the first failure (as a :class:`CollectiveError`) and abort; later failures keep the first."""
        if self._failure is None:
            if isinstance(exc, CollectiveError):
                self._failure = exc
            else:
                self._failure = CollectiveError(
                    f"rank {self.rank}: collective {seq} interrupted: {type(exc).__name__}: {exc}", rank=self.rank
                )
            self._abort(self._failure, seq)
        return self._failure
