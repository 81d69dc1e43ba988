"""RoCE's lossless mode (PFC) at the flow level, against small cases computed by hand."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.sim._pfc import max_min_rates, pfc_rates

# The victim case. Links (capacity 1): 0 host A -> S1, 1 host V -> S1, 2 S1 -> S2 (the shared uplink),
# 3 host B -> S2, 4 host C -> S2, 5 S2 -> D (the congested egress), 6 S2 -> E.
# Flows: A -> D over the uplink, V -> E over the uplink (the victim), B -> D and C -> D from S2's own hosts.
VICTIM_PATHS = [[0, 2, 5], [1, 2, 6], [3, 5], [4, 5]]
A, V, B, C = range(4)


def test_a_victim_sharing_a_paused_link_runs_at_the_congested_flows_rate() -> None:
    # By hand: the uplink serves A and V in turn, 1/2 each; the egress to D serves its three input ports in turn,
    # 1/3 each, so the uplink port is paused until it sends 1/3 of A's traffic: the uplink's FIFO is cut by
    # (1/3)/(1/2) = 2/3 for everything on it, V included: every flow runs at 1/3.
    got = pfc_rates(np.ones(7), VICTIM_PATHS)
    np.testing.assert_allclose(got.rates, [1 / 3] * 4, rtol=1e-12)
    # The uplink held back a third of what arrived for it; A's and V's host links, half.
    np.testing.assert_allclose(got.held_back[[0, 1, 2]], [1 - 1 / 3, 1 - 1 / 3, 1 / 3], rtol=1e-12)
    assert got.held_back[5] == 0  # the congested egress itself is never paused, its inputs are


def test_without_pfc_the_victim_takes_what_the_congested_flow_leaves() -> None:
    # Lossy max-min: D's egress gives A, B, C 1/3 each; V takes the uplink's other 2/3.
    np.testing.assert_allclose(max_min_rates(np.ones(7), VICTIM_PATHS), [1 / 3, 2 / 3, 1 / 3, 1 / 3], rtol=1e-12)


def test_congestion_spreads_two_hops_upstream() -> None:
    # A second victim W one switch further up: links 7 host A -> S0 and 8 host W -> S0 feed 0 (S0 -> S1),
    # so A's path is 7, 0, 2, 5 and W's 8, 0, 9 (9: S1 -> F). Link 0 is cut with A's traffic, W with it.
    paths = [[7, 0, 2, 5], [1, 2, 6], [3, 5], [4, 5], [8, 0, 9]]
    got = pfc_rates(np.ones(10), paths)
    # Link 0 carries A and W in turn (1/2 each) into S1, whose uplink gives A's port 1/2; D's egress then
    # allows the uplink 1/3, cutting A and V to 1/3 each; link 0 is paused until A sends 1/3, so W, behind it
    # in link 0's FIFO at the same mix (1/2 : 1/2), runs at 1/3 too.
    np.testing.assert_allclose(got.rates, [1 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3], rtol=1e-12)
    assert max_min_rates(np.ones(10), paths)[4] == pytest.approx(2 / 3)


def test_without_congestion_pfc_is_the_lossy_fabric() -> None:
    # Two hosts into one egress: it serves both ports in turn, which is max-min too.
    paths = [[0, 2], [1, 2]]
    np.testing.assert_allclose(pfc_rates(np.ones(3), paths).rates, [0.5, 0.5], rtol=1e-12)
    np.testing.assert_allclose(max_min_rates(np.ones(3), paths), [0.5, 0.5], rtol=1e-12)
    # One flow through a slower link runs at that link's rate.
    np.testing.assert_allclose(pfc_rates(np.array([1.0, 0.25]), [[0, 1]]).rates, [0.25], rtol=1e-12)


def test_a_path_with_an_unknown_link_is_refused_naming_the_flow() -> None:
    with pytest.raises(ValueError, match="flow 1 crosses link 9"):
        pfc_rates(np.ones(3), [[0], [9]])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True), min_size=1, max_size=6),
    st.lists(st.floats(0.1, 10.0), min_size=6, max_size=6),
)
def test_no_link_carries_more_than_its_capacity(paths: list[list[int]], capacity: list[float]) -> None:
    got = pfc_rates(np.array(capacity), paths)
    load = np.zeros(6)
    for rate, path in zip(got.rates, paths, strict=True):
        load[path] += rate
    assert np.all(load <= np.array(capacity) * (1 + 1e-9))
    assert np.all(got.rates > 0)
