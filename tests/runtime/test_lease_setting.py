"""The lease's one knob: ``allreduce.init(lease_s=...)``, else ``ALLREDUCE_LEASE_S``, else the default; 0 turns the
heartbeat off; anything else outside 1 s to an hour is refused with an error naming where it came from."""

from __future__ import annotations

import pytest

import allreduce
from allreduce.runtime._liveness import DEFAULT_LEASE_S, LEASE_ENV, MAX_LEASE_S, MIN_LEASE_S, lease_arg


def test_without_a_setting_the_lease_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LEASE_ENV, raising=False)
    assert lease_arg(None) == DEFAULT_LEASE_S


def test_the_environment_variable_sets_the_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LEASE_ENV, "4.5")
    assert lease_arg(None) == 4.5


def test_the_argument_wins_over_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LEASE_ENV, "4.5")
    assert lease_arg(30) == 30.0


def test_zero_turns_the_heartbeat_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LEASE_ENV, "0")
    assert lease_arg(None) == 0.0


@pytest.mark.parametrize("text", ["ten", "1e", "5s", "nan", "0.5"])
def test_a_malformed_environment_variable_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(LEASE_ENV, text)
    with pytest.raises(ValueError, match=LEASE_ENV):
        lease_arg(None)


@pytest.mark.parametrize("value", [MIN_LEASE_S / 2, -1.0, MAX_LEASE_S * 2, float("inf")])
def test_a_lease_out_of_bounds_is_refused_naming_the_argument(value: float) -> None:
    with pytest.raises(ValueError, match=r"^lease_s: .* 0 turns the heartbeat off"):
        lease_arg(value)


@pytest.mark.parametrize("value", [True, "10", [10]])
def test_a_lease_that_is_not_a_number_is_a_type_error(value: object) -> None:
    with pytest.raises(TypeError, match=r"^lease_s: expected a number of seconds"):
        lease_arg(value)


def test_init_refuses_a_bad_lease_before_it_reaches_the_store() -> None:
    # rank 1 of 2 would wait for rank 0's store: the refusal comes first
    with pytest.raises(ValueError, match=r"^lease_s: "):
        allreduce.init(rank=1, world_size=2, master_port=1, lease_s=0.1)
