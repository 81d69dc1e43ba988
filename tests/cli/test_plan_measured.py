"""``allreduce plan --profile`` and ``--module ... --measure``: the step overlaps buckets as the real model's
backward produced them; the bucket ready times and the timeline against closed forms; errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from allreduce.cli import main
from allreduce.plan import Compute, Model, step_time
from profiler_traces import record_mlp_trace

CLUSTER = ("--gpus", "8", "--topology", "switch:8", "--no-scaling", "--no-what-if", "--no-failures")

MODULE = """
import torch

def mlp_and_batch():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    return net, torch.randn(32, 128)

def mlp_only():
    return torch.nn.Linear(4, 4)
"""


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["plan", *argv])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_a_buckets_ready_time_is_its_latest_tensors() -> None:
    # registration order a, b, c; backward produces c, b, a; buckets of whole tensors in reverse order
    model = Model("m", (10, 20, 30), whole_tensors=True, tensor_ready=(0.9, 0.5, 0.1))
    assert model.bucket_ready((30 * 2, 30 * 2), element_bytes=2) == (0.1, 0.9)


def test_a_bucket_ready_at_backwards_start_is_all_reduced_then() -> None:
    # one micro-batch of 1 s, backward the last 0.5 s; the bucket is ready at 0.5 s and takes 2 s
    compute = Compute(1.0, backward_fraction=0.5, bucket_ready=(0.0,))
    assert step_time((100,), (2.0,), compute).step_s == pytest.approx(2.5)
    uniform = Compute(1.0, backward_fraction=0.5)
    assert step_time((100,), (2.0,), uniform).step_s == pytest.approx(3.0)


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    pytest.importorskip("torch")
    path = tmp_path / "step.json"
    record_mlp_trace(path)
    return path


@pytest.mark.slow
def test_a_profile_drives_the_plan(capsys: pytest.CaptureFixture[str], trace: Path) -> None:
    code, out, err = run(capsys, "--profile", str(trace), *CLUSTER, "--json")
    assert code == 0, err
    base = json.loads(out)["base"]
    assert base["model"] == "profile step.json"
    assert base["params"] == 128 * 256 + 256 + 256 * 10 + 10
    assert 0 < base["backward_fraction"] < 1


@pytest.mark.slow
def test_measuring_a_module_drives_the_plan(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    (tmp_path / "planned_models.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run(capsys, "--module", "planned_models:mlp_and_batch", "--measure", *CLUSTER, "--json")
    assert code == 0, err
    base = json.loads(out)["base"]
    assert base["params"] == 128 * 256 + 256 + 256 * 10 + 10
    assert base["micro_batch_s"] > 0


def test_measure_needs_a_module(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "--params", "1e6", "--measure", *CLUSTER)
    assert code == 2
    assert "--measure runs a model: give it with --module" in err


@pytest.mark.slow
def test_measure_says_what_the_function_must_return(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    (tmp_path / "planned_models.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = run(capsys, "--module", "planned_models:mlp_only", "--measure", *CLUSTER)
    assert code == 2
    assert "to return (module, inputs)" in err


def test_a_missing_profile_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "--profile", str(tmp_path / "none.json"), *CLUSTER)
    assert code == 2
    assert "none.json: cannot read the profile" in err


@pytest.mark.slow
def test_a_profile_moved_to_a_target_gpu_runs_its_counted_flops_there(
    capsys: pytest.CaptureFixture[str], trace: Path
) -> None:
    code, out, err = run(capsys, "--profile", str(trace), *CLUSTER, "--gpu-tflops", "100", "--mfu", "0.5", "--json")
    assert code == 0, err
    document = json.loads(out)
    measured = document["measured"]
    assert measured["flops"] == 2 * 32 * (2 * (128 * 256 + 256 * 10) + 256 * 10)
    assert document["base"]["micro_batch_s"] == pytest.approx(measured["flops"] / 50e12)
    assert "moved to the target GPU" in measured["source"]


@pytest.mark.slow
def test_the_json_of_a_profiled_plan_has_the_steps_timeline(capsys: pytest.CaptureFixture[str], trace: Path) -> None:
    code, out, err = run(capsys, "--profile", str(trace), *CLUSTER, "--json")
    assert code == 0, err
    document = json.loads(out)
    timeline, base = document["timeline"], document["base"]
    assert len(timeline["buckets"]) == base["buckets"]
    assert sum(b["size_bytes"] for b in timeline["buckets"]) == base["params"] * 2  # bf16 gradients
    assert max(timeline["compute_end_s"], timeline["buckets"][-1]["end_s"]) == pytest.approx(base["step_s"])


@pytest.mark.slow
def test_a_profiled_plan_says_where_its_backward_timing_comes_from(
    capsys: pytest.CaptureFixture[str], trace: Path
) -> None:
    code, out, err = run(capsys, "--profile", str(trace), *CLUSTER)
    assert code == 0, err
    assert "backward timing: profile step.json: forward" in out


@pytest.fixture(scope="module")
def execution_trace(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    pytest.importorskip("torch")
    from profiler_traces import record_mlp_execution_trace

    return record_mlp_execution_trace(tmp_path_factory.mktemp("et"))


@pytest.mark.slow
def test_an_execution_trace_plans_as_the_kineto_trace_of_the_same_step(
    capsys: pytest.CaptureFixture[str], execution_trace: tuple[Path, Path]
) -> None:
    documents = []
    for path in execution_trace:
        code, out, err = run(capsys, "--profile", str(path), *CLUSTER, "--json")
        assert code == 0, err
        documents.append(json.loads(out))
    from_et, from_kineto = documents
    assert from_et["base"]["model"] == "profile step.et"
    assert "(Chakra ET, replayed)" in from_et["measured"]["source"]
    assert from_et["base"]["params"] == from_kineto["base"]["params"]
    sizes = [[b["size_bytes"] for b in d["timeline"]["buckets"]] for d in documents]
    assert sizes[0] == sizes[1]


def test_a_malformed_execution_trace_is_one_line_naming_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "cut.et"
    path.write_bytes(b"\x05\x0a\x03abc\x40\x01")  # a metadata message, then a node of 64 bytes with 1 there
    code, _, err = run(capsys, "--profile", str(path), *CLUSTER)
    assert code == 2
    assert f"--profile: {path}: neither a Chrome trace (JSON) nor a Chakra execution trace: truncated" in err
    assert "Traceback" not in err
