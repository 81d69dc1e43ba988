"""The recurrence with a sample axis: each column is the single-sample recurrence, bit for bit."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from allreduce.schedules import Phase, all_reduce
from allreduce.schedules.timing import Blame, Incidence, blame_key, step_once, step_samples


def _random_phase(rng: np.random.Generator, world_size: int, flows: int) -> Phase:
    src = rng.integers(0, world_size, flows)
    dst = (src + rng.integers(1, world_size, flows)) % world_size
    return Phase(
        first_step=0, repeat=1, src=src, dst=dst, fraction=np.full(flows, 1.0 / flows), reduce=np.ones(flows, bool)
    )


@given(
    world_size=st.integers(2, 12),
    flows=st.integers(1, 30),
    samples=st.integers(1, 5),
    with_rank_seconds=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_each_column_is_the_single_sample_step(
    world_size: int, flows: int, samples: int, with_rank_seconds: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    phase = _random_phase(rng, world_size, flows)
    clock = rng.random((world_size, samples))
    seconds = rng.random(flows)
    extra = rng.random((flows, samples))
    rank_seconds = rng.random(world_size) if with_rank_seconds else None
    active = np.zeros(world_size, dtype=bool)
    active[phase.src] = True
    active[phase.dst] = True
    per_sample = seconds[:, None] + extra
    got = step_samples(clock, phase, Incidence.of(world_size, phase), per_sample, rank_seconds)
    for k in range(samples):
        masked = None if rank_seconds is None else np.where(active, rank_seconds, 0.0)
        expected = step_once(clock[:, k], phase, per_sample[:, k], masked)
        np.testing.assert_array_equal(got[:, k], expected)


def test_a_ring_phase_has_one_identity_layer_and_one_permuted() -> None:
    phase = next(iter(all_reduce("ring", 8).phases()))
    incidence = Incidence.of(8, phase)
    assert incidence.src_identity
    assert [(every, identity) for _, _, every, identity in incidence.layers] == [(True, True), (True, False)]


def test_blame_follows_the_largest_delay_to_the_receiver() -> None:
    # Rank 0 sends to rank 1 with a 5 s delay blamed on code 7; rank 1's clock takes it.
    phase = Phase(
        first_step=0, repeat=1, src=np.array([0]), dst=np.array([1]), fraction=np.ones(1), reduce=np.ones(1, bool)
    )
    blame = Blame.zeros(3, 1)
    extra = np.array([[5.0]])
    clock = step_samples(
        np.zeros((3, 1)),
        phase,
        Incidence.of(3, phase),
        np.array([1.0]),
        None,
        extra_s=extra,
        extra_blame=blame_key(extra, np.array([[7]])),
        blame=blame,
    )
    assert clock[:, 0].tolist() == [6.0, 6.0, 0.0]
    assert blame.culprit[:, 0].tolist() == [7, 7, -1]
    assert blame.seconds[1, 0] == 5.0


def test_sparse_delays_equal_the_dense_ones() -> None:
    rng = np.random.default_rng(3)
    phase = _random_phase(rng, 6, 10)
    clock = rng.random((6, 4))
    dense = np.zeros((10, 4))
    dense[2, 1] = 0.5
    dense[7, 3] = 0.25
    incidence = Incidence.of(6, phase)
    a = step_samples(clock, phase, incidence, np.ones(10), None, extra_s=dense)
    sparse = (np.array([2, 7]), np.array([1, 3]), np.array([0.5, 0.25]), np.zeros(2, dtype=np.int64))
    b = step_samples(clock, phase, incidence, np.ones(10), None, sparse=sparse)
    np.testing.assert_array_equal(a, b)
