"""Small all-reduces alone: a :class:`SmallCalls` per rank over the control blocks of ranks that met in one
process (a thread each), with the peer data, agreement and waiting it is given; the head start of ``prepare()``
read by the peer as its step 0."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from shm_parts import BuildFn, MeetFn, Parts

from allreduce.runtime import Call, CollectiveError, compile_plan
from allreduce.runtime.shm._layout import EAGER_BYTES, PROGRESS_WORD, STEP_BITS
from allreduce.runtime.shm._small import SmallCalls, eager_step_bound
from allreduce.runtime.stats._stats import Recorder
from allreduce.runtime.transport._transport import PlanCache
from allreduce.schedules import Collective, make_schedule


class _Sum:
    """The reducer the group hands a transport: ``reduce_into(dst, incoming)``, with its ufunc exposed."""

    ufunc = np.add

    def __call__(self, dst: np.ndarray[Any, Any], incoming: np.ndarray[Any, Any]) -> None:
        np.add(dst, incoming, out=dst)


class _Rank:
    """One rank's small calls over its parts, and the transport's two callbacks as plain functions."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.failures: list[tuple[BaseException, int]] = []
        self.closed = False
        self.small = SmallCalls(
            parts.blocks.rank, parts.blocks.views, peer_data=parts.peer_data, agreement=parts.agreement,
            waiting=parts.waiting, plans=PlanCache(), recorder=Recorder(), eager_bytes=EAGER_BYTES,
            check_usable=self.check_usable, record_failure=lambda exc, seq: self.failures.append((exc, seq)),
        )  # fmt: skip

    def check_usable(self) -> None:
        if self.closed:
            raise CollectiveError(f"rank {self.parts.blocks.rank}: closed", rank=self.parts.blocks.rank)

    def call(self, seq: int, buffer: np.ndarray[Any, Any]) -> Call:
        blocks = self.parts.blocks
        plan = compile_plan(make_schedule(Collective.ALL_REDUCE, "ring", blocks.world_size), blocks.rank, buffer.size)
        return Call(plan, buffer, _Sum(), seq, time.monotonic() + 30, 30.0, False)


@pytest.fixture
def ranks(meet: MeetFn, build: BuildFn) -> Iterator[list[_Rank]]:
    made = [_Rank(build(b)) for b in meet(3)]
    yield made
    for r in made:
        r.small.release()


def _run_all(ranks: list[_Rank], seq: int, buffers: list[np.ndarray[Any, Any]], descriptors: list[bytes]) -> list[Any]:
    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = [
            pool.submit(r.small.run, r.call(seq, x), d) for r, x, d in zip(ranks, buffers, descriptors, strict=True)
        ]
        return [f.result() for f in futures]


def test_every_rank_ends_with_the_sum_and_counts_the_call(ranks: list[_Rank]) -> None:
    buffers = [np.full(1031, r + 1.0, np.float32) for r in range(3)]
    assert _run_all(ranks, 0, buffers, [b"d"] * 3) == [None] * 3
    assert all((x == 6).all() for x in buffers)
    assert [r.small.calls for r in ranks] == [1] * 3


def test_calls_in_a_row_reuse_both_snapshot_areas(ranks: list[_Rank]) -> None:
    for seq in range(5):
        buffers = [np.full(13, (r + 1) * (seq + 1), np.int64) for r in range(3)]
        _run_all(ranks, seq, buffers, [b"d"] * 3)
        assert [x.tolist() for x in buffers] == [[6 * (seq + 1)] * 13] * 3


def test_different_descriptors_come_back_and_no_data_is_read(ranks: list[_Rank]) -> None:
    buffers = [np.full(64, r + 1.0, np.float32) for r in range(3)]
    sent = [b"d", b"e", b"d"]  # every descriptor has the same length, as the group packs them
    assert _run_all(ranks, 0, buffers, sent) == [sent] * 3
    assert [float(x[0]) for x in buffers] == [1.0, 2.0, 3.0]
    assert [r.small.calls for r in ranks] == [0] * 3


def test_the_largest_small_buffer_needs_the_collective_before_agreed(ranks: list[_Rank]) -> None:
    small = ranks[0].small
    assert small.small_bytes(0) == EAGER_BYTES // eager_step_bound(3)  # collective -1: nothing to wait for
    assert small.small_bytes(1) == 0
    _run_all(ranks, 0, [np.ones(4, np.float32) for _ in range(3)], [b"d"] * 3)
    assert small.small_bytes(1) == EAGER_BYTES // eager_step_bound(3)
    small.eager_bytes = 0
    assert small.small_bytes(1) == 0


def test_a_call_on_a_closed_transport_asks_it_to_raise(ranks: list[_Rank]) -> None:
    ranks[0].closed = True
    ranks[0].small.usable = False
    x = np.ones(4, np.float32)
    with pytest.raises(CollectiveError, match="rank 0: closed"):
        ranks[0].small.run(ranks[0].call(0, x), b"d")
    assert ranks[0].failures == []  # nothing was started, so nothing failed


def test_a_call_that_fails_is_reported_with_its_collective(ranks: list[_Rank]) -> None:
    x = np.ones(4, np.float32)
    call = ranks[0].call(0, x)._replace(deadline=time.monotonic() + 0.05)  # the peers never come
    with pytest.raises(CollectiveError, match="timed out"):
        ranks[0].small.run(call, b"d")
    assert [(type(exc).__name__, seq) for exc, seq in ranks[0].failures] == [("CollectiveTimeoutError", 0)]


def test_the_head_start_is_the_peers_step_0_snapshot(ranks: list[_Rank]) -> None:
    zero = ranks[0].small
    x = np.arange(100, dtype=np.float32)
    assert zero.fits(0, x)
    zero.prepare(0, x)
    assert zero.prepared_seq == 0
    assert ranks[1].parts.blocks.views[0][PROGRESS_WORD] == 0 << STEP_BITS
    assert ranks[1].parts.peer_data.eager_area(0, 0, x.dtype)[:100].tolist() == x.tolist()


def test_a_buffer_whose_every_plan_does_not_fit_the_snapshot_area_gets_no_head_start(ranks: list[_Rank]) -> None:
    per_step = EAGER_BYTES // eager_step_bound(3)
    assert ranks[0].small.fits(0, np.empty(per_step, np.uint8))
    assert not ranks[0].small.fits(0, np.empty(per_step + 1, np.uint8))
    assert not ranks[0].small.fits(1, np.empty(1, np.uint8))  # collective 0 not agreed yet
