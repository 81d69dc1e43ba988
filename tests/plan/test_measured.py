"""Backward timing measured on a real model and read from torch.profiler traces the test records itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from allreduce.plan._measured import MeasuredBackward, measure_module, read_profile  # noqa: E402
from profiler_traces import record_trace  # noqa: E402


def _mlp() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8)
    )


def _sizes(net: Any) -> tuple[int, ...]:
    return tuple(int(p.numel()) for p in net.parameters())


def _record_trace(path: Path, *, shapes: bool = True, steps: bool = True) -> None:
    record_trace(path, _mlp(), torch.randn(64, 256), shapes=shapes, steps=steps)


@pytest.mark.slow
def test_measuring_a_model_times_each_parameter_in_registration_order() -> None:
    net = _mlp()
    measured = measure_module(net, (torch.randn(64, 256),), repeats=3)
    assert measured.tensor_params == _sizes(net)
    assert measured.forward_s > 0
    assert measured.backward_s > 0
    assert measured.optimizer_s > 0


def test_the_last_layers_gradients_are_ready_before_the_first_layers() -> None:
    measured = measure_module(_mlp(), (torch.randn(64, 256),), repeats=3)
    first_weight, last_weight = measured.ready_fraction[0], measured.ready_fraction[-2]
    assert last_weight < first_weight


def test_a_profile_gives_back_the_models_tensors_in_registration_order(tmp_path: Path) -> None:
    trace = tmp_path / "step.json"
    _record_trace(trace)
    measured = read_profile(str(trace))
    assert measured.tensor_params == _sizes(_mlp())
    assert list(measured.ready_fraction) == sorted(measured.ready_fraction, reverse=True)
    assert measured.forward_s > 0
    assert measured.backward_s > 0
    assert measured.optimizer_s > 0


def test_a_profile_without_step_marks_is_read_from_its_last_step(tmp_path: Path) -> None:
    trace = tmp_path / "steps.json"
    _record_trace(trace, steps=False)
    assert read_profile(str(trace)).tensor_params == _sizes(_mlp())


def test_a_profile_without_shapes_is_refused_saying_how_to_record_one(tmp_path: Path) -> None:
    trace = tmp_path / "step.json"
    _record_trace(trace, shapes=False)
    with pytest.raises(ValueError, match="record_shapes=True"):
        read_profile(str(trace))


def test_a_file_that_is_not_a_trace_is_refused_naming_it(tmp_path: Path) -> None:
    junk = tmp_path / "junk.json"
    junk.write_text("{not json")
    with pytest.raises(ValueError, match=r"junk\.json: not a Chrome trace"):
        read_profile(str(junk))


def test_a_trace_without_backward_is_refused(tmp_path: Path) -> None:
    trace = tmp_path / "forward.json"
    trace.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1.0, "dur": 2.0}]}))
    with pytest.raises(ValueError, match="no backward"):
        read_profile(str(trace))


def test_scaling_keeps_the_ready_fractions_and_scales_every_duration() -> None:
    measured = MeasuredBackward("m", (10, 20), (1.0, 0.5), forward_s=1.0, backward_s=2.0, optimizer_s=0.5)
    target = measured.scaled(0.3, "target")
    assert target.ready_fraction == measured.ready_fraction
    assert (target.forward_s, target.backward_s, target.optimizer_s) == pytest.approx((0.1, 0.2, 0.05))


# FLOPs of one forward and backward of _mlp on 64 inputs: each Linear's product 2·batch·in·out forward, again for
# its weight's gradient, and again for its input's gradient except the first layer's (its input needs none).
MLP_FLOPS = 2 * 64 * (2 * (256 * 512 + 512 * 512 + 512 * 8) + (512 * 512 + 512 * 8))


def test_measuring_a_model_counts_its_forward_and_backward_flops() -> None:
    assert measure_module(_mlp(), (torch.randn(64, 256),), repeats=1).flops == MLP_FLOPS


def test_a_profile_counts_the_same_flops_from_its_matrix_products_shapes(tmp_path: Path) -> None:
    trace = tmp_path / "step.json"
    _record_trace(trace)
    assert read_profile(str(trace)).flops == MLP_FLOPS


def test_on_a_target_gpu_the_counted_flops_run_at_its_peak_times_mfu() -> None:
    measured = MeasuredBackward("m", (10, 20), (1.0, 0.5), forward_s=1.0, backward_s=2.0, optimizer_s=0.5, flops=6e12)
    target = measured.on_gpu(gpu_tflops=100.0, mfu=0.5)
    assert target.compute_s == pytest.approx(6e12 / 50e12)
    assert target.backward_share == pytest.approx(measured.backward_share)
    assert target.ready_fraction == measured.ready_fraction
    assert "6000 GFLOP per micro-batch counted, 2 TFLOPS here, 100 TFLOPS x MFU 0.5 there" in target.source


def test_a_step_without_counted_flops_cannot_be_moved_to_a_target_gpu() -> None:
    measured = MeasuredBackward("trace.json", (10,), (1.0,), forward_s=1.0, backward_s=2.0, optimizer_s=0.5)
    with pytest.raises(ValueError, match=r"trace\.json: no FLOPs were counted.*give --compute-ms"):
        measured.on_gpu(gpu_tflops=100.0, mfu=0.5)
