"""Delay distributions, the loss and retransmission models, and timed faults, against their closed forms."""

from __future__ import annotations

import math
from decimal import Decimal, localcontext
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from allreduce.sim import (
    Distribution,
    LinkDegrade,
    LossModel,
    parse_distribution,
    parse_timed_fault,
    transfer_loss_probability,
)
from allreduce.sim._loss import DUPTHRESH, draw_extra_seconds
from allreduce.sim._tcp import LostTransfers

# Monte Carlo checks accept a deviation of this many standard errors (a false alarm once in ~16,000 runs; the
# seeds are fixed, so a run either always passes or always fails).
Z = 4.0


def test_lognormal_spec_gives_its_median_and_p99() -> None:
    d = parse_distribution("lognormal:median=1ms,p99=5ms")
    assert d.quantile(0.5) == pytest.approx(1e-3, rel=1e-12)
    assert d.quantile(0.99) == pytest.approx(5e-3, rel=1e-9)


def test_lognormal_draws_have_the_closed_form_median() -> None:
    d = parse_distribution("lognormal:median=1ms,p99=5ms")
    draws = d.sample(np.random.default_rng(0), 40_000)
    # The sample median's fraction below the true median is Binomial(n, 1/2)/n.
    below = float(np.mean(draws < 1e-3))
    assert abs(below - 0.5) < Z * math.sqrt(0.25 / draws.size)


def test_exponential_draws_have_the_closed_form_mean() -> None:
    d = parse_distribution("exponential:mean=2us")
    draws = d.sample(np.random.default_rng(1), 40_000)
    assert abs(draws.mean() - 2e-6) < Z * 2e-6 / math.sqrt(draws.size)
    assert d.quantile(0.9) == pytest.approx(-2e-6 * math.log(0.1))


def test_uniform_and_constant_specs() -> None:
    assert parse_distribution("uniform:low=1ms,high=3ms").mean() == pytest.approx(2e-3)
    assert parse_distribution("constant:5us").sample(np.random.default_rng(0), 3).tolist() == pytest.approx([5e-6] * 3)
    assert parse_distribution("2ms").quantile(0.7) == 2e-3


def test_spec_prints_as_written() -> None:
    assert str(parse_distribution("lognormal:median=1ms,p99=5ms")) == "lognormal:median=1ms,p99=5ms"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("lognormal:median=1ms", "missing p99"),
        ("lognormal:median=5ms,p99=1ms", "above the median"),
        ("gamma:shape=2", "unknown kind 'gamma'"),
        ("exponential:mean=fast", "cannot read 'fast'"),
        ("banana", "not a time or KIND:PARAMETERS"),
        ("uniform:low=2ms,high=1ms", "high must be"),
    ],
)
def test_bad_spec_is_named(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_distribution(spec)


def test_empirical_csv_with_a_header_and_units(tmp_path: Path) -> None:
    path = tmp_path / "steps.csv"
    path.write_text("step,step_s\n0,1ms\n1,0.002\n\n2,3ms\n")
    d = parse_distribution(f"empirical:{path}")
    assert d.values.tolist() == pytest.approx([1e-3, 2e-3, 3e-3])
    assert set(d.sample(np.random.default_rng(0), 100).tolist()) <= {1e-3, 2e-3, 3e-3}


def test_empirical_csv_error_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "steps.csv"
    path.write_text("seconds\n0.001\n\nlots\n")
    with pytest.raises(ValueError, match=rf"{path}:4: 'lots' is not a time"):
        parse_distribution(f"empirical:{path}")


@given(size=st.integers(1, 10**7), p=st.floats(1e-9, 1e-2), mtu=st.sampled_from([1500, 4096]))
def test_transfer_loss_probability_is_the_closed_form(size: int, p: float, mtu: int) -> None:
    # In 50 decimal digits, so the reference itself does not cancel.
    with localcontext() as context:
        context.prec = 50
        expected = float(1 - (1 - Decimal(p)) ** math.ceil(size / mtu))
    assert transfer_loss_probability(size, p, mtu) == pytest.approx(expected, rel=1e-9)


def test_loss_model_defaults_per_fabric() -> None:
    assert (LossModel(1e-6, "tcp").mtu, LossModel(1e-6, "tcp").rto) == (1500, 0.2)
    assert LossModel(1e-6, "tcp").tcp == "linux"  # the library's default TCP stack is a stock kernel's
    roce = LossModel(1e-6, "roce")
    assert roce.mtu == 4096
    assert roce.rto == pytest.approx(4.096e-6 * 2**20)


@pytest.mark.parametrize("p", [-0.1, 1.0, math.nan])
def test_loss_probability_outside_0_1_is_an_error(p: float) -> None:
    with pytest.raises(ValueError, match="probability in"):
        LossModel(p)


def _draw(model: LossModel, n: int, packets: int, q: float = 1e-9) -> tuple[np.ndarray, np.ndarray]:
    transfers = LostTransfers(np.full(n, q), np.full(n, packets, dtype=np.int64), np.full(n, 10e-6), np.full(n, 1e-7))
    return draw_extra_seconds(np.random.default_rng(5), model, transfers)


def test_roce_single_loss_costs_rtt_plus_two_packets_or_the_timeout() -> None:
    extra, timeout = _draw(LossModel(1e-9, "roce", rto_s=1e-3), 20_000, packets=8)
    np.testing.assert_allclose(extra[timeout == 0], 10e-6 + 2e-7, rtol=1e-12)
    np.testing.assert_allclose(extra[timeout == 1], 1e-3 + 1e-7, rtol=1e-12)


def test_roce_timeouts_are_the_last_packet_losses() -> None:
    # Given one loss among P packets (q -> 0), it is the last one with probability 1/P.
    n, packets = 40_000, 8
    _, timeout = _draw(LossModel(1e-9, "roce", rto_s=1e-3), n, packets=packets)
    p = 1 / packets
    assert abs(timeout.mean() - p) < Z * math.sqrt(p * (1 - p) / n)


def test_tcp_timeouts_are_losses_without_three_duplicate_acks() -> None:
    n, packets = 40_000, 20
    extra, timeout = _draw(LossModel(1e-9, "tcp", rto_s=0.2, tcp="rfc6298"), n, packets=packets)
    p = DUPTHRESH / packets
    assert abs(timeout.mean() - p) < Z * math.sqrt(p * (1 - p) / n)
    np.testing.assert_allclose(extra[timeout == 0], 10e-6, rtol=1e-12)
    np.testing.assert_allclose(extra[timeout == 1], 0.2 + 1e-7, rtol=1e-12)


def test_link_down_is_active_in_its_window_only() -> None:
    fault = parse_timed_fault("down", "a->b@10ms+5ms")
    t = np.array([0.0, 0.01, 0.0149, 0.015, 1.0])
    assert fault.active(t).tolist() == [False, True, True, False, False]
    assert fault.next_change(t).tolist() == pytest.approx([0.01, 0.015, 0.015, math.inf, math.inf])


def test_flap_is_down_for_its_duty_cycle_every_period() -> None:
    fault = parse_timed_fault("flap", "a->b@1ms/4ms*0.25")
    t = np.array([0.0, 0.001, 0.0019, 0.002, 0.005, 0.0061])
    assert fault.active(t).tolist() == [False, True, True, False, True, False]
    assert fault.next_change(np.array([0.0, 0.0015, 0.0025])).tolist() == pytest.approx([0.001, 0.002, 0.005])


def test_degrade_from_t_lasts() -> None:
    fault = parse_timed_fault("degrade", "a<->b@2ms=0.25")
    assert fault == LinkDegrade("a<->b", 0.002, factor=0.25)
    assert fault.active(np.array([0.001, 10.0])).tolist() == [False, True]


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        ("down", "a->b@10ms", "write it as LINK@10ms\\+50ms"),
        ("flap", "a->b@0/4ms*1.5", "duty cycle in \\(0, 1\\)"),
        ("degrade", "a->b@1ms=fast", "factor 'fast' is not a number"),
        ("down", "a->b@-1ms+2ms", "start"),
    ],
)
def test_bad_timed_fault_is_named(kind: str, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_timed_fault(kind, text)


def test_empirical_quantile_is_a_measured_value() -> None:
    d = Distribution.empirical([3.0, 1.0, 2.0, 4.0])
    assert d.quantile(0.5) == 3.0
    assert d.mean() == 2.5
