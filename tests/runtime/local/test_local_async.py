"""Asynchronous collectives: Work handles, call order, done callbacks."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from allreduce.runtime import ProcessGroup, Work

WORLD_SIZE = 3


def test_async_collectives_complete_in_call_order(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> list[int]:
        works = [group.all_reduce(np.full(100, group.rank + i, dtype=np.int64), async_op=True) for i in range(3)]
        return [int(w.result()[0]) for w in works]

    assert on_ranks(ranks(WORLD_SIZE), body) == [[3, 6, 9]] * WORLD_SIZE


def test_a_blocking_call_waits_for_pending_async_ones(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> list[bool]:
        works = [group.all_reduce(np.ones(10, dtype=np.int64), async_op=True) for _ in range(3)]
        sync = np.ones(7, dtype=np.int64)
        group.all_reduce(sync)
        return [w.done() for w in works] + [int(sync[0]) == 3]

    assert on_ranks(ranks(WORLD_SIZE), body) == [[True] * 4] * WORLD_SIZE


def test_async_returns_a_work_that_result_and_wait_agree_on(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> bool:
        x = np.ones(4)
        work = group.all_reduce(x, async_op=True)
        return isinstance(work, Work) and work.wait() is x and work.result() is x and work.done()

    assert on_ranks(ranks(WORLD_SIZE), body) == [True] * WORLD_SIZE


def test_wait_with_a_timeout_raises_while_a_peer_has_not_called(ranks: Any) -> None:
    groups = ranks(2)
    work = groups[0].all_reduce(np.ones(4), async_op=True)
    with pytest.raises(TimeoutError, match=r"has not finished after 0\.01 s"):
        work.wait(timeout_s=0.01)
    assert not work.done()
    groups[1].all_reduce(np.ones(4))
    assert work.wait().tolist() == [2.0] * 4


def test_done_callbacks_run_once_in_issue_order_with_the_result(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> list[tuple[int, int]]:
        calls: list[tuple[int, int]] = []
        works = [group.all_reduce(np.full(4, group.rank + i, dtype=np.int64), async_op=True) for i in range(3)]
        for i, w in enumerate(works):
            w.add_done_callback(lambda w, i=i: calls.append((i, int(w.wait()[0]))))
        for w in works:
            w.wait()
        group.barrier()  # the worker has run every callback of the works before it
        return calls

    assert on_ranks(ranks(WORLD_SIZE), body) == [[(0, 3), (1, 6), (2, 9)]] * WORLD_SIZE


def test_a_callback_added_to_a_finished_work_runs_at_once_in_the_caller(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> list[Any]:
        work = group.all_reduce(np.ones(2), async_op=True)
        work.wait()
        late: list[Any] = []
        work.add_done_callback(lambda w: late.append((w.done(), threading.current_thread().name)))
        return late

    results = on_ranks(ranks(WORLD_SIZE), body)
    assert results == [[(True, f"rank{r}")] for r in range(WORLD_SIZE)]


def test_a_raising_callback_does_not_stop_later_collectives(
    ranks: Any, on_ranks: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    def body(group: ProcessGroup) -> list[int]:
        bad = group.all_reduce(np.ones(2, dtype=np.int64), async_op=True)
        bad.add_done_callback({}.pop)  # raises KeyError
        after = group.all_reduce(np.ones(2, dtype=np.int64), async_op=True)
        return list(after.wait().tolist())

    assert on_ranks(ranks(WORLD_SIZE), body) == [[3, 3]] * WORLD_SIZE
    assert "raised KeyError" in capfd.readouterr().err


def test_a_callback_must_be_callable(ranks: Any) -> None:
    (group,) = ranks(1)
    work = group.all_reduce(np.ones(2), async_op=True)
    with pytest.raises(TypeError, match="expected a callable, got int"):
        work.add_done_callback(3)


def test_a_failed_async_collective_raises_from_wait(ranks: Any) -> None:
    (group,) = ranks(2)[:1]
    from allreduce.runtime import CollectiveTimeoutError

    work = group.all_reduce(np.ones(2), async_op=True, timeout_s=0.05)
    with pytest.raises(CollectiveTimeoutError, match="rank 1"):
        work.wait()
