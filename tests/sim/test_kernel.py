"""The compiled per-event core (sim/_kernel.py, numba) against the pure-Python per-event core (sim/_event.py's
_Run: the same events, its rates re-solved over whole components rather than lazily), transfer by transfer, to
1e-9; engine="event" with the kernel against the same with the kernel switched off (ALLREDUCE_SIM_KERNEL=numpy:
the windowed and per-event numpy cores)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allreduce.schedules import all_reduce
from allreduce.sim import _kernel, match_transfers, simulate
from allreduce.sim._event import _Run
from allreduce.sim._kernel import KERNEL_ENV, available, run_kernel
from allreduce.sim._layout import Layout
from allreduce.sim._routing import Router
from allreduce.topology import parse_topology, place

pytestmark = pytest.mark.skipif(not available(), reason="numba (the fast extra) is not installed")

SIZE = float(2**24)
FIELDS = ("start_s", "drained_s", "delivered_s", "slot_start", "slot_end", "rank_end", "slowest_rate")

NETWORKS = (
    ("fat-tree:k=4", 16),
    ("clos:leaves=4,spines=2,hosts_per_leaf=4,oversub=4", 16),
    ("torus:4x4", 16),
    ("rail:nodes=2,gpus=8", 16),
    ("dragonfly:groups=5,routers=2,hosts=2", 20),
    ("switch:12", 12),
)
ALGORITHMS = ("ring", "halving_doubling", "double_binary_tree", "hierarchical", "recursive_doubling")


def _runs(
    spec: str, ranks: int, algorithm: str, *, seed: int, delay: np.ndarray, extra: float, start: np.ndarray
) -> tuple[_Run, Layout]:
    topo = parse_topology(spec)
    sched = all_reduce(algorithm, ranks, group_size=4 if algorithm == "hierarchical" else 1)
    rank_gpu = np.asarray(place(ranks, topo, "random", seed=seed), dtype=np.int64)
    transfers = match_transfers(sched)
    extra_s = np.full(len(transfers), extra)
    runs = []
    for core in (_Run, Layout):
        run = core(sched, Router(topo, rank_gpu, None, seed), transfers, SIZE, delay, start_s=start, extra_s=extra_s)
        if isinstance(run, _Run):
            run.run()
        else:
            run_kernel(run)
        runs.append(run)
    reference, kernel = runs
    assert isinstance(reference, _Run)
    return reference, kernel


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    network=st.sampled_from(NETWORKS),
    algorithm=st.sampled_from(ALGORITHMS),
    seed=st.integers(0, 2**16),
    noise=st.tuples(st.integers(0, 11), st.sampled_from([0, 1e-6, 3e-5]), st.sampled_from([0, 1e-7]), st.booleans()),
)
def test_the_kernel_equals_the_per_event_core(
    network: tuple[str, int], algorithm: str, seed: int, noise: tuple[int, float, float, bool]
) -> None:
    spec, ranks = network
    slow_rank, slow_s, extra, late = noise
    if algorithm in ("halving_doubling", "recursive_doubling") and ranks & (ranks - 1):
        ranks = 8
    delay = np.zeros(ranks)
    delay[slow_rank % ranks] = slow_s
    start = np.random.default_rng(seed).uniform(0, 2e-5, ranks) if late else np.zeros(ranks)
    reference, kernel = _runs(spec, ranks, algorithm, seed=seed, delay=delay, extra=extra, start=start)
    for field in FIELDS:
        np.testing.assert_allclose(getattr(kernel, field), getattr(reference, field), rtol=1e-9, err_msg=field)
    # The same critical path and bottlenecks: the transfer that ended each step, the step that let each start.
    np.testing.assert_array_equal(kernel.slot_last, reference.slot_last)
    np.testing.assert_array_equal(kernel.trigger, reference.trigger)
    np.testing.assert_array_equal(kernel.bottleneck, reference.bottleneck)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "ranks", "algorithm"),
    [
        ("fat-tree:k=8", 128, "ring"),
        ("clos:leaves=8,spines=4,hosts_per_leaf=16,oversub=4", 128, "double_binary_tree"),
        ("torus:8x8", 64, "ring"),
    ],
)
def test_engine_event_is_the_same_with_and_without_the_kernel(
    spec: str, ranks: int, algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    topo = parse_topology(spec)
    sched = all_reduce(algorithm, ranks)
    compiled = simulate(sched, topo, size_bytes=SIZE, placement="random", seed=3, engine="event")
    monkeypatch.setenv(KERNEL_ENV, "numpy")
    assert not available()
    numpy_only = simulate(sched, topo, size_bytes=SIZE, placement="random", seed=3, engine="event")
    np.testing.assert_allclose(compiled.rank_end_s, numpy_only.rank_end_s, rtol=1e-9)
    assert compiled.seconds == pytest.approx(numpy_only.seconds, rel=1e-9)
    assert [b.name for b in compiled.bottlenecks] == [b.name for b in numpy_only.bottlenecks]


def test_the_kernel_reports_progress() -> None:
    # Ring on 48 ranks: 2 x 47 x 48 = 4,512 transfers: one report, at 4,096 deliveries.
    seen: list[float] = []
    sched = all_reduce("ring", 48)
    simulate(sched, parse_topology("switch:48"), size_bytes=SIZE, engine="event", progress=seen.append)
    assert seen == pytest.approx([4096 / 4512])


def test_more_transfers_in_flight_than_blocks_stops_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel's arrays are sized by a bound on the transfers in flight; were it wrong, the run must stop,
    # not write past them. A 4-rank ring drains four transfers at once; pretend at most one can.
    monkeypatch.setattr(_kernel, "_in_flight_bound", lambda run: 1)
    with pytest.raises(RuntimeError, match="more than 1 transfers in flight"):
        simulate(all_reduce("ring", 4), parse_topology("switch:4"), size_bytes=SIZE, engine="event")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    network=st.sampled_from(NETWORKS),
    algorithm=st.sampled_from(ALGORITHMS),
    seed=st.integers(0, 2**16),
    late=st.booleans(),
)
def test_a_transfer_alone_on_its_links_drains_at_its_solo_rate(
    network: tuple[str, int], algorithm: str, seed: int, late: bool
) -> None:
    # The kernel keeps a transfer that starts alone on its links out of their lists (resolve_solo) until another
    # starts on one of them. One that no other overlaps on any link while it drains drains at its solo rate
    # (its path's least capacity over weight) from start to end; one overlapped keeps to the per-event core
    # (the test above), here checked to drain no faster than that.
    spec, ranks = network
    if algorithm in ("halving_doubling", "recursive_doubling") and ranks & (ranks - 1):
        ranks = 8
    start = np.random.default_rng(seed).uniform(0, 2e-5, ranks) if late else np.zeros(ranks)
    _, run = _runs(spec, ranks, algorithm, seed=seed, delay=np.zeros(ranks), extra=0.0, start=start)
    nbytes = np.asarray(run.t.fraction) * run.size_bytes
    links = [run.pair_link[run.pair_ptr[p] : run.pair_ptr[p + 1]] for p in run.pair]
    solo = np.asarray(
        [
            np.min(run.link_capacity[links[x]] / run.pair_weight[run.pair_ptr[p] : run.pair_ptr[p + 1]])
            if links[x].size
            else np.inf
            for x, p in enumerate(run.pair)
        ]
    )
    flows = np.flatnonzero((nbytes > 0) & np.isfinite(solo))
    for x in flows:
        others = flows[(run.start_s[flows] < run.drained_s[x]) & (run.drained_s[flows] > run.start_s[x]) & (flows != x)]
        shared = [y for y in others if np.intersect1d(links[x], links[y]).size]
        duration = run.drained_s[x] - run.start_s[x]
        if shared:
            assert duration >= nbytes[x] / solo[x] * (1 - 1e-12)
        else:
            assert duration == pytest.approx(nbytes[x] / solo[x], rel=1e-12)
            assert run.slowest_rate[x] == solo[x]


def test_a_link_s_fields_that_a_start_or_drain_reads_share_one_cache_line() -> None:
    # Per link, its list's head and tail, its changed mark, its capacity and the level and group it last filled
    # at (what a transfer alone on its links is re-solved with) lie in the first 64-byte line of its record.
    from allreduce.sim._kernel import link_records

    capacity = np.linspace(1.0, 2.0, 7)
    head, tail, mark, link_capacity, (rows_i, rows_f) = link_records(capacity)
    assert np.array_equal(link_capacity, capacity)
    assert (head == -1).all()
    assert (tail == -1).all()
    for link in (0, 3, 6):
        line = head[link:].ctypes.data
        assert line % 64 == 0
        for field in (tail[link:], mark[link:], link_capacity[link:], rows_f[0, link:], rows_i[0, link:]):
            assert 0 <= field.ctypes.data - line < 64
        for k in range(1, 4):
            assert 64 <= rows_i[k, link:].ctypes.data - line < 128
