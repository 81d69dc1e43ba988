"""The window a loss finds (sim/_tcp_cwnd.py): CUBIC's TCP-friendly window under random loss, one round trip a
step, with Linux's floors and the RTO where nothing follows a lost repair."""

from __future__ import annotations

import math

import numpy as np

from allreduce.sim._tcp_cwnd import CHAIN_MAX_WINDOW, FOLLOW_MIN_WINDOW, draw_loss_windows, loss_window_law


def test_the_windows_losses_find_average_to_cubics_window_at_low_loss() -> None:
    # a round of W packets loses W*q of them on average, so the windows losses find are the rounds' windows
    # weighted by W: their harmonic mean is the time average, which RFC 8312 §5.1 puts at sqrt(1.5/q) where the
    # floors and the RTO do not reach (q = 1e-3: a window of 39)
    law = loss_window_law(1e-3, 1e-3)
    assert abs(1 / np.mean(1 / law) / math.sqrt(1.5 / 1e-3) - 1) < 0.03


def test_at_high_loss_windows_too_small_for_data_after_a_repair_are_common() -> None:
    # every link 1e-2 on four hops (q = 4%): the average is 6 packets, but the cuts' floor of 2, the RTOs' restart
    # at 1 and the integer windows leave a third of the losses with fewer than FOLLOW_MIN_WINDOW in flight
    high, low = loss_window_law(0.04, 0.04), loss_window_law(3e-3, 3e-3)
    assert np.mean(high < FOLLOW_MIN_WINDOW) > 0.2
    assert np.mean(low < FOLLOW_MIN_WINDOW) < 0.01
    assert high.min() >= 1


def test_the_law_is_the_same_on_every_call() -> None:
    first = loss_window_law(0.02, 0.01).copy()
    loss_window_law.cache_clear()
    np.testing.assert_array_equal(loss_window_law(0.02, 0.01), first)


def test_draws_follow_the_law_below_the_chains_limit_and_the_average_above() -> None:
    rng = np.random.default_rng(3)
    q = np.array([0.02] * 20_000 + [1e-4, 0.0])
    drawn = draw_loss_windows(rng, q, np.zeros(q.size))
    law = loss_window_law(0.02, 0.0)
    for p in (10, 50, 90):
        assert abs(np.percentile(drawn[:-2], p) - np.percentile(law, p)) <= 1
    assert drawn[-2] == math.sqrt(1.5 / 1e-4) > CHAIN_MAX_WINDOW
    assert drawn[-1] == math.inf
