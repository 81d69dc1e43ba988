"""allreduce's process group on an existing torch process group: schedules over torch.distributed.

An existing torch process group (Gloo here, NCCL on GPU clusters) keeps doing rendezvous and moving bytes, while
allreduce's :class:`~allreduce.runtime.ProcessGroup` decides the algorithm (ring, halving-doubling, trees,
hierarchical, ...), agrees on every collective before data moves, and reduces. :class:`allreduce.train.DataParallel`
runs on it as on a group from :func:`allreduce.runtime.init`.
"""

from __future__ import annotations

import torch.distributed as dist

from allreduce.runtime import ProcessGroup
from allreduce.torch._transport import TorchTransport

__all__ = ["torch_group"]


def torch_group(
    process_group: dist.ProcessGroup | None = None, *, timeout_s: float = 300.0, group_size: int | None = None
) -> ProcessGroup:
    """An allreduce process group whose bytes travel by ``isend``/``irecv`` on ``process_group`` (default: world).

    ``group_size`` is the number of ranks per node (for the hierarchical algorithm). Closing the returned group
    leaves the torch process group alone: the caller owns it.
    """
    return ProcessGroup(
        TorchTransport(process_group), transport_name="torch", timeout_s=timeout_s, group_size=group_size
    )
