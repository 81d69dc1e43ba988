"""torch.profiler Chrome traces of training steps, recorded on CPU by the tests that read them (the planner's
``--profile``, the report's timeline of a profiled plan)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any


def record_trace(
    path: Path, net: Any, x: Any, *, shapes: bool = True, steps: bool = True, observer: Any = None
) -> None:
    """Two SGD steps of ``net`` on ``x`` under torch.profiler, the trace written to ``path``. With ``steps`` a
    schedule marks the second, active step (ProfilerStep#1); without, both steps are in the trace. ``shapes``:
    record_shapes, which the planner needs for the gradients' sizes. ``observer``: an ExecutionTraceObserver to
    record the same step's execution trace."""
    from torch.profiler import ProfilerActivity, profile, schedule

    import torch

    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def export(prof: Any) -> None:
        prof.export_chrome_trace(str(path))

    plan: dict[str, Any] = {"schedule": schedule(wait=0, warmup=1, active=1), "on_trace_ready": export} if steps else {}
    if observer is not None:
        plan["execution_trace_observer"] = observer
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


def _mlp_and_batch() -> tuple[Any, Any]:
    """A seeded two-layer MLP (128 -> 256 -> 10) and 32 samples."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    return net, torch.randn(32, 128)


def record_mlp_trace(path: Path) -> int:
    """:func:`record_trace` of :func:`_mlp_and_batch`'s MLP; its parameters."""
    net, x = _mlp_and_batch()
    record_trace(path, net, x)
    return sum(int(p.numel()) for p in net.parameters())


def record_execution_trace(directory: Path, net: Any, x: Any) -> tuple[Path, Path]:
    """:func:`record_trace` with torch's ExecutionTraceObserver on the same step, made a Chakra ET as a user
    would: the host ET's operators get their durations from the Kineto trace, then MLCommons' converter
    (``chakra_converter PyTorch``) writes the protobuf ET. Returns (the ET, the Kineto trace).

    Chakra's own linker (``chakra_trace_link``) needs ``et_replay``, which is not on the package index, so the
    linking is done here as it does it for a CPU trace: each host operator takes the inclusive duration of the
    Kineto event with its record-function id, and its exclusive duration is that minus its callees'."""
    import pytest

    converter = pytest.importorskip(
        "chakra.src.converter.pytorch_converter", reason="the Chakra converter (pip install mlc-chakra) is missing"
    )
    from torch.profiler import ExecutionTraceObserver

    host, kineto = directory / "host_et.json", directory / "kineto.json"
    observer = ExecutionTraceObserver().register_callback(str(host))
    record_trace(kineto, net, x, observer=observer)
    linked = directory / "linked_et.json"
    linked.write_text(json.dumps(_linked(json.loads(host.read_text()), json.loads(kineto.read_text()))))
    et = directory / "step.et"
    converter.PyTorchConverter().convert(str(linked), str(et), False)
    return et, kineto


def _linked(host: dict[str, Any], kineto: dict[str, Any]) -> dict[str, Any]:
    by_function_id = {
        e["args"]["Record function id"]: e
        for e in kineto["traceEvents"]
        if e.get("ph") == "X" and "Record function id" in e.get("args", {})
    }
    inclusive: dict[int, float] = {}
    for node in host["nodes"]:
        function_id = next(a["value"] for a in node["attrs"] if a["name"] == "rf_id")
        event = by_function_id.get(function_id)
        if event is not None and not node["name"].startswith("[pytorch|profiler"):
            inclusive[node["id"]] = float(event["dur"])
    callees: dict[int, float] = {}
    for node in host["nodes"]:
        if node["id"] in inclusive and node["ctrl_deps"] in inclusive:
            callees[node["ctrl_deps"]] = callees.get(node["ctrl_deps"], 0.0) + inclusive[node["id"]]
    for node in host["nodes"]:
        if node["id"] in inclusive:
            node["inclusive_dur"] = inclusive[node["id"]]
            node["exclusive_dur"] = max(0.0, inclusive[node["id"]] - callees.get(node["id"], 0.0))
    return host


def record_mlp_execution_trace(directory: Path) -> tuple[Path, Path]:
    """:func:`record_execution_trace` of :func:`_mlp_and_batch`'s MLP."""
    return record_execution_trace(directory, *_mlp_and_batch())
