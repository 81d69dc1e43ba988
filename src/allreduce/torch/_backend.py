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
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

import torch
from allreduce.torch._futures import future_of

__all__ = ["BACKEND_NAME", "register_backend"]

BACKEND_NAME = "allreduce"
_MIN_TORCH = "2.2"
# Where rank 0 publishes the port of allreduce's store, in the store torch gives one process group.
_PORT_KEY = "allreduce/store_port"

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


class _AllreduceBackend(_ProcessGroupBase):  # type: ignore[misc]
    """A torch.distributed backend whose collectives are an allreduce process group's."""

    def __init__(self, group: Any) -> None:
        super().__init__(group.rank, group.world_size)
        self._group = group
        _LIVE_GROUPS.append(group)

    @property
    def allreduce_group(self) -> Any:
        """The allreduce :class:`~allreduce.runtime.ProcessGroup` whose collectives this backend runs."""
        return self._group

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _work(self, works: Sequence[Any], value: Any) -> Any:
        return _create_work_from_future(future_of(works, lambda: value))

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = _reduce_op(opts.reduceOp) if opts is not None else "sum"
        _check_cpu(tensors, "all_reduce")
        works = [self._group.all_reduce(t, op=op, async_op=True) for t in tensors]
        return self._work(works, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = int(opts.rootRank) if opts is not None else 0
        _check_cpu(tensors, "broadcast")
        works = [self._group.broadcast(t, root, async_op=True) for t in tensors]
        return self._work(works, tensors)

    def _gather_flat(self, output: torch.Tensor, local: torch.Tensor) -> None:
        # Block r of an N*n buffer is rank r's part; block_bounds cuts N*n elements into exactly n each.
        n = local.numel()
        flat = torch.empty(n * self._group.world_size, dtype=local.dtype)
        flat[self._group.rank * n : (self._group.rank + 1) * n] = local.reshape(-1)
        self._group.all_gather(flat)
        output.copy_(flat.view(output.shape))

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> Any:
        _check_cpu(input_tensors, "all_gather")
        for outputs, local in zip(output_tensors, input_tensors, strict=True):
            n = local.numel()
            flat = torch.empty(n * len(outputs), dtype=local.dtype)
            self._gather_flat(flat, local)
            for r, out in enumerate(outputs):
                out.copy_(flat[r * n : (r + 1) * n].view(out.shape))
        return self._work([], output_tensors)

    def _allgather_base(self, output: torch.Tensor, local: torch.Tensor, opts: Any = None) -> Any:
        _check_cpu([output, local], "all_gather_into_tensor")
        self._gather_flat(output, local)
        return self._work([], [output])

    # torch >= 2.10 routes all_gather_into_tensor / reduce_scatter_tensor through these names.
    all_gather_single = _allgather_base

    def _reduce_scatter_flat(self, output: torch.Tensor, flat: torch.Tensor, op: str) -> None:
        block = self._group.reduce_scatter(flat, op=op)
        output.copy_(block.view(output.shape))

    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        op = _reduce_op(opts.reduceOp) if opts is not None else "sum"
        _check_cpu(output_tensors, "reduce_scatter")
        for out, inputs in zip(output_tensors, input_lists, strict=True):
            flat = torch.cat([t.reshape(-1) for t in inputs])
            self._reduce_scatter_flat(out, flat, op)
        return self._work([], output_tensors)

    def _reduce_scatter_base(self, output: torch.Tensor, local: torch.Tensor, opts: Any = None) -> Any:
        op = _reduce_op(opts.reduceOp) if opts is not None else "sum"
        _check_cpu([output, local], "reduce_scatter_tensor")
        self._reduce_scatter_flat(output, local.reshape(-1).clone(), op)
        return self._work([], [output])

    reduce_scatter_single = _reduce_scatter_base

    def barrier(self, opts: Any = None) -> Any:
        self._group.barrier()
        return self._work([], [])

    def shutdown(self) -> None:
        self._group.close()
        with contextlib.suppress(ValueError):
            _LIVE_GROUPS.remove(self._group)


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
    # Rank 0 hosts allreduce's store on a port the kernel picks and publishes it through torch's store (one per
    # process group, given only to its members), under a key of the backend's own, so no port is guessed, none
    # of the launcher's is reused, and no count of this process's other groups enters the key.
    group = init(
        rank,
        world_size,
        master_addr=host,
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
