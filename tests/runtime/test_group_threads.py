"""Threads and the process group, on real processes over shm and tcp.

Two threads of each rank all-reduce their own arrays and reach the call in a different order on the two ranks
(rank 0: thread A first, rank 1: thread B first; an event orders them, never a sleep). Before the group checked
threads, both calls completed and paired A's array on one rank with B's on the other: a wrong sum, no error.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import allreduce
from allreduce.runtime.launcher._spawn import spawn

THREADS = ("A", "B")
# each thread's contribution per rank: any cross-pairing of A with B gives a sum no correct pairing gives
VALUES = {"A": (1.0, 2.0), "B": (100.0, 200.0)}
EXPECTED = {name: sum(values) for name, values in VALUES.items()}
TURN_TIMEOUT_S = 120.0
"""How long a thread waits for its turn: far above the collective's timeout, so a hang fails, never passes."""


def _racing_rank(group: allreduce.ProcessGroup, mode: str) -> dict[str, tuple[str, Any]]:
    """Each thread's outcome: ("ok", the sum) or (the exception's class name, its message).

    ``mode``: "plain" (no tags), "tagged" (each thread tags its calls with its name), or "handed" (the main thread
    hands the group to thread A, which then calls alone; B does not call).
    """
    rank = group.rank
    outcome: dict[str, tuple[str, Any]] = {}
    order = THREADS if rank == 0 or mode == "handed" else THREADS[::-1]
    turn = {name: threading.Event() for name in THREADS}
    turn[order[0]].set()

    def thread_body(name: str) -> None:
        try:
            if not turn[name].wait(TURN_TIMEOUT_S):
                outcome[name] = ("no turn", None)
                return
            if mode == "handed" and name == "B":
                return
            x = np.full(1024, VALUES[name][rank])
            kwargs = {"tag": name} if mode == "tagged" else {}
            group.all_reduce(x, algorithm="ring", **kwargs)
            outcome[name] = ("ok", float(x[0]))
        except Exception as exc:  # reported to the test, which asserts on it
            outcome[name] = (type(exc).__name__, str(exc))
        finally:
            if name == order[0]:
                turn[order[1]].set()

    threads = [threading.Thread(target=thread_body, args=(name,), name=f"worker-{name}") for name in THREADS]
    if mode == "handed":
        group.hand_over(threads[0])
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcome


def _race(transport: str, mode: str) -> list[dict[str, tuple[str, Any]]]:
    return spawn(2, _racing_rank, mode, init_options={"transport": transport, "timeout_s": 60}, timeout_s=240)


def _assert_no_wrong_sum(results: list[Any]) -> None:
    for rank, outcome in enumerate(results):
        assert isinstance(outcome, dict), outcome
        for name in THREADS:
            status, value = outcome[name]
            assert status != "ok" or value == EXPECTED[name], f"rank {rank} thread {name}: silent wrong sum {value}"


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_two_threads_racing_on_one_group_never_get_a_wrong_sum(transport: str) -> None:
    _assert_no_wrong_sum(_race(transport, "plain"))


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_thread_that_does_not_own_the_group_raises_naming_both_threads(transport: str) -> None:
    for rank, outcome in enumerate(_race(transport, "plain")):
        for name in THREADS:
            status, message = outcome[name]
            assert status == "WrongThreadError", (rank, name, outcome[name])
            assert f"'worker-{name}'" in message, message
            assert "'MainThread'" in message, message
            assert "hand_over" in message, message


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_tagged_calls_paired_across_threads_raise_mismatch_on_every_rank(transport: str) -> None:
    results = _race(transport, "tagged")
    _assert_no_wrong_sum(results)
    for rank, outcome in enumerate(results):
        for name in THREADS:
            status, message = outcome[name]
            assert status == "MismatchError", (rank, name, outcome[name])
            assert "different tag (rank 0: " in message, message
            assert "'A'" in message, message
            assert "'B'" in message, message


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_thread_handed_the_group_gets_the_right_sum(transport: str) -> None:
    for outcome in _race(transport, "handed"):
        assert outcome["A"] == ("ok", EXPECTED["A"]), outcome


def _left_behind_rank(transport: str) -> dict[str, tuple[str, Any]]:
    """A group made in a worker thread that has ended: the main thread's call first (refused), then its adoption
    and a call, then a second thread's attempt to take it too."""
    made: list[Any] = []
    maker = threading.Thread(
        target=lambda: made.append(allreduce.init(transport=transport, timeout_s=60)),
        name="maker",
    )
    maker.start()
    maker.join()
    group = made[0]
    outcome: dict[str, tuple[str, Any]] = {}
    x = np.full(1024, group.rank + 1.0)
    try:
        group.all_reduce(x)
        outcome["before"] = ("ok", float(x[0]))
    except Exception as exc:  # reported to the test, which asserts on it
        outcome["before"] = (type(exc).__name__, str(exc))
    group.hand_over(threading.current_thread())  # adopting it: the maker has finished
    group.all_reduce(x)
    outcome["adopted"] = ("ok", float(x[0]))

    def second() -> None:
        try:
            group.hand_over(threading.current_thread())
            outcome["second"] = ("ok", None)
        except Exception as exc:  # reported to the test, which asserts on it
            outcome["second"] = (type(exc).__name__, str(exc))

    rival = threading.Thread(target=second, name="rival")
    rival.start()
    rival.join()
    group.close()
    return outcome


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_group_whose_owner_thread_ended_is_adopted_explicitly_and_then_belongs_to_its_adopter(
    transport: str,
) -> None:
    for rank, outcome in enumerate(spawn(2, _left_behind_rank, transport, group=False, timeout_s=240)):
        status, message = outcome["before"]
        assert status == "WrongThreadError", (rank, outcome)
        assert "'maker'" in message, message
        assert "has finished" in message, message
        assert "hand_over(threading.current_thread())" in message, message
        assert outcome["adopted"] == ("ok", 3.0), (rank, outcome)
        status, message = outcome["second"]
        assert status == "WrongThreadError", (rank, outcome)  # the adopter is alive: nobody else may take it
        assert "'MainThread'" in message, message
