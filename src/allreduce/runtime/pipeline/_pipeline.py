"""The one path every collective of a group takes, in named stages.

1. **check** the arguments locally (dtype, op, shape, root, algorithm): bad input raises ``ValueError`` or
   ``TypeError`` and consumes nothing;
2. **prepare** (:meth:`Pipeline.prepare`): *resolve* the algorithm (``auto``: the cost model's pick), *plan* it
   (schedule and per-rank plan, from the group's :class:`PlanCache`) and *describe* the call (the descriptor every
   rank compares): a :class:`Prepared` call, everything per-call constant;
3. **run** (:meth:`Pipeline.run`), in call order: take the sequence number, *agree* (every rank's descriptor; a
   difference raises :class:`MismatchError` before any data moves, a different ``auto`` pick runs rank 0's),
   *execute* the plan on the buffer, *finish* (avg's division), the recorder's entry around it all.

A plain call, ``all_reduce(x)`` of a C-contiguous numpy array or CPU tensor with every other argument at its
default (the call a training loop repeats), keeps its :class:`Prepared` call per dtype, size and op
(:meth:`Pipeline.plain`), and a small one runs the transport's one-pass
:meth:`~allreduce.runtime.Transport.run_small`, on the same words in the same order as prepare, agree and execute
(peers on the other path pair with it). Everything else (tensors off the CPU, strided or read-only arrays,
``async_op``, the keyword options, pending asynchronous calls, fault injection, ``ALLREDUCE_DEBUG``) prepares its
call each time; buffers are adapted to 1-D contiguous numpy (:mod:`._buffers`).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from allreduce.runtime._args import integer_arg, rank_arg
from allreduce.runtime._errors import CollectiveError
from allreduce.runtime.pipeline._buffers import Buffer, as_buffer, check_dtype, is_torch, torch_to_numpy
from allreduce.runtime.pipeline._descriptor import (
    DESCRIPTOR,
    DTYPE_CODES,
    FLAG_CHECKSUM,
    FLAG_DETERMINISTIC,
    KIND_CODES,
    NO_OP_CODE,
    NO_TAG,
    OP_CODES,
    OPS,
    barrier_descriptor,
    check_agreement,
    proposal_of,
    tag_bytes,
)
from allreduce.runtime.pipeline._runs import DETERMINISTIC, Run, Runs
from allreduce.runtime.pipeline._threads import ThreadOwner
from allreduce.runtime.pipeline._work import OrderedExecutor
from allreduce.runtime.transport._transport import Call, PlanCache, Transport
from allreduce.schedules import Collective, CostModel, Schedule, block_bounds, predict

__all__ = ["PLAIN_CALLS", "Options", "Pipeline", "Prepared", "check_options", "checked_timeout"]

PLAIN_CALLS = 256
"""Prepared plain calls kept (one per dtype, size and op); all dropped when full (a training loop uses a few)."""

_REQUESTED_AUTO = b"auto"
_REQUESTED_DETERMINISTIC = b"deterministic"
_ALL_REDUCE = Collective.ALL_REDUCE
_REDUCE = Collective.REDUCE
# per collective: how errors name its argument
_WHAT = {c: f"{c.value}(x)" for c in Collective}
_OPTIONS = frozenset(("timeout_s", "checksum", "deterministic", "segments", "tag"))
_NOT_REDUCING = _OPTIONS - {"deterministic"}


class _Reducer:
    """``reduce_into(dst, incoming)`` for the transports; exposes ``ufunc`` so shm can reduce out of place."""

    __slots__ = ("ufunc",)

    def __init__(self, ufunc: np.ufunc) -> None:
        self.ufunc = ufunc

    def __call__(self, dst: npt.NDArray[Any], incoming: npt.NDArray[Any]) -> None:
        self.ufunc(dst, incoming, out=dst)


_REDUCERS = {name: _Reducer(ufunc) for name, ufunc in OPS.items()}
# A Call made as its tuple, on the small-call path: the NamedTuple's own __new__ is a Python function (about 300 ns
# a call against 180 ns for this, of a 4 KiB call's few microseconds of own work).
_new_tuple = tuple.__new__
_BARRIER_DESCRIPTOR = barrier_descriptor()


class Options(NamedTuple):
    """A collective's keyword options (see :class:`~allreduce.runtime.ProcessGroup`)."""

    timeout_s: float | None = None
    checksum: bool = False
    deterministic: bool = False
    segments: int = 1
    tag: str | None = None


class Prepared(NamedTuple):
    """Everything per-call constant about one collective: what runs, and the descriptor every rank compares."""

    collective: Collective
    kind: int
    root: int
    segments: int
    elements: int
    run: Run
    descriptor: bytes
    small: bool  # a plain all-reduce: may take the transport's small-call path


class _Plain(NamedTuple):
    """A plain call's prepared forms: ``fused`` (when it differs) for a buffer the transport fuses."""

    model: CostModel  # the cost model whose pick ``run`` is (a group's model may be replaced)
    prepared: Prepared
    fused: Prepared | None


class _Group(Protocol):
    """What the pipeline reads of its group (at each call: a group's cost model or timeout may be replaced)."""

    rank: int
    world_size: int
    group_size: int
    cost_model: CostModel
    timeout_s: float

    @property
    def closed(self) -> bool: ...


class Pipeline:
    """The stages of one group's collectives (see the module docstring), and the state they share: the calls'
    order (``executor``, sequence numbers), the owning thread (``owner``) and the cached choices (``runs``)."""

    def __init__(self, group: _Group, transport: Transport, plans: PlanCache) -> None:
        self._group = group
        self.transport = transport
        self.runs = Runs(group, plans)
        self.executor = OrderedExecutor(f"allreduce-rank{group.rank}")
        self.owner = ThreadOwner()
        self._seq = 0
        self.completed = 0
        """Collectives that returned here (the barrier included): a shrink compares the survivors' counts."""
        self._debug = bool(os.environ.get("ALLREDUCE_DEBUG"))
        self._fuses = transport.fuses  # bound once: asked on auto's path (see Runs.resolve)
        self._small_bytes: Callable[[int], int] = transport.small_bytes  # 0 where the transport has no run_small
        # Skip the call when the transport keeps the base class's prepare (which does nothing).
        own_prepare = getattr(type(transport), "prepare", Transport.prepare)
        self._head_start: Callable[..., None] | None = None if own_prepare is Transport.prepare else transport.prepare
        self._plain: dict[tuple[np.dtype[Any], int, str], _Plain] = {}

    # ----------------------------------------------------------------------------------------------------
    # Entries
    # ----------------------------------------------------------------------------------------------------
    def plain(self, x: Any, op: str) -> bool:
        """``all_reduce(x, op)`` of a numpy array or a CPU torch tensor (reduced through its numpy view, which
        shares its memory): True when done; False, with nothing consumed, for :meth:`collective`."""
        if x.__class__ is not np.ndarray:
            if not is_torch(x) or x.device.type != "cpu":
                return False
            x = torch_to_numpy(x, "all_reduce(x)")
        group = self._group
        if group.closed or self._debug or not x.size:
            return False
        flags = x.flags
        if not (flags.c_contiguous and flags.writeable) or self.transport.injection is not None:
            return False
        self.owner.check(group.rank, "all_reduce(x)")
        plain = self._plain.get((x.dtype, x.size, op))
        if plain is None or plain.model is not group.cost_model:
            plain = self._prepare_plain(x, op)
            if plain is None:
                return False
        if not self.executor.enter():  # asynchronous collectives are pending: they run first, in call order
            return False
        try:
            flat = x if x.ndim == 1 else x.reshape(-1)
            fused = plain.fused
            prepared = fused if fused is not None and self._fuses(flat) else plain.prepared
            self.run(prepared, flat, op, group.timeout_s, False, 0)
        finally:
            self.executor.leave()
        return True

    def collective(  # noqa: PLR0917 (the group's arguments, in its order)
        self, collective: Collective | None, x: Any, op: str | None, algorithm: str | Schedule, root: int,
        async_op: bool, options: Options,
    ) -> Any:  # fmt: skip
        """Any collective (``collective`` None: the barrier, which agrees and moves no data): the arguments
        checked, consuming nothing on bad input, then the call prepared and run in call order."""
        group = self._group
        if group.closed:
            raise CollectiveError(f"rank {group.rank}: the process group is closed", rank=group.rank)
        what = _WHAT[collective] if collective is not None else "barrier()"
        timeout_s, checksum, deterministic, segments, tag = options
        if tag is None:
            self.owner.check(group.rank, what)
            tagged = NO_TAG
        else:
            tagged = tag_bytes(tag)
        timeout = group.timeout_s if timeout_s is None else checked_timeout(timeout_s)
        if collective is None:
            barrier = _BARRIER_DESCRIPTOR if tag is None else barrier_descriptor(tagged)
            return self.executor.run(lambda: self._agree(self._take_seq(), barrier, timeout))
        if op is not None and op not in OPS:
            raise ValueError(f"op: unknown reduction {op!r}; choose one of {', '.join(OPS)}")
        if root.__class__ is not int or not 0 <= root < group.world_size:
            root = rank_arg(root, "root", group.world_size)
        if segments.__class__ is not int or segments < 1:
            segments = integer_arg(segments, "segments")
            if segments < 1:
                raise ValueError(f"segments must be a positive int, got {segments!r}")
        buf = x if isinstance(x, Buffer) else as_buffer(x, what)  # all_to_all's packed buffer comes made
        dtype = buf.flat.dtype
        if op == "avg" and dtype.kind in "iu":
            raise TypeError(f"op: avg is not defined for integer dtype {dtype}; use sum and divide yourself")
        flags = (FLAG_CHECKSUM if checksum else 0) | (FLAG_DETERMINISTIC if deterministic else 0)
        prepared = self.prepare(
            collective, dtype, buf.flat.size, op, algorithm, root=root, segments=segments, flags=flags,
            tag=tagged, buffer=buf.flat,
        )  # fmt: skip
        injection = self.transport.injection

        # non-roots of a reduce keep their input: the partial sums of the tree go to a copy
        keeps_input = collective is _REDUCE and root != group.rank

        def run() -> Any:
            if injection is not None:
                injection.sleep_before_call()
            started = time.perf_counter_ns()
            flat = buf.flat.copy() if keeps_input else buf.flat
            chosen = self.run(prepared, flat, op, timeout, checksum, started)
            if self._debug:
                self._log(collective, chosen.schedule, flat.nbytes, started, self._seq - 1)
            return buf.original if keeps_input else self._result(prepared, buf)

        # the description is formatted only when a Work needs it (str(dtype) alone costs microseconds)
        count = buf.flat.size
        return self.executor.run(run, async_op=async_op, describe=lambda: f"{collective.value} of {count} {dtype}")

    # ----------------------------------------------------------------------------------------------------
    # The stages
    # ----------------------------------------------------------------------------------------------------
    def prepare(
        self, collective: Collective, dtype: np.dtype[Any], count: int, op: str | None, algorithm: str | Schedule,
        *, root: int, segments: int, flags: int, tag: bytes, buffer: npt.NDArray[Any] | None, fused: bool = False,
    ) -> Prepared:  # fmt: skip
        """Resolve, plan and describe a call: for ``buffer`` (auto's pick may depend on whether the transport fuses
        it), or with ``buffer`` None for any buffer that the transport fuses (``fused``) or not (a plain call)."""
        group, runs, kind = self._group, self.runs, KIND_CODES[collective]
        if flags & FLAG_DETERMINISTIC and collective in DETERMINISTIC:
            run = runs.registered(
                collective, kind, DETERMINISTIC[collective], root=root, segments=segments, count=count
            )
            requested = _REQUESTED_DETERMINISTIC
        elif isinstance(algorithm, Schedule):
            run = runs.of_schedule(collective, algorithm, root, segments, count)
            requested = run.name
        else:
            # the transport's answer for this buffer, asked only if it would change auto's pick (no allocation here)
            fuses = self._fuses if buffer is not None else _yes if fused else None
            name = runs.resolve(collective, algorithm, count, dtype.itemsize, False, fuses=fuses, buffer=buffer)
            run = runs.registered(collective, kind, name, root=root, segments=segments, count=count)
            requested = _REQUESTED_AUTO if algorithm == "auto" else run.name
        descriptor = DESCRIPTOR.pack(
            kind, DTYPE_CODES[dtype], NO_OP_CODE if op is None else OP_CODES[op], flags, root, count, segments,
            group.group_size, requested, run.digest, tag, run.name,
        )  # fmt: skip
        plain = buffer is None and collective is _ALL_REDUCE and segments == 1 and not flags and tag == NO_TAG
        return Prepared(collective, kind, root, segments, count, run, descriptor, plain)

    def run(  # noqa: PLR0917 (positional: the hot path)
        self, prepared: Prepared, flat: npt.NDArray[Any], op: str | None, timeout_s: float, checksum: bool,
        started: int,
    ) -> Run:  # fmt: skip
        """Agree, execute and finish ``prepared`` on ``flat`` (the caller has the executor's turn); ``started``
        is the call's arrival (``perf_counter_ns``; 0: now, read only when recording). Returns what ran (rank 0's
        pick, when the ranks' ``auto`` picks differ)."""
        transport = self.transport
        recorder = transport.recorder
        recording = recorder.enabled
        seq = self._seq
        self._seq = seq + 1
        if recording:
            recorder.begin(seq, started or time.perf_counter_ns(), flat.nbytes)
        reducer = _REDUCERS[op or "sum"]
        run, descriptor = prepared.run, prepared.descriptor
        try:
            if prepared.small and flat.nbytes <= self._small_bytes(seq):
                deadline = time.monotonic() + timeout_s
                call: Call = _new_tuple(Call, (run.plan, flat, reducer, seq, deadline, timeout_s, False))
                descriptors = transport.run_small(call, descriptor)
            else:
                if self._head_start is not None:
                    self._head_start(seq, flat, checksum=checksum)
                descriptors = transport.agree(seq, descriptor, timeout_s=timeout_s)
                if all(d == descriptor for d in descriptors):
                    transport.execute(run.plan, flat, reducer, seq=seq, timeout_s=timeout_s, checksum=checksum)
                    descriptors = None
            if descriptors is not None:
                check_agreement(self._group.rank, seq, descriptors)
                # equal but for the algorithm auto picked (another cost model): every rank runs rank 0's pick
                run = self.runs.registered(
                    prepared.collective, prepared.kind, proposal_of(descriptors[0]), root=prepared.root,
                    segments=prepared.segments, count=prepared.elements,
                )  # fmt: skip
                transport.execute(run.plan, flat, reducer, seq=seq, timeout_s=timeout_s, checksum=checksum)
        except BaseException:
            if recording:
                recorder.void()
            raise
        if op == "avg":
            np.divide(flat, self._group.world_size, out=flat, casting="unsafe")
        if recording:
            recorder.end()
        self.completed = seq + 1
        return run

    def _result(self, prepared: Prepared, buf: Buffer) -> Any:
        """What the collective returns (its buffer, or reduce_scatter's and scatter's block), written back if it was
        copied."""
        buf.write_back()
        if prepared.collective is Collective.REDUCE_SCATTER or prepared.collective is Collective.SCATTER:
            bounds = block_bounds(prepared.elements, self._group.world_size)
            rank = self._group.rank
            return buf.block(int(bounds[rank]), int(bounds[rank + 1]))
        return buf.original

    def _prepare_plain(self, x: npt.NDArray[Any], op: str) -> _Plain | None:
        """The prepared forms of ``all_reduce(x, op)`` (cached), or None if the plain entry cannot take it; the
        general path's errors for a bad ``op`` or dtype."""
        if op not in OPS:
            raise ValueError(f"op: unknown reduction {op!r}; choose one of {', '.join(OPS)}")
        dtype = check_dtype(x.dtype, "all_reduce(x)")
        if op == "avg" and dtype.kind in "iu":
            raise TypeError(f"op: avg is not defined for integer dtype {dtype}; use sum and divide yourself")
        if dtype not in DTYPE_CODES:
            return None
        prepared, fused = (
            self.prepare(
                _ALL_REDUCE, dtype, x.size, op, "auto", root=0, segments=1, flags=0, tag=NO_TAG, buffer=None,
                fused=fused,
            )
            for fused in (False, True)
        )  # fmt: skip
        if len(self._plain) >= PLAIN_CALLS:
            self._plain.clear()
        plain = self._plain[dtype, x.size, op] = _Plain(
            self._group.cost_model, prepared, None if fused.descriptor == prepared.descriptor else fused
        )
        return plain

    def _agree(self, seq: int, descriptor: bytes, timeout: float) -> list[bytes]:
        """Every rank's descriptor; :class:`MismatchError` naming the first field on which the calls differ."""
        descriptors = self.transport.agree(seq, descriptor, timeout_s=timeout)
        check_agreement(self._group.rank, seq, descriptors)
        self.completed = seq + 1
        return descriptors

    def _take_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _log(self, collective: Collective, schedule: Schedule, size_bytes: int, started: int, seq: int) -> None:
        seconds = (time.perf_counter_ns() - started) * 1e-9
        caller_bytes = float(size_bytes) * schedule.buffer_blocks / schedule.num_blocks  # all-to-all: a row
        predicted = predict(schedule, caller_bytes, self._group.cost_model).seconds
        print(
            f"[allreduce rank {self._group.rank}] seq={seq} {collective.value} {size_bytes} B "
            f"algorithm={schedule.name} predicted={predicted * 1e6:.1f}us measured={seconds * 1e6:.1f}us",
            file=sys.stderr,
            flush=True,
        )


def _yes(_: object) -> bool:
    return True


def checked_timeout(timeout_s: float) -> float:
    """``timeout_s`` as a float, or ``ValueError`` if it is not a positive number of seconds."""
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
    return float(timeout_s)


def check_options(collective: Collective, options: Mapping[str, Any]) -> Options:
    """The keyword options of a collective as :class:`Options`; ``TypeError`` naming one it does not take."""
    allowed = _OPTIONS if collective in DETERMINISTIC else _NOT_REDUCING
    for name in options:
        if name not in allowed:
            raise TypeError(f"{collective.value}() got an unexpected keyword argument {name!r}")
    return Options(**options)
