"""When each gradient is ready during backward: measured on a real model here, or read from a profiler trace.

DDP all-reduces a bucket once backward has produced every gradient in it, so how much of the all-reduce hides
behind backward depends on the order and the timing of the layers, not on a fixed share. A
:class:`MeasuredBackward` holds, for one training step, the forward, backward and optimizer durations and each
parameter tensor's ready time as a fraction of backward (0: ready as backward starts, 1: as it ends).

- :func:`measure_module` runs forward, backward and an optimizer step of a ``torch.nn.Module`` several times,
  stamping each parameter's ready time with ``register_post_accumulate_grad_hook`` (the moment its ``.grad`` is
  final, which is when DDP's reducer marks it ready), and keeps the median of each quantity.
- :func:`read_profile` reads one step of a ``torch.profiler`` (Kineto) Chrome trace (the last ``ProfilerStep``, or
  without step marks the span after the last optimizer step but one), for instance one recorded on a
  GPU cluster elsewhere: backward spans the ``autograd::engine::evaluate_function`` events, each gradient is ready
  at the end of its ``torch::autograd::AccumulateGrad`` event (its size from the event's input shape, which the
  trace has when it was recorded with ``record_shapes=True``), the optimizer is the ``Optimizer.step#`` events.
  The times are the host's: with a GPU, kernels finish after the host enqueued them, and DDP's all-reduce waits
  on the same stream, so a trace whose GPU runs far behind its host reads backward as shorter than it is.
  A trace does not say which parameter a gradient belongs to, only its shape and when it was ready; tensors are
  taken in registration order as the reverse of their ready order (the order DDP's buckets assume).

Either also counts the FLOPs of forward and backward (:class:`torch.utils.flop_counter.FlopCounterMode` on the
module; from a trace, each matrix product's ``2·m·k·n`` from its input shapes, or the ``flops`` value an event
carries), so :meth:`MeasuredBackward.on_gpu` can move the step to a target GPU: the same
FLOPs at the target's peak × MFU, the measured shape (backward's share, the ready times) kept.

A Chakra execution trace (MLCommons' protobuf format; a file that is not JSON) is read too: its dependency graph
replayed into the spans a Chrome trace would hold, from which the same timings are taken (``_chakra``).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from allreduce.plan._chakra import execution_trace_spans
from allreduce.plan._workload import Model, module_factory
from allreduce.units import format_seconds

__all__ = ["MAX_PROFILE_BYTES", "MeasuredBackward", "measure_module", "measure_spec", "read_profile"]

MAX_PROFILE_BYTES = 1 << 30
"""The largest trace file read (a step's trace of a large model is tens of MB; a whole profiled run can be GBs)."""


@dataclass(frozen=True)
class MeasuredBackward:
    """One step's timing: durations in seconds; per parameter tensor (registration order) its element count and its
    ready time as a fraction of backward."""

    source: str
    tensor_params: tuple[int, ...]
    ready_fraction: tuple[float, ...]
    forward_s: float
    backward_s: float
    optimizer_s: float
    flops: float | None = None  # of forward and backward of one micro-batch, as counted (None: not counted)

    def __post_init__(self) -> None:
        if len(self.tensor_params) != len(self.ready_fraction):
            raise ValueError(f"{len(self.tensor_params)} tensors but {len(self.ready_fraction)} ready times")
        if not self.tensor_params:
            raise ValueError(f"{self.source}: no gradient found")
        for name in ("forward_s", "backward_s", "optimizer_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{self.source}: {name} must be a finite number of seconds >= 0, got {value}")
        if any(not 0.0 <= f <= 1.0 for f in self.ready_fraction):
            raise ValueError(f"{self.source}: ready fractions must lie in [0, 1]")
        if self.flops is not None and not (math.isfinite(self.flops) and self.flops > 0):
            raise ValueError(f"{self.source}: flops must be a finite number > 0, got {self.flops}")

    @property
    def compute_s(self) -> float:
        """Forward and backward: what the planner's compute per micro-batch is."""
        return self.forward_s + self.backward_s

    @property
    def backward_share(self) -> float:
        return self.backward_s / self.compute_s if self.compute_s > 0 else 0.0

    def scaled(self, compute_s: float, source: str) -> MeasuredBackward:
        """The same step on a machine where forward and backward take ``compute_s`` (the optimizer scales alike)."""
        factor = compute_s / self.compute_s if self.compute_s > 0 else 0.0
        return MeasuredBackward(
            source,
            self.tensor_params,
            self.ready_fraction,
            self.forward_s * factor,
            self.backward_s * factor,
            self.optimizer_s * factor,
            self.flops,
        )

    def on_gpu(self, *, gpu_tflops: float, mfu: float) -> MeasuredBackward:
        """The same step on a GPU of ``gpu_tflops`` peak at ``mfu``: its counted FLOPs at that rate; the source
        states both machines' rates."""
        if self.flops is None:
            raise ValueError(
                f"{self.source}: no FLOPs were counted (a trace without matrix products, such as a convolutional "
                "model's), so --gpu-tflops cannot move it to the target GPU; give --compute-ms"
            )
        if not (math.isfinite(gpu_tflops) and gpu_tflops > 0 and 0 < mfu <= 1):
            raise ValueError(f"--gpu-tflops must be > 0 and --mfu in (0, 1], got {gpu_tflops} and {mfu}")
        target_s = self.flops / (gpu_tflops * 1e12 * mfu)
        here = f"{self.flops / self.compute_s / 1e12:.3g} TFLOPS here" if self.compute_s > 0 else "no time here"
        return self.scaled(
            target_s,
            f"{self.source}, moved to the target GPU: {self.flops / 1e9:.4g} GFLOP per micro-batch counted, "
            f"{here}, {gpu_tflops:g} TFLOPS x MFU {mfu:g} there",
        )

    def model(self, name: str) -> Model:
        """The model as the planner sees it: these tensors, each ready when measured."""
        return Model(name, self.tensor_params, whole_tensors=True, tensor_ready=self.ready_fraction)

    def describe(self) -> str:
        return (
            f"{self.source}: forward {format_seconds(self.forward_s)}, backward {format_seconds(self.backward_s)}, "
            f"optimizer {format_seconds(self.optimizer_s)}, {len(self.tensor_params)} gradient tensors"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "tensors": len(self.tensor_params),
            "params": sum(self.tensor_params),
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "optimizer_s": self.optimizer_s,
            "flops": self.flops,
        }


def _loss_of(output: Any) -> Any:
    """A scalar to run backward from: the output itself when it is one, else the sum of its (first) tensor."""
    while isinstance(output, tuple | list) and output:
        output = output[0]
    if isinstance(output, dict) and output:
        output = output.get("loss", next(iter(output.values())))
    if not hasattr(output, "backward"):
        raise ValueError(f"the model's output is a {type(output).__name__}, not a tensor to run backward from")
    return output if output.dim() == 0 else output.float().sum()


def measure_module(
    net: Any,
    inputs: Sequence[Any],
    *,
    repeats: int = 5,
    warmup: int = 1,
    optimizer: Callable[[Any], Any] | None = None,
    source: str = "",
) -> MeasuredBackward:
    """Run ``net(*inputs)``, backward and an optimizer step ``warmup + repeats`` times; the medians of the last
    ``repeats``. ``optimizer`` makes the optimizer from the parameters (default: AdamW, the usual choice, whose
    step costs more than SGD's)."""
    import torch

    if not isinstance(net, torch.nn.Module):
        raise ValueError(f"measure_module needs a torch.nn.Module, got {type(net).__name__}")
    if not 1 <= repeats <= 1000 or not 0 <= warmup <= 100:
        raise ValueError(f"repeats must be in [1, 1000] and warmup in [0, 100], got {repeats} and {warmup}")
    params = [p for p in net.parameters() if p.requires_grad and p.numel() > 0]
    if not params:
        raise ValueError(f"{source or type(net).__name__}: the module has no trainable parameters")
    opt = optimizer(params) if optimizer is not None else torch.optim.AdamW(params, lr=1e-9)
    stamps = [0.0] * len(params)
    clock = time.perf_counter

    def stamp(index: int) -> Callable[[Any], None]:
        def hook(_param: Any) -> None:
            stamps[index] = clock()

        return hook

    handles = [p.register_post_accumulate_grad_hook(stamp(i)) for i, p in enumerate(params)]  # type: ignore[no-untyped-call]
    forward, backward, step = [], [], []
    fractions: list[list[float]] = []
    try:
        for rep in range(warmup + repeats):
            opt.zero_grad(set_to_none=True)
            t0 = clock()
            loss = _loss_of(net(*inputs))
            t1 = clock()
            loss.backward()
            t2 = clock()
            opt.step()
            t3 = clock()
            if rep < warmup:
                continue
            span = t2 - t1
            forward.append(t1 - t0)
            backward.append(span)
            step.append(t3 - t2)
            fractions.append([min(1.0, max(0.0, (s - t1) / span)) if span > 0 else 1.0 for s in stamps])
    finally:
        for handle in handles:
            handle.remove()
    flops = _counted_flops(net, inputs)
    ready = tuple(statistics.median(column) for column in zip(*fractions, strict=True))
    return MeasuredBackward(
        source or f"measured: {type(net).__name__}, median of {repeats} steps on this machine",
        tuple(int(p.numel()) for p in params),
        ready,
        statistics.median(forward),
        statistics.median(backward),
        statistics.median(step),
        flops,
    )


def _counted_flops(net: Any, inputs: Sequence[Any]) -> float | None:
    """FLOPs of one forward and backward of ``net`` (torch's flop counter; None when it counts none)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        _loss_of(net(*inputs)).backward()
    net.zero_grad(set_to_none=True)
    total = float(counter.get_total_flops())
    return total if total > 0 else None


def measure_spec(spec: str, *, repeats: int = 5) -> MeasuredBackward:
    """Measure ``module:function``, whose function returns ``(module, inputs)``: inputs a tensor or a tuple of
    them, one micro-batch as the model takes it. Errors name the spec and what is wrong."""
    factory = module_factory(spec, doing="measuring a module")
    import torch

    function_name = spec.partition(":")[2]
    made = factory()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise ValueError(
            f"{spec}: --measure needs {function_name}() to return (module, inputs), a torch.nn.Module and one "
            f"micro-batch of its input (a tensor or a tuple of tensors); it returned {type(made).__name__}"
        )
    net, inputs = made
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    return measure_module(net, inputs, repeats=repeats, source=f"measured {spec} on this machine")


_BACKWARD_PREFIX = "autograd::engine::evaluate_function"
_ACCUMULATE = "torch::autograd::AccumulateGrad"
_OPTIMIZER_PREFIX = "Optimizer.step#"
_STEP_PREFIX = "ProfilerStep"
# Matrix products whose FLOPs a trace's input shapes give: (m x k) @ (k x n) is 2·m·k·n; the batched ones carry a
# leading batch dimension. Operators that call these (linear, matmul) are not counted again.
_PRODUCT_INPUTS = {"aten::mm": 0, "aten::addmm": 1, "aten::bmm": 0, "aten::baddbmm": 1}


def read_profile(path: str) -> MeasuredBackward:
    """One training step of a ``torch.profiler`` Chrome trace or a Chakra execution trace (the last
    ``ProfilerStep`` in it, or the whole trace when it names none). Errors name the file and what is missing."""
    events, source = _profile_events(path)
    spans = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and _is_span(e)]
    steps = [e for e in spans if str(e["name"]).startswith(_STEP_PREFIX)]
    if steps:
        last = max(steps, key=lambda e: float(e["ts"]))
        start, end = float(last["ts"]), float(last["ts"]) + float(last["dur"])
        spans = [e for e in spans if start <= float(e["ts"]) <= end]
    else:
        # No step marks: the last step ends with the last optimizer step and starts after the one before it.
        optimizer_ends = sorted(
            float(e["ts"]) + float(e["dur"]) for e in spans if str(e["name"]).startswith(_OPTIMIZER_PREFIX)
        )
        if len(optimizer_ends) >= 2:
            start, end = optimizer_ends[-2], optimizer_ends[-1]
            spans = [e for e in spans if start < float(e["ts"]) <= end]
    backward = [e for e in spans if str(e["name"]).startswith(_BACKWARD_PREFIX)]
    if not backward:
        raise ValueError(f"{path}: no backward in the trace (no {_BACKWARD_PREFIX} events)")
    backward_start = min(float(e["ts"]) for e in backward)
    backward_end = max(float(e["ts"]) + float(e["dur"]) for e in backward)
    grads = sorted((e for e in spans if e["name"] == _ACCUMULATE), key=lambda e: float(e["ts"]))
    sizes, ready = [], []
    for e in grads:
        dims = (e.get("args") or {}).get("Input Dims")
        if not (isinstance(dims, list) and dims and isinstance(dims[0], list)):
            raise ValueError(f"{path}: a gradient event has no input shape; record the trace with record_shapes=True")
        sizes.append(math.prod(int(d) for d in dims[0]))
        done = float(e["ts"]) + float(e["dur"])
        span = backward_end - backward_start
        ready.append(min(1.0, max(0.0, (done - backward_start) / span)) if span > 0 else 1.0)
    if not grads:
        raise ValueError(f"{path}: no gradients in the trace (no {_ACCUMULATE} events)")
    forward_start = min(float(e["ts"]) for e in spans if not str(e["name"]).startswith(_STEP_PREFIX))
    flops = sum(_event_flops(e) for e in spans if float(e["ts"]) <= backward_end)
    optimizer_us = sum(float(e["dur"]) for e in spans if str(e["name"]).startswith(_OPTIMIZER_PREFIX))
    return MeasuredBackward(
        source,
        tuple(reversed(sizes)),
        tuple(reversed(ready)),
        max(0.0, backward_start - forward_start) / 1e6,
        (backward_end - backward_start) / 1e6,
        optimizer_us / 1e6,
        flops or None,
    )


def _profile_events(path: str) -> tuple[list[Any], str]:
    """The trace's events and the plan's name for their source: a Chrome trace's as written, a Chakra ET's as
    replayed. Either may be gzipped (torch.profiler writes ``.json.gz`` so); JSON is told from protobuf by trying
    it first, since an ET whose first message is 91 or 123 bytes long also begins with ``[`` or ``{``."""
    try:
        size = os.path.getsize(path)
        if size > MAX_PROFILE_BYTES:
            raise ValueError(
                f"{path}: {size:,} bytes is more than the {MAX_PROFILE_BYTES:,} read; profile one step "
                "(a torch.profiler.schedule with active=1)"
            )
        with open(path, "rb") as f:
            data = f.read(MAX_PROFILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the profile ({exc.strerror or exc})") from None
    if data[:2] == b"\x1f\x8b":
        data = _inflated(data, path)
    name = os.path.basename(path)
    if data.lstrip()[:1] in (b"{", b"["):
        try:
            document = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            try:
                return execution_trace_spans(data, path), f"profile {name} (Chakra ET, replayed)"
            except ValueError:
                raise ValueError(f"{path}: not a Chrome trace JSON file ({exc})") from None
        events = document.get("traceEvents") if isinstance(document, dict) else document
        if not isinstance(events, list):
            raise ValueError(f"{path}: no traceEvents list (is this a torch.profiler export_chrome_trace file?)")
        return events, f"profile {name}"
    return execution_trace_spans(data, path), f"profile {name} (Chakra ET, replayed)"


def _inflated(data: bytes, path: str) -> bytes:
    """A gzip file's content, at most :data:`MAX_PROFILE_BYTES` of it."""
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(data, MAX_PROFILE_BYTES + 1)
    except zlib.error as exc:
        raise ValueError(f"{path}: a gzip file that does not inflate ({exc})") from None
    if len(out) > MAX_PROFILE_BYTES:
        raise ValueError(f"{path}: inflates to more than the {MAX_PROFILE_BYTES:,} bytes read; profile one step")
    if not inflater.eof:
        raise ValueError(f"{path}: a truncated gzip file")
    return out


def _event_flops(event: dict[str, Any]) -> float:
    """The FLOPs of one trace event: as the profiler recorded them, else a matrix product's from its shapes."""
    args = event.get("args") or {}
    recorded = args.get("flops")
    if isinstance(recorded, int | float) and math.isfinite(recorded) and recorded > 0:
        return float(recorded)
    first = _PRODUCT_INPUTS.get(str(event["name"]))
    dims = args.get("Input Dims")
    if first is None or not isinstance(dims, list) or len(dims) < first + 2:
        return 0.0
    a, b = dims[first], dims[first + 1]
    if not (isinstance(a, list) and isinstance(b, list) and len(a) >= 2 and len(b) >= 2):
        return 0.0
    try:
        return 2.0 * math.prod(int(d) for d in a) * int(b[-1])
    except (TypeError, ValueError):
        return 0.0


def _is_span(event: dict[str, Any]) -> bool:
    try:
        return isinstance(event.get("name"), str) and float(event["ts"]) >= 0 and float(event["dur"]) >= 0
    except (KeyError, TypeError, ValueError):
        return False
