"""Failed links reroute or fail with the ranks named; results report phases, critical path and trace."""

from __future__ import annotations

import json

import numpy as np
import pytest

from allreduce.schedules import all_reduce
from allreduce.sim import Faults, chrome_trace, simulate
from allreduce.topology import fat_tree, switch

SIZE = float(2**24)


def test_failed_uplink_reroutes_and_carries_nothing() -> None:
    topo = fat_tree(4)
    sched = all_reduce("ring", 16)
    healthy = simulate(sched, topo, size_bytes=SIZE, routing="spray", engine="fast")
    failed = simulate(
        sched, topo, size_bytes=SIZE, routing="spray", engine="fast", faults=Faults(failed=("edge0<->agg0",))
    )
    names = [failed.topology.link_name(i) for i in range(failed.topology.num_links)]
    assert "edge0->agg0" not in names
    assert "agg0->edge0" not in names
    assert failed.topology.num_links == topo.num_links - 2
    # Everything edge0 sends up now takes edge0->agg1, which the healthy run shared with edge0->agg0.
    up = failed.topology.find_link("edge0->agg1")
    healthy_up = topo.find_link("edge0->agg1")
    assert failed.link_bytes[up] == pytest.approx(2 * healthy.link_bytes[healthy_up], rel=1e-9)
    # Same bytes overall, but no faster.
    assert failed.seconds >= healthy.seconds * (1 - 1e-12)


def test_disconnected_gpu_is_an_error_naming_the_ranks() -> None:
    topo = switch(8)
    with pytest.raises(ValueError, match=r"no path after failing gpu2->switch0.*rank 2 \(gpu2\) -> rank 3 \(gpu3\)"):
        simulate(all_reduce("ring", 8), topo, size_bytes=SIZE, faults=Faults(failed=("gpu2->switch0",)))
    # With a shuffled placement the message speaks of ranks, and of the GPUs they run on.
    placement = [7, 6, 5, 4, 3, 2, 1, 0]
    with pytest.raises(ValueError, match=r"rank 5 \(gpu2\) -> rank 6 \(gpu1\)"):
        simulate(
            all_reduce("ring", 8),
            topo,
            size_bytes=SIZE,
            placement=placement,
            faults=Faults(failed=("gpu2->switch0",)),
            engine="event",
        )


@pytest.mark.parametrize(
    ("faults", "message"),
    [
        (Faults(degraded=(("gpu0->nowhere0", 0.5),)), "nowhere0"),
        (Faults(failed=("gpu0-switch0",)), "SRC->DST"),
        (Faults(slow_ranks=((9, 1e-6),)), "slow rank 9"),
    ],
)
def test_bad_faults_are_named(faults: Faults, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        simulate(all_reduce("ring", 8), switch(8), size_bytes=SIZE, faults=faults)


def test_fault_parameters_are_checked() -> None:
    with pytest.raises(ValueError, match="factor"):
        Faults(degraded=(("a->b", 0.0),))
    with pytest.raises(ValueError, match="delay"):
        Faults(slow_ranks=((0, -1.0),))


def test_bad_arguments_are_named() -> None:
    sched = all_reduce("ring", 8)
    with pytest.raises(ValueError, match="size_bytes"):
        simulate(sched, switch(8), size_bytes=-1)
    with pytest.raises(ValueError, match="engine"):
        simulate(sched, switch(8), size_bytes=1, engine="warp")
    with pytest.raises(ValueError, match="only 4 GPUs"):
        simulate(sched, switch(4), size_bytes=1)


@pytest.mark.parametrize("engine", ["fast", "event"])
def test_phases_and_critical_path_account_for_the_whole_time(engine: str) -> None:
    sched = all_reduce("hierarchical", 16, group_size=4)
    result = simulate(sched, fat_tree(4), size_bytes=SIZE, engine=engine, routing="spray")
    # reduce-scatter in groups, ring reduce-scatter and all-gather across groups, all-gather in groups
    assert [p.first_step for p in result.phases] == [0, 3, 6, 9]
    assert result.phases[-1].end_s == pytest.approx(result.seconds, rel=1e-12)
    # The critical path is a chain from time 0 to the end: its stretches add up to the end time.
    assert sum(c.seconds for c in result.critical_path) == pytest.approx(result.seconds, rel=1e-9)
    assert result.critical_path[0].first_step == 0
    assert result.critical_path[-1].last_step == sched.num_steps - 1
    assert result.busbw_Bps == pytest.approx(SIZE / result.seconds * 2 * 15 / 16, rel=1e-12)
    util = result.link_utilization
    assert util.max() <= 1 + 1e-9
    assert util.min() >= 0


@pytest.mark.slow
def test_trace_is_bounded_and_well_formed() -> None:
    result = simulate(all_reduce("ring", 128), fat_tree(8), size_bytes=SIZE, engine="event", trace_ranks=16)
    trace = json.loads(json.dumps(chrome_trace([result])))
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in slices} == set(range(16))
    assert len(slices) == 16 * 2 * 127
    ends = np.asarray([e["ts"] + e["dur"] for e in slices])
    assert ends.max() == pytest.approx(result.rank_end_s[:16].max() * 1e6, rel=1e-9)


def test_to_json_carries_what_sim_json_prints_of_each_algorithm() -> None:
    topo = fat_tree(4)
    result = simulate(all_reduce("ring", 16), topo, size_bytes=SIZE, faults=Faults(degraded=(("edge0<->agg0", 0.1),)))
    data = result.to_json(bottlenecks=2)
    assert set(data) == {"name", "seconds", "algbw_GBps", "busbw_GBps", "engine", "exact", "bottlenecks"}
    assert data["busbw_GBps"] == pytest.approx(data["algbw_GBps"] * 2 * 15 / 16, rel=1e-12)
    first = result.bottlenecks[0]
    assert data["bottlenecks"][0] == {"link": first.name, "utilization": first.utilization, "waited_s": first.waited_s}
    assert len(data["bottlenecks"]) == min(2, len(result.bottlenecks))
