"""DataParallel: gradient buckets all-reduced while backward is still running.

Buckets hold parameters in reverse registration order — roughly the order in which backward produces their
gradients — grouped by dtype, each up to ``bucket_size_mb``. Each bucket is one flat tensor allocated by the group
(``group.empty``: shared memory with the shm transport, which then reduces it in place, without staging), and every
``param.grad`` is a view into it: autograd accumulates straight into the bucket and the averages land in ``.grad``
with no copy out. A per-parameter hook (``register_post_accumulate_grad_hook``) notes that a gradient is complete
— copying it in only when ``.grad`` is not the bucket's view, as after ``zero_grad(set_to_none=True)`` — and when
a bucket is complete its average all-reduce starts asynchronously, and the rest of backward overlaps with it.
Buckets are *launched* strictly in index order, whatever order their gradients arrive in, so every rank issues the
same sequence of collectives. At the end of backward a callback queued on the autograd engine launches what is
left (buckets holding parameters that got no gradient this step) and waits for everything: when
``loss.backward()`` returns, gradients are synchronised, so any optimizer (and gradient clipping, and anything else
reading ``.grad``) works unchanged.

A parameter that requires a gradient but got none on this rank in this step contributes its ``.grad`` (zeros if it
is None) and receives the average, so ranks never diverge; parameters with ``requires_grad=False`` are never
touched.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

import torch
from allreduce.train._elastic import state_source
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
    views: list[torch.Tensor]  # each parameter's gradient as a view into `flat`
    flat: torch.Tensor
    filled: set[int] = field(default_factory=set)
    handle: Any = None


def _bucket_tensor(group: CollectiveGroup, count: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed flat tensor the group reduces in place: in the transport's shared memory when it has any."""
    empty = getattr(group, "empty", None)
    if empty is not None:
        try:
            if dtype == torch.bfloat16:
                # numpy has no bfloat16 of its own; the group's (ml_dtypes) goes to torch as raw 16-bit words.
                import ml_dtypes  # late: 0.7-0.9 s to import, only for bfloat16 buckets

                raw = empty(count, ml_dtypes.bfloat16).view(np.int16)
                flat = torch.from_numpy(raw).view(torch.bfloat16)
            else:
                flat = torch.from_numpy(empty(count, torch.empty(0, dtype=dtype).numpy().dtype))
        except TypeError:  # a dtype the group's memory does not hold: reduce it from ordinary memory
            pass
        else:
            flat.zero_()
            return flat
    return torch.zeros(count, dtype=dtype)


def _broadcast_module(module: nn.Module, group: CollectiveGroup, root: int = 0) -> None:
    """The root's parameters and buffers on every rank."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            group.broadcast(tensor.data, root)


class DataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training on ``group`` (see the module docstring).

    The constructor broadcasts rank 0's parameters and buffers, so every rank starts identical.
    ``algorithm`` is passed to ``group.all_reduce`` ("auto" lets the group choose).

    ``overlap``: all-reduce each bucket on the group's worker thread while backward goes on (True), or all of a
    dtype's gradients in one collective on the calling thread when backward ends (False: no thread, one
    synchronisation point per dtype instead of one per bucket, but nothing overlaps).
    """

    def __init__(
        self,
        module: nn.Module,
        group: CollectiveGroup,
        *,
        bucket_size_mb: float = 25.0,
        algorithm: str = "auto",
        overlap: bool = True,
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
        self.overlap = overlap

        _broadcast_module(module, group)

        params = [p for p in module.parameters() if p.requires_grad]
        if any(p.device.type != "cpu" for p in params):
            raise ValueError("DataParallel on allreduce moves CPU tensors; move the module to the CPU")
        self._make_buckets(params, keep_grads=True)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
            for p in params
        ]

    def _make_buckets(self, params: list[nn.Parameter], *, keep_grads: bool) -> None:
        """The buckets of ``params`` in memory of ``self.group``; every ``.grad`` becomes a view into them (its value
        kept with ``keep_grads``, else zero)."""
        ordered = list(reversed(params))
        layout = bucket_layout(
            [p.numel() * p.element_size() for p in ordered], [p.dtype for p in ordered], self.bucket_size_bytes
        )
        # One flat tensor per dtype, its buckets consecutive slices (a dtype's buckets are in layout order), so
        # that without overlap each dtype's gradients go in a single collective.
        self._flats: dict[torch.dtype, torch.Tensor] = {}
        for dtype in dict.fromkeys(p.dtype for p in ordered):
            count = sum(p.numel() for p in ordered if p.dtype == dtype)
            self._flats[dtype] = _bucket_tensor(self.group, count, dtype)
        used = dict.fromkeys(self._flats, 0)
        self._buckets: list[_Bucket] = []
        self._where: dict[nn.Parameter, tuple[int, int]] = {}
        for members in layout:
            bucket_params = [ordered[i] for i in members]
            dtype = bucket_params[0].dtype
            count = sum(p.numel() for p in bucket_params)
            flat = self._flats[dtype][used[dtype] : used[dtype] + count]
            used[dtype] += count
            views, start = [], 0
            for slot, p in enumerate(bucket_params):
                view = flat[start : start + p.numel()].view(p.shape)
                start += p.numel()
                self._where[p] = (len(self._buckets), slot)
                views.append(view)
                if p.grad is not None:  # gradients accumulated before wrapping are kept
                    if keep_grads:
                        with torch.no_grad():
                            view.copy_(p.grad)
                    p.grad = view
            self._buckets.append(_Bucket(bucket_params, views, flat))

    def regroup(self, group: CollectiveGroup, *, joined: bool = False) -> None:
        """Go on training on ``group``, typically ``old_group.shrink()`` after a rank died: the buckets move to the
        new group's memory and every gradient is zeroed (a step that failed left partial averages in them).
        Parameters and optimizer state are untouched: the survivors' are identical already (replicas). Run the
        failed step again on the new group, with the data re-sharded over its ranks.

        When the death split the survivors by one call (``group.ahead_ranks``), the ranks ahead may have finished
        the step the others failed and applied its update: the parameters and buffers of the first of them are
        broadcast, and :func:`allreduce.train.sync_state` then gives every rank its optimizer state and step.

        ``joined=True`` after ``old_group.grow()`` admitted new ranks: rank 0's parameters and buffers are broadcast
        as the joiners' own ``DataParallel(module, group)`` does (every rank must take part); then
        :func:`allreduce.train.sync_state` for the optimizer."""
        if joined or bool(getattr(group, "ahead_ranks", None)):
            _broadcast_module(self.module, group, state_source(group))
        self.group = group
        self._active = False
        self._launched = 0
        self.last_sync = None
        params = [p for b in self._buckets for p in b.params]
        order = {id(p): i for i, p in enumerate(p for p in self.module.parameters() if p.requires_grad)}
        self._make_buckets(sorted(params, key=lambda p: order[id(p)]), keep_grads=False)

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
        self._adopt(param, bucket.views[slot])
        bucket.filled.add(slot)
        self._backward_end = time.perf_counter()
        if self.overlap:
            self._launch_ready()

    @staticmethod
    def _adopt(param: torch.Tensor, view: torch.Tensor) -> None:
        """Make ``param.grad`` the bucket's view, carrying its value over (zeros when there is none)."""
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            # After zero_grad(set_to_none=True) autograd hands over a fresh tensor: the one copy per step.
            view.copy_(grad.detach())
        else:
            return
        param.grad = view

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
        # Parameters that got no gradient in this step contribute what .grad holds (zeros if None).
        with torch.no_grad():
            for bucket in self._buckets[self._launched :]:
                for slot, p in enumerate(bucket.params):
                    if slot not in bucket.filled:
                        self._adopt(p, bucket.views[slot])
                if self.overlap:
                    self._launch(bucket)
        if self.overlap:
            for bucket in self._buckets:
                bucket.handle.wait()
                bucket.handle = None
        else:
            self._first_launch = time.perf_counter()
            for flat in self._flats.values():
                self.group.all_reduce(flat, op="avg", algorithm=self.algorithm)
        done = time.perf_counter()
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
