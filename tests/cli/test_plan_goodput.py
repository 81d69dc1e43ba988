"""``allreduce plan``'s failures section: goodput per recovery policy, the scaling table's goodput column, the JSON,
and the flags' errors."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from allreduce.cli import main
from allreduce.plan import LLAMA3_RATES, Fleet, checkpoint_bytes, daly_interval
from allreduce.plan._goodput import restart_goodput

SMALL = ("--params", "5e7", "--gpus", "16", "--topology", "fat-tree:k=4", "--compute-ms", "20", "--no-what-if")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["plan", *argv])
    except SystemExit as exc:  # argparse's own refusals
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_the_plan_prints_each_recovery_policys_goodput(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *SMALL, "--no-scaling")
    assert code == 0, err
    assert "failures on 16 GPUs (16 GPUs, 2 hosts, 16 NICs, 48 cables, 20 switches)" in out
    for policy in ("restart from the last checkpoint", "with hot spare hosts", "shrink and continue"):
        assert policy in out
    assert "\nwith failures  " in out  # beside the step time


@pytest.mark.slow
def test_the_json_goodput_is_dalys_closed_form(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *SMALL, "--no-scaling", "--json", "--restart-s", "900", "--storage-gbps", "8")
    assert code == 0, err
    goodput = json.loads(out)["goodput"]
    mtbf = goodput["mtbf_s"]
    write_s = checkpoint_bytes(5e7) / 1e9  # 8 Gbit/s
    restart = goodput["policies"][0]
    assert goodput["checkpoint_write_s"] == pytest.approx(write_s)
    assert restart["interval_s"] == pytest.approx(daly_interval(write_s, mtbf))
    assert restart["goodput"] == pytest.approx(restart_goodput(restart["interval_s"], write_s, 900.0, mtbf))


def _fleet(goodput: dict[str, Any], *, gpus_per_host: int) -> Fleet:
    """The parts a plan's --json counted, as a fleet."""
    counts = goodput["counts"]
    return Fleet(counts["gpu"], gpus_per_host, nics=counts["nic"], cables=counts["cable"], switches=counts["switch"])


@pytest.mark.slow
def test_the_job_fails_as_often_as_its_parts_say(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *SMALL, "--no-scaling", "--json", "--gpus-per-host", "4")
    assert code == 0, err
    goodput = json.loads(out)["goodput"]
    assert goodput["counts"]["host"] == 4
    assert goodput["mtbf_s"] == pytest.approx(_fleet(goodput, gpus_per_host=4).mtbf_s(LLAMA3_RATES))


@pytest.mark.slow
def test_given_failure_rates_replace_the_parts_they_name(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *SMALL, "--no-scaling", "--json", "--failure-rates", "gpu=1e-3,switch=1e-4")
    assert code == 0, err
    goodput = json.loads(out)["goodput"]
    rates = dataclasses.replace(LLAMA3_RATES, gpu_per_h=1e-3, switch_per_h=1e-4)
    assert goodput["mtbf_s"] == pytest.approx(_fleet(goodput, gpus_per_host=8).mtbf_s(rates))
    assert goodput["failures_per_h"]["switch"] == pytest.approx(goodput["counts"]["switch"] * 1e-4)
    assert goodput["rates_source"].startswith("given: gpu 0.001, switch 0.0001 per part-hour; the rest Llama 3")


@pytest.mark.slow
def test_the_scaling_table_has_a_goodput_column_falling_with_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *SMALL, "--json")
    assert code == 0, err
    rows = json.loads(out)["scaling"]
    assert [r["gpus"] for r in rows] == [8, 16]
    assert rows[0]["goodput"] > rows[1]["goodput"]


@pytest.mark.slow
def test_no_failures_leaves_the_section_out(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *SMALL, "--no-scaling", "--no-failures", "--json")
    assert code == 0, err
    assert "goodput" not in json.loads(out)


@pytest.mark.slow
def test_the_what_if_table_has_a_row_per_recovery_policy(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--params", "5e7", "--gpus", "16", "--topology", "fat-tree:k=4", "--compute-ms",
                         "20", "--no-scaling", "--loss", "0", "--algorithm", "ring", "--json")  # fmt: skip
    assert code == 0, err
    document = json.loads(out)
    rows = [w for w in document["what_ifs"] if "goodput" in w]
    assert [w["change"] for w in rows] == [
        "failures: restart from the last checkpoint",
        "failures: restart, hot spare hosts",
        "failures: shrink and continue",
    ]
    for row, policy in zip(rows, document["goodput"]["policies"], strict=True):
        assert row["goodput"] == policy["goodput"]
        assert row["step_s"] == document["base"]["step_s"]
        assert row["effective_step_s"] == pytest.approx(row["step_s"] / policy["goodput"])


@pytest.mark.slow
def test_the_plan_says_which_elastic_recovery_it_used(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *SMALL, "--no-scaling", "--elastic-timeout-s", "60", "--elastic-lease-s", "0")
    assert code == 0, err
    assert "elastic recovery " in out
    assert "modelled from the runtime's kill benchmark, benchmarks/bench_elastic.py" in out
    assert "two 60 s timeouts: 120.3 s" in out
    code, out, err = run(capsys, *SMALL, "--no-scaling")
    assert code == 0, err
    assert "dead to the store after its 10 s lease (no heartbeat), found in 9.75 s on average: 10.04 s" in out
    code, out, err = run(capsys, *SMALL, "--no-scaling", "--elastic-recovery-s", "42")
    assert code == 0, err
    assert "elastic recovery 42 s a failure, given (--elastic-recovery-s)" in out
    assert out.splitlines()[-1].split()[-4:-2] == ["42", "s"]  # the elastic row's pause per failure


@pytest.mark.slow
def test_measure_recovery_kills_a_rank_here_and_the_json_says_it_was_measured(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, *SMALL, "--no-scaling", "--json", "--measure-recovery")
    assert code == 0, err
    goodput = json.loads(out)["goodput"]
    recovery = goodput["elastic_recovery"]
    assert recovery["basis"] == "measured"
    assert recovery["source"].startswith("a kill measured here, 1 of 4 ranks over shm SIGKILLed")
    assert recovery["timeout_s"] == 300.0
    # a process exit costs the measured kill to the survivors' next step (seen through the victim's pidfd, not a
    # timeout: far below the group's 60 s), plus the store requests of 16 ranks beyond the measured 4
    assert 0 < recovery["exit_s"] - recovery["store_s"] < 60.0
    assert recovery["exit_s"] < recovery["silent_s"]
    assert goodput["policies"][2] == {**goodput["policies"][2], "policy": "elastic", "restart_s": recovery["seconds"]}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--replace-s", "700"), "--replace-s (700) is part of --restart-s (600)"),
        (("--repair-h", "inf"), "--repair-h must be a number of hours"),
        (("--storage-gbps", "0"), "--storage-gbps"),
        (("--elastic-recovery-s", "-1"), "--elastic-recovery-s must be a number of seconds"),
        (("--elastic-recovery-s", "5", "--measure-recovery"), "--elastic-recovery-s or --measure-recovery, not both"),
        (("--measure-recovery", "udp"), "--measure-recovery: invalid choice"),
        (("--measure-recovery", "--no-failures"), "--measure-recovery measures the elastic pause of goodput"),
        (("--elastic-timeout-s", "0"), "--elastic-timeout-s must be > 0"),
        (("--failure-rates", "tpu=1e-5"), "--failure-rates: 'tpu=1e-5': write PART=RATE with PART one of gpu"),
        (("--failure-rates", "gpu=2"), "--failure-rates: failure rate gpu_per_h must be"),
        (("--failure-rates", "gpu=1e-5,gpu=2e-5"), "--failure-rates: gpu is given twice"),
    ],
)
def test_bad_failure_flags_are_named(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str) -> None:
    code, _, err = run(capsys, *SMALL, "--no-scaling", *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
