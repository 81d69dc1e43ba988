"""A model for ``allreduce plan --module models.mlp:mlp_and_batch --measure`` (with ``PYTHONPATH=examples``): a
function that returns the module and one micro-batch of its input, so the planner can run forward and backward and
time when each gradient is ready."""

from __future__ import annotations

import torch


def mlp_and_batch() -> tuple[torch.nn.Module, torch.Tensor]:
    """A 4-layer MLP of about 25M parameters and a batch of 64 inputs."""
    torch.manual_seed(0)
    width = 2048
    net = torch.nn.Sequential(
        torch.nn.Linear(1024, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, 1000),
    )
    return net, torch.randn(64, 1024)
