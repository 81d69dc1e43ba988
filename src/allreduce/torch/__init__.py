"""allreduce inside torch: schedules over torch.distributed, a DDP comm hook, and a torch.distributed backend."""

from allreduce.torch._group import torch_group
from allreduce.torch._transport import TorchTransport

__all__ = ["TorchTransport", "torch_group"]
