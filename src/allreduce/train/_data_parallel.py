"""DataParallel: gradient buckets all-reduced while backward is still running.

Buckets hold parameters in reverse registration order — roughly the order in which backward produces their
gradients — grouped by dtype, each up to ``bucket_size_mb``. A per-parameter hook
(``register_post_accumulate_grad_hook``) copies a gradient into its bucket the moment autograd has accumulated
it; when a bucket is complete its average all-reduce starts asynchronously, and the rest of backward overlaps
with it. Buckets are *launched* strictly in index order, whatever order their gradients arrive in, so every rank
issues the same sequence of collectives. At the end of backward a callback queued on the autograd engine
launches what is left (buckets holding parameters that got no gradient this step), waits for everything and
writes the averages back into ``param.grad``: when ``loss.backward()`` returns, gradients are synchronised, so
any optimizer (and gradient clipping, and anything else reading ``.grad``) works unchanged.

A parameter that requires a gradient but got none on this rank in this step contributes zeros and receives the
average, so ranks never diverge; parameters with ``requires_grad=False`` are never touched.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["DataParallel", "SyncStats", "bucket_layout"]


class AsyncHandle(Protocol):
    def wait(self) -> Any: ...


class CollectiveGroup(Protocol):
    """What DataParallel needs of a group: allreduce's ProcessGroup, or :class:`allreduce.torch.ScheduleGroup`."""

    rank: int
    world_size: int

    def all_reduce(self, x: Any, op: str = ..., algorithm: str = ..., *, async_op: bool = ...) -> Any: ...

    def broadcast(self, x: Any, root: int = ..., *, async_op: bool = ...) -> Any: ...


@dataclass(frozen=True)
class SyncStats:
    """Timing of the last gradient synchronisation (``time.perf_counter`` seconds).

    ``comm_s``: from the first bucket's launch until every bucket was reduced; ``exposed_comm_s``: the part of
    it after backward's last gradient, which the step waits for (it includes waiting for slower ranks);
    ``backward_end``: when the last gradient hook ran.
    """

    buckets: int
    comm_s: float
    exposed_comm_s: float
    backward_end: float


def bucket_layout(sizes_bytes: list[int], dtypes: list[Any], bucket_size_bytes: int) -> list[list[int]]:
    """Indices of the parameters in each bucket, given in bucket-filling order (already reversed).

    A bucket holds parameters of one dtype; it is closed once it holds ``bucket_size_bytes`` or more, so a
    parameter larger than the cap has a bucket to itself. Buckets are numbered in the order they close.
    """
    open_buckets: dict[Any, tuple[list[int], int]] = {}
    closed: list[list[int]] = []
    for index, (size, dtype) in enumerate(zip(sizes_bytes, dtypes, strict=True)):
        members, total = open_buckets.get(dtype, ([], 0))
        members.append(index)
        total += size
        if total >= bucket_size_bytes:
            closed.append(members)
            open_buckets.pop(dtype, None)
        else:
            open_buckets[dtype] = (members, total)
    # Leftovers close in the order their first parameter appeared.
    closed.extend(sorted((m for m, _ in open_buckets.values()), key=lambda m: m[0]))
    closed.sort(key=lambda m: m[0])
    return closed


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor
    pending: int = 0
    filled: set[int] = field(default_factory=set)
    handle: Any = None


class DataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training on ``group`` (see the module docstring).

    The constructor broadcasts rank 0's parameters and buffers, so every rank starts identical.
    ``algorithm`` is passed to ``group.all_reduce`` ("auto" lets the group choose).
    """

    def __init__(
        self, module: nn.Module, group: CollectiveGroup, *, bucket_size_mb: float = 25.0, algorithm: str = "auto"
    ) -> None:
        super().__init__()
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb}")
        self.module = module
        self.group = group
        self.algorithm = algorithm
        self.bucket_size_bytes = max(1, int(bucket_size_mb * 1024 * 1024))
        self._sync_enabled = True
        self._launched = 0
        self._active = False
        self._first_launch = 0.0
        self._backward_end = 0.0
        self.last_sync: SyncStats | None = None

        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                group.broadcast(tensor.data, 0)

        params = [p for p in module.parameters() if p.requires_grad]
        if any(p.device.type != "cpu" for p in params):
            raise ValueError("DataParallel on allreduce moves CPU tensors; move the module to the CPU")
        ordered = list(reversed(params))
        layout = bucket_layout(
            [p.numel() * p.element_size() for p in ordered], [p.dtype for p in ordered], self.bucket_size_bytes
        )
        self._buckets: list[_Bucket] = []
        self._where: dict[nn.Parameter, tuple[int, int]] = {}
        for members in layout:
            bucket_params = [ordered[i] for i in members]
            offsets = [0]
            for p in bucket_params:
                offsets.append(offsets[-1] + p.numel())
            flat = torch.zeros(offsets[-1], dtype=bucket_params[0].dtype)
            bucket_index = len(self._buckets)
            for slot, p in enumerate(bucket_params):
                self._where[p] = (bucket_index, slot)
            self._buckets.append(_Bucket(bucket_params, offsets, flat))
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
            for p in params
        ]

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def bucket_params(self) -> list[list[nn.Parameter]]:
        """The parameters of each bucket, in launch order."""
        return [list(b.params) for b in self._buckets]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the first backward after it averages the sum."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    # ------------------------------------------------------------------------------------------------
    # Backward-time machinery
    # ------------------------------------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._sync_enabled:
            return
        if not self._active:
            self._active = True
            self._launched = 0
            self._first_launch = 0.0
            for b in self._buckets:
                b.filled.clear()
                b.handle = None
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        bucket_index, slot = self._where[param]  # type: ignore[index]
        bucket = self._buckets[bucket_index]
        grad = param.grad
        assert grad is not None  # the hook runs after accumulation
        start, stop = bucket.offsets[slot], bucket.offsets[slot + 1]
        bucket.flat[start:stop].copy_(grad.detach().reshape(-1))
        bucket.filled.add(slot)
        self._backward_end = time.perf_counter()
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._launched < len(self._buckets):
            bucket = self._buckets[self._launched]
            if len(bucket.filled) < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if self._launched == 0:
            self._first_launch = time.perf_counter()
        bucket.handle = self.group.all_reduce(bucket.flat, op="avg", algorithm=self.algorithm, async_op=True)
        self._launched += 1

    def _finish_backward(self) -> None:
        try:
            self._finish()
        finally:
            self._active = False

    def _finish(self) -> None:
        backward_end = self._backward_end
        # Parameters that got no gradient in this step: zeros go in, the average comes back.
        while self._launched < len(self._buckets):
            bucket = self._buckets[self._launched]
            for slot in range(len(bucket.params)):
                if slot not in bucket.filled:
                    bucket.flat[bucket.offsets[slot] : bucket.offsets[slot + 1]].zero_()
            self._launch(bucket)
        for bucket in self._buckets:
            bucket.handle.wait()
        done = time.perf_counter()
        with torch.no_grad():
            for bucket in self._buckets:
                for slot, p in enumerate(bucket.params):
                    averaged = bucket.flat[bucket.offsets[slot] : bucket.offsets[slot + 1]].view(p.shape)
                    if p.grad is None:
                        p.grad = averaged.clone()
                    else:
                        p.grad.copy_(averaged)
                bucket.handle = None
        self.last_sync = SyncStats(
            buckets=len(self._buckets),
            comm_s=done - self._first_launch,
            exposed_comm_s=max(0.0, done - backward_end),
            backward_end=backward_end,
        )

    def remove_hooks(self) -> None:
        """Detach from the module's parameters (the module keeps working alone)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
