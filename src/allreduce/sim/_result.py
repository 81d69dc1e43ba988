"""What a simulation reports: time, bandwidths, phases, per-link traffic, the critical path and its bottlenecks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.schedules import Collective
from allreduce.schedules.timing import Bandwidths
from allreduce.topology import Topology
from allreduce.units import format_bandwidth, format_bytes, format_seconds

__all__ = ["Bottleneck", "CriticalStep", "PhaseResult", "SimResult"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class PhaseResult:
    """One flow pattern of the schedule: steps ``[first_step, first_step + repeat)`` with ``num_flows`` flows per
    step; it ran from ``start_s`` (earliest rank) to ``end_s`` (latest rank). ``slowest_rate_Bps`` and
    ``fair_share_Bps`` are the slowest flow's rate and the median flow's rate (inf: no link crossed)."""

    first_step: int
    repeat: int
    num_flows: int
    start_s: float
    end_s: float
    slowest_rate_Bps: float
    fair_share_Bps: float


@dataclass(frozen=True)
class CriticalStep:
    """A stretch of the critical path: steps ``[first_step, last_step]`` whose pace was set by the transfer
    from ``src_rank`` to ``dst_rank`` (its bytes at ``rate_Bps`` through ``bottleneck_link``, -1 when it
    crosses no link, after ``latency_s`` of path latency) or by ``rank_delay_s`` of a slow rank;
    ``seconds`` is the time this stretch added to the end time."""

    first_step: int
    last_step: int
    src_rank: int
    dst_rank: int
    seconds: float
    transfer_s: float
    latency_s: float
    rank_delay_s: float
    rate_Bps: float
    bottleneck_link: int


@dataclass(frozen=True)
class Bottleneck:
    """A link the critical path waited on: ``waited_s`` seconds of the end time are transfers it limited."""

    link: int
    name: str
    waited_s: float
    utilization: float
    bytes: float


@dataclass(frozen=True, eq=False)
class SimResult(Bandwidths):
    """The outcome of :func:`allreduce.sim.simulate`.

    Link arrays are indexed like ``topology.link_*`` of the topology the run used (after faults; see
    :meth:`Topology.without` for how failed links renumber). ``trace_start_s`` / ``trace_end_s`` hold, for the
    first ``trace_ranks`` ranks, when each of their steps (event engine) or phases (fast engine) began and
    ended, rows in ``trace_labels`` order — bounded so a 131,072-rank run never keeps O(N x steps) times.

    ``exact`` is False only for a fast-engine run the fast engine could not certify (ranks left lockstep while
    flows shared a bottleneck link): then its time is the fast engine's approximation (see
    :mod:`allreduce.sim._fast`), not the event engine's exact figure.
    """

    name: str
    collective: Collective
    world_size: int
    size_bytes: float
    seconds: float
    engine: str
    topology: Topology
    rank_gpu: IntArray
    phases: tuple[PhaseResult, ...]
    link_bytes: FloatArray
    critical_path: tuple[CriticalStep, ...]
    bottlenecks: tuple[Bottleneck, ...]
    critical_links: int  # how many links the critical path waited on in all (bottlenecks lists the top ones)
    rank_end_s: FloatArray
    trace_labels: tuple[str, ...]
    trace_start_s: FloatArray  # shape (len(trace_labels), trace_ranks)
    trace_end_s: FloatArray
    exact: bool = True

    @property
    def link_utilization(self) -> FloatArray:
        """Per link: bytes carried / (bandwidth x total time)."""
        if self.seconds <= 0:
            return np.zeros_like(self.link_bytes)
        return np.asarray(self.link_bytes / (self.topology.link_bandwidth_Bps * self.seconds), dtype=np.float64)

    def busiest_links(self, count: int = 5) -> list[tuple[str, float]]:
        """The ``count`` most utilised links, as (name, utilization)."""
        util = self.link_utilization
        order = np.argsort(-util, kind="stable")[:count]
        return [(self.topology.link_name(int(i)), float(util[i])) for i in order if util[i] > 0]

    def summary(self, *, bottlenecks: int = 3) -> str:
        """A few lines for a terminal."""
        lines = [
            f"{self.name}: {self.world_size} ranks, {format_bytes(self.size_bytes)} on {self.topology.name} "
            f"({self.engine} engine{'' if self.exact else ', approximate: not certified exact'})",
            f"  time {format_seconds(self.seconds)}, algbw {format_bandwidth(self.algbw_Bps)}, "
            f"busbw {format_bandwidth(self.busbw_Bps)}",
        ]
        lines.extend(
            f"  bottleneck {b.name}: utilization {b.utilization:.0%}, critical path waited "
            f"{format_seconds(b.waited_s)} on it"
            for b in self.bottlenecks[:bottlenecks]
        )
        more = self.critical_links - min(bottlenecks, len(self.bottlenecks))
        if more > 0:
            lines.append(f"  ... and {more} more links on the critical path")
        return "\n".join(lines)

    def to_json(self, *, bottlenecks: int = 5) -> dict[str, Any]:
        """The result as ``allreduce sim --json`` prints one algorithm: time, bandwidths, engine, whether exact, and
        the first ``bottlenecks`` links the critical path waited on (their utilization and the seconds waited)."""
        return {
            "name": self.name,
            "seconds": self.seconds,
            "algbw_GBps": self.algbw_Bps / 1e9,
            "busbw_GBps": self.busbw_Bps / 1e9,
            "engine": self.engine,
            "exact": self.exact,
            "bottlenecks": [
                {"link": b.name, "utilization": b.utilization, "waited_s": b.waited_s}
                for b in self.bottlenecks[:bottlenecks]
            ],
        }
