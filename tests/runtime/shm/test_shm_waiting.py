"""Waiting alone: the spin policy by itself, then publishing and waiting between two ranks that met in one process
(a thread each over real control blocks), and the watch naming why a wait cannot end."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from shm_parts import BuildFn, MeetFn

from allreduce.runtime import CollectiveTimeoutError, PeerFailureError, ProtocolError
from allreduce.runtime.shm._layout import (
    ABORTED_WORD,
    CLOSED_WORD,
    CULPRIT_WORD,
    PROGRESS_WORD,
    SLEEPERS_WORD,
    WAITING_FOR_WORD,
)
from allreduce.runtime.shm._linux import open_pidfd
from allreduce.runtime.shm._rendezvous import ControlBlocks
from allreduce.runtime.shm._waiting import MIN_SPIN_S, SPIN_S, SpinPolicy, Waiting
from allreduce.runtime.shm._watch import PeerWatch
from allreduce.runtime.transport._transport import abort_kind


# ----------------------------------------------------------------------------------------------- the spin policy
def test_a_wait_that_blocked_halves_the_next_spin() -> None:
    policy = SpinPolicy(32e-6)
    policy.blocked()
    assert policy.spin_ns == 16_000


def test_a_spin_halved_below_the_minimum_is_none() -> None:
    policy = SpinPolicy(3 * MIN_SPIN_S)
    policy.blocked()
    assert policy.spin_ns == 1_500
    policy.blocked()
    assert policy.spin_ns == 0


def test_a_wait_a_full_spin_would_have_caught_restores_the_spin() -> None:
    policy = SpinPolicy(32e-6)
    for _ in range(3):
        policy.blocked()
    policy.caught(31_000, core_given_away=False)
    assert policy.spin_ns == 32_000


def test_a_wait_caught_later_than_a_full_spin_halves_the_spin() -> None:
    policy = SpinPolicy(32e-6)
    policy.caught(33_000, core_given_away=False)
    assert policy.spin_ns == 16_000


def test_a_wait_caught_after_the_core_was_given_away_halves_the_spin_however_short() -> None:
    # the peer ran on this rank's core: spinning would only have kept it from running
    policy = SpinPolicy(32e-6)
    policy.caught(10_000, core_given_away=True)
    assert policy.spin_ns == 16_000


def test_ranks_without_a_core_each_do_not_spin() -> None:
    cores = os.cpu_count() or 1
    assert SpinPolicy.for_group(cores).spin_ns == int(SPIN_S * 1e9)
    assert SpinPolicy.for_group(cores + 1).spin_ns == 0


def test_a_negative_spin_is_refused() -> None:
    with pytest.raises(ValueError, match="limit_s"):
        SpinPolicy(-1e-6)


# ----------------------------------------------------------------------------------------------- waiting
@pytest.fixture
def pair(meet: MeetFn, build: BuildFn) -> tuple[list[ControlBlocks], list[Waiting]]:
    blocks = meet(2)
    return blocks, [build(b, policy=SpinPolicy(SPIN_S)).waiting for b in blocks]


Pair = tuple[list[ControlBlocks], list[Waiting]]


def test_a_counter_already_there_returns_at_once_without_a_clock(pair: Pair) -> None:
    _, (zero, one) = pair
    one.publish(PROGRESS_WORD, 5)
    zero.wait_began = -1
    assert zero.wait(1, PROGRESS_WORD, 5, deadline=time.monotonic(), seq=0, what="x", step=0) == 0
    assert zero.wait_began == -1


def test_a_wait_blocked_until_the_peer_publishes_says_when_it_began_and_how_long_it_took(pair: Pair) -> None:
    blocks, (zero, one) = pair
    asleep: list[int] = []

    def publish_once_asleep() -> None:
        # rank 0 marks itself asleep on rank 1's block, once its spin and its yields did not catch the counter
        deadline = time.monotonic() + 30
        while blocks[1].views[1][SLEEPERS_WORD + 0] != 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        asleep.append(int(blocks[1].views[1][SLEEPERS_WORD + 0]))
        one.publish(PROGRESS_WORD, 1)

    publisher = threading.Thread(target=publish_once_asleep)
    before = time.perf_counter_ns()
    publisher.start()
    waited = zero.wait(1, PROGRESS_WORD, 1, deadline=time.monotonic() + 30, seq=0, what="x", step=0)
    after = time.perf_counter_ns()
    publisher.join()
    assert asleep == [1]
    assert before <= zero.wait_began
    assert zero.wait_began + waited <= after
    assert waited > 0
    assert blocks[1].views[1][SLEEPERS_WORD + 0] == 0  # awake again
    assert blocks[0].views[0][WAITING_FOR_WORD] == -1  # and no longer waiting for anyone
    assert zero.policy.spin_ns < zero.policy.limit_ns  # it blocked: the next wait spins less


def test_the_deadline_raises_a_timeout_naming_the_peer_and_what_was_awaited(pair: Pair) -> None:
    _, (zero, _) = pair
    with pytest.raises(
        CollectiveTimeoutError, match=r"collective 4 timed out at step 2 waiting for rank 1 \(its data\)"
    ) as caught:
        zero.wait(1, PROGRESS_WORD, 1, deadline=time.monotonic() + 0.05, seq=4, what="its data", step=2)
    assert (caught.value.peer, caught.value.step) == (1, 2)


def test_a_counter_below_its_floor_is_named_as_corruption(pair: Pair) -> None:
    _, (zero, one) = pair
    one.publish(PROGRESS_WORD, -5)
    with pytest.raises(ProtocolError, match=r"rank 1's control block is corrupt \(word progress = -5\)"):
        zero.wait(1, PROGRESS_WORD, 9, deadline=time.monotonic() + 30, seq=9, what="x", step=0, floor=7,
                  word_name="progress")  # fmt: skip


def test_a_peer_that_gave_up_ends_the_wait_with_its_error_class(pair: Pair) -> None:
    blocks, (zero, one) = pair
    blocks[1].views[1][CULPRIT_WORD] = 0
    one.publish(ABORTED_WORD, abort_kind(CollectiveTimeoutError("", rank=1, peer=0)) + 1)
    with pytest.raises(CollectiveTimeoutError, match="rank 1 gave up because it timed out waiting for rank 0"):
        zero.wait(1, PROGRESS_WORD, 1, deadline=time.monotonic() + 30, seq=0, what="x", step=0)


def test_a_peer_that_closed_while_awaited_is_named(pair: Pair) -> None:
    _, (zero, one) = pair
    one.publish(CLOSED_WORD, 1)
    with pytest.raises(PeerFailureError, match="rank 1 closed the group while this rank was at step 0"):
        zero.wait(1, PROGRESS_WORD, 1, deadline=time.monotonic() + 30, seq=0, what="x", step=0)


# ----------------------------------------------------------------------------------------------- the watch
def test_a_peer_process_that_exited_is_named_dead(meet: MeetFn) -> None:
    zero, _ = meet(2)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    pidfd = open_pidfd(child.pid)
    if pidfd < 0:
        child.wait()
        pytest.skip("this kernel has no pidfds")
    try:
        child.wait()
        watch = PeerWatch(0, zero.views, [pidfd], zero.prefix)  # rank 1's process, as far as this watch knows
        assert watch.exited_peers() == [1]
        with pytest.raises(PeerFailureError, match=r"rank 1 died \(process exited\) during collective 3"):
            watch.check(1, PROGRESS_WORD, 1, seq=3, what="x", step=0)
    finally:
        os.close(pidfd)


def test_a_timeout_names_the_rank_at_the_end_of_the_chain_of_waiters(meet: MeetFn) -> None:
    blocks = meet(4)
    blocks[1].views[1][WAITING_FOR_WORD] = 2
    blocks[2].views[2][WAITING_FOR_WORD] = 3
    watch = PeerWatch(0, blocks[0].views, blocks[0].pidfds, blocks[0].prefix)
    error = watch.timeout_error(1, seq=0, what="x", step=1)
    assert error.peer == 3
    assert "rank 3 stopped responding (rank 2 waited for rank 3; rank 1 waited for rank 2" in str(error)


def test_an_abort_word_out_of_range_is_named_as_corruption(meet: MeetFn) -> None:
    zero, one = meet(2)
    one.views[1][ABORTED_WORD] = 1 << 40
    watch = PeerWatch(0, zero.views, zero.pidfds, zero.prefix)
    with pytest.raises(ProtocolError, match=r"rank 1's control block is corrupt \(word aborted = 1099511627776\)"):
        watch.check_abort_words(seq=0, step=0)
