"""The fast engine against the event-driven one, where they must agree (see the docstring of sim/_fast.py for
where and why they may not), and the engines' own invariants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from allreduce.schedules import Schedule, algorithms, all_reduce
from allreduce.sim import Faults, match_transfers, simulate
from allreduce.topology import parse_topology, switch

SIZE = float(2**24)


def schedule(name: str, n: int) -> Schedule:
    return all_reduce(name, n, group_size=8 if n % 8 == 0 and n > 8 else 2)


def assert_agree(sched: Schedule, spec: str, rtol: float = 1e-6, **kwargs: object) -> None:
    topo = parse_topology(spec)
    fast = simulate(sched, topo, size_bytes=SIZE, engine="fast", **kwargs)  # type: ignore[arg-type]
    event = simulate(sched, topo, size_bytes=SIZE, engine="event", **kwargs)  # type: ignore[arg-type]
    assert fast.seconds == pytest.approx(event.seconds, rel=rtol), (sched.name, spec, kwargs)
    # Same bytes on every link: both engines move the schedule's bytes over the same routes.
    np.testing.assert_allclose(fast.link_bytes, event.link_bytes, rtol=1e-9, atol=1e-3)


@pytest.mark.parametrize("name", algorithms(automatic=True))
def test_agree_on_one_switch(name: str) -> None:
    assert_agree(schedule(name, 16), "switch:16")


UNIFORM = [
    ("fat-tree:k=4", 16, {"routing": "spray"}),
    ("clos:leaves=4,spines=2,hosts_per_leaf=8,oversub=4", 32, {"routing": "spray"}),
    ("rail:nodes=4,gpus=8", 32, {}),
    ("torus:4x4", 16, {}),
]
NAMES = ["ring", "halving_doubling", "recursive_doubling", "double_binary_tree", "hierarchical"]


@pytest.mark.parametrize(
    ("name", "spec", "n", "kwargs"),
    [
        (name, spec, n, kwargs)
        for spec, n, kwargs in UNIFORM
        for name in NAMES
        # Trees on a torus: a parent's flows to two children share a link for part of the route, unevenly,
        # and ranks desynchronise (documented in sim/_fast.py; measured 2.9%).
        if not (name == "double_binary_tree" and spec.startswith("torus"))
    ],
)
def test_agree_where_rates_are_uniform(name: str, spec: str, n: int, kwargs: dict[str, object]) -> None:
    # A tree rank sends to two children and its parent at once; where those flows' paths differ in length
    # (rails: NVLink vs network), ranks drift a little apart and the engines agree to the promised 1%, not 1e-6.
    tree_on_mixed_paths = name == "double_binary_tree" and spec.startswith("rail")
    assert_agree(schedule(name, n), spec, rtol=1e-2 if tree_on_mixed_paths else 1e-6, **kwargs)


@pytest.mark.parametrize("name", ["halving_doubling", "recursive_doubling", "double_binary_tree", "hierarchical"])
@pytest.mark.slow
def test_agree_with_random_placement_and_spraying_on_128_ranks(name: str) -> None:
    assert_agree(schedule(name, 128), "fat-tree:k=8", routing="spray", placement="random", seed=5)


@given(
    n=st.integers(2, 12),
    name=st.sampled_from(["ring", "halving_doubling", "recursive_doubling", "hierarchical"]),
    factor=st.sampled_from([1.0, 0.5, 0.1, 0.01]),
    degraded_gpu=st.integers(0, 11),
    slow=st.lists(st.tuples(st.integers(0, 11), st.sampled_from([0.0, 1e-6, 1e-4])), max_size=3),
)
@pytest.mark.slow
def test_agree_on_a_switch_with_any_faults(
    n: int, name: str, factor: float, degraded_gpu: int, slow: list[tuple[int, float]]
) -> None:
    """These algorithms give every rank at most one send and one receive per step, so on one switch no two
    flows share a link: rates do not depend on which flows overlap, and desynchronised ranks (slow ranks, a
    slow link) must not make the engines differ."""
    if name == "hierarchical" and n % 2:
        name = "ring"
    faults = Faults(
        degraded=((f"gpu{degraded_gpu % n}->switch0", factor),),
        slow_ranks=tuple((r % n, s) for r, s in slow),
    )
    sched = all_reduce(name, n, group_size=2) if name == "hierarchical" else all_reduce(name, n)
    assert_agree(sched, f"switch:{n}", faults=faults)


def test_slow_rank_adds_its_delay_to_every_ring_step() -> None:
    topo = switch(8)
    healthy = simulate(all_reduce("ring", 8), topo, size_bytes=SIZE, engine="fast")
    for engine in ("fast", "event"):
        slow = simulate(
            all_reduce("ring", 8), topo, size_bytes=SIZE, engine=engine, faults=Faults(slow_ranks=((5, 3e-6),))
        )
        assert slow.seconds == pytest.approx(healthy.seconds + 14 * 3e-6, rel=1e-9)
        assert slow.critical_path[0].rank_delay_s > 0


def test_slow_rank_delays_only_what_depends_on_it() -> None:
    # Hierarchical with groups {0,1}, {2,3}, ...: a slow rank 0 delays its group's steps and, through the ring
    # across groups, every rank; but only its own group waits for it in the final all-gather, so ranks 0 and 1
    # finish last and the others earlier.
    topo = switch(8)
    result = simulate(
        all_reduce("hierarchical", 8, group_size=2),
        topo,
        size_bytes=SIZE,
        engine="event",
        faults=Faults(slow_ranks=((0, 1e-3),)),
    )
    end = result.rank_end_s
    assert int(np.argmax(end)) in (0, 1)
    assert end[2:].max() < end[:2].min()


def test_a_larger_buffer_or_a_slower_link_never_finishes_sooner() -> None:
    topo = parse_topology("fat-tree:k=4")
    sched = all_reduce("halving_doubling", 16)
    times = [simulate(sched, topo, size_bytes=s, engine="fast").seconds for s in (0, 1e3, 1e6, 1e8)]
    assert times == sorted(times)
    slowdowns = [
        simulate(sched, topo, size_bytes=1e8, faults=Faults(degraded=(("edge0->agg0", f),))).seconds
        for f in (1.0, 0.5, 0.1)
    ]
    assert slowdowns == sorted(slowdowns)


def test_transfers_are_matched_from_the_per_rank_programs() -> None:
    t = match_transfers(all_reduce("ring", 4))
    assert len(t) == 2 * 3 * 4
    assert np.all(t.dst == (t.src + 1) % 4)
    np.testing.assert_array_equal(np.bincount(t.step), [4] * 6)
    np.testing.assert_allclose(t.fraction, 0.25)


def test_engines_name_the_same_bottleneck_for_a_degraded_link() -> None:
    topo = parse_topology("fat-tree:k=4")
    faults = Faults(degraded=(("gpu6->edge3", 0.05),))
    names = {
        engine: simulate(all_reduce("ring", 16), topo, size_bytes=SIZE, faults=faults, engine=engine)
        .bottlenecks[0]
        .name
        for engine in ("fast", "event")
    }
    assert names == {"fast": "gpu6->edge3", "event": "gpu6->edge3"}


def test_zero_bytes_cost_exactly_the_path_latencies() -> None:
    result = simulate(all_reduce("recursive_doubling", 8), switch(8, latency_s=2e-6), size_bytes=0, engine="event")
    assert result.seconds == pytest.approx(3 * 2 * 2e-6, rel=1e-12)
    assert result.bottlenecks == ()


@pytest.mark.slow
def test_the_event_engine_reports_progress() -> None:
    # Ring on 96 ranks: 2 x 95 x 96 = 18,240 transfers, so a report every 4,096 deliveries gives four.
    seen: list[float] = []
    sched = all_reduce("ring", 96)
    topo = parse_topology("switch:96")
    event = simulate(sched, topo, size_bytes=2**20, engine="event", progress=seen.append)
    assert seen == pytest.approx([4096 / 18240 * k for k in range(1, 5)])
    # The fast engine (certified here, so auto keeps it) reports nothing, and agrees.
    fast_seen: list[float] = []
    auto = simulate(sched, topo, size_bytes=2**20, progress=fast_seen.append)
    assert auto.engine == "fast"
    assert fast_seen == []
    assert auto.seconds == pytest.approx(event.seconds, rel=1e-9)
