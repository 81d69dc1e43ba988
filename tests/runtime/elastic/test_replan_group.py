"""ALLREDUCE_REPLAN in a real group: one link paced (over shared memory by ALLREDUCE_INJECT, over TCP by the
sender's kernel) makes the ring slow; after two windows every rank has re-planned to the same ring order that leaves
the link out, says why in group.stats(), and the all-reduces are exact and faster. Every link of one rank paced: every
rank puts it in the same tree, named. A rank late to every call is named a compute straggler, and nothing changes. A
healthy ring over TCP is never changed. Real processes, shared memory and loopback sockets."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from allreduce.runtime import spawn
from allreduce.runtime.elastic._replan import rule_from_env

CALLS = 60
COUNT = 1 << 16  # 256 KiB of float32: 64 KiB per ring step


def _loop(group: Any) -> tuple[list[float], bool, tuple[str, ...]]:
    times, exact = [], True
    expected = float(sum(range(1, group.world_size + 1)))
    for _ in range(CALLS):
        x = np.full(COUNT, float(group.rank + 1), np.float32)
        started = time.perf_counter()
        group.all_reduce(x, algorithm="ring")
        times.append(time.perf_counter() - started)
        exact = exact and bool(np.all(x == expected))
    return times, exact, group.stats().replans


@pytest.mark.slow
@pytest.mark.serial
def test_a_paced_link_is_re_planned_around_alike_on_every_rank() -> None:
    env = {"ALLREDUCE_INJECT": "pace:link=1->2:rate=2MB/s", "ALLREDUCE_REPLAN": "window=10,confirm=2"}
    results = spawn(4, _loop, env=env, init_options={"transport": "shm"}, timeout_s=240)
    changes = {r[2] for r in results}
    assert len(changes) == 1  # every rank decided the same, from the same gathered records
    (replans,) = changes
    assert len(replans) == 1
    # after the second window, or the third: the receivers' records now and then read the link after the paced one
    # below a quarter too (its receiver waits for data the paced link holds up), a different set, which the rule
    # confirms again (1 run in 4 at load 14-25)
    assert replans[0].startswith(("after call 20: link 1->2 at ", "after call 30: link 1->2 at ")), replans
    assert all(r[1] for r in results)
    before = np.median([t for r in results for t in r[0][:20]])
    after = np.median([t for r in results for t in r[0][-20:]])
    assert after < before / 2  # 64 KiB at 2 MB/s is 33 ms a step on the paced link, 200 ms in a ring's 6 steps:
    # far above what 4 ranks on 2 cores add to a call (10-15 ms at load 8, 50-70 ms at load 16, where 5 MB/s, 80 ms
    # a call, failed 2 runs in 4: 57-90 ms after against 97-113 before)


def test_the_rule_comes_from_the_environment_variable_or_is_refused_naming_it() -> None:
    assert rule_from_env("") is None
    assert rule_from_env("0") is None
    assert rule_from_env("1") is not None
    rule = rule_from_env("window=10,confirm=3")
    assert rule is not None
    assert (rule.window_calls, rule.confirm_windows) == (10, 3)
    for bad, message in [
        ("fast", "is not one of window=..."),
        ("window=x", "window='x' is not a whole number"),
        ("window=0", "window must be in 1..1,000,000"),
        ("ratio=2", "slow_ratio must be in (0, 1)"),
    ]:
        with pytest.raises(ValueError, match="ALLREDUCE_REPLAN") as info:
            rule_from_env(bad)
        assert message in str(info.value)


TCP_ENV = {"ALLREDUCE_REPLAN": "window=10,confirm=2", "ALLREDUCE_TCP_UNIX": "0"}  # TCP over loopback, not Unix
PACED_BPS = 2e6
TCP_CONFIRMED_AFTER = (20, 30, 40)
"""When re-planning over TCP acts: after two windows of 10 calls that read the paced link slow, the second and third
window, or the fourth at load 16-24, where a window's busy-time count can leave the link's rate unresolved (runs at
load 20 re-planned after call 30 and 40; before the probe's changes, 3 of 3 runs at load 21-24 not at all)."""


def _replanned_after(replan: str, link: str) -> int:
    """The call after which ``replan`` (a line of ``group.stats().replans``) acted, given that it names ``link``."""
    head, _, rest = replan.partition(": ")
    assert rest.startswith(f"link {link} at "), replan
    return int(head.removeprefix("after call "))


"""The slow link's rate: a ring all-reduce of 256 KiB on 4 ranks sends 384 KiB a call over each link, 0.1 s at 4
MB/s; in the kernel's busy time healthy loopback links read 100 MB/s and more at load 11 (steps of 64 KiB, a
loopback segment: each is acknowledged at once), so the paced one is 25x below the others, far outside both
intervals whatever the load adds."""


def _tcp_loop(group: Any, calls: int, slow: tuple[int, int] | None) -> tuple[list[float], bool, tuple[str, ...], int]:
    times, exact = [], True
    expected = float(sum(range(1, group.world_size + 1)))
    for call in range(calls):
        x = np.full(COUNT, float(group.rank + 1), np.float32)
        started = time.perf_counter()
        group.all_reduce(x, algorithm="ring")
        times.append(time.perf_counter() - started)
        exact = exact and bool(np.all(x == expected))
        if call == 0 and slow is not None and group.rank == slow[0]:
            group.transport.inject_slow_link(peer=slow[1], rate_Bps=PACED_BPS)  # the kernel paces it from now on
    return times, exact, group.stats().replans, len(group.transport.sent_counters())


@pytest.mark.slow
@pytest.mark.serial
def test_over_tcp_a_link_the_kernel_paces_is_named_and_re_planned_around_alike_on_every_rank() -> None:
    results = spawn(4, _tcp_loop, 60, (1, 2), env=TCP_ENV, init_options={"transport": "tcp"}, timeout_s=240)
    assert all(r[1] for r in results)
    changes = {r[2] for r in results}
    assert len(changes) == 1  # every rank decided the same, from the same gathered counters
    (replans,) = changes
    assert len(replans) == 1, replans
    assert _replanned_after(replans[0], "1->2") in TCP_CONFIRMED_AFTER, replans
    order = [int(r) for r in replans[0].split("ring reordered ")[1].split(";")[0].split(",")]
    assert (1, 2) not in {(order[i], order[(i + 1) % 4]) for i in range(4)}
    before = np.median([t for r in results for t in r[0][1:20]])
    after = np.median([t for r in results for t in r[0][-20:]])
    assert after < before / 2, (before, after)  # 0.2 s a call paced; what 4 ranks on 2 cores add, 10-20 ms at load 8,
    # 50-60 at load 20 (where 4 MB/s, 0.1 s a call, failed: 57 ms after against 98 before)


@pytest.mark.slow
@pytest.mark.serial
def test_over_tcp_sockets_the_kernel_counters_decide_and_a_healthy_ring_is_never_changed() -> None:
    results = spawn(4, _tcp_loop, 200, None, env=TCP_ENV, init_options={"transport": "tcp"}, timeout_s=240)
    assert all(r[3] >= 2 for r in results)  # each rank has the kernel's counters of its ring connections
    assert all(r[1] for r in results)
    assert {r[2] for r in results} == {()}  # twenty windows, every rank gathered the counters, none re-planned


SLOW_PAIRS = ((1, 2), (1, 3), (3, 2))
"""Paced pairs of which the first ring (0,1,2,3) uses one: the only ring of 4 that avoids all three is 0,2,3,1."""


def _all_pairs_loop(group: Any, calls: int) -> tuple[list[float], bool, tuple[str, ...]]:
    """A pairwise all-to-all first (it connects every pair, so each can be paced), then :func:`_tcp_loop`'s calls
    with :data:`SLOW_PAIRS` paced by their senders' kernels."""
    group.all_to_all(np.zeros(group.world_size * 1024, np.uint8), algorithm="pairwise")
    for src, dst in SLOW_PAIRS:
        if group.rank == src:
            group.transport.inject_slow_link(peer=dst, rate_Bps=PACED_BPS)
    times, exact, replans, _ = _tcp_loop(group, calls, None)
    return times, exact, replans


def _ring_pairs(order: list[int]) -> set[tuple[int, int]]:
    return {(order[i], order[(i + 1) % len(order)]) for i in range(len(order))}


@pytest.mark.slow
@pytest.mark.serial
def test_one_probe_of_every_pair_finds_the_slow_pairs_the_ring_never_used_and_the_new_ring_avoids_them_all() -> None:
    results = spawn(4, _all_pairs_loop, 60, env=TCP_ENV, init_options={"transport": "tcp"}, timeout_s=240)
    assert all(r[1] for r in results)
    changes = {r[2] for r in results}
    assert len(changes) == 1  # every rank probed, gathered the same counters and chose the same order
    (replans,) = changes
    assert len(replans) == 1, replans  # one change: no pair of the new ring is found slow later
    assert _replanned_after(replans[0], "1->2") in TCP_CONFIRMED_AFTER, replans  # the one slow pair the first ring used
    assert "probed 12 pairs with " in replans[0], replans
    assert "3 (1->2, 1->3, 3->2) slow" in replans[0], replans  # two of them the first ring never measured
    order = [int(r) for r in replans[0].split("ring reordered ")[1].split(";")[0].split(",")]
    assert order == [0, 2, 3, 1]
    assert not _ring_pairs(order) & set(SLOW_PAIRS)
    before = np.median([t for r in results for t in r[0][:20]])
    after = np.median([t for r in results for t in r[0][-15:]])
    assert after < before / 2, (before, after)


PROBE_CALL = 23
"""The probe's all-to-all among a rank's collectives (from 0): the connecting all-to-all, ten all-reduces, the
window's counter gather, ten more, the second gather; then the probe."""


def _dies_in_the_probe(calls: int) -> str:
    import allreduce

    group = allreduce.init(transport="tcp", timeout_s=60.0)
    try:
        _all_pairs_loop(group, calls)
    except allreduce.runtime.CollectiveError as exc:
        return f"{type(exc).__name__}: {exc} | {' | '.join(getattr(exc, '__notes__', []))}"
    finally:
        group.close()
    return "no error"


@pytest.mark.slow
@pytest.mark.serial
def test_a_rank_killed_during_the_probe_makes_it_raise_on_every_survivor_naming_the_probe() -> None:
    from allreduce.runtime import spawn_elastic

    env = {**TCP_ENV, "ALLREDUCE_INJECT": f"kill:rank=3:call={PROBE_CALL}:step=1"}
    outcome = spawn_elastic(4, _dies_in_the_probe, 40, min_ranks=3, env=env, timeout_s=240)
    assert [d.rank for d in outcome.departures] == [3]
    assert sorted(outcome.results) == [0, 1, 2]
    for rank, message in outcome.results.items():
        assert "rank 3" in message, (rank, message)  # the culprit, named on every survivor
        assert "re-planning probe of every pair" in message, (rank, message)


SLOW_RANK = 3
SLOW_PORT_CALLS = 50
SLOW_PORT_RULE = "window=10,confirm=2,speedup=1.05"
"""Any predicted gain: a step's latency is measured, and at load 16 it was 8-15 ms (sleeps that overshoot, ranks
waiting for a core), where the 8-chunk tree was predicted 1.2x faster and ran 1.1x (330 -> 300 ms; at load 7: 1.3x
predicted, 1.4x run, 202 -> 146 ms); the default 1.25 then keeps the ring, as it should."""


def _slow_port_inject(n: int, rank: int) -> str:
    """``ALLREDUCE_INJECT`` pacing every link into and out of ``rank`` at 2 MB/s: its port, not one cable."""
    return ";".join(f"pace:link={a}->{b}:rate=2MB/s" for a in range(n) for b in range(n) if a != b and rank in (a, b))


def _changed_around(replans: tuple[str, ...], rank: int) -> int:
    """The call after which the one change in ``replans`` named ``rank`` slow and moved it where another
    algorithm than the ring has it move the fewest bytes (a tree's leaf; with a step's latency measured high on a
    loaded machine, halving-doubling's fewer steps can win)."""
    assert len(replans) == 1, replans
    head, _, rest = replans[0].partition(": ")
    assert rest.startswith(f"rank {rank}: all "), replans
    # At load ~10 (CI run 27, beside a whole parallel suite) the slow rank's successor was named too ("with ranks
    # 3, 0 where ..."): its one other link read below the rule's quarter. Both then take light positions.
    named = rest.split(" where it moves the fewest bytes")[0].rsplit(" with rank", 1)[1].removeprefix("s").strip()
    assert str(rank) in {r.strip() for r in named.split(",")}, replans
    assert "ring reordered" not in rest, replans
    return int(head.removeprefix("after call "))


@pytest.mark.slow
@pytest.mark.serial
def test_a_rank_whose_every_link_is_paced_is_named_and_moved_out_of_the_ring_alike_on_every_rank() -> None:
    env = {"ALLREDUCE_INJECT": _slow_port_inject(4, SLOW_RANK), "ALLREDUCE_REPLAN": SLOW_PORT_RULE}
    results = [r[:3] for r in spawn(4, _tcp_loop, SLOW_PORT_CALLS, None, env=env, init_options={"transport": "shm"},
                                    timeout_s=240)]  # fmt: skip
    assert all(r[1] for r in results)
    changes = {r[2] for r in results}
    assert len(changes) == 1  # every rank decided the same, from the same gathered records
    (replans,) = changes
    assert _changed_around(replans, SLOW_RANK) in (20, 30)
    # No timing asserted: links paced by sleeping receivers cost 0.2 ms a step at load 7 and 7-15 ms at load 16,
    # varying within a run, and the tree chosen there with the step latency measured before it ran 1.4x faster
    # at load 7 (202 -> 146 ms) and 0.7x at load 16 (311 -> 429 ms). Over TCP the kernel paces: timed below.


def _slow_port_loop(group: Any, calls: int, rank: int) -> tuple[list[float], bool, tuple[str, ...]]:
    """A pairwise all-to-all first (it connects every pair), then every link into and out of ``rank`` paced by
    its sender's kernel, then :func:`_tcp_loop`'s calls."""
    group.all_to_all(np.zeros(group.world_size * 1024, np.uint8), algorithm="pairwise")
    for peer in range(group.world_size):
        if peer != group.rank and rank in (group.rank, peer):
            group.transport.inject_slow_link(peer=peer, rate_Bps=PACED_BPS)
    times, exact, replans, _ = _tcp_loop(group, calls, None)
    return times, exact, replans


@pytest.mark.slow
@pytest.mark.serial
def test_over_tcp_the_probe_finds_every_link_of_a_rank_slow_and_a_tree_is_chosen_around_it() -> None:
    env = {**TCP_ENV, "ALLREDUCE_REPLAN": SLOW_PORT_RULE}
    results = spawn(4, _slow_port_loop, SLOW_PORT_CALLS, SLOW_RANK, env=env, init_options={"transport": "tcp"},
                    timeout_s=240)  # fmt: skip
    assert all(r[1] for r in results)
    changes = {r[2] for r in results}
    assert len(changes) == 1  # every rank probed, gathered the same counters and chose the same schedule
    (replans,) = changes
    assert _changed_around(replans, SLOW_RANK) in TCP_CONFIRMED_AFTER
    assert "probed 12 pairs with " in replans[0]
    found = replans[0].split("probed 12 pairs with ")[1].split(" slow")[0]
    assert all(f"{a}->{b}" in found for a, b in [(0, 3), (1, 3), (2, 3), (3, 0), (3, 1), (3, 2)]), replans
    before = np.median([t for r in results for t in r[0][1:19]])
    after = np.median([t for r in results for t in r[0][-10:]])
    assert after < before, (before, after, replans)  # 229 -> 72 ms at load 6.5: each link is paced on its own, so
    # the tree's leaf sends to its two neighbours at once (a real slow port would share its rate: 1.5x at best)


def _replans_after(group: Any, calls: int) -> tuple[str, ...]:
    x = np.ones(1 << 16, np.float32)
    for _ in range(calls):
        group.all_reduce(x, algorithm="ring")
    return group.stats().replans


@pytest.mark.slow
@pytest.mark.serial
def test_a_rank_late_to_every_call_is_named_a_compute_straggler_and_nothing_changes() -> None:
    env = {"ALLREDUCE_INJECT": "delay:rank=3:20ms", "ALLREDUCE_REPLAN": "window=10,confirm=2"}
    results = spawn(4, _replans_after, 50, env=env, init_options={"transport": "shm"}, timeout_s=120)
    assert len(set(results)) == 1  # every rank said the same, from the same gathered records
    (replans,) = set(results)
    assert len(replans) == 1, replans  # said once, once confirmed; no schedule adopted
    head, _, said = replans[0].partition(": ")
    # after two windows, or later at load 12-16, where a window's receivers' records now and then read a link slow
    assert head in ("after call 20", "after call 30", "after call 40", "after call 50"), replans
    assert said.startswith("rank 3 late by a median "), replans
    assert "no link slow: a compute straggler, which no schedule routes around" in said
    assert said.endswith("nothing changed")
