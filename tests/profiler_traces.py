"""torch.profiler Chrome traces of training steps, recorded on CPU by the tests that read them (the planner's
``--profile``, the report's timeline of a profiled plan)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any


def record_trace(path: Path, net: Any, x: Any, *, shapes: bool = True, steps: bool = True) -> None:
    """Two SGD steps of ``net`` on ``x`` under torch.profiler, the trace written to ``path``. With ``steps`` a
    schedule marks the second, active step (ProfilerStep#1); without, both steps are in the trace. ``shapes``:
    record_shapes, which the planner needs for the gradients' sizes."""
    from torch.profiler import ProfilerActivity, profile, schedule

    import torch

    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def export(prof: Any) -> None:
        prof.export_chrome_trace(str(path))

    plan: dict[str, Any] = {"schedule": schedule(wait=0, warmup=1, active=1), "on_trace_ready": export} if steps else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Warning: Profiler clears events", UserWarning)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes, **plan) as prof:
            for _ in range(2):
                net(x).sum().backward()
                opt.step()
                opt.zero_grad()
                prof.step()
    if not steps:
        prof.export_chrome_trace(str(path))


def record_mlp_trace(path: Path) -> int:
    """:func:`record_trace` of a seeded two-layer MLP (128 -> 256 -> 10) on 32 samples; its parameters."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    record_trace(path, net, torch.randn(32, 128))
    return sum(int(p.numel()) for p in net.parameters())
