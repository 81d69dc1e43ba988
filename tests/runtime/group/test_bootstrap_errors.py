"""init() on a bad or busy MASTER_PORT, and a second init() while a group is open: one clear error on every rank.

Real processes: two ranks started by ``runtime.spawn`` with the variables a launcher sets (a test's own MASTER_PORT
set in the rank before init()); the test holds a port itself to play another service.
"""

from __future__ import annotations

import errno
import os
import socket
from typing import Any

import numpy as np
import pytest

import allreduce
from allreduce.runtime import CollectiveTimeoutError
from allreduce.runtime.launcher._spawn import spawn

WORLD_SIZE = 2
SHORT_TIMEOUT_S = 5.0
"""The rendezvous timeout where a rank is expected to give up (a silent service at MASTER_PORT): long enough for a
loaded machine to connect, short enough to keep the test quick."""


def _outcome(fn: Any) -> tuple[str, str, int | None]:
    try:
        fn()
    except Exception as exc:  # reported to the test, which asserts on it
        return type(exc).__name__, str(exc), getattr(exc, "errno", None)
    return "ok", "", None


def _second_init_rank() -> dict[str, Any]:
    first = allreduce.init(timeout_s=60)
    second = _outcome(lambda: allreduce.init(timeout_s=60))
    x = np.ones(4)
    first.all_reduce(x)  # the refused init consumed nothing of the first group
    first.close()
    with allreduce.init(timeout_s=60) as third:
        y = third.all_reduce(np.ones(4))
    return {"second": second, "first_sum": float(x[0]), "third_sum": float(y[0])}


@pytest.fixture(scope="module")
def second_init() -> list[dict[str, Any]]:
    return spawn(WORLD_SIZE, _second_init_rank, group=False, timeout_s=240)


@pytest.mark.slow
def test_a_second_init_while_the_group_is_open_says_so_on_every_rank(second_init: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(second_init):
        assert isinstance(result, dict), result
        kind, message, _ = result["second"]
        assert kind == "RuntimeError", result
        assert f"rank {rank}: init() while this process's group at 127.0.0.1:" in message
        assert "still open" in message
        assert "close it first" in message


@pytest.mark.slow
def test_the_open_group_still_works_and_a_new_one_opens_after_close(second_init: list[dict[str, Any]]) -> None:
    for result in second_init:
        assert result["first_sum"] == WORLD_SIZE
        assert result["third_sum"] == WORLD_SIZE


def _env_port_rank(master_port: str) -> tuple[str, str, int | None]:
    os.environ["MASTER_PORT"] = master_port
    return _outcome(lambda: allreduce.init(timeout_s=SHORT_TIMEOUT_S))


def _with_master_port(master_port: str) -> list[tuple[str, str, int | None]]:
    return spawn(WORLD_SIZE, _env_port_rank, master_port, group=False, timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("master_port", ["70000", "0", "-1"])
def test_a_master_port_that_is_no_tcp_port_is_refused_on_every_rank(master_port: str) -> None:
    for outcome in _with_master_port(master_port):
        kind, message, _ = outcome
        assert kind == "ValueError", outcome
        assert message.startswith(f"MASTER_PORT: {master_port} is not a TCP port (1..65535)"), message


def test_a_master_port_argument_that_is_no_tcp_port_names_the_argument() -> None:
    with pytest.raises(ValueError, match=r"master_port: 65536 is not a TCP port"):
        allreduce.init(0, 2, master_port=65536)


def test_a_master_port_argument_of_another_type_is_refused() -> None:
    with pytest.raises(TypeError, match=r"master_port: expected an integer, got str '29500'"):
        allreduce.init(0, 2, master_port="29500")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def port_held_by_a_silent_service() -> list[Any]:
    # a listener that accepts (the kernel does, into the backlog) and never answers: another service's port
    with socket.create_server(("127.0.0.1", 0)) as service:
        return _with_master_port(str(service.getsockname()[1]))


@pytest.mark.slow
def test_rank_0_says_the_master_port_is_in_use(port_held_by_a_silent_service: list[Any]) -> None:
    kind, message, code = port_held_by_a_silent_service[0]
    assert kind == "OSError", port_held_by_a_silent_service[0]
    assert code == errno.EADDRINUSE
    assert "rank 0: cannot host the rendezvous store at 127.0.0.1:" in message
    assert "already in use" in message
    assert "Set MASTER_PORT to a free port" in message


@pytest.mark.slow
def test_the_other_ranks_say_what_answered_is_not_the_store(port_held_by_a_silent_service: list[Any]) -> None:
    kind, message, _ = port_held_by_a_silent_service[1]
    assert kind == CollectiveTimeoutError.__name__, port_held_by_a_silent_service[1]
    assert "rank 1: something at 127.0.0.1:" in message
    assert "another service may hold MASTER_PORT" in message
