"""The event engine's windowed core (sim/_window.py) against the per-event core (sim/_event.py's _Run, the
reference it replaces), transfer by transfer; its many-component progressive filling against the one-component
one and the definition of max-min fairness; the transfers matched from the schedule's streams against the
per-rank programs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.schedules import Schedule, Verb, algorithms, all_reduce
from allreduce.sim import match_transfers, simulate
from allreduce.sim._event import _Run
from allreduce.sim._fair import max_min_rates
from allreduce.sim._routing import Router
from allreduce.sim._window import WindowRun, _fill_components
from allreduce.topology import parse_topology, place

SIZE = float(2**24)


def _paired_from_programs(schedule: Schedule) -> set[tuple[int, int, int, int, int]]:
    """(step, src, dst, block_start, block_stop) of every send that its receiver's program receives."""
    sends = set()
    recvs = set()
    for rank in range(schedule.world_size):
        for op in schedule.program(rank):
            if op.verb is Verb.SEND:
                sends.add((op.step, rank, op.peer, op.block_start, op.block_stop))
            else:
                recvs.add((op.step, op.peer, rank, op.block_start, op.block_stop))
    assert sends == recvs
    return sends


@pytest.mark.parametrize("name", algorithms(automatic=True))
@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 16])
def test_transfers_from_the_streams_are_the_programs_pairs(name: str, n: int) -> None:
    try:
        sched = all_reduce(name, n, group_size=4 if n % 4 == 0 and n > 4 else 1)
    except ValueError:
        pytest.skip(f"{name} does not run on {n} ranks")
    t = match_transfers(sched)
    pairs = _paired_from_programs(sched)
    assert len(t) == len(pairs)
    fractions = {(s, a, b, (stop - start) / sched.num_blocks) for s, a, b, start, stop in pairs}
    got = set(zip(t.step.tolist(), t.src.tolist(), t.dst.tolist(), t.fraction.tolist(), strict=True))
    assert got == fractions
    order = np.lexsort((t.dst, t.src, t.step))
    np.testing.assert_array_equal(order, np.arange(len(t)))


Case = tuple[str, str | None, str, int, str, tuple[tuple[int, float], ...]]

# Topologies, algorithms and placements (16 to 40 ranks; those above 16 marked slow) on which the two cores must
# agree to 1e-9 on every transfer; slow ranks desynchronise them so that transfers start and drain at scattered
# instants. benchmarks/bench_engines.py --grid runs the larger grid.
GRID: list[object] = [
    ("fat-tree:k=4", "ecmp", "ring", 16, "random", ()),
    ("fat-tree:k=4", "spray", "halving_doubling", 16, "random", ()),
    ("fat-tree:k=4", "ecmp", "double_binary_tree", 16, "random", ((3, 1e-5),)),
    pytest.param(
        ("clos:leaves=4,spines=2,hosts_per_leaf=8,oversub=4", "ecmp", "ring", 32, "random", ()), marks=pytest.mark.slow
    ),
    pytest.param(
        ("clos:leaves=4,spines=2,hosts_per_leaf=8,oversub=4", "ecmp", "double_binary_tree", 32, "random", ((7, 2e-6),)),
        marks=pytest.mark.slow,
    ),
    ("clos:leaves=4,spines=1,hosts_per_leaf=4,oversub=4", "ecmp", "hierarchical", 16, "random", ()),
    ("torus:4x4", None, "halving_doubling", 16, "random", ((3, 1e-5), (7, 2e-6))),
    ("torus:4x4", None, "double_binary_tree", 16, "linear", ()),
    pytest.param(("rail:nodes=4,gpus=8", None, "hierarchical", 32, "random", ()), marks=pytest.mark.slow),
    pytest.param(("rail:nodes=4,gpus=8", None, "double_binary_tree", 32, "random", ()), marks=pytest.mark.slow),
    pytest.param(("dragonfly:groups=5,routers=4,hosts=2", None, "ring", 40, "random", ()), marks=pytest.mark.slow),
    ("switch:16", None, "recursive_doubling", 16, "linear", ((0, 1e-6),)),
]


def _both(case: Case) -> tuple[_Run, WindowRun]:
    spec, routing, name, n, placement, slow = case
    topo = parse_topology(spec)
    sched = all_reduce(name, n, group_size=4 if name == "hierarchical" else 1)
    rank_gpu = np.asarray(place(n, topo, placement, seed=1), dtype=np.int64)
    delay = np.zeros(n)
    for rank, seconds in slow:
        delay[rank] = seconds
    reference = _Run(sched, Router(topo, rank_gpu, routing, 1), match_transfers(sched), SIZE, delay)
    windowed = WindowRun(sched, Router(topo, rank_gpu, routing, 1), match_transfers(sched), SIZE, delay)
    reference.run()
    assert windowed.run(may_give_up=False)
    return reference, windowed


@pytest.mark.parametrize("case", GRID)
def test_the_windowed_core_equals_the_per_event_core(case: Case) -> None:
    reference, windowed = _both(case)
    assert windowed.usable
    for field in ("start_s", "drained_s", "delivered_s", "slot_start", "slot_end", "rank_end", "slowest_rate"):
        np.testing.assert_allclose(getattr(windowed, field), getattr(reference, field), rtol=1e-9, err_msg=field)
    np.testing.assert_array_equal(windowed.bottleneck >= 0, reference.bottleneck >= 0)


@pytest.mark.slow
def test_the_windowed_core_advances_many_transfers_per_window() -> None:
    # Ring on 32 randomly placed ranks of a 4:1 Clos: 1,984 transfers in about 500 windows (so the test above
    # compares the windowed core, not a one-event-per-window replay).
    _, windowed = _both(("clos:leaves=4,spines=2,hosts_per_leaf=8,oversub=4", "ecmp", "ring", 32, "random", ()))
    assert 0 < windowed.windows < len(windowed.t) / 3


def test_without_lookahead_the_per_event_core_runs() -> None:
    # Zero latency: a transfer is delivered the instant it drains, so no window is safe.
    topo = parse_topology("switch:8,lat=0us")
    sched = all_reduce("ring", 8)
    run = WindowRun(sched, Router(topo, np.arange(8), None, 0), match_transfers(sched), SIZE, None)
    assert not run.usable
    result = simulate(sched, topo, size_bytes=SIZE, engine="event")
    assert result.seconds == pytest.approx(14 * SIZE / 8 / topo.link_bandwidth_Bps[0], rel=1e-12)


@st.composite
def components(draw: st.DrawFn) -> tuple[list[list[int]], list[list[float]], list[float], list[int]]:
    """Several independent incidences side by side: paths (link ids), weights, capacities, component per link."""
    paths: list[list[int]] = []
    weights: list[list[float]] = []
    capacity: list[float] = []
    link_comp: list[int] = []
    for comp in range(draw(st.integers(1, 4))):
        first = len(capacity)
        num_links = draw(st.integers(1, 5))
        capacity += draw(st.lists(st.integers(1, 20).map(float), min_size=num_links, max_size=num_links))
        link_comp += [comp] * num_links
        for _ in range(draw(st.integers(1, 6))):
            path = sorted(draw(st.sets(st.integers(first, first + num_links - 1), min_size=1, max_size=num_links)))
            paths.append(path)
            weights.append([draw(st.sampled_from([1.0, 0.5, 0.25])) for _ in path])
    return paths, weights, capacity, link_comp


@settings(max_examples=100, deadline=None)
@given(components())
@pytest.mark.slow
def test_filling_many_components_at_once_is_filling_each(
    case: tuple[list[list[int]], list[list[float]], list[float], list[int]],
) -> None:
    """Each component at its own level gives the rates the one-component filling gives it, and they are
    max-min fair: within capacity, and every flow crosses a saturated link on which no flow is faster."""
    paths, weights, capacity, link_comp = case
    flow = np.repeat(np.arange(len(paths)), [len(p) for p in paths])
    link = np.asarray([x for p in paths for x in p], dtype=np.int64)
    weight = np.asarray([w for ws in weights for w in ws])
    comp = np.asarray(link_comp)
    start = np.flatnonzero(np.concatenate([[True], comp[1:] != comp[:-1]]))
    rate, bottleneck, _ = _fill_components(
        len(paths), flow, link, weight, np.asarray(capacity), link_comp_start=start, link_comp=comp
    )
    ptr = np.cumsum([0] + [len(p) for p in paths])
    alone = max_min_rates(ptr, link, weight, capacity)
    np.testing.assert_allclose(rate, alone.rate_Bps, rtol=1e-12)
    load = np.bincount(link, weights=weight * rate[flow], minlength=len(capacity))
    assert np.all(load <= np.asarray(capacity) * (1 + 1e-9))
    for f, path in enumerate(paths):
        assert bottleneck[f] in path
        b = int(bottleneck[f])
        assert load[b] >= capacity[b] * (1 - 1e-9)
        on_b = [g for g, p in enumerate(paths) if b in p]
        assert rate[f] >= max(rate[on_b]) * (1 - 1e-9)
