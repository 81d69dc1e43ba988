"""``dist.init_process_group("allreduce", ...)``: allreduce as a torch.distributed backend.

Importing :mod:`allreduce.torch` registers the backend. torch hands the backend factory a store of the group's
own (its rendezvous store, already connected and agreed by every rank, under a prefix that names the group);
rank 0 publishes there the port of allreduce's own store (bound to a port the kernel picked), and every rank then
joins an allreduce process group (shared memory when all ranks share the host, TCP otherwise) with
:func:`allreduce.runtime.init`. Nothing depends on the launcher: torchrun, ``allreduce run`` and variables set
by hand all reach the backend through torch's store.
``dist.all_reduce / broadcast / reduce / all_gather / all_gather_into_tensor / reduce_scatter /
reduce_scatter_tensor / gather / scatter / all_to_all / all_to_all_single / barrier`` then run allreduce's schedules
on CPU tensors; ``dist.send / recv / isend / irecv / batch_isend_irecv``
the group's point-to-point channels (:mod:`allreduce.runtime.p2p`).

This relies on torch letting Python code implement a backend (``dist.Backend.register_backend`` and
``_create_work_from_future``), which torch has had since 2.2; older versions get a clear error.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import importlib
import os
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

import torch
from allreduce.runtime import CollectiveError
from allreduce.torch._reductions import as_runtime_dtype, reduction
from allreduce.torch._work import BackendWork, torch_error

__all__ = ["BACKEND_NAME", "TRANSPORT_ENV", "register_backend"]

BACKEND_NAME = "allreduce"
_MIN_TORCH = "2.2"
# Where rank 0 publishes the port of allreduce's store, in the store torch gives one process group.
_PORT_KEY = "allreduce/store_port"
TRANSPORT_ENV = "ALLREDUCE_TRANSPORT"
"""The transport of every ``"allreduce"`` process group: ``auto`` (default: shm when every rank shares the host,
else tcp), ``shm`` or ``tcp``."""

_create_work_from_future: Any = getattr(torch._C._distributed_c10d, "_create_work_from_future", None)
# Typed as Any: the backend implements the list-of-tensors calling convention torch uses for Python backends,
# not every overload of the typed ProcessGroup.
_ProcessGroupBase: Any = dist.ProcessGroup


def _check_cpu(tensors: Sequence[torch.Tensor], what: str) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"the allreduce backend moves CPU tensors; {what} got a tensor on {t.device}")
        if t.layout != torch.strided:
            raise ValueError(
                f"the allreduce backend moves dense tensors; {what} got a {t.layout} tensor (Gloo's all_reduce "
                "takes sparse COO tensors: reduce those on a Gloo group, or call .to_dense() first)"
            )


def _reduce_op_of(opts: Any) -> Any:
    return opts.reduceOp if opts is not None else dist.ReduceOp.SUM


def _root_of(opts: Any) -> int:
    return int(opts.rootRank) if opts is not None else 0


def _reported(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A backend method for torch's ``what``: its synchronous failures reach torch as :func:`torch_error` makes
    them, and under torch.profiler the call is a ``record_function`` (``allreduce.<what>``, with the bytes, the
    algorithm for the first tensor and the number of ranks) that ends when the work completes."""

    def decorate(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(self: _AllreduceBackend, *args: Any, **kwargs: Any) -> Any:
            record = _profiled(self, what, [*args, *kwargs.values()]) if _profiler_enabled() else None
            try:
                work = method(self, *args, **kwargs)
            except CollectiveError as exc:
                error = torch_error(exc)
                if record is not None:
                    record.__exit__(None, None, None)
                if error is exc:
                    raise
                raise error from exc
            if record is not None:
                work.end_record(record)
            return work

        return call

    return decorate


def _profiler_enabled() -> bool:
    return bool(torch.autograd.profiler._is_profiler_enabled)


def _tensors_in(args: Sequence[Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            found.append(arg)
        elif isinstance(arg, list | tuple):
            found.extend(_tensors_in(arg))
    return found


def _profiled(backend: _AllreduceBackend, what: str, args: Sequence[Any]) -> Any:
    tensors = _tensors_in(args)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    algorithm = "-"
    collective = _COLLECTIVE_OF.get(what)
    if collective is not None and tensors:
        with contextlib.suppress(Exception):  # a dtype the runtime does not take: the call itself will say so
            first = as_runtime_dtype(tensors[0])
            algorithm = backend.allreduce_group.choose_algorithm(first.numel(), first.numpy().dtype, collective)
    label = f"allreduce.{what} {nbytes} B {algorithm} {backend.allreduce_group.world_size} ranks"
    record: Any = torch.autograd.profiler.record_function(label)
    record.__enter__()
    return record


_COLLECTIVE_OF = {
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
}


class _AllreduceBackend(_ProcessGroupBase):  # type: ignore[misc]
    """A torch.distributed backend whose collectives are an allreduce process group's.

    Every collective returns a :class:`BackendWork`: ``wait()`` raises the collective's error, and the future DDP
    reads fails with it. Tensors are handed to the group as they are (numpy views of CPU tensors); results that
    need copying out are copied on the group's worker before the work completes. torch calls these methods by
    name from Python (``dist.*``); from C++ (DDP's reducer, functional collectives) it reaches only those its
    Python-backend trampoline forwards (docs/torch.md lists them).
    """

    def __init__(self, group: Any) -> None:
        super().__init__(group.rank, group.world_size)
        self._group = group
        self._group_name = ""
        self._group_desc = ""
        _LIVE_GROUPS.append(group)

    @property
    def allreduce_group(self) -> Any:
        """The allreduce :class:`~allreduce.runtime.ProcessGroup` whose collectives this backend runs."""
        return self._group

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # torch keeps a Python process group's name and description in the object itself (a C++ one keeps them in
    # its backends, which this one has none of): torch sets them once, and DeviceMesh and destroy_process_group
    # look the group up by its name.
    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    # ------------------------------------------------------------------------------------------------
    # The verbs every operation is made of
    # ------------------------------------------------------------------------------------------------
    def _start_all_reduce(self, tensor: torch.Tensor, reduce_op: Any, what: str) -> tuple[Any, Callable[[], Any]]:
        """Start reducing ``tensor`` in place: the group's work, and what finishes the result once it is done."""
        plan = reduction(tensor, reduce_op, what)
        if plan.op is not None:
            return self._group.all_reduce(plan.buffer, op=plan.op, async_op=True), plan.finish
        flat = torch.empty(tensor.numel() * self._group.world_size, dtype=tensor.dtype)
        work = self._start_all_gather(flat, plan.buffer)
        return work, lambda: plan.finish(flat)

    def _start_all_gather(self, flat: torch.Tensor, local: torch.Tensor) -> Any:
        """Start gathering every rank's ``local`` into ``flat`` (contiguous, N blocks of ``local.numel()`` in rank
        order): the group's work."""
        n = local.numel()
        flat[self._group.rank * n : (self._group.rank + 1) * n] = local.reshape(-1)
        return self._group.all_gather(as_runtime_dtype(flat), async_op=True)

    def _gathered(self, output: torch.Tensor, local: torch.Tensor) -> tuple[Any, Callable[[], Any]]:
        """Start the all-gather of ``local`` into ``output``; with what copies the result in once done (nothing
        when ``output`` is contiguous: the gather runs in it)."""
        if output.is_contiguous():
            return self._start_all_gather(output.view(-1), local), lambda: None
        flat = torch.empty(output.numel(), dtype=local.dtype)
        return self._start_all_gather(flat, local), lambda: output.copy_(flat.view(output.shape))

    def _work(self, works: Sequence[Any], finish: Callable[[], Any], value: Any, what: str) -> BackendWork:
        def complete() -> Any:
            finish()
            return value

        return BackendWork(works, complete, what)

    # ------------------------------------------------------------------------------------------------
    # Reductions
    # ------------------------------------------------------------------------------------------------
    @_reported("all_reduce")
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        _check_cpu(tensors, "all_reduce")
        started = [self._start_all_reduce(t, _reduce_op_of(opts), "all_reduce") for t in tensors]
        return self._work([w for w, _ in started], lambda: [f() for _, f in started], tensors, "all_reduce")

    @_reported("all_reduce_coalesced")
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        _check_cpu(tensors, "all_reduce_coalesced")
        started = [self._start_all_reduce(t, _reduce_op_of(opts), "all_reduce_coalesced") for t in tensors]
        return self._work([w for w, _ in started], lambda: [f() for _, f in started], tensors, "all_reduce_coalesced")

    @_reported("reduce")
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        _check_cpu(tensors, "reduce")
        root = _root_of(opts)
        works, finishes = [], []
        for t in tensors:
            plan = reduction(t, _reduce_op_of(opts), "reduce")
            if not plan.direct:
                work, finish = self._start_all_reduce(t, _reduce_op_of(opts), "reduce")
            else:
                work, finish = self._group.reduce(plan.buffer, root, op=plan.op, async_op=True), plan.finish
            works.append(work)
            finishes.append(finish)
        return self._work(works, lambda: [f() for f in finishes], tensors, "reduce")

    def _start_reduce_scatter(
        self, output: torch.Tensor, flat: torch.Tensor, reduce_op: Any, what: str
    ) -> tuple[Any, Callable[[], Any]]:
        """Start reducing ``flat`` (N blocks of ``output.numel()``) over the ranks into ``output``, this rank's
        block."""
        plan = reduction(flat, reduce_op, what)
        if plan.direct:
            work = self._group.reduce_scatter(plan.buffer, op=plan.op, async_op=True)
            target = output.view(plan.buffer.dtype) if output.dtype != plan.buffer.dtype else output
            return work, lambda: target.copy_(torch.as_tensor(work.wait()).view(output.shape))
        # Ops the runtime reduces through a copy or a gather: reduce all of flat, keep this rank's block.
        work, finish = self._start_all_reduce(flat, reduce_op, what)
        n, rank = output.numel(), self._group.rank

        def keep_block() -> None:
            finish()
            output.copy_(flat[rank * n : (rank + 1) * n].view(output.shape))

        return work, keep_block

    @_reported("reduce_scatter")
    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        _check_cpu(output_tensors, "reduce_scatter")
        started = [
            self._start_reduce_scatter(
                out, torch.cat([t.reshape(-1) for t in inputs]), _reduce_op_of(opts), "reduce_scatter"
            )
            for out, inputs in zip(output_tensors, input_lists, strict=True)
        ]
        return self._work([w for w, _ in started], lambda: [f() for _, f in started], output_tensors, "reduce_scatter")

    @_reported("reduce_scatter_tensor")
    def _reduce_scatter_base(self, output: torch.Tensor, local: torch.Tensor, opts: Any = None) -> Any:
        _check_cpu([output, local], "reduce_scatter_tensor")
        work, finish = self._start_reduce_scatter(
            output, local.reshape(-1).clone(), _reduce_op_of(opts), "reduce_scatter_tensor"
        )
        return self._work([work], finish, [output], "reduce_scatter_tensor")

    # torch >= 2.10 routes reduce_scatter_tensor through this name.
    reduce_scatter_single = _reduce_scatter_base

    @_reported("reduce_scatter_tensor_coalesced")
    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        _check_cpu([*outputs, *inputs], "reduce_scatter_tensor_coalesced")
        started = [
            self._start_reduce_scatter(out, local.reshape(-1).clone(), _reduce_op_of(opts), "reduce_scatter")
            for out, local in zip(outputs, inputs, strict=True)
        ]
        return self._work([w for w, _ in started], lambda: [f() for _, f in started], outputs, "reduce_scatter")

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # ------------------------------------------------------------------------------------------------
    # Copies
    # ------------------------------------------------------------------------------------------------
    @_reported("broadcast")
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        _check_cpu(tensors, "broadcast")
        root = _root_of(opts)
        works = [self._group.broadcast(as_runtime_dtype(t), root, async_op=True) for t in tensors]
        return self._work(works, _NOTHING, tensors, "broadcast")

    def _all_gather_lists(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], what: str
    ) -> BackendWork:
        _check_cpu(input_tensors, what)
        works, copies = [], []
        for outputs, local in zip(output_tensors, input_tensors, strict=True):
            flat = torch.empty(local.numel() * len(outputs), dtype=local.dtype)
            works.append(self._start_all_gather(flat, local))
            copies.append((flat, outputs, local.numel()))

        def copy_out() -> None:
            for flat, outputs, n in copies:
                for r, out in enumerate(outputs):
                    out.copy_(flat[r * n : (r + 1) * n].view(out.shape))

        return self._work(works, copy_out, output_tensors, what)

    @_reported("all_gather")
    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self._all_gather_lists(output_tensors, input_tensors, "all_gather")

    @_reported("all_gather_coalesced")
    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> Any:
        # output_lists[r][i] receives rank r's input_tensors[i] (one list per rank, unlike all_gather's one list
        # per input): the inputs travel as one block per rank, in one all-gather.
        what = "all_gather_coalesced"
        _check_cpu(input_tensors, what)
        world_size = self._group.world_size
        if len(output_lists) != world_size or any(len(outs) != len(input_tensors) for outs in output_lists):
            raise ValueError(
                f"{what}: output_tensor_lists must hold {world_size} lists (one per rank) of "
                f"{len(input_tensors)} tensors (one per input); got lengths {[len(outs) for outs in output_lists]}"
            )
        local = torch.cat([t.reshape(-1) for t in input_tensors])
        flat = torch.empty(local.numel() * world_size, dtype=local.dtype)
        work = self._start_all_gather(flat, local)

        def copy_out() -> None:
            blocks = flat.view(world_size, -1)
            for r, outputs in enumerate(output_lists):
                offset = 0
                for out in outputs:
                    out.copy_(blocks[r, offset : offset + out.numel()].view(out.shape))
                    offset += out.numel()

        return self._work([work], copy_out, output_lists, what)

    @_reported("all_gather_into_tensor")
    def _allgather_base(self, output: torch.Tensor, local: torch.Tensor, opts: Any = None) -> Any:
        _check_cpu([output, local], "all_gather_into_tensor")
        work, copy = self._gathered(output, local)
        return self._work([work], copy, [output], "all_gather_into_tensor")

    # torch >= 2.10 routes all_gather_into_tensor through this name.
    all_gather_single = _allgather_base

    @_reported("all_gather_into_tensor_coalesced")
    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        _check_cpu([*outputs, *inputs], "all_gather_into_tensor_coalesced")
        started = [self._gathered(out, local) for out, local in zip(outputs, inputs, strict=True)]
        return self._work([w for w, _ in started], lambda: [f() for _, f in started], outputs, "all_gather")

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    @_reported("gather")
    def gather(
        self, output_lists: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> Any:
        # The group's gather: block r of a buffer of N blocks from rank r, into the root's.
        _check_cpu(input_tensors, "gather")
        root, rank, world_size = _root_of(opts), self._group.rank, self._group.world_size
        works, copies = [], []
        for i, local in enumerate(input_tensors):
            n = local.numel()
            flat = torch.empty(n * world_size, dtype=local.dtype)
            flat[rank * n : (rank + 1) * n] = local.reshape(-1)
            works.append(self._group.gather(as_runtime_dtype(flat), root, async_op=True))
            copies.append((flat, output_lists[i] if rank == root else [], n))

        def copy_out() -> None:
            for flat, outputs, n in copies:
                for r, out in enumerate(outputs):
                    out.copy_(flat[r * n : (r + 1) * n].view(out.shape))

        return self._work(works, copy_out, output_lists, "gather")

    @_reported("scatter")
    def scatter(
        self, output_tensors: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        # The group's scatter: block r of the root's buffer of N blocks to rank r.
        _check_cpu(output_tensors, "scatter")
        root, rank, world_size = _root_of(opts), self._group.rank, self._group.world_size
        works, copies = [], []
        for i, out in enumerate(output_tensors):
            n = out.numel()
            flat = torch.empty(n * world_size, dtype=out.dtype)
            if rank == root:
                for r, block in enumerate(input_lists[i]):
                    flat[r * n : (r + 1) * n] = block.reshape(-1)
            works.append(self._group.scatter(as_runtime_dtype(flat), root, async_op=True))
            copies.append((flat, out, n))

        def copy_out() -> None:
            for flat, out, n in copies:
                out.copy_(flat[rank * n : (rank + 1) * n].view(out.shape))

        return self._work(works, copy_out, output_tensors, "scatter")

    def _start_all_to_all(
        self, out: torch.Tensor, local: torch.Tensor, splits: tuple[list[int], list[int]] | None
    ) -> Any:
        """Start the group's all-to-all of ``local`` into ``out`` (both flat and contiguous); ``splits`` (elements
        sent to, received from each rank) None for equal parts, which need no exchange of sizes."""
        if out.dtype != local.dtype:
            raise TypeError(f"all_to_all: the output is {out.dtype}, the input {local.dtype}; they must match")
        ins, outs = splits if splits is not None else (None, None)
        if splits is not None and local.dtype.is_complex:  # moved as (real, imaginary) pairs
            ins, outs = [2 * k for k in splits[0]], [2 * k for k in splits[1]]
        return self._group.all_to_all(
            as_runtime_dtype(local), as_runtime_dtype(out), async_op=True, input_splits=ins, output_splits=outs
        )

    @_reported("all_to_all_single")
    def alltoall_base(
        self,
        output: torch.Tensor,
        local: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Any:
        # The group's all-to-all; without split sizes, N equal parts and no exchange of sizes.
        _check_cpu([output, local], "all_to_all_single")
        world_size = self._group.world_size
        splits = None
        if input_split_sizes or output_split_sizes:
            row_in = local[0].numel() if local.dim() and local.size(0) else 1
            row_out = output[0].numel() if output.dim() and output.size(0) else 1
            in_rows = list(input_split_sizes) or [local.size(0) // world_size] * world_size
            out_rows = list(output_split_sizes) or [output.size(0) // world_size] * world_size
            splits = ([rows * row_in for rows in in_rows], [rows * row_out for rows in out_rows])
        target = output if output.is_contiguous() else torch.empty_like(output)
        work = self._start_all_to_all(target.view(-1), local.contiguous().view(-1), splits)

        def finish() -> None:
            if target is not output:
                output.copy_(target)

        return self._work([work], finish, [output], "all_to_all_single")

    all_to_all_single = alltoall_base

    @_reported("all_to_all")
    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        # The group's all-to-all of the inputs laid end to end, whose sizes may differ: sizes exchanged first.
        _check_cpu([*outputs, *inputs], "all_to_all")
        local = torch.cat([t.reshape(-1) for t in inputs]) if inputs else torch.empty(0)
        received = torch.empty(sum(t.numel() for t in outputs), dtype=local.dtype)
        splits = ([t.numel() for t in inputs], [t.numel() for t in outputs])
        work = self._start_all_to_all(received, local, splits)

        def copy_out() -> None:
            offset = 0
            for t in outputs:
                t.copy_(received[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()

        return self._work([work], copy_out, outputs, "all_to_all")

    @_reported("barrier")
    def barrier(self, opts: Any = None) -> Any:
        self._group.barrier()
        return self._work([], _NOTHING, [], "barrier")

    # ------------------------------------------------------------------------------------------------
    # Point-to-point: the group's channels between two ranks (allreduce.runtime.p2p)
    # ------------------------------------------------------------------------------------------------
    @_reported("send")
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        _check_cpu(tensors, "send")
        works = [self._group.isend(t, dst, tag) for t in tensors]
        return self._work(works, _NOTHING, tensors, f"send to rank {dst} (tag {tag})")

    @_reported("recv")
    def recv(self, tensors: list[torch.Tensor], src: int | None, tag: int) -> Any:
        _check_cpu(tensors, "recv")
        works = [self._group.irecv(t, src, tag) for t in tensors]
        whence = "any rank" if src is None else f"rank {src}"
        # torch asks a receive from any rank who sent (work._source_rank()): the first message's sender.
        return BackendWork(works, lambda: tensors, f"recv from {whence} (tag {tag})", source=works[0].wait)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        return self.recv(tensors, None, tag)

    recvAnysource = recv_anysource

    def shutdown(self) -> None:
        self._group.close()
        with contextlib.suppress(ValueError):
            _LIVE_GROUPS.remove(self._group)


def _nothing() -> None:
    return None


_NOTHING = _nothing


_HOOK_GROUPS: weakref.WeakSet[Any] = weakref.WeakSet()
"""The allreduce groups :func:`allreduce.torch.comm_hook` has run on (closed at exit too: see _close_at_exit)."""

_LIVE_GROUPS: list[Any] = []
"""The allreduce groups behind this process's open ``"allreduce"`` torch process groups (for :func:`hand_over`)."""


def _close_at_exit() -> None:
    """Close the groups behind this process's open ``"allreduce"`` process groups before the interpreter
    finalizes (a script need not call ``destroy_process_group``).

    A group's worker thread completes torch's futures: torch wakes whoever waits on one (DDP's reducer) inside
    that completion, while the worker is still in torch's C++ frames, about to take the GIL back. If the waiter
    then ends the script, the worker takes the GIL during finalization, Python ends the thread with
    pthread_exit, and its unwinding through a noexcept C++ frame aborts the process ("terminate called without
    an active exception"). Closing joins the worker while the interpreter is whole (after what is pending, each
    collective bounded by its timeout)."""
    for group in [*_LIVE_GROUPS, *_HOOK_GROUPS]:
        try:
            group.close()
        except Exception as exc:  # the process is exiting: say so, and close the others
            print(f"allreduce: closing {group!r} at exit: {exc!r}", file=sys.stderr)


def hand_over(thread: threading.Thread) -> None:
    """Let ``thread`` run the collectives of every open ``"allreduce"`` torch process group of this process (each
    is bound to the thread that created it; see :meth:`allreduce.runtime.ProcessGroup.hand_over`). Call it on
    every rank, from the thread that ran ``init_process_group``; the groups come back when ``thread`` ends."""
    for group in _LIVE_GROUPS:
        if not group.closed:
            group.hand_over(thread)


def _create_backend(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> _AllreduceBackend:
    from allreduce.runtime import init

    # The first collective of each size picks its algorithm with the cost model, whose np.unique imports
    # numpy.ma on first use: an import on the caller's thread, contending with the group's worker for the GIL,
    # blocked the first async 16 MiB all_reduce 320-400 ms (20-30 ms when done here; load 18-24). Done while
    # init_process_group waits anyway.
    importlib.import_module("numpy.ma")

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    transport = os.environ.get(TRANSPORT_ENV, "auto")
    if transport not in ("auto", "shm", "tcp"):
        raise ValueError(f"{TRANSPORT_ENV}={transport!r}: the allreduce backend's transport is auto, shm or tcp")
    # Rank 0 hosts allreduce's store on a port the kernel picks and publishes it through torch's store (one per
    # process group, given only to its members), under a key of the backend's own, so no port is guessed, none
    # of the launcher's is reused, and no count of this process's other groups enters the key.
    group = init(
        rank,
        world_size,
        master_addr=host,
        transport=transport,
        timeout_s=timeout.total_seconds(),
        rendezvous_store=store,
        rendezvous_key=_PORT_KEY,
    )
    return _AllreduceBackend(group)


def register_backend() -> None:
    """Make ``dist.init_process_group("allreduce", ...)`` available (done on ``import allreduce.torch``)."""
    if _create_work_from_future is None or not hasattr(dist.Backend, "register_backend"):
        raise RuntimeError(
            f"the allreduce torch.distributed backend needs torch >= {_MIN_TORCH} (Python backends); "
            f"this is torch {torch.__version__}"
        )
    if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, devices=["cpu"])
    atexit.register(_close_at_exit)
