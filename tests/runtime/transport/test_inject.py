"""ALLREDUCE_INJECT is bounded and validated when the group starts: every value that used to parse and then fail
inside a collective (an OverflowError), sleep for years, or print a raw int() message is refused up front, naming
the variable, the field and the limit."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from allreduce.runtime import spawn
from allreduce.runtime.launcher._spawn import RankFailedError
from allreduce.runtime.transport._inject import (
    ENV_VAR,
    MAX_FAULT_S,
    Distribution,
    injection_from_env,
    parse_injection,
)


@pytest.mark.parametrize(
    ("spec", "field", "limit"),
    [
        ("hold:rank=0:p=1:ms=inf", "ms", "3.6e+06"),
        ("hold:rank=0:p=1:ms=1e12", "ms", "3.6e+06"),
        ("hold:rank=0:p=nan:ms=1", "p", "(0, 1]"),
        ("delay:rank=0:lognormal:median=1ms,p99=1e300s", "p99", "3600 s"),
        ("delay:rank=0:1e12s", "the time", "3600 s"),
        ("delay:rank=0:uniform:low=1ms,high=2h", "high", ""),
        ("delay:rank=0:exponential:mean=1e5s", "mean", "3600 s"),
        ("pace:link=1->0:rate=1e-300B/s", "rate", "1000 B/s"),
        ("delay:rank=²:1ms", "rank", "at most 18 digits"),
        ("delay:rank=1:seed=1" + "0" * 5000 + ":1ms", "seed", "at most 18 digits"),
        ("kill:rank=0:call=-1:step=0", "call", "non-negative integer"),
        ("kill:rank=0:call=1", "step", "missing"),
    ],
)
def test_a_value_out_of_bounds_is_refused_naming_the_variable_field_and_limit(
    spec: str, field: str, limit: str
) -> None:
    with pytest.raises(ValueError, match=ENV_VAR) as refused:
        parse_injection(spec, 0, 2)
    message = str(refused.value)
    assert message.startswith(ENV_VAR), message
    assert field in message, message
    assert limit in message, message


def test_a_kill_names_the_call_and_step_of_its_rank_only() -> None:
    spec = "kill:rank=3:call=2:step=5"
    assert parse_injection(spec, 3, 4).kill_at == (2, 5)
    assert injection_from_env({ENV_VAR: spec}, 1, 4) is None  # nothing to inject on another rank
    assert injection_from_env({ENV_VAR: spec}, 0, 3) is None  # a group shrunk past rank 3


@pytest.mark.parametrize(
    "distribution", [Distribution("exponential", 1000.0), Distribution("lognormal", 1e-9, float(MAX_FAULT_S))]
)
def test_every_draw_of_an_unbounded_tail_is_cut_at_the_limit(distribution: Distribution) -> None:
    rng = random.Random(0)
    draws = [distribution.draw(rng) for _ in range(20_000)]
    assert max(draws) <= MAX_FAULT_S
    assert max(draws) > MAX_FAULT_S / 2  # the tail did reach the cut


@pytest.mark.parametrize("spec", [" ", ";", " ; ;"])
def test_a_value_without_effects_is_as_if_unset_and_warns_nothing(
    spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert injection_from_env({ENV_VAR: spec}, 0, 2) is None
    assert capsys.readouterr().err == ""


def _one_call(group: object) -> float:
    x = np.ones(16, np.float32)
    group.all_reduce(x)  # type: ignore[attr-defined]
    return float(x[0])


@pytest.mark.slow
def test_an_overflowing_injection_fails_init_on_real_ranks_not_a_collective() -> None:
    with pytest.raises(RankFailedError) as failed:
        spawn(2, _one_call, env={ENV_VAR: "pace:link=1->0:rate=1e-300B/s"}, timeout_s=60)
    message = str(failed.value)
    assert ENV_VAR in message
    assert "rate" in message
    assert "OverflowError" not in message


def test_the_cli_tune_refuses_to_cache_an_injected_model(tmp_path: Path) -> None:
    tune = tmp_path / "tune.json"
    done = subprocess.run(
        [sys.executable, "-m", "allreduce", "tune", "--transport", "shm", "--repeats", "1"],
        env={**os.environ, ENV_VAR: "delay:rank=1:1ms", "ALLREDUCE_TUNE_FILE": str(tune)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    assert ENV_VAR in done.stderr
    assert "Traceback" not in done.stderr
    assert not tune.exists()
