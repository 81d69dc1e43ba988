"""simulate_sizes: several buffer sizes in one pass, each size's result the one simulate gives it alone."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.schedules import all_reduce
from allreduce.sim import Faults, SimResult, simulate, simulate_sizes
from allreduce.sim._fast import run_fast_certified, run_fast_sizes
from allreduce.sim._routing import Router
from allreduce.topology import parse_topology, place

RTOL = 1e-12
ALGORITHMS = ["ring", "halving_doubling", "recursive_doubling", "double_binary_tree", "hierarchical"]
# Networks where the fast engine certifies (one switch, rings on a fat-tree) and where it cannot (ECMP collisions,
# an oversubscribed Clos, random placement on a torus or rails).
NETWORKS = [
    ("switch:{n}", None),
    ("fat-tree:k=4", "ecmp"),
    ("fat-tree:k=4", "spray"),
    ("clos:leaves=4,spines=1,hosts_per_leaf=4,oversub=4", "ecmp"),
    ("torus:4x4", None),
    ("rail:nodes=2,gpus=8", None),
]
SIZES = st.one_of(st.just(0.0), st.integers(1, 2**30).map(float), st.floats(0.5, 2.0**31))


def assert_same(together: SimResult, alone: SimResult) -> None:
    assert together.size_bytes == alone.size_bytes
    assert together.exact == alone.exact
    assert together.engine == alone.engine
    assert together.seconds == pytest.approx(alone.seconds, rel=RTOL, abs=0)
    np.testing.assert_allclose(together.rank_end_s, alone.rank_end_s, rtol=RTOL, atol=0)
    np.testing.assert_allclose(together.link_bytes, alone.link_bytes, rtol=RTOL, atol=0)
    np.testing.assert_allclose(together.trace_end_s, alone.trace_end_s, rtol=RTOL, atol=0)
    assert [(p.first_step, p.repeat) for p in together.phases] == [(p.first_step, p.repeat) for p in alone.phases]
    np.testing.assert_allclose([p.end_s for p in together.phases], [p.end_s for p in alone.phases], rtol=RTOL, atol=0)
    assert [(c.src_rank, c.dst_rank, c.bottleneck_link) for c in together.critical_path] == [
        (c.src_rank, c.dst_rank, c.bottleneck_link) for c in alone.critical_path
    ]
    assert [b.name for b in together.bottlenecks] == [b.name for b in alone.bottlenecks]
    np.testing.assert_allclose(
        [b.waited_s for b in together.bottlenecks], [b.waited_s for b in alone.bottlenecks], rtol=RTOL, atol=0
    )


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(ALGORITHMS),
    n=st.sampled_from([4, 8, 16]),
    network=st.sampled_from(NETWORKS),
    placement=st.sampled_from(["linear", "random"]),
    slow=st.sampled_from([None, (1, 1e-5), (2, 1e-3)]),
    sizes=st.lists(SIZES, min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
@pytest.mark.slow
def test_each_size_of_a_pass_is_what_it_gets_alone(
    *,
    name: str,
    n: int,
    network: tuple[str, str | None],
    placement: str,
    slow: tuple[int, float] | None,
    sizes: list[float],
    seed: int,
) -> None:
    spec, routing = network
    topo = parse_topology(spec.format(n=n))
    sched = all_reduce(name, n, group_size=4 if n > 4 else 2)
    faults = Faults(slow_ranks=(slow,) if slow else ())
    kwargs = {"placement": placement, "routing": routing, "seed": seed, "faults": faults, "engine": "fast"}
    together = simulate_sizes(sched, topo, sizes_bytes=sizes, **kwargs)  # type: ignore[arg-type]
    assert len(together) == len(sizes)
    for size, result in zip(sizes, together, strict=True):
        assert_same(result, simulate(sched, topo, size_bytes=size, **kwargs))  # type: ignore[arg-type]


def test_sizes_the_fast_engine_cannot_certify_are_uncertified_alone_too() -> None:
    # A 4:1 oversubscribed Clos with one spine and random placement: ring hops share the leaf's one uplink. A
    # zero-byte buffer (only path latencies) is certified; the larger ones are not, whatever else runs beside them.
    topo = parse_topology("clos:leaves=4,spines=1,hosts_per_leaf=4,oversub=4")
    sched = all_reduce("ring", 16)
    sizes = [0.0, 2.0**20, 2.0**26]
    together = simulate_sizes(sched, topo, sizes_bytes=sizes, placement="random", seed=2, engine="fast")
    assert [r.exact for r in together] == [True, False, False]
    for size, result in zip(sizes, together, strict=True):
        assert_same(result, simulate(sched, topo, size_bytes=size, placement="random", seed=2, engine="fast"))


@pytest.mark.parametrize(("sizes", "certified"), [([2.0**20, 2.0**26], False), ([0.0, 2.0**20], True)])
def test_a_fast_run_for_certified_sizes_only_stops_once_none_is(sizes: list[float], certified: bool) -> None:
    # What auto asks for: the results where some size keeps its certificate (the same as the full run), else
    # nothing, the phases left not simulated.
    topo = parse_topology("clos:leaves=4,spines=1,hosts_per_leaf=4,oversub=4")
    sched = all_reduce("ring", 16)
    router = Router(topo, np.asarray(place(16, topo, "random", seed=2), dtype=np.int64), None, 2)
    got = run_fast_certified(sched, router, sizes_bytes=sizes, rank_delay_s=None, trace_ranks=4)
    if not certified:
        assert got is None
        return
    assert got is not None
    full = run_fast_sizes(sched, router, sizes_bytes=sizes, rank_delay_s=None, trace_ranks=4)
    for result, alone in zip(got, full, strict=True):
        assert_same(result, alone)


@pytest.mark.slow
def test_auto_runs_the_event_engine_for_exactly_the_uncertified_sizes() -> None:
    topo = parse_topology("clos:leaves=4,spines=1,hosts_per_leaf=4,oversub=4")
    sched = all_reduce("ring", 16)
    sizes = [2.0**26, 0.0, 2.0**20]
    together = simulate_sizes(sched, topo, sizes_bytes=sizes, placement="random", seed=2)
    assert [r.engine for r in together] == ["event", "fast", "event"]
    for size, result in zip(sizes, together, strict=True):
        assert_same(result, simulate(sched, topo, size_bytes=size, placement="random", seed=2))


def test_a_long_ring_whose_sizes_settle_at_different_steps() -> None:
    # Ranks leave lockstep on a fat-tree (paths of 2, 4 and 6 hops); each size's clocks reach their periodic
    # regime at their own step and skip their own cycles.
    topo = parse_topology("fat-tree:k=8")
    sched = all_reduce("ring", 128)
    sizes = [1.0, 3.0e3, 2.0**20, 1.5 * 2**20, 25.0 * 2**20]
    together = simulate_sizes(sched, topo, sizes_bytes=sizes, placement="random", seed=5, engine="fast")
    for size, result in zip(sizes, together, strict=True):
        assert_same(result, simulate(sched, topo, size_bytes=size, placement="random", seed=5, engine="fast"))


def test_results_come_in_the_order_of_the_sizes_repeats_included() -> None:
    topo = parse_topology("fat-tree:k=4")
    sched = all_reduce("halving_doubling", 16)
    small, large = simulate_sizes(sched, topo, sizes_bytes=[2.0**10, 2.0**24], engine="fast")
    again = simulate_sizes(sched, topo, sizes_bytes=[2.0**24, 2.0**10, 2.0**24], engine="fast")
    assert [r.size_bytes for r in again] == [2.0**24, 2.0**10, 2.0**24]
    assert [r.seconds for r in again] == [large.seconds, small.seconds, large.seconds]


def test_no_sizes_is_no_results() -> None:
    assert simulate_sizes(all_reduce("ring", 4), parse_topology("switch:4"), sizes_bytes=[]) == []


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "many"])
def test_a_bad_size_is_named_by_its_position(bad: object) -> None:
    with pytest.raises(ValueError, match=r"sizes_bytes\[1\] must be"):
        simulate_sizes(all_reduce("ring", 4), parse_topology("switch:4"), sizes_bytes=[1.0, bad])  # type: ignore[list-item]


@pytest.mark.slow
def test_a_ring_of_more_ranks_than_the_cycle_test_probes() -> None:
    # 1,024 ranks: the cycle test screens every fourth rank before testing all of them.
    topo = parse_topology("fat-tree:k=16")
    sched = all_reduce("ring", 1024)
    sizes = [1.0, 2.0**20, 25.0 * 2**20]
    together = simulate_sizes(sched, topo, sizes_bytes=sizes, placement="random", seed=1, engine="fast")
    for size, result in zip(sizes, together, strict=True):
        assert_same(result, simulate(sched, topo, size_bytes=size, placement="random", seed=1, engine="fast"))
