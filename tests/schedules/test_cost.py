"""The cost model, evaluated from schedules, reproduces the closed forms of shared/reference/FIGURES.md."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from allreduce.schedules import (
    Collective,
    CostModel,
    Phase,
    all_reduce,
    bus_factor,
    halving_doubling_all_reduce,
    hierarchical_all_reduce,
    predict,
    recursive_doubling_all_reduce,
    ring_all_reduce,
)
from allreduce.schedules.timing import propagate

RTOL = 1e-9


def ring_closed_form(n: int, s: float, alpha: float, beta: float, gamma: float = 0.0) -> float:
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * s * beta + (n - 1) / n * s * gamma


def rabenseifner_closed_form(n: int, s: float, alpha: float, beta: float, gamma: float = 0.0) -> float:
    return 2 * math.log2(n) * alpha + 2 * (n - 1) / n * s * beta + (n - 1) / n * s * gamma


def recursive_doubling_closed_form(n: int, s: float, alpha: float, beta: float, gamma: float = 0.0) -> float:
    return math.log2(n) * (alpha + s * beta + s * gamma)


MODELS = [
    CostModel(latency_s=5e-6, bandwidth_Bps=50e9),
    CostModel(latency_s=1e-6, bandwidth_Bps=12.5e9, reduce_bandwidth_Bps=100e9),
    CostModel(latency_s=0.0, bandwidth_Bps=1e9, reduce_bandwidth_Bps=7.6e9),
]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 64, 1024])
@pytest.mark.parametrize("size", [1.0, 4096.0, 2.0**30])
def test_ring_matches_closed_form(model: CostModel, n: int, size: float) -> None:
    got = predict(ring_all_reduce(n), size, model).seconds
    want = ring_closed_form(n, size, model.latency_s, model.seconds_per_byte, model.reduce_seconds_per_byte)
    assert got == pytest.approx(want, rel=RTOL, abs=1e-18)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("n", [1, 2, 4, 8, 64, 1024])
@pytest.mark.parametrize("size", [1.0, 4096.0, 2.0**30])
def test_halving_doubling_and_recursive_doubling_match_closed_forms(model: CostModel, n: int, size: float) -> None:
    a, b, g = model.latency_s, model.seconds_per_byte, model.reduce_seconds_per_byte
    hd = predict(halving_doubling_all_reduce(n), size, model).seconds
    rd = predict(recursive_doubling_all_reduce(n), size, model).seconds
    assert hd == pytest.approx(rabenseifner_closed_form(n, size, a, b, g), rel=RTOL, abs=1e-18)
    assert rd == pytest.approx(recursive_doubling_closed_form(n, size, a, b, g), rel=RTOL, abs=1e-18)


def test_issue_example_1024_ranks_1gib() -> None:
    p = predict(ring_all_reduce(1024), 2.0**30, CostModel(latency_s=5e-6, bandwidth_Bps=50e9))
    assert p.seconds == pytest.approx(2 * 1023 * 5e-6 + 2 * (1023 / 1024) * 2**30 / 50e9, rel=1e-9)
    assert p.busbw_Bps == pytest.approx(2**30 / p.seconds * 2 * 1023 / 1024)


def test_non_power_of_two_fold_costs_two_extra_full_buffer_steps() -> None:
    model = CostModel(latency_s=2e-6, bandwidth_Bps=10e9)
    n, p, s = 12, 8, 2.0**20
    got = predict(halving_doubling_all_reduce(n), s, model).seconds
    core = rabenseifner_closed_form(p, s, model.latency_s, model.seconds_per_byte)
    assert got == pytest.approx(core + 2 * (model.latency_s + s * model.seconds_per_byte), rel=RTOL)


def test_hierarchical_closed_form() -> None:
    # RS in groups of G, ring all-reduce of 1/G across M groups, AG in groups.
    model = CostModel(latency_s=3e-6, bandwidth_Bps=25e9)
    n, g, s = 64, 8, 2.0**28
    m = n // g
    a, b = model.latency_s, model.seconds_per_byte
    want = 2 * ((g - 1) * a + (g - 1) / g * s * b) + 2 * (m - 1) * a + 2 * (m - 1) / m * (s / g) * b
    assert predict(hierarchical_all_reduce(n, g), s, model).seconds == pytest.approx(want, rel=RTOL)


def test_shares_add_up_to_the_total_and_name_the_bound() -> None:
    model = CostModel(latency_s=5e-6, bandwidth_Bps=50e9, reduce_bandwidth_Bps=100e9)
    for size, bound in ((2.0**30, "bandwidth"), (1024.0, "latency")):
        p = predict(ring_all_reduce(256), size, model)
        assert p.latency_s + p.transfer_s + p.reduce_s == pytest.approx(p.seconds, rel=1e-6)
        assert p.latency_s == pytest.approx(2 * 255 * 5e-6, rel=1e-6)
        assert p.bound == bound


def test_segments_overlap_transfer_and_reduction() -> None:
    model = CostModel(latency_s=0.0, bandwidth_Bps=10e9, reduce_bandwidth_Bps=10e9)
    n, s = 4, 2.0**24
    plain = predict(ring_all_reduce(n), s, model).seconds
    piped = predict(ring_all_reduce(n).with_segments(8), s, model).seconds
    t = s / n / 10e9
    # Reduce-scatter steps: transfer T and reduction R = T pipelined in 8 segments take T + T/8 instead of 2T.
    assert plain == pytest.approx(2 * (n - 1) * t + (n - 1) * t, rel=RTOL)
    assert piped == pytest.approx(2 * (n - 1) * t + (n - 1) * t / 8, rel=RTOL)


@given(
    algorithm=st.sampled_from(["ring", "halving_doubling", "recursive_doubling", "double_binary_tree", "direct"]),
    n=st.integers(min_value=1, max_value=40),
    small=st.floats(min_value=1.0, max_value=2.0**20),
    factor=st.floats(min_value=1.0, max_value=1e4),
)
@pytest.mark.slow
def test_time_never_decreases_with_size(algorithm: str, n: int, small: float, factor: float) -> None:
    model = CostModel(latency_s=1e-6, bandwidth_Bps=10e9, reduce_bandwidth_Bps=20e9)
    s = all_reduce(algorithm, n)
    assert predict(s, small, model).seconds <= predict(s, small * factor, model).seconds * (1 + 1e-12)


def test_single_rank_costs_nothing() -> None:
    for algorithm in ("ring", "halving_doubling", "recursive_doubling", "double_binary_tree", "direct"):
        assert predict(all_reduce(algorithm, 1), 2.0**20, MODELS[0]).seconds == 0.0


def test_bus_factor_follows_nccl_tests() -> None:
    assert bus_factor(Collective.ALL_REDUCE, 8) == pytest.approx(1.75)
    assert bus_factor(Collective.ALL_GATHER, 8) == pytest.approx(0.875)
    assert bus_factor(Collective.BROADCAST, 8) == 1.0


def test_bad_model_parameters_are_named() -> None:
    with pytest.raises(ValueError, match="bandwidth_Bps must be"):
        CostModel(latency_s=1e-6, bandwidth_Bps=0.0)
    with pytest.raises(ValueError, match="latency_s must be"):
        CostModel(latency_s=-1.0, bandwidth_Bps=1.0)
    with pytest.raises(ValueError, match="size_bytes must be"):
        predict(ring_all_reduce(2), -1.0, MODELS[0])


# ---- the shared recurrence ---------------------------------------------------------------------------------------
def test_propagate_extrapolates_exactly_what_stepping_computes() -> None:
    # An uneven ring: one slow flow. Stepping 1,000 times and the steady-state jump must agree.
    n = 5
    src = np.arange(n)
    phase = Phase(
        first_step=0, repeat=1000, src=src, dst=(src + 1) % n, fraction=np.full(n, 0.2), reduce=np.ones(n, dtype=bool)
    )
    durations = np.array([1.0, 1.0, 3.0, 1.0, 1.0])
    extra = np.array([0.0, 0.5, 0.0, 0.0, 0.25])
    jumped, timings = propagate(n, [phase], lambda _: durations, lambda _: extra)
    clock = np.zeros(n)
    for _ in range(1000):
        start = np.maximum(clock[src], clock[(src + 1) % n])
        end = start + durations
        new = clock.copy()
        np.maximum.at(new, src, end)
        np.maximum.at(new, (src + 1) % n, end)
        clock = new + extra
    np.testing.assert_allclose(jumped, clock, rtol=1e-12)
    assert timings[0].end_s == pytest.approx(clock.max())


# ---- fused calls: one pass per step ------------------------------------------------------------------------------
FUSED = CostModel(latency_s=8e-6, bandwidth_Bps=6e9, reduce_bandwidth_Bps=7e9, fused_bytes=math.inf)


@pytest.mark.parametrize("size", [4096.0, 2.0**20, 2.0**30])
def test_fused_recursive_doubling_of_two_is_one_step_of_max_transfer_reduce(size: float) -> None:
    a, b, g = FUSED.latency_s, FUSED.seconds_per_byte, FUSED.reduce_seconds_per_byte
    got = predict(recursive_doubling_all_reduce(2), size, FUSED).seconds
    assert got == pytest.approx(a + size * max(b, g), rel=RTOL)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("size", [4096.0, 2.0**24])
def test_fused_ring_overlaps_each_reduce_scatter_step_and_leaves_the_all_gather_as_it_was(n: int, size: float) -> None:
    a, b, g = FUSED.latency_s, FUSED.seconds_per_byte, FUSED.reduce_seconds_per_byte
    block = size / n
    want = (n - 1) * (a + block * max(b, g)) + (n - 1) * (a + block * b)
    assert predict(ring_all_reduce(n), size, FUSED).seconds == pytest.approx(want, rel=RTOL)


def test_a_call_is_fused_up_to_steps_times_size_equal_to_fused_bytes() -> None:
    model = CostModel(latency_s=1e-6, bandwidth_Bps=1e9, reduce_bandwidth_Bps=1e9, fused_bytes=2.0 * 4096)
    ring = ring_all_reduce(2)  # 2 steps
    a, t = 1e-6, 2048 / 1e9  # per step at 4096 bytes: a block of 2048
    assert predict(ring, 4096.0, model).seconds == pytest.approx(2 * a + 2 * t, rel=RTOL)  # fused: max(T, R)
    unfused = predict(ring, 4097.0, model).seconds
    assert unfused == pytest.approx(ring_closed_form(2, 4097.0, a, 1e-9, 1e-9), rel=RTOL)


def test_fused_bytes_must_be_a_number_at_least_zero() -> None:
    with pytest.raises(ValueError, match="fused_bytes must be"):
        CostModel(latency_s=1e-6, bandwidth_Bps=1.0, fused_bytes=-1.0)
    with pytest.raises(ValueError, match="fused_bytes must be"):
        CostModel(latency_s=1e-6, bandwidth_Bps=1.0, fused_bytes=math.nan)
