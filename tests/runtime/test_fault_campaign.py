"""The fault campaign's short version: two faults of every kind, run by ``benchmarks/faults.py`` once per module.

Real ranks started by hand (no launcher), real faults (SIGKILL, SIGSTOP, exits, mismatched calls, racing threads,
strangers on every listening port, junk in the store, corrupted shared-memory control words). Each test asserts one
property of one kind's row of the campaign's table: no hang, no silent wrong result, the culprit named, nothing
left behind. The full campaign (1,000 faults) and what each column means: docs/faults.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

FAULTS_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "faults.py"
SEED = 2026
FAULTS_PER_KIND = 2
CAMPAIGN_TIMEOUT_S = 270.0  # about a minute on 2 loaded cores; a hang inside a case is killed by the campaign


def _kinds() -> tuple[str, ...]:
    """The campaign's own list of fault kinds (benchmarks/ is not a package: load the script as a module)."""
    spec = importlib.util.spec_from_file_location("faults_campaign", FAULTS_SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    kinds: tuple[str, ...] = module.KINDS
    return kinds


KINDS = _kinds()

pytestmark = [pytest.mark.slow, pytest.mark.serial]


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("faults") / "campaign.json"
    command = [
        sys.executable,
        str(FAULTS_SCRIPT),
        "--faults",
        str(FAULTS_PER_KIND * len(KINDS)),
        "--seed",
        str(SEED),
        "--jobs",
        "2",
        "--json",
        str(out),
    ]
    result = subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=CAMPAIGN_TIMEOUT_S, env=dict(os.environ)
    )
    assert out.exists(), f"the campaign did not finish: {result.stderr[-3000:]}"
    report = json.loads(out.read_text())
    rows: dict[str, dict[str, Any]] = {row["kind"]: row for row in report["summary"]}
    for case in report["cases"]:  # each failing case's problems and seed, for the assertion messages
        rows[case["kind"]].setdefault("problems", []).extend(f"seed {case['seed']}: {p}" for p in case["problems"])
    return rows


def _row(campaign: dict[str, dict[str, Any]], kind: str) -> dict[str, Any]:
    row = campaign[kind]
    assert row["faults"] == FAULTS_PER_KIND
    return row


def _problems(campaign: dict[str, dict[str, Any]], kind: str) -> str:
    return "; ".join(campaign[kind].get("problems", []))[:2000]


@pytest.mark.parametrize("kind", KINDS)
def test_no_fault_hangs_a_rank(campaign: dict[str, dict[str, Any]], kind: str) -> None:
    assert _row(campaign, kind)["hangs"] == 0, _problems(campaign, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_no_fault_gives_a_silent_wrong_result(campaign: dict[str, dict[str, Any]], kind: str) -> None:
    assert _row(campaign, kind)["silent_wrong"] == 0, _problems(campaign, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_every_error_names_the_culprit(campaign: dict[str, dict[str, Any]], kind: str) -> None:
    assert _row(campaign, kind)["culprit_named_pct"] == 100.0, _problems(campaign, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_no_fault_leaves_a_process_behind(campaign: dict[str, dict[str, Any]], kind: str) -> None:
    assert _row(campaign, kind)["leftover_processes"] == 0, _problems(campaign, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_no_fault_leaves_shared_memory_behind(campaign: dict[str, dict[str, Any]], kind: str) -> None:
    assert _row(campaign, kind)["leftover_shm_files"] == 0, _problems(campaign, kind)
