"""A rank SIGKILLed in the middle of a ring all-reduce, at a fixed step, splits the survivors by one call: the ranks
that already hold the call's whole result finish it, the others raise in it. shrink() agrees on the last call every
survivor completed and names the ranks ahead (``ahead_ranks``); the others take the call's result from them and
every survivor goes on from the same call, with exact sums, over shm and tcp.

The victim dies by its own SIGKILL at the start of a chosen step of the plan (``ALLREDUCE_INJECT=kill:...``), so
where the survivors stand when it dies is fixed by the schedule, not by a timer: in a ring of 4, rank 3's successor
(rank 0) waits for rank 3 at every step, and rank r + 1 waits for rank r's next step. One thing is a race by design:
over tcp, a rank waiting for a chunk from a live peer also hears the ABORT frame of a peer that gave up (so
that it never waits out its timeout on a peer that will not come); whichever arrives first decides whether it
finishes the call or raises in it. Both are the rule kept; the test then checks that shrink() agrees with it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from allreduce.runtime import CollectiveError, spawn_elastic

WORLD = 4
VICTIM = 3
RING_STEPS = 2 * (WORLD - 1)  # reduce-scatter, then all-gather
CALLS = 6
SPLIT_CALL = 2


def _contribution(rank: int, call: int) -> float:
    return float((rank + 1) * (call + 1))


def _ring_through_a_death(transport: str, follow_the_rule: bool) -> dict[str, Any]:
    """All-reduce CALLS times (ring); the victim dies in call SPLIT_CALL (``ALLREDUCE_INJECT``). A survivor that
    raises shrinks, takes the split call's result from the first rank ahead if the survivors split, and goes on from
    the call after the last one every survivor holds (unless not ``follow_the_rule``: then it re-runs the call it
    failed)."""
    import allreduce

    group = allreduce.init(transport=transport, timeout_s=60)
    me = group.rank
    results: dict[int, float] = {}
    report: dict[str, Any] = {"raised_in": None, "ahead": None, "resumed_at": None, "results": results}
    try:
        call = 0
        while call < CALLS:
            x = np.full(1 << 14, _contribution(me, call), np.float32)
            try:
                group.all_reduce(x, algorithm="ring")
            except CollectiveError as exc:
                report["raised_in"] = call
                report["error"] = str(exc)
                group = group.shrink()
                report["ahead"] = group.ahead_ranks
                report["last_agreed"] = group.last_agreed_call
                if group.ahead_ranks and follow_the_rule:
                    split = call - 1 if group.rank in group.ahead_ranks else call
                    kept = np.array([results.get(split, np.nan)])
                    group.broadcast(kept, root=group.ahead_ranks[0])
                    results[split] = float(kept[0])
                    call = split + 1
                report["resumed_at"] = call
                continue
            results[call] = float(x[0])
            call += 1
    except RuntimeError as exc:
        report["refused"] = str(exc)
    finally:
        group.close()
    return report


def _survivors(transport: str, die_at_step: int, *, follow_the_rule: bool = True) -> dict[int, dict[str, Any]]:
    kill = f"kill:rank={VICTIM}:call={SPLIT_CALL}:step={die_at_step}"
    outcome = spawn_elastic(
        WORLD, _ring_through_a_death, transport, follow_the_rule, min_ranks=WORLD - 1,
        env={"ALLREDUCE_INJECT": kill}, timeout_s=120,
    )  # fmt: skip
    assert [(d.rank, d.how) for d in outcome.departures] == [(VICTIM, "was killed by SIGKILL")]
    assert sorted(outcome.results) == [0, 1, 2]
    return outcome.results


def _exact_sums() -> dict[int, float]:
    """Calls up to the split one summed over all four ranks, later ones over the three survivors."""
    return {
        call: sum(_contribution(r, call) for r in range(WORLD) if call <= SPLIT_CALL or r != VICTIM)
        for call in range(CALLS)
    }


def _sums_with_the_split_call_re_run() -> dict[int, float]:
    """As :func:`_exact_sums`, the split call re-run on the three survivors."""
    sums = _exact_sums()
    sums[SPLIT_CALL] -= _contribution(VICTIM, SPLIT_CALL)
    return sums


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize(
    ("transport", "die_at_step", "ahead", "racing"),
    [
        # at the last step rank 0 still waits on the victim; over shm so does rank 2, which sends to it
        ("shm", RING_STEPS - 1, (1,), ()),
        # over tcp rank 2 waits only for rank 1's last chunk, which races rank 0's ABORT frame (module docstring)
        ("tcp", RING_STEPS - 1, (1,), (2,)),
        # rank 1 waits on rank 0, which the victim held up a step earlier; rank 2 for rank 1's chunks, racing rank 0's
        # ABORT frame: where the frame wins, no survivor finished the call, and all re-run it
        ("tcp", RING_STEPS - 2, (), (2,)),
    ],
)
def test_a_death_in_the_rings_last_steps_splits_the_survivors_and_every_one_goes_on_from_the_same_call(
    transport: str, die_at_step: int, ahead: tuple[int, ...], racing: tuple[int, ...]
) -> None:
    reports = _survivors(transport, die_at_step)
    raised_in = {r: rep["raised_in"] for r, rep in reports.items()}
    for r in range(WORLD - 1):
        allowed = {SPLIT_CALL, SPLIT_CALL + 1} if r in racing else {SPLIT_CALL + 1 if r in ahead else SPLIT_CALL}
        assert raised_in[r] in allowed, f"rank {r} raised in call {raised_in[r]}: {reports[r].get('error')}"
    went_on = tuple(r for r in range(WORLD - 1) if raised_in[r] == SPLIT_CALL + 1)
    assert {rep["ahead"] for rep in reports.values()} == {went_on}  # shrink() agrees on who finished the call
    assert {rep["last_agreed"] for rep in reports.values()} == {SPLIT_CALL - 1}
    # with ranks ahead, every survivor takes the split call's whole sum from them and goes on after it; with none,
    # every survivor re-runs it on the three
    assert {rep["resumed_at"] for rep in reports.values()} == {SPLIT_CALL + 1 if went_on else SPLIT_CALL}
    expected = _exact_sums() if went_on else _sums_with_the_split_call_re_run()
    for report in reports.values():
        assert report["results"] == expected


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_death_before_the_victim_sends_anything_fails_the_call_everywhere(transport: str) -> None:
    reports = _survivors(transport, die_at_step=0)
    assert {rep["raised_in"] for rep in reports.values()} == {SPLIT_CALL}
    assert {rep["ahead"] for rep in reports.values()} == {()}
    assert {rep["last_agreed"] for rep in reports.values()} == {SPLIT_CALL - 1}
    assert {rep["resumed_at"] for rep in reports.values()} == {SPLIT_CALL}
    for report in reports.values():
        assert report["results"] == _sums_with_the_split_call_re_run()


@pytest.mark.slow
@pytest.mark.serial
def test_survivors_that_re_run_their_own_failed_calls_after_a_split_are_refused_on_every_rank() -> None:
    """Rank 0 would re-run call 2 while ranks 1 and 2 re-run call 3, of the same size: a sum of different calls.
    The group refuses any first collective but the broadcast from the first rank ahead, naming it."""
    reports = _survivors("tcp", RING_STEPS - 1, follow_the_rule=False)
    for report in reports.values():
        assert "split by one call" in report["refused"]
        assert "broadcast(x, root=1)" in report["refused"]
        assert set(report["results"]) == set(range(report["raised_in"]))  # nothing summed on the shrunk group
