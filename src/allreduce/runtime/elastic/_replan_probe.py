"""The all-pairs probe: once a slow link is confirmed, the rate of every ordered pair of ranks, measured at once.

A ring measures only the pairs it uses, so a re-planner fed by it learns the pairs of a new order one window at a
time. On a fabric with several paths between two hosts that is slow to converge: the switches hash each
connection's addresses and ports onto one path (ECMP), so which pairs cross a degraded cable is a property of the
connections, not of the hosts, and differs between pairs that look alike (on an emulated 2x2 Clos, 10-20 of the 56
ordered pairs of 8 ranks crossed one slow spine cable, a different set in each run). The probe measures them all
before the order is chosen:

- the group runs one pairwise all-to-all (``allreduce.schedules.pairwise_all_to_all``: N-1 steps, at step k rank r
  sends to rank r+k and receives from r-k) of :func:`probe_pair_bytes` per pair, on its own transport, so each
  pair's bytes take the connection, and so the path, that the ring will use; every rank sends to one peer and
  receives from one per step, the load a ring step puts on its links;
- each pair's rate is read as the windows' are over TCP (``_replan.sender_rates``: the senders' kernel counters,
  gathered before and after), so the same interval rule names the slow ones. Only there: a receiver's record of
  an all-to-all step is no rate (it waits for a sender still busy with the step before), so a group without the
  counters (shared memory, Unix sockets) is not probed and re-plans from its windows alone;
- the probe's size is set from the confirmed slow link's rate so that a pair as slow as it takes
  :data:`PROBE_SLOW_S` to send its part: long enough for the interval rule to tell a link at a tenth of the
  others from them whatever their own speed (a healthy pair's busy count of 0 still allows nine jiffies).

Every rank gathers the same counters, so every rank reads the same rates and chooses the same order. A rank that
fails during the probe fails the all-to-all, which raises on every rank like any collective; the error says it
happened in the probe.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from allreduce.runtime._errors import CollectiveError
from allreduce.runtime.stats._stats import GroupStats
from allreduce.runtime.transport._transport import Transport

__all__ = [
    "PROBE_MAX_PAIR_BYTES",
    "PROBE_MIN_PAIR_BYTES",
    "PROBE_SLOW_S",
    "ProbedGroup",
    "gather_sent_counters",
    "probe_pair_bytes",
    "run_probe",
]

PROBE_SLOW_S = 1.0
"""Seconds a pair as slow as the confirmed slow link takes to send its part of the probe. The interval rule
(``_replan.busy_interval_s``, 3 standard deviations of a jiffy count) calls a link slow when its shortest possible
time exceeds four times the longest possible time of the others: a count of 0.8 s is at least 0.65 s, and a link 10
times faster counts 0.08 s, at most 0.155 s; a count of 0.5 s with a link 10 times faster is not resolved (0.38 s
against 4 x 0.114 s). 1 s leaves room for a slow link that the ring shared between two of its hops (it then read
half its rate, and the probe, sized by that, runs half as long on it)."""

PROBE_MIN_PAIR_BYTES = 64 << 10
PROBE_MAX_PAIR_BYTES = 32 << 20
"""The probe's bytes per pair are kept in these bounds: the all-to-all's buffers are N times the part, twice. A slow
link above 32 MiB/s is probed for less than :data:`PROBE_SLOW_S`; pairs the probe cannot resolve are then not called
slow, and the re-planner goes on with what the windows measure."""


class ProbedGroup(Protocol):
    """What the probe needs of a process group: its size and rank, two collectives, its transport and records."""

    world_size: int
    rank: int

    @property
    def transport(self) -> Transport: ...

    def all_gather(self, x: Any) -> Any: ...

    def all_to_all(self, x: Any, out: Any, algorithm: str) -> Any: ...

    def barrier(self) -> None: ...

    def stats(self, last: int = ...) -> GroupStats: ...


def probe_pair_bytes(slow_rate_Bps: float) -> int:
    """Bytes per pair that a link of ``slow_rate_Bps`` (the confirmed slow link's highest possible rate) sends in
    :data:`PROBE_SLOW_S`, within the bounds."""
    if not math.isfinite(slow_rate_Bps) or slow_rate_Bps <= 0:
        return PROBE_MAX_PAIR_BYTES
    return int(min(max(slow_rate_Bps * PROBE_SLOW_S, PROBE_MIN_PAIR_BYTES), PROBE_MAX_PAIR_BYTES))


def gather_sent_counters(group: ProbedGroup) -> npt.NDArray[np.float64] | None:
    """Every rank's kernel counters of its connections (``Transport.sent_counters``), all-gathered: row ``src``,
    columns ``2·dst`` and ``2·dst + 1`` (bytes acknowledged, seconds network-limited), NaN where there are none; None
    for a transport that keeps none (every rank's transport is of one kind, so every rank returns the same)."""
    transport = group.transport
    if type(transport).sent_counters is Transport.sent_counters:
        return None
    n = group.world_size
    table = np.full((n, 2 * n), np.nan)
    for peer, counters in transport.sent_counters().items():
        table[group.rank, 2 * peer : 2 * peer + 2] = counters
    group.all_gather(table.reshape(-1))
    return table


def run_probe(group: ProbedGroup, pair_bytes: int) -> None:
    """The probe's traffic: one pairwise all-to-all of ``pair_bytes`` per ordered pair (a collective). A failure
    raises the collective's error, with a note that it was the probe."""
    n = group.world_size
    send = np.zeros(n * pair_bytes, np.uint8)
    try:
        group.all_to_all(send, np.empty_like(send), algorithm="pairwise")
        # A rank's part of the all-to-all ends once its sends are in its socket buffers: its counters, read now,
        # would miss the bytes still queued for a slow peer. Past the barrier every rank has received everything.
        group.barrier()
    except CollectiveError as exc:
        exc.add_note(f"rank {group.rank}: this collective was the re-planning probe of every pair of ranks")
        raise
