"""The process group: who is who, and the collectives every rank calls.

Each collective goes through the same three stages:

1. check the arguments locally (dtype, op, shape, root) — bad input raises ``ValueError``/``TypeError`` and
   consumes nothing;
2. ``transport.agree``: every rank publishes a small descriptor (collective, element count, dtype, op, root,
   algorithm, flags) for sequence number k and compares all N — any difference raises :class:`MismatchError`
   on every rank, naming the field and each rank's value, before any data moves (the buffer is untouched);
3. ``transport.execute`` on the compiled plan of the chosen schedule (never an algorithm of our own).

Buffer conventions (``count`` elements, blocks of ``block_bounds(count, N)``, rank r owns block r):

- ``all_reduce(x)``: in place, every rank ends with the reduction of all ranks' ``x``;
- ``reduce_scatter(x)``: ``x`` holds all N blocks of this rank's contribution and is used as work space;
  the call returns this rank's block (a view into ``x``), reduced over all ranks — other blocks of ``x`` are
  unspecified afterwards;
- ``all_gather(x)``: the inverse: on entry block r of ``x`` holds rank r's part (other blocks are ignored), on
  return every block is filled. ``all_gather(reduce_scatter(x)'s x)`` is an all-reduce;
- ``broadcast(x, root)``: in place; ``reduce(x, root)``: the root's ``x`` receives the reduction, the other ranks'
  ``x`` are left untouched (they reduce in a copy).
"""

from __future__ import annotations

import math
import os
import queue
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from allreduce.runtime._errors import CollectiveError, MismatchError
from allreduce.runtime._plan import RankPlan, compile_plan
from allreduce.runtime._transport import Transport
from allreduce.schedules import (
    ALL_REDUCE_ALGORITHMS,
    Collective,
    CostModel,
    Schedule,
    all_reduce,
    binary_tree_broadcast,
    binary_tree_reduce,
    binomial_broadcast,
    binomial_reduce,
    block_bounds,
    direct_all_gather,
    direct_reduce_scatter,
    predict,
    ring_all_gather,
    ring_reduce_scatter,
)

__all__ = [
    "ALGORITHMS",
    "DTYPES",
    "OPS",
    "ProcessGroup",
    "Work",
    "default_cost_model",
    "make_schedule",
]

DTYPES: dict[str, np.dtype[Any]] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
}
_DTYPE_CODE = {dt: i for i, dt in enumerate(DTYPES.values())}
_DTYPE_NAME = {dt: name for name, dt in DTYPES.items()}

OPS: dict[str, np.ufunc] = {
    "sum": np.add,
    "avg": np.add,  # then divided by N
    "min": np.minimum,
    "max": np.maximum,
    "prod": np.multiply,
}
_OP_CODE = {name: i for i, name in enumerate(OPS)}

ALGORITHMS: dict[Collective, tuple[str, ...]] = {
    Collective.ALL_REDUCE: ALL_REDUCE_ALGORITHMS,
    Collective.REDUCE_SCATTER: ("ring", "direct"),
    Collective.ALL_GATHER: ("ring", "direct"),
    Collective.BROADCAST: ("binomial", "binary_tree"),
    Collective.REDUCE: ("binomial", "binary_tree"),
}
# deterministic=True: one fixed schedule per collective, so each element is reduced along one fixed chain
# of ranks for a given N whatever algorithm= says and whatever the transport.
_DETERMINISTIC = {Collective.ALL_REDUCE: "ring", Collective.REDUCE_SCATTER: "ring", Collective.REDUCE: "binomial"}
_BARRIER = 99
_KIND_CODE = {c: i for i, c in enumerate(Collective)}
_KIND_NAME = {i: c.value for c, i in _KIND_CODE.items()} | {_BARRIER: "barrier"}

# kind, dtype, op, flags, root, count, segments, group_size, algorithm(24s) | proposal(24s)
_DESC = struct.Struct("<BBBBiqii24s")
_PROPOSAL = struct.Struct("<24s")
_FLAG_CHECKSUM = 1
_FLAG_DETERMINISTIC = 2


def default_cost_model(transport: str) -> CostModel:
    """Built-in α, β, γ per transport (measured on the 2-core development machine; ``allreduce tune`` refines)."""
    if transport == "shm":
        return CostModel(latency_s=8e-6, bandwidth_Bps=6e9, reduce_bandwidth_Bps=7e9)
    return CostModel(latency_s=40e-6, bandwidth_Bps=2e9, reduce_bandwidth_Bps=7e9)


@lru_cache(maxsize=256)
def make_schedule(
    collective: Collective, algorithm: str, world_size: int, *, root: int = 0, segments: int = 1, group_size: int = 0
) -> Schedule:
    """The schedule called ``algorithm`` for ``collective`` (names in :data:`ALGORITHMS`)."""
    names = ALGORITHMS[collective]
    if algorithm not in names:
        raise ValueError(f"unknown {collective.value} algorithm {algorithm!r}; choose one of {', '.join(names)}")
    schedule: Schedule
    if collective is Collective.ALL_REDUCE:
        return all_reduce(algorithm, world_size, group_size=group_size or world_size, segments=segments)
    if collective is Collective.REDUCE_SCATTER:
        schedule = ring_reduce_scatter(world_size) if algorithm == "ring" else direct_reduce_scatter(world_size)
    elif collective is Collective.ALL_GATHER:
        schedule = ring_all_gather(world_size) if algorithm == "ring" else direct_all_gather(world_size)
    elif collective is Collective.BROADCAST:
        builder = binomial_broadcast if algorithm == "binomial" else binary_tree_broadcast
        schedule = builder(world_size, root)
    else:
        builder = binomial_reduce if algorithm == "binomial" else binary_tree_reduce
        schedule = builder(world_size, root)
    return schedule.with_segments(segments) if segments != 1 else schedule


class _Reducer:
    """``reduce_into(dst, incoming)`` for the transports; exposes ``ufunc`` so shm can reduce out of place."""

    __slots__ = ("ufunc",)

    def __init__(self, ufunc: np.ufunc) -> None:
        self.ufunc = ufunc

    def __call__(self, dst: npt.NDArray[Any], incoming: npt.NDArray[Any]) -> None:
        self.ufunc(dst, incoming, out=dst)


_REDUCERS = {name: _Reducer(ufunc) for name, ufunc in OPS.items()}


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


@dataclass(frozen=True)
class _Buffer:
    """A user's array or tensor seen as numpy: ``flat`` is what the transport works on."""

    original: Any
    array: npt.NDArray[Any]  # numpy view of the user's memory (any strides)
    flat: npt.NDArray[Any]  # 1-D contiguous: a view of `array`, or a copy that is written back
    copied: bool

    def write_back(self) -> None:
        if self.copied:
            self.array[...] = self.flat.reshape(self.array.shape)


def _torch_to_numpy(tensor: Any, what: str) -> npt.NDArray[Any]:
    import torch

    if tensor.device.type != "cpu":
        raise ValueError(f"{what}: only CPU tensors are supported, got a tensor on {tensor.device}")
    t = tensor.detach()
    if t.dtype == torch.bfloat16:
        return np.asarray(t.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    array: npt.NDArray[Any] = t.numpy()
    return array


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


class ProcessGroup:
    """N ranks that run collectives together over one :class:`Transport` (made by :func:`init`).

    ``timeout_s`` is the default per-collective timeout; ``cost_model`` feeds ``algorithm="auto"``;
    ``group_size`` is the number of ranks per host (for the hierarchical algorithm). Use as a context manager
    or call :meth:`close`.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        transport_name: str,
        timeout_s: float = 300.0,
        cost_model: CostModel | None = None,
        group_size: int | None = None,
        store: Any = None,
    ) -> None:
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
        self._transport = transport
        self.transport_name = transport_name
        self.rank: int = transport.rank
        self.world_size: int = transport.world_size
        self.timeout_s = float(timeout_s)
        self.cost_model = cost_model or default_cost_model(transport_name)
        self.group_size = group_size or self.world_size
        self._store = store
        self._seq = 0
        self._lock = threading.Lock()
        self._exec_lock = threading.Lock()
        self._pending = 0
        self._queue: queue.SimpleQueue[Callable[[], None] | None] | None = None
        self._worker: threading.Thread | None = None
        self._closed = False
        self._debug = bool(os.environ.get("ALLREDUCE_DEBUG"))
        self._auto_cache: dict[tuple[Collective, int, int], str] = {}
        # shm: publish a small buffer's step-0 data with the descriptor (one handoff fewer per call)
        self._prepare: Callable[..., None] | None = getattr(transport, "prepare", None)

    # ----------------------------------------------------------------------------------------------------
    # Lifetime
    # ----------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish pending asynchronous collectives, then release the transport and the store."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None and self._queue is not None:
            self._queue.put(None)
            self._worker.join()
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
        dt = self._dtype_of(np.dtype(dtype), "dtype")
        shape_t = (shape,) if isinstance(shape, int | np.integer) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape_t):
            raise ValueError(f"shape must not have negative sizes, got {shape_t}")
        count = math.prod(shape_t)
        allocate = getattr(self._transport, "allocate", None)
        if allocate is None:
            return np.empty(shape_t, dtype=dt)
        raw = allocate(count * dt.itemsize)
        return np.asarray(raw.view(dt).reshape(shape_t))

    def zeros(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> npt.NDArray[Any]:
        """Like :meth:`empty`, filled with zeros."""
        out = self.empty(shape, dtype)
        out[...] = 0
        return out

    def block_range(self, count: int, rank: int | None = None) -> tuple[int, int]:
        """Elements [start, stop) of the block that ``rank`` (default: this rank) owns in reduce_scatter."""
        r = self.rank if rank is None else rank
        bounds = block_bounds(count, self.world_size)
        return int(bounds[r]), int(bounds[r + 1])

    # ----------------------------------------------------------------------------------------------------
    # Collectives
    # ----------------------------------------------------------------------------------------------------
    def all_reduce(
        self,
        x: Any,
        op: str = "sum",
        algorithm: str = "auto",
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
        checksum: bool = False,
        deterministic: bool = False,
        segments: int = 1,
    ) -> Any:
        """Reduce ``x`` (numpy array or CPU tensor, any shape) over all ranks, in place; returns ``x``."""
        return self._submit(
            Collective.ALL_REDUCE,
            x,
            op=op,
            algorithm=algorithm,
            root=0,
            async_op=async_op,
            timeout_s=timeout_s,
            checksum=checksum,
            deterministic=deterministic,
            segments=segments,
        )

    def reduce_scatter(
        self,
        x: Any,
        op: str = "sum",
        algorithm: str = "auto",
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
        checksum: bool = False,
        deterministic: bool = False,
        segments: int = 1,
    ) -> Any:
        """Reduce ``x`` over all ranks and return this rank's block of it (see the module docstring)."""
        return self._submit(
            Collective.REDUCE_SCATTER,
            x,
            op=op,
            algorithm=algorithm,
            root=0,
            async_op=async_op,
            timeout_s=timeout_s,
            checksum=checksum,
            deterministic=deterministic,
            segments=segments,
        )

    def all_gather(
        self,
        x: Any,
        algorithm: str = "auto",
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
        checksum: bool = False,
        segments: int = 1,
    ) -> Any:
        """Fill every block of ``x`` from its owner (block r from rank r); returns ``x``."""
        return self._submit(
            Collective.ALL_GATHER,
            x,
            op=None,
            algorithm=algorithm,
            root=0,
            async_op=async_op,
            timeout_s=timeout_s,
            checksum=checksum,
            deterministic=False,
            segments=segments,
        )

    def broadcast(
        self,
        x: Any,
        root: int = 0,
        algorithm: str = "auto",
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
        checksum: bool = False,
        segments: int = 1,
    ) -> Any:
        """Copy the root's ``x`` into every rank's ``x``; returns ``x``."""
        return self._submit(
            Collective.BROADCAST,
            x,
            op=None,
            algorithm=algorithm,
            root=root,
            async_op=async_op,
            timeout_s=timeout_s,
            checksum=checksum,
            deterministic=False,
            segments=segments,
        )

    def reduce(
        self,
        x: Any,
        root: int = 0,
        op: str = "sum",
        algorithm: str = "auto",
        async_op: bool = False,
        *,
        timeout_s: float | None = None,
        checksum: bool = False,
        deterministic: bool = False,
        segments: int = 1,
    ) -> Any:
        """Reduce ``x`` over all ranks into the root's ``x`` (other ranks' ``x`` untouched); returns ``x``."""
        return self._submit(
            Collective.REDUCE,
            x,
            op=op,
            algorithm=algorithm,
            root=root,
            async_op=async_op,
            timeout_s=timeout_s,
            checksum=checksum,
            deterministic=deterministic,
            segments=segments,
        )

    def barrier(self, *, timeout_s: float | None = None) -> None:
        """Return once every rank has entered the barrier."""
        self._check_open()
        timeout = self._timeout(timeout_s)
        descriptor = _DESC.pack(_BARRIER, 0, 0, 0, 0, 0, 0, 0, b"") + _PROPOSAL.pack(b"")

        def run() -> None:
            seq = self._take_seq()
            descriptors = self._transport.agree(seq, descriptor, timeout_s=timeout)
            self._compare(seq, descriptors)

        self._run_ordered(run)

    # ----------------------------------------------------------------------------------------------------
    # Internals
    # ----------------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise CollectiveError(f"rank {self.rank}: the process group is closed", rank=self.rank)

    def _timeout(self, timeout_s: float | None) -> float:
        if timeout_s is None:
            return self.timeout_s
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
        return float(timeout_s)

    def _take_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    @staticmethod
    def _dtype_of(dtype: np.dtype[Any], what: str) -> np.dtype[Any]:
        if dtype not in _DTYPE_CODE:
            raise TypeError(f"{what}: unsupported dtype {dtype}; supported: {', '.join(DTYPES)}")
        return dtype

    def _as_buffer(self, x: Any, what: str) -> _Buffer:
        if _is_torch(x):
            array = _torch_to_numpy(x, what)
        elif isinstance(x, np.ndarray):
            array = x
        else:
            raise TypeError(f"{what}: expected a numpy array or a torch CPU tensor, got {type(x).__name__}")
        self._dtype_of(array.dtype, what)
        if not array.flags.writeable:
            raise ValueError(f"{what}: the array is read-only; collectives work in place")
        if array.flags.c_contiguous:
            return _Buffer(x, array, array.reshape(-1), copied=False)
        # A strided view goes through a contiguous copy (C order, so every rank flattens the same way).
        return _Buffer(x, array, np.ascontiguousarray(array).reshape(-1), copied=True)

    def _resolve(self, collective: Collective, algorithm: str, count: int, itemsize: int, deterministic: bool) -> str:
        if deterministic and collective in _DETERMINISTIC:
            return _DETERMINISTIC[collective]
        if algorithm != "auto":
            if algorithm not in ALGORITHMS[collective]:
                raise ValueError(
                    f"algorithm: unknown {collective.value} algorithm {algorithm!r}; choose auto or one of "
                    f"{', '.join(ALGORITHMS[collective])}"
                )
            if algorithm == "hierarchical" and self.world_size % self.group_size:
                raise ValueError(
                    f"algorithm: hierarchical needs world_size ({self.world_size}) divisible by the ranks per "
                    f"host ({self.group_size})"
                )
            return algorithm
        size_class = max(count * itemsize, 1).bit_length()
        key = (collective, size_class, self.world_size)
        cached = self._auto_cache.get(key)
        if cached is not None:
            return cached
        size_bytes = float(1 << (size_class - 1))
        candidates = [
            name
            for name in ALGORITHMS[collective]
            if name != "hierarchical" or (self.group_size < self.world_size and self.world_size % self.group_size == 0)
        ]
        best = min(
            candidates,
            key=lambda name: (
                predict(
                    make_schedule(collective, name, self.world_size, group_size=self.group_size),
                    size_bytes,
                    self.cost_model,
                ).seconds
            ),
        )
        self._auto_cache[key] = best
        return best

    def _submit(
        self,
        collective: Collective,
        x: Any,
        *,
        op: str | None,
        algorithm: str,
        root: int,
        async_op: bool,
        timeout_s: float | None,
        checksum: bool,
        deterministic: bool,
        segments: int,
    ) -> Any:
        self._check_open()
        what = f"{collective.value}(x)"
        if op is not None and op not in OPS:
            raise ValueError(f"op: unknown reduction {op!r}; choose one of {', '.join(OPS)}")
        if not isinstance(root, int) or not 0 <= root < self.world_size:
            raise ValueError(f"root: {root!r} is not a rank of this group of {self.world_size}")
        if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
            raise ValueError(f"segments must be a positive int, got {segments!r}")
        timeout = self._timeout(timeout_s)
        buf = self._as_buffer(x, what)
        dtype = buf.flat.dtype
        if op == "avg" and dtype.kind in "iu":
            raise TypeError(f"op: avg is not defined for integer dtype {dtype}; use sum and divide yourself")
        count = buf.flat.size
        chosen = self._resolve(collective, algorithm, count, dtype.itemsize, deterministic)
        flags = (_FLAG_CHECKSUM if checksum else 0) | (_FLAG_DETERMINISTIC if deterministic else 0)
        requested = "deterministic" if deterministic else algorithm
        descriptor = _DESC.pack(
            _KIND_CODE[collective],
            _DTYPE_CODE[dtype],
            _OP_CODE.get(op or "sum", 0) if op is not None else 255,
            flags,
            root,
            count,
            segments,
            self.group_size,
            requested.encode()[:24],
        ) + _PROPOSAL.pack(chosen.encode()[:24])

        def run() -> Any:
            seq = self._take_seq()
            started = time.perf_counter()
            if self._prepare is not None:
                self._prepare(seq, buf.flat, checksum=checksum)
            descriptors = self._transport.agree(seq, descriptor, timeout_s=timeout)
            self._compare(seq, descriptors)
            name = _PROPOSAL.unpack_from(descriptors[0], _DESC.size)[0].rstrip(b"\0").decode()
            schedule = make_schedule(
                collective, name, self.world_size, root=root, segments=segments, group_size=self.group_size
            )
            plan = compile_plan(schedule, self.rank, count)
            result = self._execute(
                collective, buf=buf, plan=plan, op=op, root=root, seq=seq, timeout=timeout, checksum=checksum
            )
            if self._debug:
                self._log(
                    collective,
                    name=name,
                    schedule=schedule,
                    size_bytes=count * dtype.itemsize,
                    seconds=time.perf_counter() - started,
                    seq=seq,
                )
            return result

        # the description is formatted only when a Work needs it (str(dtype) alone costs microseconds)
        return self._run_ordered(run, async_op=async_op, describe=lambda: f"{collective.value} of {count} {dtype}")

    def _execute(
        self,
        collective: Collective,
        *,
        buf: _Buffer,
        plan: RankPlan,
        op: str | None,
        root: int,
        seq: int,
        timeout: float,
        checksum: bool,
    ) -> Any:
        flat = buf.flat
        reducer = _REDUCERS[op or "sum"]
        if collective is Collective.REDUCE and self.rank != root:
            # Non-roots keep their input: the partial sums of the tree go to a copy.
            work = flat.copy()
            self._transport.execute(plan, work, reducer, seq=seq, timeout_s=timeout, checksum=checksum)
            return buf.original
        self._transport.execute(plan, flat, reducer, seq=seq, timeout_s=timeout, checksum=checksum)
        if op == "avg" and (collective is not Collective.REDUCE or self.rank == root):
            np.divide(flat, self.world_size, out=flat, casting="unsafe")
        buf.write_back()
        if collective is Collective.REDUCE_SCATTER:
            start, stop = self.block_range(flat.size)
            if _is_torch(buf.original):
                return buf.original.reshape(-1)[start:stop]
            return buf.array.reshape(-1)[start:stop]
        return buf.original

    def _compare(self, seq: int, descriptors: list[bytes]) -> None:
        """Raise MismatchError naming the first field on which the ranks' calls differ."""
        first = descriptors[0][: _DESC.size]
        if all(d[: _DESC.size] == first for d in descriptors):
            return
        fields = ("collective", "dtype", "op", "flags", "root", "count", "segments", "group_size", "algorithm")
        decoded = [_DESC.unpack_from(d) for d in descriptors]
        for i, field in enumerate(fields):
            values = [_describe(field, row[i]) for row in decoded]
            if len(set(values)) > 1:
                per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                raise MismatchError(
                    f"rank {self.rank}: collective {seq} mismatch before any data moved: ranks called it with "
                    f"different {field} ({per_rank})",
                    rank=self.rank,
                )
        raise MismatchError(f"rank {self.rank}: collective {seq} descriptors differ", rank=self.rank)

    def _run_ordered(
        self, fn: Callable[[], Any], *, async_op: bool = False, describe: Callable[[], str] = lambda: "barrier"
    ) -> Any:
        """Run ``fn`` after every collective submitted before it (sequence numbers follow call order)."""
        with self._lock:
            if not async_op and self._pending == 0:
                with self._exec_lock:
                    return fn()
            self._pending += 1
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                self._worker = threading.Thread(target=self._work_loop, name=f"allreduce-rank{self.rank}", daemon=True)
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

    def _work_loop(self) -> None:
        assert self._queue is not None
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._exec_lock:
                job()

    def _log(
        self, collective: Collective, *, name: str, schedule: Schedule, size_bytes: int, seconds: float, seq: int
    ) -> None:
        predicted = predict(schedule, float(size_bytes), self.cost_model).seconds
        print(
            f"[allreduce rank {self.rank}] seq={seq} {collective.value} {size_bytes} B algorithm={name} "
            f"predicted={predicted * 1e6:.1f}us measured={seconds * 1e6:.1f}us",
            file=sys.stderr,
            flush=True,
        )


def _describe(field: str, value: Any) -> str:
    if field == "collective":
        return _KIND_NAME.get(int(value), str(value))
    if field == "dtype":
        return list(DTYPES)[int(value)] if int(value) < len(DTYPES) else str(value)
    if field == "op":
        return list(OPS)[int(value)] if int(value) < len(OPS) else "none"
    if field == "flags":
        names = [n for bit, n in ((_FLAG_CHECKSUM, "checksum"), (_FLAG_DETERMINISTIC, "deterministic")) if value & bit]
        return "+".join(names) or "none"
    if field == "algorithm":
        return bytes(value).rstrip(b"\0").decode()
    return str(value)
