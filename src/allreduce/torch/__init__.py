"""allreduce inside torch: schedules over torch.distributed, a DDP comm hook, and a torch.distributed backend.

Importing this package registers the ``"allreduce"`` torch.distributed backend (see :mod:`._backend`).
"""

from allreduce.torch._backend import BACKEND_NAME, hand_over, register_backend
from allreduce.torch._group import torch_group
from allreduce.torch._hook import comm_hook
from allreduce.torch._transport import TorchTransport

__all__ = ["BACKEND_NAME", "TorchTransport", "comm_hook", "hand_over", "register_backend", "torch_group"]

register_backend()
