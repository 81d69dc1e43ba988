"""spawn_elastic: a rank's failure does not stop the others while enough remain; the job fails once too few do."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from allreduce.runtime import RankFailedError, spawn_elastic


def _die_on(deaths: dict[int, float], wait_s: float) -> int:
    """Rank r SIGKILLs itself after ``deaths[r]`` seconds; the others return after ``wait_s`` (outliving them)."""
    rank = int(os.environ["RANK"])
    if rank in deaths:
        time.sleep(deaths[rank])
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(wait_s)
    return rank * 10


def _raise_on(victim: int) -> int:
    rank = int(os.environ["RANK"])
    if rank == victim:
        raise RuntimeError(f"rank {rank} gave up")
    time.sleep(3.0)
    return rank


@pytest.mark.slow
def test_survivors_return_and_the_dead_rank_is_a_departure() -> None:
    # The survivors' wait is the launcher's whole margin to see the death while they still run: forked ranks
    # start within milliseconds of each other (1 s failed once at load average 12)
    outcome = spawn_elastic(3, _die_on, {1: 0.0}, 3.0, min_ranks=2, timeout_s=120)
    assert outcome.results == {0: 0, 2: 20}
    assert [(d.rank, d.how, d.survivors) for d in outcome.departures] == [(1, "was killed by SIGKILL", 2)]


def _die_after_rank_0(pid_file: str) -> int:
    """Rank 0 returns at once; rank 1 SIGKILLs itself once rank 0's process is gone (exited and reaped)."""
    path = Path(pid_file)
    if int(os.environ["RANK"]) == 0:
        path.with_suffix(".tmp").write_text(str(os.getpid()))
        path.with_suffix(".tmp").rename(path)
        return 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if path.exists():
            try:
                os.kill(int(path.read_text()), 0)
            except ProcessLookupError:
                break
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
    return 1


@pytest.mark.slow
def test_a_rank_that_finished_counts_among_those_that_go_on(tmp_path: Path) -> None:
    # rank 0 returned its result before rank 1 died: one rank (the minimum) is still there, finished
    outcome = spawn_elastic(2, _die_after_rank_0, str(tmp_path / "pid"), min_ranks=1, timeout_s=120)
    assert outcome.results == {0: 0}
    assert [(d.rank, d.how, d.survivors) for d in outcome.departures] == [(1, "was killed by SIGKILL", 1)]


@pytest.mark.slow
def test_an_exception_is_a_departure_with_its_text() -> None:
    outcome = spawn_elastic(3, _raise_on, 2, min_ranks=2, timeout_s=120)
    assert sorted(outcome.results) == [0, 1]
    assert outcome.departures[0].rank == 2
    assert "RuntimeError: rank 2 gave up" in outcome.departures[0].how


@pytest.mark.slow
def test_fewer_ranks_than_the_minimum_fail_the_job_naming_the_rank() -> None:
    with pytest.raises(RankFailedError, match="rank 2 was killed by SIGKILL") as info:
        spawn_elastic(3, _die_on, {1: 0.0, 2: 1.0}, 5.0, min_ranks=2, timeout_s=120)
    assert info.value.rank == 2


def test_min_ranks_is_checked_before_any_rank_starts() -> None:
    with pytest.raises(ValueError, match=r"min_ranks must be in 1\.\.3"):
        spawn_elastic(3, _die_on, {}, 0.0, min_ranks=4)


def _die_once(wait_s: float) -> tuple[int, str]:
    """Rank 1's first process dies; its restart (ALLREDUCE_JOIN=1) returns."""
    rank = int(os.environ["RANK"])
    joining = os.environ.get("ALLREDUCE_JOIN", "")
    if rank == 1 and not joining:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(wait_s)
    return rank, joining


@pytest.mark.slow
def test_a_failed_rank_is_restarted_asking_to_join_and_its_result_is_the_restarts() -> None:
    outcome = spawn_elastic(3, _die_once, 2.0, min_ranks=2, max_restarts=1, timeout_s=120)
    assert outcome.results == {0: (0, ""), 1: (1, "1"), 2: (2, "")}
    assert [(d.rank, d.restarted) for d in outcome.departures] == [(1, True)]


@pytest.mark.slow
def test_rank_0_failing_ends_an_elastic_job_it_hosts_the_store() -> None:
    with pytest.raises(RankFailedError, match="rank 0 was killed by SIGKILL"):
        spawn_elastic(3, _die_on, {0: 0.0}, 3.0, min_ranks=1, max_restarts=3, timeout_s=120)
