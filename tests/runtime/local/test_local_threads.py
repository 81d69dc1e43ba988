"""Which thread may call a group's collectives, on the in-process transport (see ``ProcessGroup``'s *Threads*)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from allreduce.runtime import MismatchError, ProcessGroup, WrongThreadError
from allreduce.runtime.pipeline._descriptor import MAX_TAG_BYTES

WORLD_SIZE = 2


def _in_thread(fn: Any, name: str = "other") -> Any:
    """Run ``fn()`` in a new thread named ``name``; its result, or the exception it raised."""
    box: list[Any] = [None]

    def body() -> None:
        try:
            box[0] = fn()
        except BaseException as exc:  # returned to the test, which asserts on it
            box[0] = exc

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"thread {name} did not finish"
    return box[0]


def test_a_collective_from_a_thread_that_does_not_own_the_group_raises_naming_both(ranks: Any) -> None:
    group = ranks(WORLD_SIZE)[0]
    error = _in_thread(lambda: group.all_reduce(np.zeros(4)), name="intruder")
    assert isinstance(error, WrongThreadError), error
    assert "'intruder'" in str(error)
    assert f"{threading.current_thread().name!r}" in str(error)
    assert error.rank == 0


def test_the_barrier_and_stats_are_checked_too(ranks: Any) -> None:
    group = ranks(WORLD_SIZE)[0]
    assert isinstance(_in_thread(group.barrier), WrongThreadError)
    assert isinstance(_in_thread(group.stats), WrongThreadError)


def test_a_refused_call_consumes_nothing(ranks: Any, on_ranks: Any) -> None:
    groups = ranks(WORLD_SIZE)
    assert isinstance(_in_thread(lambda: groups[0].all_reduce(np.ones(4))), WrongThreadError)
    results = on_ranks(groups, lambda g: g.all_reduce(np.full(4, g.rank + 1.0)))
    for result in results:
        assert np.array_equal(result, np.full(4, 3.0)), result


def test_the_group_comes_back_to_the_thread_that_handed_it_over(ranks: Any) -> None:
    group = ranks(1)[0]
    borrower = threading.Thread(target=lambda: group.all_reduce(np.ones(2)), name="borrower")
    group.hand_over(borrower)
    assert group.thread is borrower
    assert isinstance(_owner_call_error(group), WrongThreadError)
    borrower.start()
    borrower.join(60)
    assert group.thread is threading.current_thread()
    assert np.array_equal(group.all_reduce(np.ones(2)), np.ones(2))


def _owner_call_error(group: ProcessGroup) -> Any:
    try:
        group.all_reduce(np.ones(2))
    except WrongThreadError as exc:
        return exc
    return None


def test_only_the_owner_may_hand_the_group_over(ranks: Any) -> None:
    group = ranks(1)[0]
    error = _in_thread(lambda: group.hand_over(threading.current_thread()), name="thief")
    assert isinstance(error, WrongThreadError), error
    assert "only the thread that owns" in str(error)


def test_hand_over_refuses_anything_but_a_thread(ranks: Any) -> None:
    with pytest.raises(TypeError, match=r"threading\.Thread"):
        ranks(1)[0].hand_over("worker")


def test_tagged_calls_from_any_thread_run_when_they_pair_alike(ranks: Any, on_ranks: Any) -> None:
    groups = ranks(WORLD_SIZE)

    def tagged_in_a_thread(g: ProcessGroup) -> Any:
        return _in_thread(lambda: g.all_reduce(np.full(3, g.rank + 1.0), tag="grads"), name=f"side{g.rank}")

    for result in on_ranks(groups, tagged_in_a_thread):
        assert np.array_equal(result, np.full(3, 3.0)), result


def test_calls_with_different_tags_raise_mismatch_naming_each_ranks_tag(ranks: Any, on_ranks: Any) -> None:
    results = on_ranks(ranks(WORLD_SIZE), lambda g: g.all_reduce(np.zeros(3), tag=f"t{g.rank}"))
    for result in results:
        assert isinstance(result, MismatchError), result
        assert "different tag (rank 0: 't0', rank 1: 't1')" in str(result)


def test_a_tagged_call_against_an_untagged_one_raises_mismatch(ranks: Any, on_ranks: Any) -> None:
    results = on_ranks(ranks(WORLD_SIZE), lambda g: g.barrier(tag="b" if g.rank == 0 else None))
    for result in results:
        assert isinstance(result, MismatchError), result
        assert "no tag" in str(result)


@pytest.mark.parametrize(
    ("tag", "error"),
    [("", ValueError), ("x" * (MAX_TAG_BYTES + 1), ValueError), ("a\0b", ValueError), (7, TypeError)],
    ids=["empty", "too long", "nul", "an int"],
)
def test_a_tag_that_cannot_travel_intact_is_refused(ranks: Any, tag: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="tag"):
        ranks(1)[0].all_reduce(np.zeros(2), tag=tag)


def test_close_from_another_thread_releases_the_group(ranks: Any) -> None:
    group = ranks(1)[0]
    assert _in_thread(group.close) is None
    with pytest.raises(Exception, match="closed"):
        group.all_reduce(np.zeros(2))
