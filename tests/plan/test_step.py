"""The overlap timeline: hand-computed steps for no overlap, full overlap, accumulation and a straggler."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from allreduce.plan import Compute, step_time, step_timeline


def test_without_overlap_the_step_is_compute_plus_every_all_reduce() -> None:
    step = step_time([100, 200, 300], [0.01, 0.02, 0.03], Compute(0.5, overlap=False))
    assert step.step_s == pytest.approx(0.5 + 0.06, abs=1e-12)
    assert step.exposed_comm_s == pytest.approx(0.06, abs=1e-12)
    assert step.waiting_s == 0.0


def test_with_a_fast_network_only_the_last_bucket_is_exposed() -> None:
    # Backward is the whole step: bucket k is ready at (k+1)/3 of it, and each all-reduce ends long before
    # the next bucket is ready, so only the last one (ready when compute ends) adds to the step.
    step = step_time([1, 1, 1], [0.001, 0.001, 0.002], Compute(0.3, backward_fraction=1.0))
    assert step.step_s == pytest.approx(0.3 + 0.002, abs=1e-12)


def test_a_backlog_of_buckets_queues_on_one_communication_stream() -> None:
    # Backward 0.2 s of 0.3; two equal buckets ready at 0.2 and 0.3; each all-reduce takes 0.15 s:
    # the first ends at 0.35, the second starts then and ends at 0.5.
    step = step_time([1, 1], [0.15, 0.15], Compute(0.3, backward_fraction=2 / 3))
    assert step.step_s == pytest.approx(0.5, abs=1e-12)
    assert step.hidden_comm_s == pytest.approx(0.1, abs=1e-12)


def test_gradient_accumulation_communicates_once_per_step() -> None:
    step = step_time([1], [0.05], Compute(0.1, accumulation_steps=4, overlap=False))
    assert step.step_s == pytest.approx(0.4 + 0.05, abs=1e-12)
    assert step.compute_s == pytest.approx(0.4, abs=1e-12)


def test_a_straggler_makes_everyone_wait_for_its_compute() -> None:
    step = step_time([1], [0.05], Compute(0.1, overlap=False, straggler_slowdown=0.5))
    assert step.waiting_s == pytest.approx(0.05, abs=1e-12)
    assert step.step_s == pytest.approx(0.15 + 0.05, abs=1e-12)


computes = st.builds(
    Compute,
    st.floats(0, 2),
    backward_fraction=st.floats(0, 1),
    accumulation_steps=st.integers(1, 4),
    overlap=st.booleans(),
    straggler_slowdown=st.floats(0, 1),
)
# Buckets in all-reduce order: their sizes and their all-reduce times.
bucket_times = st.lists(st.tuples(st.integers(1, 10**9), st.floats(0, 1)), min_size=1, max_size=20).map(
    lambda pairs: ([b for b, _ in pairs], [s for _, s in pairs])
)


@given(bucket_times, computes)
@pytest.mark.slow
def test_the_split_adds_up_and_the_step_is_bounded_by_its_parts(
    buckets: tuple[list[int], list[float]], compute: Compute
) -> None:
    sizes, seconds = buckets
    compute_s, accumulation, slow = compute.micro_batch_s, compute.accumulation_steps, compute.straggler_slowdown
    step = step_time(sizes, seconds, compute)
    assert step.step_s == pytest.approx(step.compute_s + step.waiting_s + step.exposed_comm_s, abs=1e-9)
    slowest = accumulation * compute_s * (1 + slow)
    assert step.step_s >= max(slowest, sum(seconds)) - 1e-9
    assert step.step_s <= slowest + sum(seconds) + 1e-9
    assert 0 <= step.exposed_comm_s <= step.comm_s + 1e-9


@given(bucket_times, computes)
@pytest.mark.slow
def test_the_timeline_queues_each_bucket_after_its_ready_time_and_the_one_before(
    buckets: tuple[list[int], list[float]], compute: Compute
) -> None:
    sizes, seconds = buckets
    timeline = step_timeline(sizes, seconds, compute)
    assert timeline.step_s == step_time(sizes, seconds, compute).step_s
    previous_end = 0.0
    for span, duration in zip(timeline.buckets, seconds, strict=True):
        assert span.start_s == max(span.ready_s, previous_end)
        assert span.end_s == pytest.approx(span.start_s + duration)
        assert timeline.backward_start_s - 1e-12 <= span.ready_s <= timeline.compute_end_s + 1e-12
        previous_end = span.end_s


def test_a_measured_bucket_is_ready_at_its_share_of_the_last_backward() -> None:
    # two micro-batches of 1 s, backward the last 0.6 s of each: the last backward runs from 1.4 s to 2 s
    compute = Compute(1.0, backward_fraction=0.6, accumulation_steps=2, bucket_ready=(0.25, 1.0))
    timeline = step_timeline((100, 100), (0.5, 0.1), compute)
    assert (timeline.forward_start_s, timeline.backward_start_s, timeline.compute_end_s) == pytest.approx((1, 1.4, 2))
    assert [b.ready_s for b in timeline.buckets] == pytest.approx([1.55, 2.0])
    assert [t for b in timeline.buckets for t in (b.start_s, b.end_s)] == pytest.approx([1.55, 2.05, 2.05, 2.15])
