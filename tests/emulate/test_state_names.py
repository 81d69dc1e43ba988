"""Emulation names reach the file system only as ``up`` accepts them: no verb reads, writes or deletes a state file
outside the state directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from allreduce.emulate import EmulationError, EmulationSpec, existing_emulations, load, remove
from allreduce.emulate._netns import _State

HOSTILE = ["../victim", "../../victim", "a/b", "/tmp/victim", "UPPER", "x" * 9, "ok\n", ""]


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A JSON file beside the state directory, shaped like a state file (what `down` used to delete)."""
    state = tmp_path / "state"
    state.mkdir()
    path = tmp_path / "victim.json"
    _State(path, EmulationSpec("clos:leaves=2,spines=2,hosts_per_leaf=2", name="victim"), []).save()
    return path


@pytest.mark.parametrize("name", HOSTILE)
def test_remove_refuses_a_name_up_would_refuse(name: str, victim: Path) -> None:
    with pytest.raises(EmulationError, match="1 to 8 lowercase letters or digits"):
        remove(name, state_dir=victim.parent / "state")
    assert victim.exists()


@pytest.mark.parametrize("name", HOSTILE)
def test_load_refuses_a_name_up_would_refuse(name: str, victim: Path) -> None:
    with pytest.raises(EmulationError, match="1 to 8 lowercase letters or digits"):
        load(name, state_dir=victim.parent / "state")


def test_a_file_whose_name_up_would_refuse_is_not_listed(victim: Path) -> None:
    state = victim.parent / "state"
    (state / "Not-Ours.json").write_text("{}")
    assert existing_emulations(state) == []


@pytest.mark.parametrize("verb", ["down", "run"])
def test_the_cli_refuses_a_traversing_name_and_deletes_nothing(verb: str, victim: Path) -> None:
    env = dict(os.environ, ALLREDUCE_EMULATE_STATE_DIR=str(victim.parent / "state"))
    done = subprocess.run([sys.executable, "-m", "allreduce", "emulate", verb, "--name", "../victim"],
                          env=env, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    if os.geteuid() == 0:  # else the privilege check refuses first
        assert "1 to 8 lowercase letters or digits" in done.stderr
    assert victim.exists()
