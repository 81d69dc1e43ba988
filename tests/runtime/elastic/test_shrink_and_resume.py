"""``shrink_and_resume``: a loop of all-reduces that a death interrupted goes on on the survivors, by the rule of
docs/elastic.md, whether the death split the survivors by one call or failed the call everywhere.

The victim (rank 3 of 4) SIGKILLs itself at a fixed step of the ring's call 2 (``ALLREDUCE_INJECT=kill:...``, as in
test_shrink_split.py): at the ring's last step ranks 1 and 2 over tcp already hold the call's whole sum and raise in
call 3, rank 0 raises in call 2; at step 0 every survivor raises in call 2. Rank r contributes (r + 1)(call + 1),
so each call's sum says which call it was and over which ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from allreduce.runtime import CollectiveError, shrink_and_resume, spawn_elastic

WORLD = 4
VICTIM = 3
RING_STEPS = 2 * (WORLD - 1)
KILLED_IN_CALL = 2
COUNT = 1 << 14


def _sum(call: int, ranks: range | list[int]) -> float:
    return float(sum((r + 1) * (call + 1) for r in ranks))


SURVIVORS = [0, 1, 2]


def _all_reduces_until_a_death(keep: bool) -> dict[str, Any]:
    """All-reduce until a call raises, then resume (keeping each call's result if ``keep``): the call each rank
    raised in, the calls it ran after (``fill``'s), its kept result and the resumed call's sum."""
    import allreduce

    group = allreduce.init(transport="tcp", timeout_s=60)
    me = group.rank
    x, kept = np.zeros(COUNT, np.float32), np.full(COUNT, -1.0, np.float32)
    report: dict[str, Any] = {"raised_in": None, "ran": []}

    def fill(buffer: np.ndarray, took: bool) -> None:
        call = report["raised_in"] + took
        report["ran"].append(call)
        buffer.fill((me + 1) * (call + 1))

    try:
        for call in range(KILLED_IN_CALL + 2):
            x.fill((me + 1) * (call + 1))
            try:
                group.all_reduce(x, algorithm="ring")
            except CollectiveError:
                report["raised_in"] = call
                group = shrink_and_resume(group, x, fill, kept=kept if keep else None, algorithm="ring")
                break
            if keep:
                kept[:] = x
        report.update(ahead=group.ahead_ranks, size=group.world_size, kept=float(kept[0]), sum=float(x[0]))
        report["exact"] = bool(np.all(x == x[0]))
        return report
    finally:
        group.close()


def _resumed(die_at_step: int, *, keep: bool) -> dict[int, dict[str, Any]]:
    kill = f"kill:rank={VICTIM}:call={KILLED_IN_CALL}:step={die_at_step}"
    outcome = spawn_elastic(
        WORLD, _all_reduces_until_a_death, keep, min_ranks=WORLD - 1, env={"ALLREDUCE_INJECT": kill}, timeout_s=120
    )
    assert [d.rank for d in outcome.departures] == [VICTIM]
    assert sorted(outcome.results) == SURVIVORS
    return outcome.results


def _every_survivor_ran(reports: dict[int, dict[str, Any]], call: int) -> None:
    for rank, report in reports.items():
        assert report["ran"] == [call], rank
        assert (report["size"], report["sum"], report["exact"]) == (len(SURVIVORS), _sum(call, SURVIVORS), True)


@pytest.mark.slow
def test_after_a_split_the_ranks_behind_take_the_split_calls_kept_sum_and_every_survivor_runs_the_next_call() -> None:
    reports = _resumed(RING_STEPS - 1, keep=True)
    assert {r: (rep["raised_in"], rep["ahead"]) for r, rep in reports.items()} == {
        0: (KILLED_IN_CALL, (1, 2)), 1: (KILLED_IN_CALL + 1, (1, 2)), 2: (KILLED_IN_CALL + 1, (1, 2)),
    }  # fmt: skip
    assert {rep["kept"] for rep in reports.values()} == {_sum(KILLED_IN_CALL, range(WORLD))}  # rank 0's taken
    _every_survivor_ran(reports, KILLED_IN_CALL + 1)


@pytest.mark.slow
def test_with_nothing_kept_a_split_still_pairs_the_broadcast_and_every_survivor_runs_the_next_call() -> None:
    reports = _resumed(RING_STEPS - 1, keep=False)
    assert {rep["ahead"] for rep in reports.values()} == {(1, 2)}
    assert {rep["kept"] for rep in reports.values()} == {-1.0}  # nothing received into a buffer not given
    _every_survivor_ran(reports, KILLED_IN_CALL + 1)


@pytest.mark.slow
def test_a_death_that_fails_the_call_everywhere_is_run_again_on_the_survivors() -> None:
    reports = _resumed(0, keep=True)
    assert {(rep["raised_in"], rep["ahead"]) for rep in reports.values()} == {(KILLED_IN_CALL, ())}
    assert {rep["kept"] for rep in reports.values()} == {_sum(KILLED_IN_CALL - 1, range(WORLD))}
    _every_survivor_ran(reports, KILLED_IN_CALL)
