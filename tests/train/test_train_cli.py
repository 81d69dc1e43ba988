"""``allreduce train``: real ranks, JSON output, the slow rank named, bad input refused in one line."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable

import pytest

from allreduce.cli._main import main


@pytest.mark.slow
@pytest.mark.serial
def test_train_json_names_the_injected_slow_rank(
    run_allreduce: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    out = run_allreduce("train", "-n", "2", "--epochs", "2", "--slow-rank", "1=0.05", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["slowest_rank"] == 1
    assert [e["epoch"] for e in report["epochs"]] == [1, 2]
    keys = {"epoch", "loss", "accuracy", "step_s", "compute_s", "comm_s", "exposed_comm_s", "wait_s"}
    for epoch in report["epochs"]:
        assert set(epoch) == keys
        assert 0.0 <= epoch["accuracy"] <= 1.0
        assert epoch["loss"] > 0
        # The breakdown is consistent: exposed communication is part of the step, waiting part of exposed.
        assert 0.0 <= epoch["exposed_comm_s"] <= epoch["step_s"]
        assert epoch["compute_s"] <= epoch["step_s"]
    # Training progresses: the second epoch's loss is below the first's.
    assert report["epochs"][1]["loss"] < report["epochs"][0]["loss"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "2", "--slow-rank", "5=0.1"], "slow rank 5 is not a rank of 2 ranks"),
        (["-n", "2", "--slow-rank", "1"], "expected RANK=SECONDS"),
        (["-n", "2", "--slow-rank", "1=fast"], "the delay in '1=fast'"),
        (["-n", "0"], "-n must be >= 1"),
        (["-n", "2", "--batch-size", "1000"], "exceeds the 1438 training samples"),
        (["-n", "2", "--bucket-mb", "0"], "bucket size must be > 0 MB"),
        (["-n", "2", "--kill-rank", "0@3"], "rank 0 hosts the group's store"),
        (["-n", "2", "--kill-rank", "2@3"], "kill rank 2 is not a rank of 2 ranks"),
        (["-n", "1", "--kill-rank", "0@3"], "killing a rank needs at least 2 ranks"),
        (["-n", "2", "--kill-rank", "1"], "expected RANK@STEP"),
        (["-n", "2", "--kill-rank", "1@x"], "must be integers"),
        (["-n", "2", "--kill-rank", "1@-1"], "kill step must be >= 0"),
        (["-n", "2", "--kill-rank", "1@1000"], "kill step 1000 is past the run's last step"),
        (["-n", "2", "--kill-rank", "1@3", "--transport", "torch"], "not on torch"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["train", *argv])
    except SystemExit as exc:  # argparse rejects malformed values itself, with status 2
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err
