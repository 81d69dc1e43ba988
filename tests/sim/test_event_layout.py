"""The event engines' layout (sim/_layout.py): distinct keys numbered by a table or by np.unique alike, the
transfers' order by one combined key or by lexsort alike, and slots that hold exactly their transfers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.schedules import all_reduce
from allreduce.sim import match_transfers
from allreduce.sim._layout import Layout, _sort_order, numbered
from allreduce.sim._routing import Router
from allreduce.topology import parse_topology, place


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=300), st.sampled_from([5001, 10**9]))
def test_keys_are_numbered_as_np_unique_numbers_them(keys: list[int], space: int) -> None:
    # A space of 5,001 keys takes the table, 10^9 np.unique: both must give unique's answer.
    array = np.asarray(keys, dtype=np.int64)
    distinct, index = numbered(array, space)
    expected, inverse = np.unique(array, return_inverse=True)
    np.testing.assert_array_equal(distinct, expected)
    np.testing.assert_array_equal(index, inverse.reshape(-1))
    assert index.dtype == np.int32


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 9), st.integers(0, 6), st.integers(0, 6), st.integers(0, 20)), max_size=200),
    st.sampled_from([7, 2**20]),
)
def test_transfers_sort_by_step_sender_receiver_block_as_lexsort_sorts_them(
    rows: list[tuple[int, int, int, int]], n: int
) -> None:
    # 2^20 ranks make the combined key overflow 63 bits: lexsort then, and the same order.
    step, src, dst, block = np.asarray(rows, dtype=np.int64).reshape(-1, 4).T.copy()
    order = _sort_order(step, src, dst, block, n)
    np.testing.assert_array_equal(order, np.lexsort((block, dst, src, step)))


@pytest.mark.parametrize("algorithm", ["ring", "double_binary_tree", "halving_doubling"])
def test_each_slot_holds_the_transfers_its_rank_sends_and_receives_at_its_step(algorithm: str) -> None:
    sched = all_reduce(algorithm, 16)
    topo = parse_topology("fat-tree:k=4")
    t = match_transfers(sched)
    run = Layout(sched, Router(topo, np.asarray(place(16, topo, "random", seed=2)), None, 2), t, 1.0, None)
    for slot in range(run.num_slots):
        members = run.slot_member[run.slot_ptr[slot] : run.slot_ptr[slot + 1]].tolist()
        rank, step = run.slot_rank[slot], run.slot_step[slot]
        sends = np.flatnonzero((t.src == rank) & (t.step == step)).tolist()
        receives = np.flatnonzero((t.dst == rank) & (t.step == step)).tolist()
        assert members == sends + receives
        assert all(run.send_slot[x] == slot for x in sends)
        assert all(run.recv_slot[x] == slot for x in receives)
    # A rank's slots are consecutive and in step order.
    assert np.all(np.diff(run.slot_rank) >= 0)
    same = run.slot_rank[1:] == run.slot_rank[:-1]
    assert np.all(np.diff(run.slot_step)[same] > 0)
