"""What a tail simulation takes and gives: :class:`TailConfig` (the noise, the engine) and :class:`TailResult`
(the samples, their percentiles and culprits, and which engine computed each)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from allreduce.sim._faults import TimedFault
from allreduce.sim._loss import LossModel
from allreduce.sim._simulate import ENGINES
from allreduce.sim._stochastic import Distribution
from allreduce.topology import FloatArray, IntArray, Topology
from allreduce.units import format_bytes, format_seconds

__all__ = [
    "EVENT_MAX_TRANSFERS",
    "PERCENTILES",
    "SAMPLE_EVENT",
    "SAMPLE_FAST",
    "SAMPLE_FAST_UNCERTIFIED",
    "TAIL_MEMORY_LIMIT_BYTES",
    "Culprit",
    "TailConfig",
    "TailResult",
    "tail_memory_bytes",
]

# The percentiles a tail report shows.
PERCENTILES = (50.0, 90.0, 99.0, 99.9)
# How each sample was computed (TailResult.sample_engine): by the fast engine's recurrence, certified exact;
# by it, not certified (the "~" of the output); by the event engine.
SAMPLE_FAST = 0
SAMPLE_FAST_UNCERTIFIED = 1
SAMPLE_EVENT = 2
# engine="auto" re-runs the samples the fast engine cannot certify with the event engine when the group has at
# most AUTO_EXACT_MAX_RANKS ranks and the re-runs take at most this many transfers in all: the event engine
# costs 30-80 µs of CPU per transfer (measured on the development machine: rings, halving-doubling and
# double binary trees of 16-64 ranks on a fat-tree), so about 10-15 s at most.
EVENT_MAX_TRANSFERS = 200_000
# The most memory a tail simulation may plan to hold (its per-rank, per-sample arrays): a sixth of the
# development machine's 24 GiB, which several people share.
TAIL_MEMORY_LIMIT_BYTES = 4 * 2**30
# Bytes a tail simulation holds per rank and sample (arrival and start times, their blame, the agreement's
# draws: five float64 arrays) and per sample (step and collective times, culprits, counts: twelve).
_BYTES_PER_RANK_SAMPLE = 5 * 8
_BYTES_PER_SAMPLE = 12 * 8


def tail_memory_bytes(world_size: int, samples: int) -> int:
    """About how much memory a tail simulation of ``samples`` samples of ``world_size`` ranks holds at once
    (the stepping works through cache-sized chunks; what grows with the samples is these arrays)."""
    return samples * (world_size * _BYTES_PER_RANK_SAMPLE + _BYTES_PER_SAMPLE)


@dataclass(frozen=True)
class TailConfig:
    """The noise of a tail simulation.

    ``loss``: packet loss and the fabric's retransmission model; ``link_jitter``: extra one-way latency of every
    transfer, drawn per transfer; ``rank_jitter``: when each rank reaches the collective (its compute time's
    spread), drawn per rank and sample; ``timed_faults``: links that go down, flap or degrade at given
    times; ``ecmp_seeds``: if > 0, that many ECMP hash seeds are drawn and the samples spread over them, so the
    distribution over path assignments shows (0: the simulation's one seed); ``attribution``: carry each
    sample's culprit through the recurrence (2-2.5x the stepping's array work; off: culprits are not named);
    ``stragglers``: (rank, seconds) pairs, ranks that reach the collective that much later in every sample;
    ``engine``: "fast" (every sample by the fast engine's recurrence), "event" (every sample by the event
    engine, whatever it costs) or "auto" (the samples the fast engine cannot certify exact by the event
    engine, when the group has at most AUTO_EXACT_MAX_RANKS ranks and the re-runs at most
    EVENT_MAX_TRANSFERS transfers; never with timed faults, which only the fast engine models)."""

    samples: int = 1000
    seed: int = 0
    loss: LossModel = field(default_factory=LossModel)
    link_jitter: Distribution | None = None
    rank_jitter: Distribution | None = None
    timed_faults: tuple[TimedFault, ...] = ()
    ecmp_seeds: int = 0
    attribution: bool = True
    stragglers: tuple[tuple[int, float], ...] = ()
    engine: str = "auto"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine == "event" and self.timed_faults:
            raise ValueError("engine 'event': the event engine does not model timed faults; use auto or fast")
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.ecmp_seeds < 0:
            raise ValueError(f"ecmp_seeds must be >= 0, got {self.ecmp_seeds}")
        for rank, seconds in self.stragglers:
            if not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"straggler rank {rank}: the delay must be a finite time >= 0, got {seconds}")

    @property
    def per_transfer(self) -> bool:
        """Whether any noise is drawn per transfer (which needs stepping every step)."""
        jitter = self.link_jitter is not None and not self.link_jitter.is_zero
        return bool(self.loss) or jitter or bool(self.timed_faults)


@dataclass(frozen=True)
class Culprit:
    """A cause named in the attribution table: a rank or a link, the fraction of samples whose largest
    single delay on the critical path it caused, and that delay's mean over those samples."""

    kind: str  # "rank" or "link"
    name: str
    fraction: float
    mean_delay_s: float


@dataclass(frozen=True, eq=False)
class TailResult:
    """K samples of one schedule: step time (from the step's start: arrival + collective), collective time
    (from the last rank's arrival), the noise-free time, and per sample the culprit of its largest delay."""

    name: str
    world_size: int
    size_bytes: float
    topology_name: str
    engine: str  # "sensitivity" or "stepping"
    exact: bool
    baseline_s: float
    step_s: FloatArray
    collective_s: FloatArray
    culprit: IntArray  # per sample: rank r as r, link l as world_size + l, none as -1
    culprit_delay_s: FloatArray
    lost_transfers: IntArray  # per sample
    timeouts: IntArray  # per sample: retransmission timeouts that fired
    topology: Topology  # the one culprit link codes index (after static faults)
    description: str = ""
    sample_engine: IntArray | None = None  # per sample: SAMPLE_FAST, SAMPLE_FAST_UNCERTIFIED or SAMPLE_EVENT

    def engine_counts(self) -> dict[str, int]:
        """How many samples each engine computed: "fast" (certified exact), "fast ~" (not certified) and
        "event"."""
        codes = self.sample_engine if self.sample_engine is not None else np.zeros(self.samples, dtype=np.int64)
        counts = np.bincount(codes, minlength=3)
        return {
            "fast": int(counts[SAMPLE_FAST]),
            "fast ~": int(counts[SAMPLE_FAST_UNCERTIFIED]),
            "event": int(counts[SAMPLE_EVENT]),
        }

    @property
    def samples(self) -> int:
        return int(self.step_s.size)

    def percentiles(self, which: str = "step") -> dict[str, float]:
        """p50, p90, p99, p99.9, max and mean of the step (or ``"collective"``) time."""
        values = self.step_s if which == "step" else self.collective_s
        out = {f"p{p:g}": float(np.percentile(values, p)) for p in PERCENTILES}
        out["max"] = float(values.max())
        out["mean"] = float(values.mean())
        return out

    def slowdown(self, statistic: str = "p50") -> float:
        """A statistic of the collective time over the noise-free run's time."""
        value = self.percentiles("collective")[statistic]
        return value / self.baseline_s if self.baseline_s > 0 else math.inf

    def culprit_name(self, code: int) -> tuple[str, str]:
        if code < 0:
            return "none", "-"
        if code < self.world_size:
            return "rank", f"rank {code}"
        return "link", self.topology.link_name(code - self.world_size)

    def attribution(self, top: int = 5, kind: str | None = None) -> list[Culprit]:
        """The causes that most often set a sample's largest delay, most frequent first: ranks and links, or
        only ``kind`` ("rank" or "link")."""
        named = self.culprit >= 0
        if kind == "rank":
            named &= self.culprit < self.world_size
        elif kind == "link":
            named &= self.culprit >= self.world_size
        if not named.any():
            return []
        codes, counts = np.unique(self.culprit[named], return_counts=True)
        order = np.lexsort((codes, -counts))[:top]
        out = []
        for i in order:
            kind, name = self.culprit_name(int(codes[i]))
            delay = self.culprit_delay_s[self.culprit == codes[i]]
            out.append(Culprit(kind, name, float(counts[i]) / self.samples, float(delay.mean())))
        return out

    def loss_frequency(self) -> float:
        """Fraction of samples with at least one lost transfer."""
        return float(np.mean(self.lost_transfers > 0))

    def to_json(self, *, top: int = 5) -> dict[str, Any]:
        return {
            "name": self.name,
            "ranks": self.world_size,
            "size_bytes": self.size_bytes,
            "topology": self.topology_name,
            "samples": self.samples,
            "engine": self.engine,
            "exact": self.exact,
            "samples_by_engine": self.engine_counts(),
            "noise": self.description,
            "noise_free_s": self.baseline_s,
            "step_s": self.percentiles("step"),
            "collective_s": self.percentiles("collective"),
            "slowdown_p50": self.slowdown("p50"),
            "slowdown_p99": self.slowdown("p99"),
            "samples_with_loss": self.loss_frequency(),
            "attribution": [
                {"kind": c.kind, "name": c.name, "fraction": c.fraction, "mean_delay_s": c.mean_delay_s}
                for c in self.attribution(top)
            ],
        }

    def summary(self) -> str:
        p = self.percentiles("step")
        return (
            f"{self.name}: {self.world_size} ranks, {format_bytes(self.size_bytes)}, {self.samples} samples: "
            f"p50 {format_seconds(p['p50'])}, p99 {format_seconds(p['p99'])}, max {format_seconds(p['max'])} "
            f"(noise-free {format_seconds(self.baseline_s)})"
        )
