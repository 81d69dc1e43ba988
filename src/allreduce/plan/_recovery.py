"""Elastic recovery: how long shrink-and-continue pauses per failure, measured on this machine, modelled at scale.

A failure costs a shrinking job (``group.shrink()``, docs/elastic.md) the time from the failure to the next step
completed on the survivors. :func:`measure_recovery` measures it here through the public runtime: a small local
group runs all-reduces, one rank SIGKILLs itself, the survivors' collective raises, they shrink and run the step
again; it times the kill to the slowest survivor's raise (*detection*) and that raise to the slowest survivor's
completed step (*resume*: the agreement, the new group's transport and the step).

What changes at the target (:class:`RecoveryModel`):

- *How the survivors learn of it.* A GPU or software failure ends the rank's process (a CUDA error raises, the
  process exits) and the kernel closes its connections: the survivors raise as measured. A host, NIC, cable or
  switch failure takes the rank off the network with its connections open: no socket tells. Its heartbeats to rank
  0's store stop with it, and the store declares it dead after its lease (``allreduce.init(lease_s=...)``,
  :data:`RUNTIME_LEASE_S`); a survivor blocked on it asks the store once a second and raises, and the shrink's
  agreement sees it dead at once. :func:`allreduce.runtime.silent_detection_s` gives the mean from the heartbeat's
  periods (a 10 s lease: 9.75 s; ``benchmarks/bench_heartbeat.py --stop`` measures it). This assumes the failed
  part cuts the rank off from the store too (its host, NIC, cable, its leaf switch); a partition that leaves both
  sides reaching the store is found only at the group's timeout (``timeout_s``, :data:`RUNTIME_TIMEOUT_S`), as
  is every silent failure with the heartbeat off (``lease_s=0``): the collective raises after one timeout and the
  agreement waits another for the rank to check in or die to the store. A silent failure costs the smaller of the
  two: min(the lease's detection, two timeouts).
- *The agreement.* Every survivor checks in with rank 0's store and waits for one decider's member list (5
  requests each); the decider reads every check-in (2 requests each) and polls while they arrive; the new
  transport's start adds about 4 per rank: :func:`agreement_requests`, 11N + 3 at least. One server thread answers
  them all, so they take that × :data:`STORE_REQUEST_S` (the server's CPU per request, measured by
  ``benchmarks/bench_plan.py --store``) beyond what the measured group's took: 0.25 s at 1,024 ranks, 4.1 s at
  16,384 (the first version's agreement, every survivor polling every other rank, was 2N² + 8N: 47 s and 3.4 h).

The mean over failure kinds, weighted by their rates, is the pause goodput uses (the work of an up period does not
depend on the recovery that ends it, so the renewal-reward form of :func:`allreduce.plan.elastic_goodput` takes the
mean exactly).
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import allreduce
from allreduce.runtime import (
    DEFAULT_LEASE_S,
    MAX_LEASE_S,
    MIN_LEASE_S,
    CollectiveError,
    shrink_and_resume,
    silent_detection_s,
    spawn_elastic,
)
from allreduce.units import format_seconds

__all__ = [
    "EXIT_KINDS",
    "RUNTIME_LEASE_S",
    "RUNTIME_TIMEOUT_S",
    "STORED_MEASUREMENT",
    "STORE_REQUEST_S",
    "ElasticRecovery",
    "RecoveryMeasurement",
    "RecoveryModel",
    "agreement_requests",
    "duration",
    "measure_recovery",
]

RUNTIME_TIMEOUT_S = float(inspect.signature(allreduce.init).parameters["timeout_s"].default)
"""The group's default timeout (``allreduce.init``): how long a collective waits on a silent peer, and how long the
shrink's agreement waits for a rank that neither checks in nor dies to the store."""

RUNTIME_LEASE_S = DEFAULT_LEASE_S
"""The group's default lease (``allreduce.init(lease_s=...)``): a rank silent this long is dead to the store."""

STORE_REQUEST_S = 22.5e-6
"""The runtime's store server's CPU seconds per request: ``benchmarks/bench_plan.py --store`` (4 client processes x
20,000 ``check`` requests, 2026-12-07, load 16.4 on 2 cores: 1.80 CPU s for 80,000 requests)."""

EXIT_KINDS = frozenset({"gpu", "software"})
"""Failure kinds that end the rank's process, closing its connections (the others leave them open, silent)."""


@dataclass(frozen=True)
class RecoveryMeasurement:
    """One kill of a rank of a local group and what the survivors took to step again."""

    ranks: int  # before the kill
    transport: str
    detection_s: float  # the kill to the slowest survivor's collective raising
    resume_s: float  # that raise to the step completed again on every survivor (shrink, then the step)
    source: str

    @property
    def total_s(self) -> float:
        return self.detection_s + self.resume_s


STORED_MEASUREMENT = RecoveryMeasurement(
    ranks=8,
    transport="tcp",
    detection_s=0.037,
    resume_s=0.285,
    source="benchmarks/bench_elastic.py --reps 3 (1 of 8 ranks over tcp SIGKILLed; medians, 2026-12-07, load 12-18)",
)
"""The runtime's own kill benchmark, its TCP row (the transport between hosts): what the planner uses without
``--measure-recovery``."""


def agreement_requests(ranks: int) -> int:
    """Store requests of one shrink of ``ranks`` ranks: 5 from each survivor but the decider, the decider's 2 per
    check-in and 8 of its own, and the new transport's start, 4 per rank. A lower bound: the decider polls while
    the others arrive (1,024 ranks as threads of one process, load 14: 8,172 agreement requests, 7,171 counted
    here; ``tests/runtime/elastic/test_shrink_agreement.py`` holds every survivor but the decider to its 5)."""
    return 11 * ranks + 3


@dataclass(frozen=True)
class ElasticRecovery:
    """The pause per failure of shrink-and-continue at one job size, and where it comes from."""

    seconds: float  # the mean over failure kinds: what goodput uses
    basis: str  # "measured" (here, this run), "stored" (the runtime's benchmark, kept), "given"
    source: str
    # the model's parts (zeros when given)
    ranks: int = 0  # the job's ranks the model was evaluated at
    exit_s: float = 0.0  # after a failure that ends the process (GPU, software)
    silent_s: float = 0.0  # after one that takes the rank off the network (host, NIC, cable, switch)
    store_s: float = 0.0  # of each, the store requests beyond the measured group's
    silent_share: float = 0.0  # of failures
    timeout_s: float = 0.0
    lease_s: float = 0.0  # 0: the heartbeat off (then two timeouts)
    detect_s: float = 0.0  # of a silent failure: the lease's detection, or two timeouts

    def describe(self) -> list[str]:
        """Where the pause comes from, in a line or two."""
        if self.basis == "given":
            return [f"elastic recovery {duration(self.seconds)} a failure, given ({self.source})"]
        if self.lease_s > 0 and self.detect_s < 2 * self.timeout_s:
            found = (
                f"dead to the store after its {duration(self.lease_s)} lease (no heartbeat), found in "
                f"{duration(self.detect_s)} on average"
            )
        else:
            found = f"found after two {duration(self.timeout_s)} timeouts"
        return [
            f"elastic recovery {duration(self.seconds)} a failure (mean), modelled from {self.source}",
            f"  at {self.ranks:,} ranks the shrink's {agreement_requests(self.ranks):,} store requests add "
            f"{duration(self.store_s)}; a process exit (GPU, software) costs {duration(self.exit_s)}; a host, NIC, "
            f"cable or switch failure ({self.silent_share:.0%}) is silent, {found}: {duration(self.silent_s)}",
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "basis": self.basis,
            "source": self.source,
            **(
                {}
                if self.basis == "given"
                else {
                    "ranks": self.ranks,
                    "exit_s": self.exit_s,
                    "silent_s": self.silent_s,
                    "store_s": self.store_s,
                    "silent_share": self.silent_share,
                    "timeout_s": self.timeout_s,
                    "lease_s": self.lease_s,
                    "detect_s": self.detect_s,
                }
            ),
        }


@dataclass(frozen=True)
class RecoveryModel:
    """A measured kill, moved to a job of any size (see the module docstring)."""

    measurement: RecoveryMeasurement = STORED_MEASUREMENT
    timeout_s: float = RUNTIME_TIMEOUT_S
    store_request_s: float = STORE_REQUEST_S
    basis: str = "stored"
    lease_s: float = RUNTIME_LEASE_S

    def __post_init__(self) -> None:
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"the group's timeout must be a number of seconds > 0, got {self.timeout_s}")
        if self.lease_s != 0 and not MIN_LEASE_S <= self.lease_s <= MAX_LEASE_S:
            raise ValueError(
                f"the group's lease must be 0 (the heartbeat off) or {MIN_LEASE_S:g} to {MAX_LEASE_S:g} s, got "
                f"{self.lease_s}"
            )

    @property
    def silent_detection_s(self) -> float:
        """A silent failure to the survivors' agreement on who is left: the lease's mean detection, or two
        timeouts (the collective's, then the agreement's), whichever is shorter (see the module docstring)."""
        twice = 2 * self.timeout_s
        return min(silent_detection_s(self.lease_s)[0], twice) if self.lease_s > 0 else twice

    def at(self, ranks: int, failures_per_h: dict[str, float]) -> ElasticRecovery:
        """The mean pause per failure of a job of ``ranks`` ranks whose parts fail at ``failures_per_h``."""
        m = self.measurement
        store_s = self.store_request_s * max(0, agreement_requests(ranks) - agreement_requests(m.ranks))
        exit_s = m.detection_s + m.resume_s + store_s
        detect_s = self.silent_detection_s
        silent_s = detect_s + m.resume_s + store_s
        total = sum(failures_per_h.values())
        silent = sum(rate for kind, rate in failures_per_h.items() if kind not in EXIT_KINDS)
        share = silent / total if total > 0 else 0.0
        what = "a kill measured here" if self.basis == "measured" else "the runtime's kill benchmark"
        source = (
            f"{what}, {m.source}: detected in {format_seconds(m.detection_s)}, stepping again "
            f"{format_seconds(m.resume_s)} later"
        )
        return ElasticRecovery(
            seconds=(1 - share) * exit_s + share * silent_s,
            basis=self.basis,
            source=source,
            ranks=ranks,
            exit_s=exit_s,
            silent_s=silent_s,
            store_s=store_s,
            silent_share=share,
            timeout_s=self.timeout_s,
            lease_s=self.lease_s,
            detect_s=detect_s,
        )


def duration(seconds: float) -> str:
    """Seconds as the planner prints a pause: hours past an hour."""
    return format_seconds(seconds) if seconds < 3600 or not math.isfinite(seconds) else f"{seconds / 3600:.3g} h"


# ------------------------------------------------------------------------------------------------------------
# Measuring it: a real kill of one rank of a local group
# ------------------------------------------------------------------------------------------------------------
_COUNT = 1 << 14  # float32 elements per all-reduce: a step's collective, small so the kill's cost shows
_WARM_CALLS = 3  # all-reduces before the kill: connections made, the group running


def _recovery_rank(victim: int, transport: str, kill_file: str, timeout_s: float) -> tuple[float, float, bool]:
    """One rank of the measurement: (when its collective raised, when its first step on the survivors completed,
    whether that step summed exactly); the victim SIGKILLs itself after the warm-up calls."""
    # the death is the measurement's own: the store's warning about a rank gone without close() would only alarm
    logging.getLogger("allreduce.store").setLevel(logging.ERROR)
    group = allreduce.init(transport=transport, timeout_s=timeout_s)
    x = np.ones(_COUNT, np.float32)
    for _ in range(_WARM_CALLS):
        x[:] = 1.0
        group.all_reduce(x)
    if group.rank == victim:
        Path(kill_file).write_text(repr(time.monotonic()))  # CLOCK_MONOTONIC: every process of the host shares it
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        while True:
            x[:] = 1.0
            group.all_reduce(x)
    except CollectiveError:
        raised = time.monotonic()
    group = shrink_and_resume(group, x, lambda buffer, _: buffer.fill(1.0), kept=None)  # the same step again
    stepped = time.monotonic()
    exact = bool(np.all(x == float(group.world_size)))
    group.close()
    return raised, stepped, exact


MEASURE_RANKS = 4
"""Ranks of the measured group by default (one is killed)."""


def measure_recovery(
    ranks: int = MEASURE_RANKS, transport: str = "shm", *, timeout_s: float = 60.0
) -> RecoveryMeasurement:
    """Kill one rank of ``ranks`` local ranks over ``transport`` in the middle of their all-reduces and time the
    survivors' recovery (see the module docstring). Raises RuntimeError when they do not recover exactly."""
    if not 3 <= ranks <= 16:
        raise ValueError(f"ranks must be in [3, 16] (one is killed, rank 0 hosts the store), got {ranks}")
    if transport not in ("shm", "tcp"):
        raise ValueError(f"transport must be shm or tcp, got {transport!r}")
    victim = ranks - 1
    with tempfile.TemporaryDirectory(prefix="allreduce-recovery-") as tmp:
        kill_file = str(Path(tmp) / "killed_at")
        outcome = spawn_elastic(
            ranks, _recovery_rank, victim, transport, kill_file, timeout_s, min_ranks=ranks - 1,
            timeout_s=4 * timeout_s,
        )  # fmt: skip
        killed_at = float(Path(kill_file).read_text())
    survivors = outcome.results
    if sorted(survivors) != [r for r in range(ranks) if r != victim] or len(outcome.departures) != 1:
        gone = ", ".join(f"rank {d.rank} {d.how}" for d in outcome.departures)
        raise RuntimeError(f"expected rank {victim} to die and the others to recover; returned: {sorted(survivors)}, "
                           f"gone: {gone}")  # fmt: skip
    if not all(exact for _, _, exact in survivors.values()):
        raise RuntimeError("the survivors' first all-reduce after the shrink did not sum exactly")
    raised = max(r for r, _, _ in survivors.values())
    stepped = max(s for _, s, _ in survivors.values())
    return RecoveryMeasurement(
        ranks=ranks,
        transport=transport,
        detection_s=raised - killed_at,
        resume_s=stepped - raised,
        source=f"1 of {ranks} ranks over {transport} SIGKILLed",
    )
