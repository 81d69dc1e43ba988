"""Workloads: presets, DDP bucketing (checked against torch's own assignment), compute from FLOPs."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from allreduce.plan import (
    DDP_BUCKET_CAP_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    PRESETS,
    compute_seconds,
    ddp_buckets,
    model_from_module,
    model_from_params,
    preset,
)

MiB = 2**20


def test_presets_cover_the_issue_models_with_their_paper_parameter_counts() -> None:
    expected = {
        "resnet50": 25.6e6,
        "bert-large": 340e6,
        "gpt2-xl": 1542e6,
        "llama2-7b": 6.74e9,
        "llama2-70b": 69.0e9,
    }
    for name, params in expected.items():
        assert PRESETS[name].params == pytest.approx(params, rel=0.01), name


def test_a_preset_splits_into_a_1MiB_first_bucket_full_caps_and_the_remainder() -> None:
    grads = preset("llama2-7b").params * 2
    buckets = ddp_buckets([grads], whole_tensors=False)
    assert buckets[0] == DDP_FIRST_BUCKET_BYTES
    assert set(buckets[1:-1]) == {DDP_BUCKET_CAP_BYTES}
    assert 0 < buckets[-1] <= DDP_BUCKET_CAP_BYTES
    assert sum(buckets) == grads


@given(st.lists(st.integers(1, 3 * MiB), min_size=1, max_size=30), st.integers(1, 4 * MiB), st.integers(1, 2 * MiB))
def test_whole_tensors_bucket_like_torch_ddp(sizes: list[int], cap: int, first: int) -> None:
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    elements = [math.ceil(s / 4) for s in sizes]
    tensors = [torch.empty(n, dtype=torch.float32) for n in elements]
    ready_order = list(reversed(tensors))  # backward produces gradients in reverse registration order
    first = min(first, cap)
    indices, _ = dist._compute_bucket_assignment_by_size(ready_order, [first, cap], [False] * len(tensors))
    theirs = tuple(sum(ready_order[i].numel() * 4 for i in bucket) for bucket in indices)
    ours = ddp_buckets([n * 4 for n in elements], bucket_cap_bytes=cap, first_bucket_bytes=first)
    assert ours == theirs


def test_transformer_compute_is_six_params_tokens_at_the_effective_flops() -> None:
    model = model_from_params(1e9)
    seconds = compute_seconds(model, gpu_tflops=100, mfu=0.5, tokens_per_gpu=1000)
    assert seconds == pytest.approx(6 * 1e9 * 1000 / 50e12, rel=1e-12)


def test_cnn_compute_needs_samples_and_is_three_forward_passes() -> None:
    model = preset("resnet50")
    with pytest.raises(ValueError, match="samples-per-gpu"):
        compute_seconds(model, gpu_tflops=100, mfu=0.5, tokens_per_gpu=1000)
    seconds = compute_seconds(model, gpu_tflops=100, mfu=0.5, samples_per_gpu=256)
    assert seconds == pytest.approx(3 * 2 * 3.8e9 * 256 / 50e12, rel=1e-12)


def test_a_torch_module_is_read_for_its_parameters_without_a_forward_pass() -> None:
    pytest.importorskip("torch")
    model = model_from_module("plan_test_nets:two_layer")
    assert model.tensor_params == (10 * 20, 20, 20 * 3, 3)


def test_a_bad_module_spec_names_the_problem() -> None:
    with pytest.raises(ValueError, match="module:function"):
        model_from_module("no_colon_here")
    with pytest.raises(ValueError, match="has no function"):
        model_from_module("plan_test_nets:missing")


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="llama2-7b"):
        preset("gpt-5")
