"""``allreduce tail --engine``: which engine computed the samples, in the text and the JSON."""

from __future__ import annotations

import json

import pytest

from allreduce.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["tail", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_event_engine_counts_every_sample(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "-t", "switch:n=8", "--size", "1MiB", "-k", "20", "--loss", "1e-5", "--rto", "1ms", "--engine", "event"
    )
    assert code == 0, err
    assert "samples by engine" in out
    assert "\n  ring                 20 event\n" in out


def test_auto_reruns_uncertified_samples_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("-t", "fat-tree:k=4", "--size", "4MiB", "-a", "halving_doubling", "--placement", "random", "--seed", "3")
    code, out, err = run(capsys, *argv, "-k", "10", "--jitter-rank", "exponential:mean=10us", "--json")
    assert code == 0, err
    (hd,) = json.loads(out)["algorithms"]
    assert hd["samples_by_engine"] == {"fast": 0, "fast ~": 0, "event": 10}
    assert hd["exact"] is True


def test_a_zero_exact_budget_leaves_the_uncertified_samples_to_the_fast_engine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ("-t", "fat-tree:k=4", "--size", "4MiB", "-a", "halving_doubling", "--placement", "random", "--seed", "3")
    code, out, err = run(capsys, *argv, "-k", "10", "--jitter-rank", "exponential:mean=10us", "--exact-budget", "0")
    assert code == 0, err
    assert "--engine" in out  # the note on the ~ samples says how to get them exact


@pytest.mark.parametrize("budget", ["-1", "nan", "soon", "1e9"])
def test_a_bad_exact_budget_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], budget: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["tail", "-t", "switch:n=8", "--size", "1MiB", "--exact-budget", budget])
    assert exit_info.value.code == 2
    assert "--exact-budget" in capsys.readouterr().err


def test_fast_engine_marks_uncertified_samples(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("-t", "fat-tree:k=4", "--size", "4MiB", "-a", "halving_doubling", "--placement", "random", "--seed", "3")
    code, out, err = run(capsys, *argv, "-k", "10", "--jitter-rank", "exponential:mean=10us", "--engine", "fast")
    assert code == 0, err
    assert "halving_doubling     10 fast ~" in out
    assert "sensitivity ~" in out


def test_unknown_engine_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["tail", "-t", "switch:n=8", "--size", "1MiB", "--engine", "exact"])
    assert exc.value.code == 2
    assert "--engine" in capsys.readouterr().err


def test_event_engine_with_a_timed_fault_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(
        capsys, "-t", "switch:n=8", "--size", "1MiB", "--link-down", "gpu2<->switch0@1ms+1ms", "--engine", "event"
    )
    assert code == 2
    assert "timed faults" in err
    assert len(err.strip().splitlines()) == 1
