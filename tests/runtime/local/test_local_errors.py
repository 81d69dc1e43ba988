"""Errors name the culprit: bad arguments (consuming nothing), timeouts, dead peers, closed groups, corruption."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from allreduce.runtime import (
    ChecksumError,
    CollectiveError,
    CollectiveTimeoutError,
    PeerFailureError,
    ProcessGroup,
)

WORLD_SIZE = 3


def _read_only() -> np.ndarray[Any, Any]:
    x = np.zeros(3)
    x.setflags(write=False)
    return x


# Each case: the call, the exception class, and what its message must name.
BAD_ARGUMENTS: dict[str, tuple[Callable[[ProcessGroup], Any], type[Exception], str]] = {
    "avg of integers": (lambda g: g.all_reduce(np.zeros(3, np.int32), op="avg"), TypeError, "avg .* int32"),
    "unsupported dtype": (lambda g: g.all_reduce(np.zeros(3, np.complex64)), TypeError, "complex64"),
    "read-only array": (lambda g: g.all_reduce(_read_only()), ValueError, "read-only"),
    "unknown algorithm": (lambda g: g.all_reduce(np.zeros(3), algorithm="bogus"), ValueError, "'bogus'.*ring"),
    "algorithm of another type": (lambda g: g.all_reduce(np.zeros(3), algorithm=3), TypeError, "got int"),
    "unknown op": (lambda g: g.all_reduce(np.zeros(3), op="median"), ValueError, "median"),
    "root out of range": (lambda g: g.broadcast(np.zeros(3), root=WORLD_SIZE), ValueError, "root: 3"),
    "root a float": (lambda g: g.reduce(np.zeros(3), root=0.5), TypeError, "root: .* float 0.5"),  # type: ignore[arg-type]
    "root a bool": (lambda g: g.broadcast(np.zeros(3), root=True), TypeError, "root: .* bool True"),
    "a list": (lambda g: g.all_reduce([1, 2, 3]), TypeError, "got list"),
    "zero segments": (lambda g: g.all_reduce(np.zeros(3), segments=0), ValueError, "segments .* got 0"),
    "boolean segments": (lambda g: g.all_reduce(np.zeros(3), segments=True), TypeError, "segments: .* bool True"),
    "negative timeout": (lambda g: g.all_reduce(np.zeros(3), timeout_s=-1.0), ValueError, "timeout_s .* -1.0"),
    "hierarchical on unequal hosts": (
        lambda g: g.all_reduce(np.zeros(3), algorithm="hierarchical"),
        ValueError,
        "hierarchical on 3 ranks",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_a_bad_argument_raises_naming_it(ranks: Any, case: str) -> None:
    call, error, fragment = BAD_ARGUMENTS[case]
    groups = ranks(WORLD_SIZE, group_size=2)
    with pytest.raises(error, match=fragment):
        call(groups[0])


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_a_bad_argument_consumes_nothing(ranks: Any, on_ranks: Any, case: str) -> None:
    call = BAD_ARGUMENTS[case][0]

    def body(group: ProcessGroup) -> list[int]:
        if group.rank == 0:
            with pytest.raises((TypeError, ValueError)):
                call(group)
        v = np.ones(3, dtype=np.int64)
        group.all_reduce(v)
        return list(v.tolist())

    assert on_ranks(ranks(WORLD_SIZE, group_size=2), body) == [[3, 3, 3]] * WORLD_SIZE


def test_a_group_needs_a_positive_timeout(ranks: Any) -> None:
    from allreduce.runtime import ProcessGroup, local_transports

    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds, got 0"):
        ProcessGroup(local_transports(1)[0], timeout_s=0)


def test_a_rank_that_never_calls_is_named_by_the_timeout(ranks: Any, on_ranks: Any) -> None:
    groups = ranks(WORLD_SIZE)
    results = on_ranks(groups[:2], lambda g: g.all_reduce(np.zeros(8), timeout_s=0.2))
    for result in results:
        assert isinstance(result, CollectiveTimeoutError), result
        assert "rank 2" in str(result)
        assert result.peer == 2


def test_after_a_timeout_the_group_is_unusable_and_says_why(ranks: Any, on_ranks: Any) -> None:
    groups = ranks(WORLD_SIZE)
    on_ranks(groups[:2], lambda g: g.all_reduce(np.zeros(8), timeout_s=0.2))
    for result in on_ranks(groups, lambda g: g.all_reduce(np.zeros(2))):
        assert isinstance(result, CollectiveTimeoutError), result
        assert "rank 2" in str(result)


def test_a_peer_that_closed_is_reported_as_dead(ranks: Any, on_ranks: Any) -> None:
    groups = ranks(WORLD_SIZE)
    groups[2].close()
    for rank, result in enumerate(on_ranks(groups[:2], lambda g: g.all_reduce(np.zeros(4)))):
        assert isinstance(result, PeerFailureError), result
        assert result.peer == 2
        assert str(result).startswith(f"rank {rank}: ")
        assert "rank 2 closed its transport" in str(result)


def test_a_closed_group_raises_collective_error(ranks: Any) -> None:
    (group,) = ranks(1)
    group.close()
    with pytest.raises(CollectiveError, match="rank 0: the process group is closed"):
        group.all_reduce(np.zeros(2))


def test_a_closed_group_refuses_a_barrier_too(ranks: Any) -> None:
    (group,) = ranks(1)
    group.close()
    with pytest.raises(CollectiveError, match="closed"):
        group.barrier()


def test_close_finishes_pending_async_collectives(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> bool:
        work = group.all_reduce(np.ones(4), async_op=True)
        group.close()
        return bool(work.done() and work.wait().tolist() == [3.0] * 4)

    assert on_ranks(ranks(WORLD_SIZE), body) == [True] * WORLD_SIZE


def test_a_corrupted_block_is_caught_by_checksum_naming_the_link(ranks: Any, on_ranks: Any) -> None:
    groups = ranks(WORLD_SIZE)
    groups[0].transport.inject_corruption(peer=1, step=0)
    results = on_ranks(groups, lambda g: g.all_reduce(np.arange(64, dtype=np.int32), algorithm="direct", checksum=True))
    for result in results:
        assert isinstance(result, ChecksumError), result
        assert "rank 0 -> rank 1" in str(result)


def test_healthy_data_passes_the_checksum(ranks: Any, on_ranks: Any) -> None:
    def body(group: ProcessGroup) -> bool:
        z = np.arange(1000, dtype=np.float32) * (group.rank + 1)
        group.all_reduce(z, checksum=True, algorithm="ring", segments=4)
        return bool(np.array_equal(z, np.arange(1000, dtype=np.float32) * 6))

    assert on_ranks(ranks(WORLD_SIZE), body) == [True] * WORLD_SIZE


def test_corruption_needs_another_rank_as_peer(ranks: Any) -> None:
    groups = ranks(2)
    with pytest.raises(ValueError, match="peer: 0 is not another rank"):
        groups[0].transport.inject_corruption(peer=0)


def test_the_transport_of_a_group_is_read_only(ranks: Any) -> None:
    (group,) = ranks(1)
    with pytest.raises(AttributeError):
        group.transport = group.transport  # type: ignore[misc]
