"""Wait records and group.stats() on the in-process transport: what is recorded, and who is named."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from allreduce.runtime import GroupStats, ProcessGroup
from allreduce.runtime.stats._trace import rank_events
from allreduce.runtime.transport._inject import parse_injection

COUNT = 4096


def _all_reduces(group: ProcessGroup, calls: int, last: int | None = None) -> GroupStats:
    group.recording = True
    x = np.zeros(COUNT, np.float32)
    for _ in range(calls):
        group.all_reduce(x, algorithm="ring")
    return group.stats(last=last or calls)


def test_a_ring_all_reduce_records_one_transfer_per_step(ranks: Any, on_ranks: Any) -> None:
    world_size = 4
    groups = ranks(world_size)
    on_ranks(groups, lambda g: _all_reduces(g, 3))
    # 2(N-1) steps of one receive each, per call; stats()'s own all-gather is not recorded
    assert [g.transport.recorder.transfers_recorded for g in groups] == [3 * 2 * (world_size - 1)] * world_size
    assert [g.transport.recorder.calls_recorded for g in groups] == [3] * world_size


def test_every_rank_gets_the_same_summary(ranks: Any, on_ranks: Any) -> None:
    results = on_ranks(ranks(3), lambda g: _all_reduces(g, 5))
    assert results[0] == results[1] == results[2]


def test_a_ring_has_one_link_per_rank(ranks: Any, on_ranks: Any) -> None:
    stats = on_ranks(ranks(4), lambda g: _all_reduces(g, 2))[0]
    assert [(link.src, link.dst) for link in stats.links] == [(0, 1), (1, 2), (2, 3), (3, 0)]
    # each link carries 2(N-1) blocks of COUNT/N float32 per call
    assert {link.size_bytes for link in stats.links} == {2 * 2 * 3 * (COUNT // 4) * 4}


def test_last_limits_the_calls_summarised(ranks: Any, on_ranks: Any) -> None:
    stats = on_ranks(ranks(2), lambda g: _all_reduces(g, 6, last=4))[0]
    assert (stats.calls, stats.first_seq, stats.last_seq) == (4, 2, 5)


def _one_call_then_stats(group: ProcessGroup) -> GroupStats:
    group.all_reduce(np.zeros(COUNT, np.float32))
    return group.stats()


def test_recording_is_on_by_default(ranks: Any, on_ranks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ALLREDUCE_STATS", raising=False)
    groups = ranks(2)
    stats = on_ranks(groups, _one_call_then_stats)[0]
    assert [g.recording for g in groups] == [True, True]
    assert stats.calls == 1


def test_stats_env_0_turns_recording_off(ranks: Any, on_ranks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALLREDUCE_STATS", "0")
    groups = ranks(2)
    stats = on_ranks(groups, _one_call_then_stats)[0]
    assert [g.recording for g in groups] == [False, False]
    assert stats.calls == 0
    assert stats.slowest_rank is None
    assert "recording was off" in stats.table()


def test_last_must_be_positive(ranks: Any) -> None:
    with pytest.raises(ValueError, match="last must be a positive int"):
        ranks(1)[0].stats(last=0)


def test_an_injected_delay_names_the_rank(ranks: Any, on_ranks: Any) -> None:
    groups = ranks(4)
    for g in groups:
        g.transport.injection = parse_injection("delay:rank=3:2ms", g.rank, 4)
    stats = on_ranks(groups, lambda g: _all_reduces(g, 20))[0]
    assert stats.slowest_rank == 3


def test_a_paced_link_is_named(ranks: Any, on_ranks: Any) -> None:
    groups = ranks(4)
    for g in groups:
        g.transport.injection = parse_injection("pace:link=2->3:rate=5MB/s", g.rank, 4)
    stats = on_ranks(groups, lambda g: _all_reduces(g, 10))[0]
    assert stats.slowest_link == (2, 3)


def test_the_trace_has_a_slice_per_collective_and_per_step(ranks: Any, on_ranks: Any) -> None:
    groups = ranks(3)
    on_ranks(groups, lambda g: _all_reduces(g, 2))
    events = rank_events(groups[1].transport.recorder, 1)
    names = [e["name"] for e in events if e["ph"] == "X"]
    assert names.count("collective 0") == names.count("collective 1") == 1
    assert sorted(n for n in names if n.startswith("step")) == sorted([f"step {s}" for s in range(4)] * 2)
    assert all(e["tid"] == 1 and e["dur"] >= 0 for e in events if e["ph"] == "X")


@pytest.mark.slow
def test_close_reports_instead_of_raising_when_stats_cannot_be_gathered(
    ranks: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ALLREDUCE_STATS", "1")
    first, second = ranks(2, timeout_s=0.5)
    first.close()  # its peer never joins the stats collective: it times out
    second.close()  # its peer has gone
    err = capsys.readouterr().err
    assert "[allreduce rank 0] no stats or trace at close" in err
    assert "[allreduce rank 1] no stats or trace at close" in err
    assert first.transport.closed
    assert second.transport.closed
