"""The compiled core on a streamed layout (sim/_stream.py) against the same core on the whole layout: the same
events on the same floats, so every result equal bit for bit (the per-link bytes, summed window by window, to
rounding), whatever the window; and the parts it is made of (transfers matched per step range, the rank
pairs found from the streams, the median kept as distinct values)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allreduce.schedules import Schedule, all_reduce
from allreduce.sim import match_transfers
from allreduce.sim._event import _layout_chain, _phase_results, _trace, run_event
from allreduce.sim._kernel import available, run_kernel
from allreduce.sim._layout import Layout
from allreduce.sim._routing import Router
from allreduce.topology import parse_topology, place

pytestmark = pytest.mark.skipif(not available(), reason="numba (the fast extra) is not installed")

SIZE = float(2**24)
NETWORKS = (
    ("fat-tree:k=4", 16),
    ("clos:leaves=4,spines=2,hosts_per_leaf=4,oversub=4", 16),
    ("torus:4x4", 16),
    ("dragonfly:groups=5,routers=2,hosts=2", 20),
)
ALGORITHMS = ("ring", "halving_doubling", "double_binary_tree", "hierarchical", "recursive_doubling")


def _schedule(algorithm: str, ranks: int) -> Schedule:
    return all_reduce(algorithm, ranks, group_size=4 if algorithm == "hierarchical" else 1)


def _fits(algorithm: str, ranks: int) -> bool:
    """Whether the algorithm takes that many ranks (powers of two; groups of 4)."""
    if algorithm in ("halving_doubling", "recursive_doubling"):
        return ranks & (ranks - 1) == 0
    return algorithm != "hierarchical" or ranks % 4 == 0


def _streamed(  # type: ignore[no-untyped-def]
    network: int, algorithm: str, *, seed: int, window: int, collect_min: int, delay: bool
):
    """The same run on the whole layout and on a layout streamed ``window`` transfers at a time."""
    from allreduce.sim._stream import StreamRun

    spec, ranks = NETWORKS[network]
    topo = parse_topology(spec)
    sched = _schedule(algorithm, ranks)
    rank_gpu = np.asarray(place(ranks, topo, "random", seed=seed), dtype=np.int64)
    rank_delay = np.linspace(0.0, 2e-6, ranks) if delay else None
    whole = Layout(sched, Router(topo, rank_gpu, None, seed), match_transfers(sched), SIZE, rank_delay)
    run_kernel(whole)
    streamed = StreamRun(
        sched,
        Router(topo, rank_gpu, None, seed),
        SIZE,
        rank_delay,
        trace_ranks=8,
        window_transfers=window,
        collect_min=collect_min,
    )
    streamed.run()
    return sched, whole, streamed


_PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def _cases(draw: st.DrawFn, *, delay: bool | None) -> dict[str, Any]:
    """_streamed's arguments: a network, algorithm, placement seed, window and collection threshold (and ranks
    delayed or not, drawn where ``delay`` is None)."""
    return {
        "network": draw(st.integers(0, len(NETWORKS) - 1)),
        "algorithm": draw(st.sampled_from(ALGORITHMS)),
        "seed": draw(st.integers(0, 3)),
        "window": draw(st.integers(1, 200)),
        "collect_min": draw(st.integers(0, 64)),
        "delay": draw(st.booleans()) if delay is None else delay,
    }


@pytest.mark.slow
@_PROPERTY
@given(case=_cases(delay=None))
def test_a_streamed_run_ends_every_rank_when_the_whole_layout_does(case: dict[str, Any]) -> None:
    _, whole, streamed = _streamed(**case)
    assert np.array_equal(streamed.rank_end, whole.rank_end)


@pytest.mark.slow
@_PROPERTY
@given(case=_cases(delay=False))
def test_a_streamed_run_keeps_the_critical_path_of_the_whole_layout(case: dict[str, Any]) -> None:
    _, whole, streamed = _streamed(**case)
    ours, theirs = streamed.chain(), _layout_chain(whole)
    for field in dataclasses.fields(ours):
        assert np.array_equal(getattr(ours, field.name), getattr(theirs, field.name)), field.name


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_streamed_run_reports_the_phases_of_the_whole_layout(algorithm: str) -> None:
    sched, whole, streamed = _streamed(0, algorithm, seed=1, window=5, collect_min=0, delay=False)
    assert streamed.phase_results() == _phase_results(sched, whole)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_streamed_run_traces_the_first_ranks_as_the_whole_layout(algorithm: str) -> None:
    _, whole, streamed = _streamed(2, algorithm, seed=2, window=3, collect_min=0, delay=True)
    start, end = _trace(whole, streamed.steps_with, 8)
    assert np.array_equal(streamed.trace_start, start, equal_nan=True)
    assert np.array_equal(streamed.trace_end, end, equal_nan=True)


def test_a_streamed_run_holds_a_band_of_steps_not_every_transfer() -> None:
    # A 64-rank ring has 8,064 transfers; laid out 64 at a time, the buffers hold the steps under way.
    from allreduce.sim._stream import StreamRun

    topo = parse_topology("fat-tree:k=8")
    sched = all_reduce("ring", 64)
    rank_gpu = np.asarray(place(64, topo, "random", seed=0), dtype=np.int64)
    streamed = StreamRun(sched, Router(topo, rank_gpu, None, 0), SIZE, None, trace_ranks=0, window_transfers=64)
    streamed.run()
    assert streamed.transfers.mask + 1 <= streamed.total // 8


def test_run_event_streamed_equals_run_event_whole() -> None:
    topo = parse_topology("fat-tree:k=8")
    sched = all_reduce("ring", 128)
    rank_gpu = np.asarray(place(128, topo, "random", seed=3), dtype=np.int64)
    results = [
        run_event(sched, Router(topo, rank_gpu, None, 3), size_bytes=SIZE, rank_delay_s=None, trace_ranks=4, stream=s)
        for s in (False, True)
    ]
    whole, streamed = results
    assert streamed.critical_path == whole.critical_path
    np.testing.assert_allclose(streamed.link_bytes, whole.link_bytes, rtol=1e-12)


@settings(max_examples=40, deadline=None)
@given(algorithm=st.sampled_from(ALGORITHMS), ranks=st.sampled_from([2, 3, 4, 8, 12, 16]), cut=st.integers(0, 40))
def test_transfers_matched_by_step_ranges_are_the_transfers_matched_at_once(
    algorithm: str, ranks: int, cut: int
) -> None:
    if not _fits(algorithm, ranks):
        return
    sched = _schedule(algorithm, ranks)
    whole = match_transfers(sched)
    stop = int((sched.streams.start + sched.streams.steps).max())
    cut = min(cut, stop)
    parts = [match_transfers(sched, (0, cut)), match_transfers(sched, (cut, stop))]
    for field in ("src", "dst", "step", "fraction"):
        assert np.array_equal(np.concatenate([getattr(p, field) for p in parts]), getattr(whole, field))


@settings(max_examples=40, deadline=None)
@given(algorithm=st.sampled_from(ALGORITHMS), ranks=st.sampled_from([2, 3, 4, 8, 12, 16, 32]))
def test_the_rank_pairs_found_from_streams_are_those_of_the_transfers(algorithm: str, ranks: int) -> None:
    from allreduce.sim._stream import stream_pairs

    if not _fits(algorithm, ranks):
        return
    sched = _schedule(algorithm, ranks)
    t = match_transfers(sched)
    assert np.array_equal(stream_pairs(sched), np.unique(t.src.astype(np.int64) * ranks + t.dst))


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.one_of(st.sampled_from([1.0, 2.0, 2.5, np.inf]), st.floats(0.1, 1e12)), min_size=1, max_size=60),
    parts=st.integers(1, 6),
)
def test_the_median_kept_as_distinct_values_is_numpys(values: list[float], parts: int) -> None:
    from allreduce.sim._stream import _Median

    median = _Median()
    for chunk in np.array_split(np.asarray(values), parts):
        median.add(chunk)
    assert median.median() == float(np.median(values))


@settings(max_examples=100, deadline=None)
@given(
    batches=st.lists(
        st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40)), min_size=1, max_size=8), min_size=1, max_size=8
    )
)
def test_the_records_kept_are_those_the_roots_reach(batches: list[list[tuple[int, int]]]) -> None:
    # Records come in batches, each entry (its rank, how far back its parent is among the records kept and
    # those of its batch before it); each rank's last record is its root. After every batch the records kept
    # are those a walk up from the roots reaches, each counting its kept children plus one if it is a root.
    from allreduce.sim._records import _adopt

    total = sum(len(b) for b in batches)
    up = np.full(total, -1, dtype=np.int64)
    rc = np.zeros(total, dtype=np.int32)
    root = np.full(4, -1, dtype=np.int64)
    first = dropped = 0
    for batch in batches:
        for i, (_, back) in enumerate(batch):
            kept = [r for r in range(first + i) if r >= first or rc[r] >= 0]
            up[first + i] = kept[-1 - back] if back < len(kept) else -1
        rank = np.asarray([r for r, _ in batch], dtype=np.int32)
        dropped += _adopt((up, rc), first, rank, root, np.empty(rank.size, dtype=np.int64))
        first += rank.size
        reached: set[int] = set()
        for start in root[root >= 0].tolist():
            record = start
            while record >= 0 and record not in reached:
                reached.add(record)
                record = int(up[record])
        assert set(np.flatnonzero(rc[:first] >= 0).tolist()) == reached
        assert dropped == first - len(reached)
        for r in reached:
            assert rc[r] == sum(1 for c in reached if up[c] == r) + int(r in root.tolist())


@settings(max_examples=100, deadline=None)
@given(
    capacity_log=st.integers(0, 4),
    lo=st.integers(0, 100),
    sizes=st.lists(st.integers(1, 40), max_size=6),
    records=st.sampled_from([(), (("value", "tag", "flag"),), (("value", "flag"),)]),
)
def test_rings_hold_the_numbers_put_across_wraps_and_growth(
    capacity_log: int, lo: int, sizes: list[int], records: tuple[tuple[str, ...], ...]
) -> None:
    # Numbers are put window by window (growing the rings where they must) and read back as spans: the values
    # put, in order, whether or not they wrap round, and whether the fields are arrays or share records.
    from allreduce.sim._stream import _Rings

    rings = _Rings(1 << capacity_log, records, value=(np.float64, np.nan), tag=(np.int32, -1), flag=(np.int8, 0))
    expected: dict[str, list[Any]] = {"value": [], "tag": [], "flag": []}
    hi = lo
    for size in sizes:
        rings.fit(lo, hi + size)
        rings.put("value", hi, np.arange(hi, hi + size) * 0.5)
        rings.put("tag", hi, np.arange(hi, hi + size, dtype=np.int32))
        rings["flag"][np.arange(hi, hi + size) & rings.mask] = 1
        rings.reset(hi, hi + size, ("flag",))
        expected["value"] += list(np.arange(hi, hi + size) * 0.5)
        expected["tag"] += list(range(hi, hi + size))
        expected["flag"] += [0] * size
        hi += size
    for name, got in zip(expected, rings.span(lo, hi, *expected), strict=True):
        assert got.tolist() == expected[name], name


def test_a_ring_entry_s_fields_in_a_record_share_one_cache_line() -> None:
    # The fields named together are views of one array of records of 64 bytes at most, aligned to cache lines:
    # the kernel's reads of one transfer's fields touch one line, not one per field.
    from allreduce.sim._stream import _Rings

    fields = {
        "a": (np.float64, 0.0),
        "b": (np.int64, -1),
        "c": (np.int32, 2),
        "d": (np.int8, 0),
        "e": (np.float64, 1.0),
    }
    rings = _Rings(1 << 10, (("a", "b", "c", "d"),), **fields)
    rings.fit(0, 1 << 12)
    grouped = [rings[name] for name in "abcd"]
    assert {array.strides[0] for array in grouped} == {32}
    starts = [array.ctypes.data for array in grouped]
    assert min(starts) % 64 == 0
    assert max(starts) - min(starts) < 32
    assert rings["e"].strides[0] == 8
    assert [rings[name][100] for name in "abcde"] == [0.0, -1, 2, 0, 1.0]
