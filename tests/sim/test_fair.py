"""Max-min fair rates: hand-computed cases and the defining property on random incidences."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from allreduce.sim import max_min_rates


def csr(paths: list[list[int]], weights: list[list[float]] | None = None) -> tuple[np.ndarray, ...]:
    ptr = np.cumsum([0] + [len(p) for p in paths])
    link = np.asarray([x for p in paths for x in p], dtype=np.int64)
    flat = [x for w in weights for x in w] if weights is not None else [1.0] * link.size
    weight = np.asarray(flat, dtype=np.float64)
    return ptr, link, weight


def test_two_flows_split_one_link_evenly() -> None:
    share = max_min_rates(*csr([[0], [0]]), [10.0])
    np.testing.assert_array_equal(share.rate_Bps, [5.0, 5.0])
    np.testing.assert_array_equal(share.bottleneck_link, [0, 0])


def test_flow_freed_by_a_tighter_link_takes_the_rest() -> None:
    # Link 0 (10 B/s): flows 0, 1; link 1 (4 B/s): flows 1, 2. Link 1 fills first at 2 B/s per flow;
    # flow 0 then takes 10 - 2 = 8 on link 0.
    share = max_min_rates(*csr([[0], [0, 1], [1]]), [10.0, 4.0])
    np.testing.assert_allclose(share.rate_Bps, [8.0, 2.0, 2.0], rtol=1e-12)
    np.testing.assert_array_equal(share.bottleneck_link, [0, 1, 1])
    assert share.levels == 2


def test_flow_without_links_is_infinitely_fast() -> None:
    share = max_min_rates(*csr([[], [0]]), [3.0])
    assert share.rate_Bps[0] == np.inf
    assert share.bottleneck_link[0] == -1
    assert share.rate_Bps[1] == 3.0


def test_sprayed_flow_loads_each_path_with_its_weight() -> None:
    # Flow 0 sprays half its bytes over link 0 and half over link 1; flow 1 uses link 0 only.
    # Link 0 fills when 0.5 r + r = 10: r = 20/3 for both; link 1 then carries only 10/3 of its 10.
    share = max_min_rates(*csr([[0, 1], [0]], [[0.5, 0.5], [1.0]]), [10.0, 10.0])
    np.testing.assert_allclose(share.rate_Bps, [20 / 3, 20 / 3], rtol=1e-12)
    np.testing.assert_array_equal(share.bottleneck_link, [0, 0])


def test_unused_slow_links_do_not_matter() -> None:
    share = max_min_rates(*csr([[2]]), [1e-9, 1e-9, 7.0])
    assert share.rate_Bps[0] == 7.0


@pytest.mark.parametrize(
    ("ptr", "link", "weight", "capacity", "message"),
    [
        ([0, 1], [5], [1.0], [1.0], "link index 5"),
        ([0, 2], [0], [1.0], [1.0], "flow_ptr"),
        ([0, 1], [0], [0.0], [1.0], "weight"),
        ([0, 1], [0], [1.0], [0.0], "link 0 carries flows but has capacity"),
    ],
)
def test_bad_incidence_is_named(
    ptr: list[int], link: list[int], weight: list[float], capacity: list[float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        max_min_rates(ptr, link, weight, capacity)


@st.composite
def incidences(draw: st.DrawFn) -> tuple[list[list[int]], list[list[float]], list[float]]:
    num_links = draw(st.integers(1, 6))
    capacity = draw(st.lists(st.integers(1, 20).map(float), min_size=num_links, max_size=num_links))
    num_flows = draw(st.integers(1, 10))
    paths = [
        sorted(draw(st.sets(st.integers(0, num_links - 1), min_size=0, max_size=num_links))) for _ in range(num_flows)
    ]
    weights = [[draw(st.sampled_from([1.0, 0.5, 0.25])) for _ in p] for p in paths]
    return paths, weights, capacity


@given(incidences())
@pytest.mark.slow
def test_rates_are_feasible_and_every_flow_is_max_on_a_full_link(
    case: tuple[list[list[int]], list[list[float]], list[float]],
) -> None:
    """The definition of max-min fairness: a feasible allocation where each flow crosses a saturated link on
    which no other flow is faster — so it cannot grow without slowing a flow that is no faster."""
    paths, weights, capacity = case
    share = max_min_rates(*csr(paths, weights), capacity)
    load = np.zeros(len(capacity))
    for f, (path, ws) in enumerate(zip(paths, weights, strict=True)):
        for link, w in zip(path, ws, strict=True):
            load[link] += w * share.rate_Bps[f]
    assert np.all(load <= np.asarray(capacity) * (1 + 1e-9))
    for f, path in enumerate(paths):
        if not path:
            assert share.rate_Bps[f] == np.inf
            continue
        b = int(share.bottleneck_link[f])
        assert b in path
        assert load[b] >= capacity[b] * (1 - 1e-9), "the bottleneck link must be full"
        others = [share.rate_Bps[g] for g, p in enumerate(paths) if b in p]
        assert share.rate_Bps[f] >= max(others) * (1 - 1e-9), "no flow on the bottleneck may be faster"
