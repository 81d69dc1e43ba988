"""The Monte Carlo's cyclic-shift step (rings, hierarchical rings) against the general step it replaces."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allreduce.schedules import Phase, all_reduce
from allreduce.schedules.timing import Blame, Incidence, blame_key, step_samples
from allreduce.sim import (
    Distribution,
    Faults,
    LinkFlap,
    LossModel,
    TailConfig,
    TailResult,
    _cyclic,
    simulate_tail,
)
from allreduce.topology import Topology, fat_tree, rail_optimized, switch


def _cyclic_phase(blocks: int, block: int, shift: int, order: np.ndarray) -> Phase:
    src = np.arange(blocks * block, dtype=np.int64)[order]
    dst = src - src % block + (src % block + shift) % block
    n = src.size
    return Phase(0, 1, src, dst, np.full(n, 1.0 / n), np.ones(n, dtype=np.bool_))


@settings(max_examples=40, deadline=None)
@given(
    blocks=st.integers(1, 4),
    block=st.integers(2, 9),
    shift_seed=st.integers(0, 10**6),
    samples=st.integers(1, 5),
    seed=st.integers(0, 10**6),
    with_extra=st.booleans(),
    with_delay=st.booleans(),
)
def test_cyclic_step_equals_the_general_step_bit_for_bit(
    *, blocks: int, block: int, shift_seed: int, samples: int, seed: int, with_extra: bool, with_delay: bool
) -> None:
    rng = np.random.default_rng(seed)
    n = blocks * block
    shift = 1 + shift_seed % (block - 1)
    phase = _cyclic_phase(blocks, block, shift, rng.permutation(n))
    cyclic = _cyclic.Cyclic.of(n, phase)
    assert cyclic is not None
    assert (cyclic.block, cyclic.shift) == ((block, shift) if blocks > 1 else (n, shift))
    # Clocks with ties (rounded), so the strict comparisons that pick blames are exercised.
    clock = np.round(rng.random((n, samples)) * 4) / 4
    keys = blame_key(rng.random((n, samples)) * 1e-3, rng.integers(0, 50, (n, samples)))
    seconds = rng.random(n)
    extra = rng.random((n, samples)) * 1e-3 if with_extra else None
    extra_keys = blame_key(extra, rng.integers(0, 50, (n, samples))) if extra is not None else None
    delay = rng.random(n) * 1e-4 if with_delay else None
    delay_keys = blame_key(delay, np.arange(n)) if delay is not None else None
    flow, sample = rng.integers(0, n, 6), rng.integers(0, samples, 6)
    lost = rng.random(6)
    lost_keys = blame_key(lost, rng.integers(0, 50, 6))

    expected_blame = Blame(keys.copy())
    expected = step_samples(
        clock,
        phase,
        Incidence.of(n, phase),
        seconds,
        delay,
        extra_s=extra,
        extra_blame=extra_keys,
        rank_blame=delay_keys,
        sparse=(flow, sample, lost, lost_keys),
        blame=expected_blame,
    )
    blame = Blame(keys.copy())
    order = cyclic.order
    got = _cyclic.step_cyclic(
        clock,
        cyclic,
        seconds[order],
        delay,
        extra_s=None if extra is None else extra[order],
        extra_blame=None if extra_keys is None else extra_keys[order],
        rank_blame=delay_keys,
        sparse=(phase.src[flow], sample, lost, lost_keys),
        blame=blame,
    )
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(blame.key, expected_blame.key)
    unblamed = _cyclic.step_cyclic(
        clock,
        cyclic,
        seconds[order],
        delay,
        extra_s=None if extra is None else extra[order],
        extra_blame=None,
        rank_blame=None,
        sparse=(phase.src[flow], sample, lost, None),
        blame=None,
    )
    np.testing.assert_array_equal(unblamed, expected)


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ([0, 1, 2, 3], [1, 2, 3, 3]),  # a rank sends to itself's neighbour twice
        ([0, 1, 2, 3], [2, 3, 1, 0]),  # a permutation that is no shift
        ([0, 1, 2], [1, 2, 0]),  # not every rank of four
    ],
)
def test_phases_that_are_no_cyclic_shift_take_the_general_step(src: list[int], dst: list[int]) -> None:
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    phase = Phase(0, 1, s, d, np.full(s.size, 0.25), np.ones(s.size, dtype=np.bool_))
    assert _cyclic.Cyclic.of(4, phase) is None


def _general_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn the cyclic step off: every phase takes the general step (the path before it existed)."""
    monkeypatch.setattr(_cyclic.Cyclic, "of", classmethod(lambda cls, world_size, phase: None))


def _same(a: TailResult, b: TailResult) -> None:
    np.testing.assert_array_equal(a.step_s, b.step_s)
    np.testing.assert_array_equal(a.culprit, b.culprit)
    np.testing.assert_array_equal(a.culprit_delay_s, b.culprit_delay_s)
    np.testing.assert_array_equal(a.lost_transfers, b.lost_transfers)
    np.testing.assert_array_equal(a.timeouts, b.timeouts)


@pytest.mark.parametrize(
    ("algorithm", "topology"),
    [
        ("ring", fat_tree(4)),
        ("hierarchical", rail_optimized(4, 4)),
        ("halving_doubling", fat_tree(4)),
    ],
    ids=["ring-fat-tree", "hierarchical-rail", "halving-doubling"],
)
@pytest.mark.parametrize("attribution", [True, False])
@pytest.mark.slow
def test_tail_with_cyclic_steps_equals_the_general_path(
    algorithm: str, topology: Topology, attribution: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    schedule = all_reduce(algorithm, 16, group_size=4) if algorithm == "hierarchical" else all_reduce(algorithm, 16)
    config = TailConfig(
        samples=40,
        seed=5,
        loss=LossModel(2e-4, "tcp", rto_s=1e-3),
        link_jitter=Distribution.exponential(1e-6),
        rank_jitter=Distribution.lognormal(20e-6, 200e-6),
        attribution=attribution,
    )
    faults = Faults(slow_ranks=((3, 5e-6),))
    assert any(_cyclic.Cyclic.of(16, phase) is not None for phase in schedule.phases())
    fast = simulate_tail(schedule, topology, size_bytes=2**22, config=config, faults=faults)
    assert fast.lost_transfers.sum() > 0
    _general_only(monkeypatch)
    reference = simulate_tail(schedule, topology, size_bytes=2**22, config=config, faults=faults)
    _same(fast, reference)


def test_tail_with_a_flapping_link_and_cyclic_steps_equals_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    flap = LinkFlap("gpu1<->switch0", 0.0, period_s=200e-6, duty=0.5)
    config = TailConfig(samples=8, seed=3, timed_faults=(flap,), rank_jitter=Distribution.exponential(50e-6))
    schedule = all_reduce("ring", 8)
    fast = simulate_tail(schedule, switch(8), size_bytes=2**22, config=config)
    _general_only(monkeypatch)
    _same(fast, simulate_tail(schedule, switch(8), size_bytes=2**22, config=config))
