"""allreduce inside torch: schedules over torch.distributed, a DDP comm hook, and a torch.distributed backend."""

from allreduce.torch._transport import TorchTransport

__all__ = ["TorchTransport"]
