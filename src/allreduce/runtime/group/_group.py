"""The process group: who is who, and the collectives every rank calls.

Every public collective (and the barrier) takes one path, :class:`._pipeline.Pipeline`: its arguments are checked
locally (bad input consumes nothing), then ``transport.agree`` compares every rank's descriptor (:mod:`._descriptor`:
collective, element count, dtype, op, root, algorithm, flags) for sequence number k — any difference raises
:class:`MismatchError` on every rank, naming the field and each rank's value, before any data moves — and
``transport.execute`` runs the compiled plan of the chosen schedule: a registered algorithm
(:func:`allreduce.schedules.algorithms`) or a :class:`Schedule` the caller passed, never one of our own.

Collectives run one at a time in call order (:mod:`._work`); buffers are adapted to 1-D contiguous numpy
(:mod:`._buffers`). Schedules, plans and the transport's compiled forms share one :class:`PlanCache`.

Buffer conventions (``count`` elements, blocks of ``block_bounds(count, N)``, rank r owns block r):

- ``all_reduce(x)``: in place, every rank ends with the reduction of all ranks' ``x``;
- ``reduce_scatter(x)``: ``x`` holds all N blocks of this rank's contribution and is used as work space;
  the call returns this rank's block (a view into ``x``), reduced over all ranks — other blocks of ``x`` are
  unspecified afterwards;
- ``all_gather(x)``: the inverse: on entry block r of ``x`` holds rank r's part (other blocks are ignored), on
  return every block is filled. ``all_gather(reduce_scatter(x)'s x)`` is an all-reduce;
- ``broadcast(x, root)``: in place; ``reduce(x, root)``: the root's ``x`` receives the reduction, the other ranks'
  ``x`` are left untouched (they reduce in a copy);
- ``gather(x, root)``: block r of every rank's ``x`` into block r of the root's; ``scatter(x, root)``: block r of
  the root's ``x`` into rank r's block r, which it returns;
- ``all_to_all(x, out)``: part d of ``x`` to rank d, part s of ``out`` from rank s (equal parts, or splits).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict, Unpack

import numpy as np
import numpy.typing as npt

from allreduce.runtime._args import integer_arg, rank_arg
from allreduce.runtime._store_api import Store
from allreduce.runtime.elastic._elastic import Lineage, Shrunk, grow, shrink
from allreduce.runtime.elastic._replan import REPLAN_ENV, GroupReplanning, rule_from_env
from allreduce.runtime.group._cost_models import default_cost_model
from allreduce.runtime.p2p import PointToPoint
from allreduce.runtime.pipeline._buffers import as_buffer, check_dtype
from allreduce.runtime.pipeline._descriptor import DTYPES, OPS
from allreduce.runtime.pipeline._personalized import WorkBuffers, check_splits, pack_all_to_all, split_table
from allreduce.runtime.pipeline._pipeline import Options, Pipeline, check_options, checked_timeout
from allreduce.runtime.pipeline._work import Work
from allreduce.runtime.stats._stats import CALL_CAPACITY, GroupStats, merge_summaries, summary_row, summary_row_length
from allreduce.runtime.stats._trace import TRACE_ENV, check_trace_path, write_trace
from allreduce.runtime.transport._inject import injection_from_env
from allreduce.runtime.transport._transport import PLAN_CACHE_ENTRIES, PlanCache, Transport
from allreduce.schedules import Collective, CostModel, Schedule, block_bounds

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DTYPES",
    "OPS",
    "STATS_FILE_ENV",
    "ProcessGroup",
    "Work",
]

STATS_FILE_ENV = "ALLREDUCE_STATS_FILE"
"""Where rank 0 writes the stats table at close instead of stderr (``allreduce run --stats`` sets it)."""

DEFAULT_TIMEOUT_S = 300.0
"""A collective's default timeout: generous enough for a GiB all-reduce over slow TCP on a loaded host, short
enough that a rank that never calls is reported within minutes rather than hanging a job forever."""

_DEFAULTS = Options()

_PLAIN_OPTIONS: dict[str, object] = {
    "timeout_s": None, "checksum": False, "segments": 1, "tag": None, "deterministic": False,
}  # fmt: skip
"""The options a plain all-reduce may be given and still take the fast path: each at its default, of the default's
own type (``segments=True`` is checked on the general path, never taken for 1)."""


def _defaults_only(options: Mapping[str, object]) -> bool:
    """Whether every option given is one of :data:`_PLAIN_OPTIONS` at its default (``all_reduce(x, segments=1)``
    is as fast as ``all_reduce(x)``)."""
    for key, value in options.items():
        default = _PLAIN_OPTIONS.get(key, _PLAIN_OPTIONS)  # the table itself: not an option of the fast path
        if default is _PLAIN_OPTIONS or value.__class__ is not default.__class__ or value != default:
            return False
    return True


def _new_like(x: Any, size: int) -> Any:
    """A new 1-D array (a tensor for a tensor) of ``size`` elements of ``x``'s dtype."""
    if isinstance(x, np.ndarray):
        return np.empty(size, dtype=x.dtype)
    return x.new_empty(size)


class MoveOptions(TypedDict, total=False):
    """The keyword options of every collective: ``timeout_s`` (default: the group's), ``checksum`` (a crc32 per
    block), ``segments`` (pieces each transfer is streamed in), ``tag`` (pairs calls made from any thread)."""

    timeout_s: float | None
    checksum: bool
    segments: int
    tag: str | None


class ReduceOptions(MoveOptions, total=False):
    """Those of the reducing collectives: also ``deterministic`` (one fixed reduction order for a given N)."""

    deterministic: bool


class ProcessGroup:
    """N ranks that run collectives together over one :class:`Transport` (made by :func:`init`).

    ``timeout_s`` is the default per-collective timeout; ``cost_model`` feeds ``algorithm="auto"``;
    ``group_size`` is the number of ranks per host (for hierarchical algorithms). Use as a context manager
    or call :meth:`close`.

    ``algorithm=`` of every collective is ``"auto"`` (the cost model picks among the registered algorithms), the
    name of a registered algorithm (:func:`allreduce.schedules.algorithms`), or a :class:`Schedule` object for
    this collective and world size, verified on first use; every rank must pass an equal schedule (its digest
    travels in the descriptor, so a difference raises :class:`MismatchError` before any data moves). ``auto``
    decides once per size class (powers of two), among the algorithms registered at that moment.

    Threads: collectives pair by call order (the k-th call on every rank is one collective), so a group belongs to
    one thread, the one that created it. A collective from another thread raises :class:`WrongThreadError` before
    anything is consumed, naming both threads: two threads could reach the ranks in different orders and combine
    different arrays without any error. To use the group from another thread, the owner hands it over with
    :meth:`hand_over` (the group comes back when that thread finishes). A call with ``tag=`` may come from any
    thread: its tag travels in the descriptor, so calls that pair differently on different ranks raise
    :class:`MismatchError` on every rank instead (give each thread its own tags). ``async_op=True`` is safe from
    the owner: collectives run in call order on the group's worker. :meth:`close` may be called from any thread.
    ``empty``, ``zeros``, ``block_range`` and ``choose_algorithm`` move nothing and are safe from any thread.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        transport_name: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        cost_model: CostModel | None = None,
        group_size: int | None = None,
        store: Store | None = None,
        lineage: Lineage | None = None,
    ) -> None:
        checked_timeout(timeout_s)
        # what the environment asks is checked before anything starts (a thread, a collective)
        injection = injection_from_env(None, transport.rank, transport.world_size)
        if trace := os.environ.get(TRACE_ENV):
            try:
                check_trace_path(trace)
            except ValueError as exc:
                raise ValueError(f"{TRACE_ENV}: {exc}") from None
        self._transport = transport
        self.transport_name: str = transport_name or transport.name
        self.rank: int = transport.rank
        self.world_size: int = transport.world_size
        self.timeout_s = float(timeout_s)
        self.cost_model = cost_model or default_cost_model(self.transport_name, self.world_size)
        self.group_size = group_size or self.world_size
        self._store = store
        self._lineage = lineage  # how to shrink it (groups from init() only)
        self._grow_calls = 0  # grow() calls on this group: the members count them alike
        self.last_agreed_call: int = -1
        """After :meth:`shrink`: the old group's last call (numbered from 0) that every survivor completed."""
        self.ahead_ranks: tuple[int, ...] = ()
        """After :meth:`shrink`: the ranks (new numbers) that completed the old group's call ``last_agreed_call + 1``,
        which the others raised in; empty when every survivor raised in the same call (docs/elastic.md)."""
        self._split_root: int | None = None  # while set, the first collective must be a broadcast from it
        rule = rule_from_env(os.environ.get(REPLAN_ENV))
        self._replanning = (
            None
            if rule is None or self.world_size < 4
            else GroupReplanning(self.world_size, rule, self.cost_model.latency_s)
        )
        self._closed = False
        self._p2p: PointToPoint | None = None  # made by the first send or receive
        self._p2p_lock = threading.Lock()
        # One cache for every compiled form: the group's schedules and plans, and the transport's own.
        plans = PlanCache(PLAN_CACHE_ENTRIES)
        transport.plans = plans
        self._pipeline = Pipeline(self, transport, plans)
        self._work_buffers = WorkBuffers(lambda size_bytes: self.empty(size_bytes, np.uint8))
        transport.injection = injection
        # On unless ALLREDUCE_STATS=0: a straggler is found after the fact, so the record must already be there.
        # It costs about 1% of a 1 MiB call (0.7-1.4% on the 2-core machine, benchmarks/bench_stats.py, docs/tail.md)
        # and 2-8% of a 4 KiB one (0.5 µs of a small call); ~10 MiB per process, taken once (runtime/stats/_spare.py).
        if os.environ.get("ALLREDUCE_STATS") != "0" or any(
            os.environ.get(name) for name in (STATS_FILE_ENV, TRACE_ENV)
        ):
            transport.recorder.reserve()
            transport.recorder.enabled = True

    # ----------------------------------------------------------------------------------------------------
    # Lifetime
    # ----------------------------------------------------------------------------------------------------
    @property
    def transport(self) -> Transport:
        """The transport this group runs on (read-only; for its ``statistics()`` and test hooks)."""
        return self._transport

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    @property
    def thread(self) -> threading.Thread:
        """The thread whose collectives this group runs (see *Threads* above)."""
        return self._pipeline.owner.thread

    def hand_over(self, thread: threading.Thread) -> None:
        """Let ``thread`` (started or not) call this group's collectives instead of the calling thread, which must
        own the group (or any thread, once the owner has finished without handing it over: ``thread`` may then be
        the caller, which adopts the group); it gets the group back once ``thread`` has finished. Collectives
        submitted before keep their place in the order. Every rank hands its own group over."""
        self._pipeline.owner.hand_over(thread, self.rank)

    def shrink(self, *, timeout_s: float | None = None) -> ProcessGroup:
        """The survivors of a failure as a new group, renumbered 0..k-1 in their old order; this one is closed.
        Every survivor calls it (in ``except CollectiveError``). The survivors also agree on the last collective all
        of them completed (:attr:`last_agreed_call`): when the death split them by one call, the new group's
        :attr:`ahead_ranks` completed the call the others raised in, and the others take its result from
        ``ahead_ranks[0]`` (a broadcast on the new group) before every survivor re-runs the call the ahead ranks
        failed; otherwise every survivor re-runs the one it failed. Raises :class:`ShrinkError` on every survivor
        when none can be formed (docs/reliability.md)."""
        if self._lineage is None or self._store is None:
            raise RuntimeError(f"rank {self.rank}: only groups made by allreduce.init() can shrink (through the store)")
        store, self._store = self._store, None  # the new group's from now on
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        parts = shrink(store, self._lineage, timeout_s=wait_s, close=self.close, completed=self._pipeline.completed)
        return self._successor(parts)

    def grow(self, *, timeout_s: float | None = None) -> ProcessGroup:
        """Admit the processes that asked to join (``allreduce.init()`` with ``ALLREDUCE_JOIN=1``): every member
        calls it at the same point (a step boundary), all get the same answer: this group when nobody asked, else
        the grown group (this one closed), the joiners numbered after the members. Then broadcast the state the
        joiners need (``allreduce.train.sync_state``)."""
        if self._lineage is None or self._store is None:
            raise RuntimeError(f"rank {self.rank}: only groups made by allreduce.init() can grow (through the store)")
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        self._grow_calls += 1
        parts = grow(self._store, self._lineage, self._grow_calls, timeout_s=wait_s, close=self._hand_store_over)
        return self if parts is None else self._successor(parts)

    def _hand_store_over(self) -> None:
        """Close this group but keep its store, which the group that replaces it goes on with."""
        self._store = None
        self.close()

    def _successor(self, parts: Shrunk) -> ProcessGroup:
        group = ProcessGroup(
            parts.transport, transport_name=self.transport_name, timeout_s=self.timeout_s,
            cost_model=parts.cost_model, group_size=parts.group_size, store=parts.store, lineage=parts.lineage,
        )  # fmt: skip
        group.last_agreed_call, group.ahead_ranks = parts.last_agreed_call, parts.ahead
        if parts.ahead:
            group._split_root = parts.ahead[0]
        return group

    def _check_split(self, collective: Collective | None, root: int) -> None:
        """After a shrink that split the survivors by one call, the first collective must take the split call's
        result from the first rank ahead: a caller that re-runs its own failed call instead would pair the call the
        others failed with the one after it, and the sums would agree in size, not in meaning."""
        if collective is Collective.BROADCAST and root == self._split_root:
            self._split_root = None
            return
        what = collective.value if collective is not None else "barrier"
        raise RuntimeError(
            f"rank {self.rank}: {what}() on a group whose survivors split by one call: ranks "
            f"{', '.join(map(str, self.ahead_ranks))} completed the old group's call {self.last_agreed_call + 1}, "
            f"which the others raised in; first broadcast its result from rank {self._split_root} "
            f"(broadcast(x, root={self._split_root}) on every rank), then re-run the call the ranks ahead failed "
            "(docs/elastic.md)"
        )

    @property
    def completed_calls(self) -> int:
        """How many collectives (the barrier included) completed on this rank: the k-th call is number k - 1."""
        return self._pipeline.completed

    def close(self) -> None:
        """Finish pending asynchronous collectives, then release the transport and the store."""
        if self._closed:
            return
        if not self._closed and self._transport.failure is None:
            self._report_at_close()
        self._closed = True
        with self._p2p_lock:
            if self._p2p is not None:
                self._p2p.close()
        self._pipeline.executor.close()
        self._transport.close()
        if self._store is not None:
            self._store.close()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ProcessGroup(rank={self.rank}, world_size={self.world_size}, transport={self.transport_name!r})"

    # ----------------------------------------------------------------------------------------------------
    # Arrays the transport can reduce without a copy
    # ----------------------------------------------------------------------------------------------------
    def empty(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> npt.NDArray[Any]:
        """An uninitialised array that collectives use in place (in shared memory with the shm transport)."""
        dt = check_dtype(np.dtype(dtype), "dtype")
        shape_t = (shape,) if isinstance(shape, int | np.integer) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape_t):
            raise ValueError(f"shape must not have negative sizes, got {shape_t}")
        allocate = getattr(self._transport, "allocate", None)
        raw = None if allocate is None else allocate(math.prod(shape_t) * dt.itemsize)
        if raw is None:
            return np.empty(shape_t, dtype=dt)
        return np.asarray(raw.view(dt).reshape(shape_t))

    def zeros(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> npt.NDArray[Any]:
        """Like :meth:`empty`, filled with zeros."""
        out = self.empty(shape, dtype)
        out[...] = 0
        return out

    def block_range(self, count: int, rank: int | None = None) -> tuple[int, int]:
        """Elements [start, stop) of the block that ``rank`` (default: this rank) owns in reduce_scatter."""
        r = self.rank if rank is None else rank_arg(rank, "rank", self.world_size)
        bounds = block_bounds(count, self.world_size)
        return int(bounds[r]), int(bounds[r + 1])

    # ----------------------------------------------------------------------------------------------------
    # Collectives
    # ----------------------------------------------------------------------------------------------------
    def all_reduce(
        self, x: Any, op: str = "sum", algorithm: str | Schedule = "auto", async_op: bool = False,
        **options: Unpack[ReduceOptions],
    ) -> Any:  # fmt: skip
        """Reduce ``x`` (numpy array or CPU tensor, any shape) over all ranks, in place; returns ``x``."""
        if self._replanning is not None:
            return self._replanned_all_reduce(x, op, algorithm, async_op, options)
        if (
            (not options or _defaults_only(options))
            and not async_op
            and algorithm.__class__ is str
            and algorithm == "auto"
            and self._split_root is None
            and self._pipeline.plain(x, op)
        ):
            return x
        return self._collective(Collective.ALL_REDUCE, x, op, algorithm, 0, async_op, options)

    def _replanned_all_reduce(
        self, x: Any, op: str, algorithm: str | Schedule, async_op: bool, options: Mapping[str, Any]
    ) -> Any:
        """An all-reduce under ``ALLREDUCE_REPLAN``: on the re-planned ring where it applies, then counted; every
        window the ranks gather their link records and decide alike (runtime/elastic/_replan.py)."""
        replanning = self._replanning
        assert replanning is not None
        nbytes = int(getattr(x, "nbytes", 0))
        chosen = replanning.algorithm(algorithm, nbytes)
        result = self._collective(Collective.ALL_REDUCE, x, op, chosen, 0, async_op, options)  # type: ignore[arg-type]
        decision = replanning.after_call(nbytes, self)
        if decision is not None and self.rank == 0 and os.environ.get("ALLREDUCE_DEBUG"):
            print(f"allreduce: re-planned: {replanning.changes[-1]}", file=sys.stderr, flush=True)
        return result

    def reduce_scatter(
        self, x: Any, op: str = "sum", algorithm: str | Schedule = "auto", async_op: bool = False,
        **options: Unpack[ReduceOptions],
    ) -> Any:  # fmt: skip
        """Reduce ``x`` over all ranks and return this rank's block of it (see the module docstring)."""
        return self._collective(Collective.REDUCE_SCATTER, x, op, algorithm, 0, async_op, options)

    def all_gather(
        self, x: Any, algorithm: str | Schedule = "auto", async_op: bool = False, **options: Unpack[MoveOptions]
    ) -> Any:
        """Fill every block of ``x`` from its owner (block r from rank r); returns ``x``."""
        return self._collective(Collective.ALL_GATHER, x, None, algorithm, 0, async_op, options)

    def broadcast(
        self, x: Any, root: int = 0, algorithm: str | Schedule = "auto", async_op: bool = False,
        **options: Unpack[MoveOptions],
    ) -> Any:  # fmt: skip
        """Copy the root's ``x`` into every rank's ``x``; returns ``x``."""
        return self._collective(Collective.BROADCAST, x, None, algorithm, root, async_op, options)

    def reduce(
        self, x: Any, root: int = 0, op: str = "sum", algorithm: str | Schedule = "auto", async_op: bool = False,
        **options: Unpack[ReduceOptions],
    ) -> Any:  # fmt: skip
        """Reduce ``x`` over all ranks into the root's ``x`` (other ranks' ``x`` untouched); returns ``x``."""
        return self._collective(Collective.REDUCE, x, op, algorithm, root, async_op, options)

    def gather(
        self, x: Any, root: int = 0, algorithm: str | Schedule = "auto", async_op: bool = False,
        **options: Unpack[MoveOptions],
    ) -> Any:  # fmt: skip
        """Collect every rank's block r of ``x`` (block r from rank r) into the root's ``x``; returns ``x``. The
        other ranks' other blocks are work space (a tree passes its subtree's blocks through them)."""
        return self._collective(Collective.GATHER, x, None, algorithm, root, async_op, options)

    def scatter(
        self, x: Any, root: int = 0, algorithm: str | Schedule = "auto", async_op: bool = False,
        **options: Unpack[MoveOptions],
    ) -> Any:  # fmt: skip
        """Send block r of the root's ``x`` to rank r; returns this rank's block (a view into ``x``, whose other
        blocks are work space on the other ranks)."""
        return self._collective(Collective.SCATTER, x, None, algorithm, root, async_op, options)

    def all_to_all(
        self, x: Any, out: Any = None, algorithm: str | Schedule = "auto", async_op: bool = False, *,
        input_splits: Sequence[int] | None = None, output_splits: Sequence[int] | None = None,
        **options: Unpack[MoveOptions],
    ) -> Any:  # fmt: skip
        """Send part d of ``x`` to rank d, and receive rank s's part for this rank into part s of ``out``
        (default: a new array like ``x``); returns ``out``. Parts are N equal slices, or ``input_splits`` and
        ``output_splits`` elements (every rank's splits are all-gathered first: a blocking call; see
        :mod:`._personalized`). ``x`` is read when the call is made; ``out`` is written when it completes."""
        n = self.world_size
        count = as_buffer(x, "all_to_all(x)", writable=False).flat.size
        in_parts = check_splits(input_splits, count, n, "all_to_all(input_splits)")
        if out is None:
            size = count if output_splits is None else sum(int(s) for s in output_splits)
            out = _new_like(x, size)
        out_count = as_buffer(out, "all_to_all(out)").flat.size
        out_parts = check_splits(output_splits, out_count, n, "all_to_all(output_splits)")
        if input_splits is None and output_splits is None:
            if count != out_count:
                raise ValueError(f"all_to_all: out holds {out_count} elements, x {count}; they must match")
            block = count // n
        else:
            block = split_table(in_parts, out_parts, lambda t: self.all_gather(t, tag=options.get("tag")), self.rank)
        packed = pack_all_to_all(x, out, self.rank, n, in_parts, out_parts, block, self._work_buffers)
        return self._collective(Collective.ALL_TO_ALL, packed, None, algorithm, 0, async_op, options)

    def barrier(self, *, timeout_s: float | None = None, tag: str | None = None) -> None:
        """Return once every rank has entered the barrier."""
        if self._split_root is not None:
            self._check_split(None, 0)
        self._pipeline.collective(None, None, None, "auto", 0, False, Options(timeout_s=timeout_s, tag=tag))

    def _collective(  # noqa: PLR0917 (the public methods' arguments, in their order)
        self, collective: Collective, x: Any, op: str | None, algorithm: str | Schedule, root: int, async_op: bool,
        options: Mapping[str, Any],
    ) -> Any:  # fmt: skip
        checked = check_options(collective, options) if options else _DEFAULTS
        if self._split_root is not None:
            self._check_split(collective, root)
        return self._pipeline.collective(collective, x, op, algorithm, root, async_op, checked)

    # ----------------------------------------------------------------------------------------------------
    # Point-to-point (runtime/p2p): between two ranks, apart from the collectives' call order
    # ----------------------------------------------------------------------------------------------------
    def send(self, x: Any, dst: int, tag: int = 0, *, timeout_s: float | None = None) -> None:
        """Send ``x`` (numpy array or CPU tensor) to rank ``dst``; returns once its bytes are handed to the
        connection. Messages of one pair and tag meet their receives in order (see :mod:`allreduce.runtime.p2p`)."""
        self._point_to_point().isend(x, dst, tag, timeout_s=self._p2p_timeout(timeout_s), async_op=False)

    def isend(self, x: Any, dst: int, tag: int = 0, *, timeout_s: float | None = None) -> Work:
        """Like :meth:`send`, in the background: a :class:`Work` (``x`` must not change until it is done)."""
        work = self._point_to_point().isend(x, dst, tag, timeout_s=self._p2p_timeout(timeout_s), async_op=True)
        assert work is not None
        return work

    def recv(self, x: Any, src: int | None = None, tag: int = 0, *, timeout_s: float | None = None) -> int:
        """Receive into ``x`` the next message from rank ``src`` (None: from any rank) with ``tag``; its dtype and
        element count must be ``x``'s. Returns the sender's rank."""
        return int(self.irecv(x, src, tag, timeout_s=timeout_s).wait())

    def irecv(self, x: Any, src: int | None = None, tag: int = 0, *, timeout_s: float | None = None) -> Work:
        """Like :meth:`recv`, in the background: a :class:`Work` whose result is the sender's rank."""
        return self._point_to_point().irecv(x, src, tag, timeout_s=self._p2p_timeout(timeout_s))

    def _point_to_point(self) -> PointToPoint:
        with self._p2p_lock:
            if self._p2p is None:
                if self._closed or self._store is None:
                    why = "is closed" if self._closed else "has no store to publish its channels in (see init())"
                    raise RuntimeError(f"rank {self.rank}: point-to-point: this group {why}")
                epoch = self._lineage.epoch if self._lineage is not None else 0
                self._p2p = PointToPoint(self.rank, self.world_size, self._store, epoch=epoch)
            return self._p2p

    def _p2p_timeout(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else checked_timeout(timeout_s)

    @property
    def recording(self) -> bool:
        """Whether collectives record their per-step waits for :meth:`stats` and ``ALLREDUCE_TRACE`` (on unless
        ``ALLREDUCE_STATS=0`` was set without ``ALLREDUCE_TRACE``; set it on every rank)."""
        return self._transport.recorder.enabled

    @recording.setter
    def recording(self, enabled: bool) -> None:
        self._pipeline.executor.run(
            lambda: None
        )  # collectives already submitted keep the setting they were called with
        if enabled:
            self._transport.recorder.reserve()
        self._transport.recorder.enabled = bool(enabled)

    def stats(self, last: int = 1000) -> GroupStats:
        """Waits, lateness and transfer times over the last ``last`` recorded collectives of every rank (a
        collective: call it on every rank with the same ``last``); names the slowest rank and the slowest link."""
        self._pipeline.owner.check(self.rank, "stats()")
        last = integer_arg(last, "last")
        if last < 1:
            raise ValueError(f"last must be a positive int, got {last!r}")
        last = min(last, CALL_CAPACITY)  # no more calls are kept: the summary rows are sized for what can be there
        recorder = self._transport.recorder
        self._pipeline.executor.run(lambda: None)  # earlier asynchronous collectives have finished
        rows = np.zeros((self.world_size, summary_row_length(self.world_size, last)))
        rows[self.rank] = summary_row(recorder, self.rank, self.world_size, last)
        was, recorder.enabled = recorder.enabled, False
        try:
            self.all_gather(rows.reshape(-1), algorithm="ring" if self.world_size > 1 else "auto")
        finally:
            recorder.enabled = was
        merged = merge_summaries(rows, last)
        if self._replanning is not None and self._replanning.changes:
            merged = dataclasses.replace(merged, replans=tuple(self._replanning.changes))
        return merged

    def _report_at_close(self) -> None:
        """``ALLREDUCE_STATS`` / ``ALLREDUCE_TRACE``: collectives of their own, so a failure is reported, not raised
        (closing must release the transport whatever happened). Rank 0 prints, or writes where the launcher reads."""
        try:
            if os.environ.get("ALLREDUCE_STATS", "0") != "0" or os.environ.get(STATS_FILE_ENV):
                table = self.stats().table()
                target = os.environ.get(STATS_FILE_ENV)
                if self.rank == 0 and target:
                    Path(target).write_text(table + "\n")
                elif self.rank == 0:
                    print(table, file=sys.stderr, flush=True)
            if trace := os.environ.get(TRACE_ENV):
                write_trace(trace, self._transport.recorder, self)
        except (RuntimeError, OSError, ValueError) as exc:  # a CollectiveError, or a split not taken yet
            print(f"[allreduce rank {self.rank}] no stats or trace at close: {exc}", file=sys.stderr, flush=True)

    def choose_algorithm(
        self,
        count: int,
        dtype: Any = np.float32,
        collective: Collective | str = "all_reduce",
        *,
        like: Any = None,
    ) -> str:
        """The algorithm ``algorithm="auto"`` picks for ``count`` elements of ``dtype`` (by the cost model); with
        ``like`` (an array or tensor), for a call on that very buffer, whose memory the transport may move in one
        pass per step at any size (a plain array staged in a group of two over shm)."""
        coll = Collective(collective)
        itemsize = check_dtype(np.dtype(dtype), "dtype").itemsize
        if like is None:
            return self._pipeline.runs.resolve(coll, "auto", count, itemsize, deterministic=False)
        flat = as_buffer(like, "like").flat
        return self._pipeline.runs.resolve(
            coll, "auto", count, itemsize, deterministic=False, fuses=self._transport.fuses, buffer=flat
        )
