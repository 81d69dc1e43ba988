"""The group's path for plain calls: ``all_reduce(x)`` of a C-contiguous numpy array or CPU torch tensor with every
other argument at its default, the call a training loop repeats.

Such calls repeat with the same dtype, size and op, so everything per-call constant is looked up once: the checked
arguments, the algorithm ``auto`` picks, its plan and the descriptor. A call then takes its sequence number, writes
the recorder's entry and hands the buffer to the transport: a small one to
:meth:`~allreduce.runtime.Transport.run_small` (when the transport has it), which does what ``prepare``, ``agree``
and ``execute`` do in one pass, on the same words in the same order (peers on the general path pair with it); any
other to ``prepare``, ``agree`` and ``execute`` themselves, as the general path calls them. Every reliability
property stays: a mismatch raises :class:`MismatchError` before any data moves, a dead or stalled peer is named by
the same waits.

Anything else takes the general path (:meth:`ProcessGroup._collective`) with nothing consumed: tensors off the CPU,
strided or read-only arrays, ``async_op``, a ``timeout_s``, ``checksum``, ``deterministic``, ``segments``, ``tag``,
a call made while asynchronous ones are pending, fault injection and ``ALLREDUCE_DEBUG``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt

from allreduce.runtime._buffers import check_dtype, is_torch, torch_to_numpy
from allreduce.runtime._descriptor import (
    DESCRIPTOR,
    DTYPE_CODES,
    KIND_CODES,
    NO_TAG,
    OP_CODES,
    OPS,
    check_agreement,
    proposal_of,
)
from allreduce.runtime._runs import Run
from allreduce.runtime._stats import SPILL_ENTRIES
from allreduce.runtime._transport import ReduceInto
from allreduce.schedules import Collective, CostModel

if TYPE_CHECKING:
    from allreduce.runtime._group import ProcessGroup

__all__ = ["PLAIN_CALLS", "PlainCalls"]

PLAIN_CALLS = 256
"""Per-call constants kept (one entry per dtype, size and op); all dropped when full (a training loop uses a few)."""

_ALL_REDUCE = Collective.ALL_REDUCE
_KIND = KIND_CODES[Collective.ALL_REDUCE]


class _Call(NamedTuple):
    """What ``all_reduce(x, op)`` of one dtype, size and op sends and runs."""

    model: CostModel  # the cost model whose pick ``run`` is (a group's model may be replaced)
    run: Run
    descriptor: bytes
    fused_run: Run | None  # auto's pick for a buffer the transport fuses, when it differs (see Runs.resolve)
    fused_descriptor: bytes


class PlainCalls:
    """The plain-call path of one group."""

    def __init__(self, group: ProcessGroup, reducers: Mapping[str, ReduceInto], requested_auto: bytes) -> None:
        transport = group.transport
        self._group = group
        self._transport = transport
        self._small_bytes: Callable[[int], int] = transport.small_bytes  # 0 where the transport has no run_small
        self._reducers = reducers
        self._requested_auto = requested_auto
        self._calls: dict[tuple[np.dtype[Any], int, str], _Call] = {}

    def run(self, x: Any, op: str) -> bool:
        """``all_reduce(x, op)`` of a numpy array or a CPU torch tensor (reduced through its numpy view, which
        shares its memory): True when done; False, with nothing consumed, for the general path."""
        group = self._group
        if x.__class__ is not np.ndarray:
            if not is_torch(x) or x.device.type != "cpu":
                return False
            x = torch_to_numpy(x, "all_reduce(x)")
        if group._closed or group._debug or not x.size:
            return False
        flags = x.flags
        if not (flags.c_contiguous and flags.writeable) or self._transport.injection is not None:
            return False
        group._owner.check(group.rank, "all_reduce(x)")
        call = self._calls.get((x.dtype, x.size, op))
        if call is None or call.model is not group.cost_model:
            call = self._call(x, op)
            if call is None:
                return False
        if not group._executor.enter():  # asynchronous collectives are pending: they run first, in call order
            return False
        try:
            flat = x if x.ndim == 1 else x.reshape(-1)
            if call.fused_run is not None and group._fuses(flat):
                self._run(flat, op, call.fused_run, call.fused_descriptor)
            else:
                self._run(flat, op, call.run, call.descriptor)
        finally:
            group._executor.leave()
        return True

    def _call(self, x: npt.NDArray[Any], op: str) -> _Call | None:
        """The per-call constants of ``all_reduce(x, op)`` (cached), or None if this path cannot take it; the
        general path's errors for a bad ``op`` or dtype."""
        if op not in OPS:
            raise ValueError(f"op: unknown reduction {op!r}; choose one of {', '.join(OPS)}")
        dtype = check_dtype(x.dtype, "all_reduce(x)")
        if op == "avg" and dtype.kind in "iu":
            raise TypeError(f"op: avg is not defined for integer dtype {dtype}; use sum and divide yourself")
        if dtype not in DTYPE_CODES:
            return None
        group, count = self._group, x.size
        runs = group._runs
        plain = runs.resolve(_ALL_REDUCE, "auto", count, dtype.itemsize, deterministic=False)
        fused = runs.resolve(_ALL_REDUCE, "auto", count, dtype.itemsize, False, fuses=lambda _: True, buffer=None)

        def constants(name: str) -> tuple[Run, bytes]:
            run = runs.registered(_ALL_REDUCE, _KIND, name, root=0, segments=1, count=count)
            descriptor = DESCRIPTOR.pack(
                _KIND, DTYPE_CODES[dtype], OP_CODES[op], 0, 0, count, 1, group.group_size, self._requested_auto,
                run.digest, NO_TAG, run.name,
            )  # fmt: skip
            return run, descriptor

        run, descriptor = constants(plain)
        fused_run, fused_descriptor = constants(fused) if fused != plain else (None, b"")
        if len(self._calls) >= PLAIN_CALLS:
            self._calls.clear()
        call = self._calls[dtype, count, op] = _Call(group.cost_model, run, descriptor, fused_run, fused_descriptor)
        return call

    def _run(self, flat: npt.NDArray[Any], op: str, run: Run, descriptor: bytes) -> None:
        """One call: the recorder's entry, the transport's calls, then what the group does after the agreement
        (a mismatch raised, rank 0's plan run when the ranks' automatic picks differ) and the steps (avg's
        division)."""
        group, transport = self._group, self._transport
        recorder = transport.recorder
        recording = recorder.enabled
        if recording:  # Recorder.begin, inline (as on the general path)
            started = time.perf_counter_ns()
            seq = group._take_seq()
            log = recorder.log
            if len(log) >= SPILL_ENTRIES:
                recorder.flush()
                log = recorder.log
            log.append(~seq)
            log.append(started)
            log.append(flat.nbytes)
        else:
            seq = group._take_seq()
        reducer = self._reducers[op]
        timeout_s = group.timeout_s
        try:
            if flat.nbytes <= self._small_bytes(seq):
                descriptors = transport.run_small(seq, flat, descriptor, run.plan, reducer, timeout_s=timeout_s)
            else:
                if group._prepare is not None:
                    group._prepare(seq, flat, checksum=False)
                descriptors = transport.agree(seq, descriptor, timeout_s=timeout_s)
                if all(d == descriptor for d in descriptors):
                    transport.execute(run.plan, flat, reducer, seq=seq, timeout_s=timeout_s, checksum=False)
                    descriptors = None
            if descriptors is not None:
                check_agreement(group.rank, seq, descriptors)
                # equal but for the algorithm auto picked (another cost model): every rank runs rank 0's pick
                chosen = group._runs.registered(
                    _ALL_REDUCE, _KIND, proposal_of(descriptors[0]), root=0, segments=1, count=flat.size
                )
                transport.execute(chosen.plan, flat, reducer, seq=seq, timeout_s=timeout_s, checksum=False)
        except BaseException:
            if recording:
                recorder.void()
            raise
        if op == "avg":
            np.divide(flat, group.world_size, out=flat, casting="unsafe")
        if recording:
            log.append(time.perf_counter_ns())  # Recorder.end
