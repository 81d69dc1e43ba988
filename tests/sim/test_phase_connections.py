"""When a connection (sender to receiver) next carries a transfer, found by one sort of every flow
(sim/_phases.py), against a plain scan of the phases in order: for the collective's own flows and for the
agreement's frames before it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.schedules import all_reduce
from allreduce.sim import LossModel
from allreduce.sim._phases import PhaseData, _agreement_steps, _data_follow_gaps, _next_phase, phase_data
from allreduce.sim._routing import Router
from allreduce.topology import FloatArray, parse_topology, place

TOPOLOGY = parse_topology("fat-tree:k=8")
ALGORITHMS = ("ring", "halving_doubling", "double_binary_tree", "recursive_doubling", "hierarchical")


def _data(algorithm: str, ranks: int, seed: int) -> tuple[Router, list[PhaseData]]:
    schedule = all_reduce(algorithm, ranks, **({"group_size": 4} if algorithm == "hierarchical" else {}))
    router = Router(TOPOLOGY, np.asarray(place(ranks, TOPOLOGY, "random", seed=seed), dtype=np.int64), None, 0)
    link_loss = np.full(TOPOLOGY.num_links, 1e-6)
    return router, phase_data(schedule, router, 2.0**20, link_loss, connections=True)


def _scan_gaps(ranks: int, later_s: list[float], data: list[PhaseData], dst: np.ndarray) -> FloatArray:
    """Per sender, the first phase with a flow to ``dst[sender]``, scanned phase by phase."""
    gaps = np.full(ranks, math.inf)
    for sender in range(ranks):
        between = sum(later_s)
        for d in data:
            if np.any((d.phase.src == sender) & (d.phase.dst == dst[sender])):
                gaps[sender] = between
                break
            between += float(d.seconds.max(initial=0.0)) * d.phase.repeat
    return gaps


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
    algorithm=st.sampled_from(ALGORITHMS),
    ranks=st.sampled_from([4, 8, 12, 16, 32]),
    seed=st.integers(0, 100),
    every=st.integers(1, 3),
)
def test_an_agreement_frame_waits_for_the_first_data_phase_on_its_connection(
    algorithm: str, ranks: int, seed: int, every: int
) -> None:
    router, data = _data(algorithm, ranks, seed)
    data = data[::every]  # a subset of phases: connections that carry nothing get inf
    steps = _agreement_steps(router, LossModel(1e-6, fabric="tcp"), np.full(TOPOLOGY.num_links, 1e-6))
    gaps = _data_follow_gaps(ranks, steps, data)
    for s, step in enumerate(steps):
        expected = _scan_gaps(ranks, [later.seconds for later in steps[s + 1 :]], data, step.dst)
        assert np.array_equal(gaps[s], expected), f"agreement step {s}"


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(algorithm=st.sampled_from(ALGORITHMS), ranks=st.sampled_from([4, 8, 12, 16, 32]))
def test_a_flows_connection_next_carries_data_in_the_first_later_phase_with_it(algorithm: str, ranks: int) -> None:
    schedule = all_reduce(algorithm, ranks, **({"group_size": 4} if algorithm == "hierarchical" else {}))
    phases = list(schedule.phases())
    following = _next_phase(schedule, phases)
    for i, phase in enumerate(phases):
        for f in range(len(phase)):
            later = [
                j
                for j in range(i + 1, len(phases))
                if np.any((phases[j].src == phase.src[f]) & (phases[j].dst == phase.dst[f]))
            ]
            assert following[i][f] == (later[0] if later else len(phases)), f"phase {i} flow {f}"
