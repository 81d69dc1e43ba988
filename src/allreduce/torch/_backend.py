"""``dist.init_process_group("allreduce", ...)``: allreduce as a torch.distributed backend.

Importing :mod:`allreduce.torch` registers the backend. torch hands the backend factory a store of the group's
own (its rendezvous store, already connected and agreed by every rank, under a prefix that names the group);
rank 0 publishes there the port of allreduce's own store (bound to a port the kernel picked), and every rank then
joins an allreduce process group (shared memory when all ranks share the host, TCP otherwise) with
:func:`allreduce.runtime.init`. Nothing depends on the launcher: torchrun, ``allreduce run`` and variables set
by hand all reach the backend through torch's store.
``dist.all_reduce / broadcast / all_gather / all_gather_into_tensor / reduce_scatter / reduce_scatter_tensor /
barrier`` then run allreduce's schedules on CPU tensors.

This relies on torch letting Python code implement a backend (``dist.Backend.register_backend`` and
``_create_work_from_future``), which torch has had since 2.2; older versions get a clear error.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

import torch
from allreduce.runtime import CollectiveError
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


def _reduce_op(op: Any) -> str:
    names = {
        dist.ReduceOp.SUM: "sum",
        dist.ReduceOp.AVG: "avg",
        dist.ReduceOp.PRODUCT: "prod",
        dist.ReduceOp.MIN: "min",
        dist.ReduceOp.MAX: "max",
    }
    for known, name in names.items():
        if op == known:
            return name
    raise ValueError(f"the allreduce backend reduces with SUM, AVG, PRODUCT, MIN or MAX, not {op}")


def _check_cpu(tensors: Sequence[torch.Tensor], what: str) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"the allreduce backend moves CPU tensors; {what} got a tensor on {t.device}")


def _reported(method: Callable[..., Any]) -> Callable[..., Any]:
    """A backend method whose synchronous failures reach torch as :func:`torch_error` makes them."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except CollectiveError as exc:
            error = torch_error(exc)
            if error is exc:
                raise
            raise error from exc

    return call


class _AllreduceBackend(_ProcessGroupBase):  # type: ignore[misc]
    """A torch.distributed backend whose collectives are an allreduce process group's.

    Every collective returns a :class:`BackendWork`: ``wait()`` raises the collective's error, and the future DDP
    reads fails with it. Tensors are handed to the group as they are (numpy views of CPU tensors); results that
    need copying out are copied on the group's worker before the work completes.
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

    def _work(self, works: Sequence[Any], value: Callable[[], Any], description: str) -> BackendWork:
        return BackendWork(works, value, description)

    @_reported
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = _reduce_op(opts.reduceOp) if opts is not None else "sum"
        _check_cpu(tensors, "all_reduce")
        works = [self._group.all_reduce(t, op=op, async_op=True) for t in tensors]
        return self._work(works, lambda: tensors, "all_reduce")

    @_reported
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = int(opts.rootRank) if opts is not None else 0
        _check_cpu(tensors, "broadcast")
        works = [self._group.broadcast(t, root, async_op=True) for t in tensors]
        return self._work(works, lambda: tensors, "broadcast")

    def _gather_flat(self, output: torch.Tensor, local: torch.Tensor) -> tuple[Any, Callable[[], Any]]:
        """Start the all-gather of ``local`` into ``output`` (N blocks of ``local.numel()``, in rank order): the
        group's work and what copies the result into ``output`` once it has finished (nothing when ``output`` is
        contiguous: the gather runs in it)."""
        n = local.numel()
        flat = output.view(-1) if output.is_contiguous() else torch.empty(n * self._group.world_size, dtype=local.dtype)
        flat[self._group.rank * n : (self._group.rank + 1) * n] = local.reshape(-1)
        work = self._group.all_gather(flat, async_op=True)
        if flat.data_ptr() == output.data_ptr():
            return work, lambda: None
        return work, lambda: output.copy_(flat.view(output.shape))

    @_reported
    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> Any:
        _check_cpu(input_tensors, "all_gather")
        works, copies = [], []
        for outputs, local in zip(output_tensors, input_tensors, strict=True):
            n = local.numel()
            flat = torch.empty(n * len(outputs), dtype=local.dtype)
            work, _ = self._gather_flat(flat, local)
            works.append(work)
            copies.append((flat, outputs, n))

        def copy_out() -> Any:
            for flat, outputs, n in copies:
                for r, out in enumerate(outputs):
                    out.copy_(flat[r * n : (r + 1) * n].view(out.shape))
            return output_tensors

        return self._work(works, copy_out, "all_gather")

    @_reported
    def _allgather_base(self, output: torch.Tensor, local: torch.Tensor, opts: Any = None) -> Any:
        _check_cpu([output, local], "all_gather_into_tensor")
        work, copy = self._gather_flat(output, local)

        def copy_out() -> Any:
            copy()
            return [output]

        return self._work([work], copy_out, "all_gather_into_tensor")

    # torch >= 2.10 routes all_gather_into_tensor / reduce_scatter_tensor through these names.
    all_gather_single = _allgather_base

    @_reported
    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        op = _reduce_op(opts.reduceOp) if opts is not None else "sum"
        _check_cpu(output_tensors, "reduce_scatter")
        works = [
            self._group.reduce_scatter(torch.cat([t.reshape(-1) for t in inputs]), op=op, async_op=True)
            for inputs in input_lists
        ]
        return self._work(works, lambda: _copy_blocks(output_tensors, works), "reduce_scatter")

    @_reported
    def _reduce_scatter_base(self, output: torch.Tensor, local: torch.Tensor, opts: Any = None) -> Any:
        op = _reduce_op(opts.reduceOp) if opts is not None else "sum"
        _check_cpu([output, local], "reduce_scatter_tensor")
        works = [self._group.reduce_scatter(local.reshape(-1).clone(), op=op, async_op=True)]
        return self._work(works, lambda: _copy_blocks([output], works), "reduce_scatter_tensor")

    reduce_scatter_single = _reduce_scatter_base

    @_reported
    def barrier(self, opts: Any = None) -> Any:
        self._group.barrier()
        return self._work([], list, "barrier")

    def shutdown(self) -> None:
        self._group.close()
        with contextlib.suppress(ValueError):
            _LIVE_GROUPS.remove(self._group)


def _copy_blocks(outputs: Sequence[torch.Tensor], works: Sequence[Any]) -> list[torch.Tensor]:
    """Copy each finished reduce-scatter's block (the work's result) into its output tensor."""
    for out, work in zip(outputs, works, strict=True):
        block = work.wait()
        out.copy_(torch.as_tensor(block).view(out.shape))
    return list(outputs)


_LIVE_GROUPS: list[Any] = []
"""The allreduce groups behind this process's open ``"allreduce"`` torch process groups (for :func:`hand_over`)."""


def hand_over(thread: threading.Thread) -> None:
    """Let ``thread`` run the collectives of every open ``"allreduce"`` torch process group of this process (each
    is bound to the thread that created it; see :meth:`allreduce.runtime.ProcessGroup.hand_over`). Call it on
    every rank, from the thread that ran ``init_process_group``; the groups come back when ``thread`` ends."""
    for group in _LIVE_GROUPS:
        if not group.closed:
            group.hand_over(thread)


def _create_backend(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> _AllreduceBackend:
    from allreduce.runtime import init

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
