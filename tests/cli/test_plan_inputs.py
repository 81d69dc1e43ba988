"""``allreduce plan``'s inputs: user algorithms through the registry, limits that name their flag, readable counts."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from allreduce.cli import main
from allreduce.plan import MAX_BUCKETS, Compute, PlanRequest, format_count, model_from_params

ROOT = Path(__file__).resolve().parents[2]
MY_RING = str(ROOT / "examples" / "algorithms" / "my_ring.py") + ":bidirectional_ring"
SMALL = ("--params", "2.56e7", "--gpus", "16", "--topology", "fat-tree:k=4", "--compute-ms", "20")
QUICK = (*SMALL, "--no-scaling", "--no-what-if")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(code: int, err: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "internal error" not in err
    assert "Traceback" not in err
    return lines[0]


def test_a_user_algorithm_from_a_file_is_planned_with(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *QUICK, "-a", MY_RING)
    assert code == 0, err
    assert "by bidirectional_ring in" in out
    assert "by ring" not in out


def test_naive_is_planned_with_when_named(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *QUICK, "-a", "naive")
    assert code == 0, err
    assert "by naive in" in out


def test_auto_never_picks_naive_or_a_user_algorithm_that_is_not_automatic(capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, *QUICK, "-a", MY_RING)  # registers it in this process
    code, out, err = run(capsys, *QUICK)
    assert code == 0, err
    assert "naive" not in out
    assert "bidirectional_ring" not in out


@pytest.mark.parametrize(
    ("algorithm", "culprit"),
    [("no_such", "'no_such'"), ("missing.py:f", "missing.py"), ("ring,naive", "name one algorithm")],
)
def test_an_algorithm_that_cannot_be_planned_with_is_one_line_naming_it(
    capsys: pytest.CaptureFixture[str], algorithm: str, culprit: str
) -> None:
    line = _one_line_error(*run(capsys, *QUICK, "-a", algorithm)[::2])
    assert "--algorithm" in line
    assert culprit in line


def test_a_bucket_cap_under_one_byte_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(*run(capsys, *QUICK, "--bucket-mb", "1e-9")[::2])
    assert "--bucket-mb" in line
    assert "0 bytes" in line


def test_a_first_bucket_under_one_byte_names_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(*run(capsys, *QUICK, "--first-bucket-mb", "1e-9")[::2])
    assert "--first-bucket-mb" in line


def test_1e18_parameters_are_refused_up_front_with_the_bucket_count_and_cap(
    capsys: pytest.CaptureFixture[str],
) -> None:
    tracemalloc.start()
    try:
        line = _one_line_error(*run(capsys, *QUICK[2:], "--params", "1e18")[::2])
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "76,293,945,314 buckets" in line
    assert f"{MAX_BUCKETS:,}" in line
    assert "--bucket-mb 25" in line
    assert "GB" in line
    assert peak_bytes < 50e6


def test_the_bucket_cap_refusal_is_the_library_s_too() -> None:
    with pytest.raises(ValueError, match="more than the cap"):
        PlanRequest(model=model_from_params(1e15), gpus=16, topology="fat-tree:k=4", compute=Compute(0.01))


def test_a_count_of_buckets_at_the_cap_is_accepted() -> None:
    # 1 MiB first bucket, then MAX_BUCKETS - 1 full 25 MiB buckets of bf16 gradients
    params = (2**20 + (MAX_BUCKETS - 1) * 25 * 2**20) // 2
    request = PlanRequest(model=model_from_params(params), gpus=16, topology="fat-tree:k=4", compute=Compute(0.01))
    assert len(request.bucket_bytes) == MAX_BUCKETS


def test_the_parameter_count_is_printed_with_a_suffix(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *QUICK)
    assert code == 0, err
    assert out.startswith("25.6M-parameter transformer (bf16 gradients)")
    assert "0.0256B" not in out


@pytest.mark.parametrize(
    ("count", "text"),
    [(340, "340"), (25_557_032, "25.6M"), (340e6, "340M"), (6_738_415_616, "6.74B"), (1.2e13, "12T"), (1e18, "1e+18")],
)
def test_format_count(count: float, text: str) -> None:
    assert format_count(count) == text


@pytest.mark.parametrize("params", ["inf", "1.5"])
def test_a_parameter_count_that_is_not_a_whole_number_names_the_flag(
    capsys: pytest.CaptureFixture[str], params: str
) -> None:
    line = _one_line_error(*run(capsys, *QUICK[2:], "--params", params)[::2])
    assert "--params" in line
