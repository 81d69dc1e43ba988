"""Who is blamed when a rank fails: every survivor names the rank at fault, not a neighbour that reacted to it.

Real processes over the real transports, started by ``runtime.spawn`` (``spawn_elastic`` where a rank dies on
purpose: the others go on without it): a dying rank really exits, without closing anything. Each rank returns
what it raised, (kind, peer, message).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import pytest
from rank_processes import RANKS

import allreduce
from allreduce.runtime import RankFailedError, spawn, spawn_elastic

Raised = tuple[str, int | None, str]


BLAME_TIMEOUT_S = 60.0
"""The collective timeout of these groups: far longer than detecting a death takes, so a survivor that raises
CollectiveTimeoutError (instead of PeerFailureError) waited out the clock instead of hearing of the death."""


def _dies_before_collective_zero(victim: int) -> Raised:
    group = allreduce.init(transport="tcp", timeout_s=BLAME_TIMEOUT_S)
    if group.rank == victim:
        os._exit(1)  # no close: the store sees the connection drop, no connection to a peer exists yet
    try:
        group.all_reduce(np.ones(1024, np.float32), algorithm="ring")
    except allreduce.CollectiveError as exc:
        return type(exc).__name__, exc.peer, str(exc)
    finally:
        group.close()
    return "returned", None, ""


@pytest.mark.slow
def test_tcp_death_before_the_connections_exist_is_named_by_every_survivor() -> None:
    n, victim = 4, 3
    outcome = spawn_elastic(n, _dies_before_collective_zero, victim, min_ranks=1, timeout_s=BLAME_TIMEOUT_S * 3)
    assert [d.rank for d in outcome.departures] == [victim]
    assert sorted(outcome.results) == [0, 1, 2]
    for rank, (kind, peer, message) in outcome.results.items():
        assert (kind, peer) == ("PeerFailureError", victim), f"rank {rank}: {message}"
        assert f"rank {victim}" in message


def _corrupts_its_control_word(case: tuple[int, str, Any, Any]) -> Raised:
    """The victim overwrites one word of its own control block between two collectives with a value its code never
    writes (the campaign does it from outside, through /proc/PID/mem), and joins the next collective only once the
    others have reported: they read the corrupted word, never a value it rewrote."""
    from allreduce.runtime.shm._layout import ABORTED_WORD, descriptor_word

    victim, word, survivors, finished_first = case
    group = allreduce.init(transport="shm", timeout_s=BLAME_TIMEOUT_S)
    rank, n = group.rank, group.world_size
    try:
        for _ in range(2 if word == "descriptor_low" else 1):  # a low stamp is detectable from collective 2 on
            group.all_reduce(np.ones(1024, np.float32))
        finished_first.wait(timeout=BLAME_TIMEOUT_S)  # nobody reads the victim's block of these anymore
        if rank == victim:
            writes = {
                "aborted": [(ABORTED_WORD, 1 << 40)],
                # a kind an abort does write (PeerFailureError's), over the culprit no abort left there: the
                # campaign's "aborted: 0 -> 1", which every rank read as "rank 2 gave up because rank 0 died"
                "aborted_kind": [(ABORTED_WORD, 1)],
                "descriptor": [(descriptor_word(1), 1 << 40)],  # the next collective's stamp, too far ahead
                "descriptor_low": [(descriptor_word(0), -5)],  # below what the slot already held
                # the next collective's stamp as the victim would publish it, over an empty descriptor (the
                # crc32 of b"" is 0, so a zeroed length word passes a crc check)
                "descriptor_length": [(descriptor_word(1) + 1, 0), (descriptor_word(1), 1)],
            }[word]
            for index, value in writes:
                group._transport._views[rank][index] = value  # type: ignore[attr-defined]
            for _ in range(n - 1):
                survivors.get(timeout=BLAME_TIMEOUT_S * 2)
        group.all_reduce(np.ones(1024, np.float32))
    except allreduce.CollectiveError as exc:
        if rank != victim:
            survivors.put(rank)
        return type(exc).__name__, exc.peer, str(exc)
    finally:
        group.close()
    return "returned", None, ""


def _corruption_reports(word: str) -> list[Raised]:
    n, victim = 3, 2
    case = (victim, word, RANKS.Queue(), RANKS.Barrier(n))
    return spawn(n, _corrupts_its_control_word, case, group=False, timeout_s=BLAME_TIMEOUT_S * 3)


def _every_rank_names_the_victims_block(reports: list[Any]) -> None:
    """Every rank, the victim included, raised ProtocolError naming rank 2's control block as corrupt."""
    for rank, (kind, peer, message) in enumerate(reports):
        assert (kind, peer) == ("ProtocolError", 2), f"rank {rank}: {message}"
        assert "rank 2's control block is corrupt" in message, f"rank {rank}: {message}"


@pytest.mark.slow
def test_shm_corrupt_abort_word_is_named_as_corruption_of_its_owners_block_on_every_rank() -> None:
    _every_rank_names_the_victims_block(_corruption_reports("aborted"))


@pytest.mark.slow
def test_shm_an_abort_word_set_without_its_culprit_is_named_as_corruption_not_as_rank_0_dying() -> None:
    reports = _corruption_reports("aborted_kind")
    _every_rank_names_the_victims_block(reports)
    assert any("(word aborted = 1)" in message for _, _, message in reports), reports


def _reads_a_buffer_offset_past_the_segment(done: Any) -> Raised:
    """Rank 1 finds rank 0's published buffer offset past the end of rank 0's segment (the campaign's
    "buffer_offset: 0 -> 1" on a buffer that fills its segment) when it looks up where rank 0's data lies."""
    from allreduce.runtime.shm._layout import BUFFER_OFFSET_WORD

    group = allreduce.init(transport="shm", timeout_s=BLAME_TIMEOUT_S)
    count = 1 << 18  # 1 MiB of float32: not eager, so rank 0 publishes a data segment and an offset
    try:
        group.all_reduce(group.empty(count, np.float32))
        if group.rank == 0:
            return "published", None, ""
        transport = group._transport  # type: ignore[attr-defined]
        transport._views[0][BUFFER_OFFSET_WORD] = 1
        transport._peer_data.peer_array(0, np.dtype(np.float32), count, seq=1, step=0)
    except allreduce.CollectiveError as exc:
        return type(exc).__name__, exc.peer, str(exc)
    finally:
        done.wait(timeout=BLAME_TIMEOUT_S)  # rank 0's block stays mapped until rank 1 has looked
        group.close()
    return "returned", None, ""


@pytest.mark.slow
def test_shm_a_buffer_offset_past_the_peers_segment_is_named_as_corruption_not_a_value_error() -> None:
    reports = spawn(
        2, _reads_a_buffer_offset_past_the_segment, RANKS.Barrier(2), group=False, timeout_s=BLAME_TIMEOUT_S * 3
    )
    kind, peer, message = reports[1]
    assert (kind, peer) == ("ProtocolError", 0), message
    assert "rank 0's control block is corrupt (word buffer_offset = 1)" in message


@pytest.mark.slow
def test_shm_a_descriptor_stamp_gone_backwards_is_named_as_corruption_not_waited_out() -> None:
    reports = _corruption_reports("descriptor_low")
    _every_rank_names_the_victims_block(reports)
    assert any("(word descriptors[0].stamp = -5)" in message for _, _, message in reports), reports


@pytest.mark.slow
def test_shm_a_zeroed_descriptor_length_is_named_as_corruption_not_parsed() -> None:
    reports = _corruption_reports("descriptor_length")
    _every_rank_names_the_victims_block(reports)


@pytest.mark.slow
def test_shm_corrupt_descriptor_stamp_is_named_as_corruption_of_its_owners_block_on_every_rank() -> None:
    _every_rank_names_the_victims_block(_corruption_reports("descriptor"))


STALL_TIMEOUT_S = 3.0
"""The collective timeout of the stall test's group."""
STALLED_RANK = 3
STALL_HOLD_S = 20 * STALL_TIMEOUT_S
"""How long the stalled rank holds each step: far past every survivor's raise at any load, and never waited out (rank
0 SIGKILLs the stalled rank once the survivors have raised)."""


def _one_rank_stalls_mid_collective(transport: str, news: Any, said: Any) -> None:
    """The stalled rank says its pid, then holds (``ALLREDUCE_INJECT``); every other rank puts what it raised on
    ``said``, then tells rank 0, which SIGKILLs the stalled rank once all three have raised."""
    with allreduce.init(transport=transport, timeout_s=STALL_TIMEOUT_S) as group:
        if group.rank == STALLED_RANK:
            news.put(("pid", os.getpid()))
        try:
            group.all_reduce(np.ones(1 << 16, np.float32), algorithm="ring")
            raised: Raised = ("returned", None, "")
        except allreduce.CollectiveError as exc:
            raised = (type(exc).__name__, exc.peer, str(exc))
        said.put((group.rank, raised))
        said.close()
        said.join_thread()  # on its way to the test before the kill that ends the job
        news.put(("raised", group.rank))
        if group.rank == 0:
            heard = dict(news.get(timeout=BLAME_TIMEOUT_S) for _ in range(group.world_size))  # 3 raised, 1 pid
            os.kill(heard["pid"], signal.SIGKILL)


def _stall_reports(transport: str) -> list[Raised]:
    """What ranks 0-2 raised. In the ring, only rank 0 receives from rank 3; ranks 1 and 2 wait for ranks 0 and 1,
    which wait for rank 3. The job ends in the stalled rank's SIGKILL, not in its hold."""
    news, said = RANKS.Queue(), RANKS.Queue()
    with pytest.raises(RankFailedError, match=f"^rank {STALLED_RANK} was killed by SIGKILL"):
        spawn(
            4,
            _one_rank_stalls_mid_collective,
            transport,
            news,
            said,
            group=False,
            env={"ALLREDUCE_INJECT": f"hold:rank={STALLED_RANK}:p=1:ms={int(STALL_HOLD_S * 1000)}"},
            timeout_s=BLAME_TIMEOUT_S * 3,
        )
    reports = dict(said.get(timeout=BLAME_TIMEOUT_S) for _ in range(3))
    return [reports[rank] for rank in range(3)]


@pytest.mark.slow
@pytest.mark.serial  # a stall against a 3 s collective timeout: alone, so that only the stall times out
def test_shm_a_rank_stalled_mid_collective_is_named_by_every_rank_not_only_its_direct_waiters() -> None:
    for rank, (kind, peer, message) in enumerate(_stall_reports("shm")):
        assert peer == 3, f"rank {rank}: {kind}: {message}"


@pytest.mark.slow
@pytest.mark.serial  # a stall against a 3 s collective timeout: alone, so that only the stall times out
def test_tcp_a_rank_stalled_mid_collective_is_named_by_every_rank_not_only_its_direct_waiters() -> None:
    for rank, (kind, peer, message) in enumerate(_stall_reports("tcp")):
        assert peer == 3, f"rank {rank}: {kind}: {message}"
