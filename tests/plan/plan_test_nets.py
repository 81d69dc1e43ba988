"""Small torch modules for the planner's tests, built as ``module:function`` specs name them."""

from __future__ import annotations

from typing import Any


def two_layer() -> Any:
    import torch

    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 3))
