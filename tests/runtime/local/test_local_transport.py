"""The in-process transport on its own: the Transport contract the group relies on."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from allreduce.runtime import CollectiveError, LocalTransport, compile_plan, local_transports
from allreduce.schedules import recursive_doubling_all_reduce

TIMEOUT_S = 10.0


def _overwrite(dst: np.ndarray[Any, Any], incoming: np.ndarray[Any, Any]) -> None:
    dst[...] = incoming


def test_sends_read_the_buffer_as_it_was_when_the_step_began(on_ranks: Any) -> None:
    # recursive doubling on 2 ranks: one step in which each rank sends its whole buffer and receives the other's
    # into the same range; with an overwriting "reduction" the ranks swap only if sends read the step-start state
    schedule = recursive_doubling_all_reduce(2)
    transports = local_transports(2)

    def body(t: LocalTransport) -> list[float]:
        x = np.full(4, float(t.rank))
        t.execute(compile_plan(schedule, t.rank, 4), x, _overwrite, seq=0, timeout_s=TIMEOUT_S, checksum=False)
        return list(x.tolist())

    assert on_ranks(transports, body) == [[1.0] * 4, [0.0] * 4]


def test_agree_returns_every_ranks_descriptor_by_rank(on_ranks: Any) -> None:
    transports = local_transports(3)
    results = on_ranks(transports, lambda t: t.agree(0, bytes([t.rank]) * 3, timeout_s=TIMEOUT_S))
    assert results == [[b"\0\0\0", b"\1\1\1", b"\2\2\2"]] * 3


def test_statistics_count_the_messages_and_bytes_sent(on_ranks: Any) -> None:
    schedule = recursive_doubling_all_reduce(2)
    transports = local_transports(2)

    def body(t: LocalTransport) -> dict[str, int]:
        x = np.ones(8, np.float32)
        t.execute(compile_plan(schedule, t.rank, 8), x, _overwrite, seq=0, timeout_s=TIMEOUT_S, checksum=False)
        return dict(t.statistics())

    assert on_ranks(transports, body) == [{"messages_sent": 1, "bytes_sent": 32}] * 2


def test_a_closed_transport_raises_collective_error() -> None:
    (t,) = local_transports(1)
    t.close()
    with pytest.raises(CollectiveError, match="rank 0: the local transport is closed"):
        t.agree(0, b"x", timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("world_size", [0, -1, True, 2.0])
def test_a_bad_world_size_is_refused(world_size: Any) -> None:
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        local_transports(world_size)
