"""A DDP communication hook that averages DDP's gradient buckets with allreduce's collectives.

``ddp.register_comm_hook(group, allreduce.torch.comm_hook)``: DDP keeps its bucketing, its overlap with backward
and its own process group for setup; each bucket's all-reduce goes to ``group`` — a torch process group on the
``"allreduce"`` backend (``dist.new_group(backend="allreduce")``, which joins through torch's store and so works
under every launcher), an allreduce :class:`~allreduce.runtime.ProcessGroup` from :func:`allreduce.runtime.init`
(shared memory on one host, TCP across hosts), or :func:`allreduce.torch.torch_group`.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects (dist.GradBucket).
from typing import Any

import torch.distributed as dist

import torch
from allreduce.torch._backend import _HOOK_GROUPS, _AllreduceBackend
from allreduce.torch._futures import future_of
from allreduce.torch._work import torch_error

__all__ = ["comm_hook"]


def comm_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # type: ignore[name-defined]
    """Average ``bucket`` over ``state`` (an allreduce process group) asynchronously; the future holds the result,
    or fails (so DDP's backward raises) with the collective's error."""
    if isinstance(state, _AllreduceBackend):
        state = state.allreduce_group
    if not hasattr(state, "all_reduce"):
        raise TypeError(
            f"comm_hook's state must be an allreduce process group (dist.new_group(backend='allreduce'), "
            f"allreduce.runtime.init() or allreduce.torch.torch_group()), got {type(state).__name__}"
        )
    if state not in _HOOK_GROUPS:
        _HOOK_GROUPS.add(state)
    tensor = bucket.buffer()
    work = state.all_reduce(tensor, op="avg", async_op=True)
    return future_of([work], lambda: tensor, translate=torch_error)
