"""Goodput: the share of a synchronous job's wall time that trains, once failures, checkpoints and restarts count.

A data-parallel job stops when any part it uses fails, so its failure rate is the sum over its parts::

    failures per hour  λ = Σ_c  count_c · rate_c        (GPUs, hosts, NICs, network cables, switches, software)
    mean time between failures  M = 1 / λ

Rates are per component-hour. The defaults (:data:`LLAMA3_RATES`) are Meta's Llama 3 report ("The Llama 3 Herd of
Models", 2024, table 5): 419 unexpected interruptions in 54 days (1,296 h) of pre-training on 16,384 H100 GPUs in
2,048 hosts of 8, with one 400 Gbit/s NIC per GPU, sorted by root cause. Each cause is charged to the part that
holds it: GPU (faulty GPU 148, HBM3 72, SRAM 19, system processor 17, thermal interface and sensor 6, silent data
corruption 6: 268), host (host maintenance 32, SSD 3, power supply 3, chassis 2, IO expansion board 2, CPU 2, system
memory 2: 46), NIC (7), network switch or cable (35) and software (bugs 54, NCCL watchdog 7, dependencies 2: 63, per
GPU since each GPU runs a process). The report counts switches and cables together; they are charged to cables,
three per GPU as in a non-blocking three-tier Clos (49,152), so the switch rate defaults to 0. With these rates a
16,384-GPU job fails every 3.09 h, the report's "one failure every three hours".

Three recovery policies (:data:`POLICIES`):

- ``restart``: roll back to the last checkpoint and restart. Checkpoints of ``write_s`` every ``interval_s`` of work;
  after a failure the job pays ``restart_s`` (detect, replace the host, reload), during which it can fail again.
  For exponential failures Daly's complete model ("A higher order estimate of the optimum checkpoint interval for
  restart dumps", FGCS 2006) is exact for this process::

      wall / work = M · e^(R/M) · (e^((τ+δ)/M) − 1) / τ        τ = interval_s, δ = write_s, R = restart_s

  and the interval defaults to Daly's optimum τ = √(2δM)·[1 + ⅓√(δ/2M) + (δ/2M)/9] − δ (for δ < 2M; else M),
  which refines Young's √(2δM) (CACM 1974).
- ``spares``: the same with hot spare hosts, so a restart skips waiting for a replacement: R = restart_s −
  replace_s.
- ``elastic``: survivors shrink the group and go on from the state they hold (no rollback, no checkpoint needed for
  the failures it survives). A failure costs ``elastic_recovery_s`` (the runtime's shrink, measured and moved to
  the job's size by :class:`~allreduce.plan.RecoveryModel`, or given) and the progress of the step in flight; up
  periods are exponential, so with step time t::

      goodput_pause = E[work in an up period] / E[up period + recovery]
                    = (t · e^(−λt) / (1 − e^(−λt))) / (1/λ + elastic_recovery_s)

  and while a failed host is repaired (``repair_s``) the job runs without its GPUs. A software failure ends a
  process, not a host, and needs no repair, so only the hardware failures λ_hw (all but software) take hosts out:
  by Little's law the mean number out is λ_hw · repair_s, and the mean capacity is 1 − λ_hw · repair_s ·
  gpus_per_host / gpus (exact for the mean; the global batch is kept, so throughput scales with the GPUs that
  remain).

Goodput = useful time / wall time; the effective step time is step time / goodput. :func:`simulate_restarts` and
:func:`simulate_elastic` replay the same processes failure by failure (seeded), the check on the closed forms.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from allreduce.plan._recovery import ElasticRecovery, RecoveryModel
from allreduce.topology import NVLINK_BANDWIDTH_BPS, NodeKind, Topology

__all__ = [
    "LLAMA3_RATES",
    "POLICIES",
    "RATE_NAMES",
    "STORAGE_BPS",
    "Checkpointing",
    "FailureRates",
    "FailureSettings",
    "Fleet",
    "GoodputPlan",
    "GoodputRow",
    "Network",
    "checkpoint_bytes",
    "daly_interval",
    "elastic_goodput",
    "expected_lost_s",
    "fleet_of",
    "goodput_plan",
    "goodput_table",
    "rates_with",
    "restart_goodput",
    "simulate_elastic",
    "simulate_restarts",
    "young_interval",
]

_LLAMA3_HOURS = 54 * 24.0
_LLAMA3_GPUS = 16_384
_LLAMA3_HOSTS = _LLAMA3_GPUS // 8
_LLAMA3_CABLES = 3 * _LLAMA3_GPUS

POLICIES = ("restart", "spares", "elastic")
"""Recovery policies compared by :func:`goodput_table`."""

BYTES_PER_PARAMETER = 14
"""What a mixed-precision Adam checkpoint holds per parameter: bf16 weights (2), fp32 master weights (4) and
Adam's two fp32 moments (8)."""


@dataclass(frozen=True)
class FailureRates:
    """Failures per component-hour of each kind of part a job uses."""

    gpu_per_h: float
    host_per_h: float
    nic_per_h: float
    cable_per_h: float
    switch_per_h: float
    software_per_gpu_per_h: float
    source: str = "given"

    def __post_init__(self) -> None:
        for name in ("gpu_per_h", "host_per_h", "nic_per_h", "cable_per_h", "switch_per_h", "software_per_gpu_per_h"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value <= 1.0):
                raise ValueError(f"failure rate {name} must be a number of failures per hour in [0, 1], got {value}")


RATE_NAMES = {
    "gpu": "gpu_per_h",
    "host": "host_per_h",
    "nic": "nic_per_h",
    "cable": "cable_per_h",
    "switch": "switch_per_h",
    "software": "software_per_gpu_per_h",
}
"""The parts a job's failure rate sums over, and the :class:`FailureRates` field of each (per part-hour)."""


def rates_with(base: FailureRates, text: str) -> FailureRates:
    """``base`` with the parts ``text`` names set (``gpu=2e-5,switch=1e-6``: failures per part-hour), its source
    saying which were given."""
    given: dict[str, float] = {}
    for item in text.split(","):
        part, sep, value = item.strip().partition("=")
        if not sep or part not in RATE_NAMES:
            raise ValueError(
                f"{item.strip()!r}: write PART=RATE with PART one of {', '.join(RATE_NAMES)} (failures per part-hour)"
            )
        if part in given:
            raise ValueError(f"{part} is given twice")
        try:
            given[part] = float(value)
        except ValueError:
            raise ValueError(f"{part}={value!r}: the rate must be a number of failures per part-hour") from None
    fields = {RATE_NAMES[part]: rate for part, rate in given.items()}
    named = ", ".join(f"{part} {rate:.3g}" for part, rate in given.items())
    return dataclasses.replace(base, **fields, source=f"given: {named} per part-hour; the rest {base.source}")


LLAMA3_RATES = FailureRates(
    gpu_per_h=268 / (_LLAMA3_HOURS * _LLAMA3_GPUS),
    host_per_h=46 / (_LLAMA3_HOURS * _LLAMA3_HOSTS),
    nic_per_h=7 / (_LLAMA3_HOURS * _LLAMA3_GPUS),
    cable_per_h=35 / (_LLAMA3_HOURS * _LLAMA3_CABLES),
    switch_per_h=0.0,
    software_per_gpu_per_h=63 / (_LLAMA3_HOURS * _LLAMA3_GPUS),
    source="Llama 3 report, table 5 (419 interruptions, 16,384 GPUs, 54 days)",
)
"""Per-component rates from the Llama 3 report's root causes (see the module docstring for the attribution)."""


@dataclass(frozen=True)
class Fleet:
    """The parts one job uses: any of them failing stops it."""

    gpus: int
    gpus_per_host: int = 8
    nics: int | None = None  # default: one per GPU
    cables: int | None = None  # default: three per GPU (a non-blocking three-tier Clos)
    switches: int = 0

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"a fleet needs at least one GPU, got {self.gpus}")
        if self.gpus_per_host < 1:
            raise ValueError(f"gpus per host must be >= 1, got {self.gpus_per_host}")
        for name in ("nics", "cables", "switches"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")

    @property
    def hosts(self) -> int:
        return -(-self.gpus // self.gpus_per_host)

    def counts(self) -> dict[str, int]:
        return {
            "gpu": self.gpus,
            "host": self.hosts,
            "nic": self.gpus if self.nics is None else self.nics,
            "cable": 3 * self.gpus if self.cables is None else self.cables,
            "switch": self.switches,
            "software": self.gpus,
        }

    def failures_per_h(self, rates: FailureRates) -> dict[str, float]:
        """Failures per hour of the job, by kind of part."""
        per_part = {
            "gpu": rates.gpu_per_h,
            "host": rates.host_per_h,
            "nic": rates.nic_per_h,
            "cable": rates.cable_per_h,
            "switch": rates.switch_per_h,
            "software": rates.software_per_gpu_per_h,
        }
        return {kind: count * per_part[kind] for kind, count in self.counts().items()}

    def mtbf_s(self, rates: FailureRates) -> float:
        """The job's mean time between failures, in seconds (inf when no part can fail)."""
        total = sum(self.failures_per_h(rates).values())
        return math.inf if total == 0 else 3600.0 / total


def checkpoint_bytes(parameters: float, bytes_per_parameter: float = BYTES_PER_PARAMETER) -> float:
    """Bytes of a model-and-optimizer checkpoint."""
    if not (math.isfinite(parameters) and parameters > 0):
        raise ValueError(f"parameters must be a finite number > 0, got {parameters}")
    return parameters * bytes_per_parameter


@dataclass(frozen=True)
class Checkpointing:
    """How the job checkpoints and recovers (seconds). Defaults other than ``write_s`` are assumptions, stated as
    such wherever they are printed: set them from your own cluster."""

    write_s: float
    elastic_recovery_s: float  # shrink-and-continue's pause per failure (goodput_plan: RecoveryModel's, or given)
    restart_s: float = 600.0  # a failure's detection, rescheduling and checkpoint reload
    replace_s: float = 300.0  # the part of restart_s spent waiting for a replacement host (spares skip it)
    interval_s: float | None = None  # None: Daly's optimum
    repair_s: float = 4 * 3600.0  # how long a failed host stays out of an elastic job
    assumed: tuple[str, ...] = field(default=("restart_s", "replace_s", "repair_s"))

    def __post_init__(self) -> None:
        for name in ("write_s", "restart_s", "replace_s", "elastic_recovery_s", "repair_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value}")
        if self.replace_s > self.restart_s:
            raise ValueError(
                f"replace_s ({self.replace_s:g}) is part of restart_s ({self.restart_s:g}): it cannot exceed it"
            )
        if self.interval_s is not None and not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"interval_s must be a finite number of seconds > 0, got {self.interval_s}")


def young_interval(write_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum checkpoint interval √(2δM)."""
    return math.sqrt(2.0 * write_s * mtbf_s)


def daly_interval(write_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum checkpoint interval (of work between checkpoints)."""
    if math.isinf(mtbf_s):
        return math.inf
    if write_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = write_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * write_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - write_s


def restart_goodput(interval_s: float, write_s: float, restart_s: float, mtbf_s: float) -> float:
    """Work / wall time of the checkpoint-restart process (Daly's complete model, exact for exponential failures)."""
    if math.isinf(mtbf_s):
        return interval_s / (interval_s + write_s) if math.isfinite(interval_s) else 1.0
    exponent_restart = restart_s / mtbf_s
    exponent_segment = (interval_s + write_s) / mtbf_s
    if exponent_restart + exponent_segment > 700:  # the job (almost) never completes a segment
        return 0.0
    return interval_s / (mtbf_s * math.exp(exponent_restart) * math.expm1(exponent_segment))


def elastic_goodput(step_s: float, recovery_s: float, mtbf_s: float, capacity: float = 1.0) -> float:
    """Work / wall time of shrink-and-continue: the pause and the lost step (exact), times the mean capacity."""
    if math.isinf(mtbf_s):
        return capacity
    rate = 1.0 / mtbf_s
    if step_s <= 0:
        work = 1.0 / rate
    else:
        x = rate * step_s
        work = step_s * math.exp(-x) / -math.expm1(-x) if x < 700 else 0.0
    return max(0.0, capacity * work / (1.0 / rate + recovery_s))


def expected_lost_s(segment_s: float, mtbf_s: float) -> float:
    """The work a failure throws away: how far into a stretch of ``segment_s`` it struck, given that it struck
    there (exponential failures): E[X | X < T] = M − T·e^(−T/M) / (1 − e^(−T/M)), T/2 when T ≪ M. For a restart
    the stretch is a checkpoint interval and its write; for shrink-and-continue, one step."""
    if math.isinf(mtbf_s) or segment_s <= 0:
        return segment_s / 2 if math.isfinite(segment_s) else math.inf
    x = segment_s / mtbf_s
    if x < 1e-6:  # the series: T/2 − T²/(12M), without the cancellation
        return segment_s / 2 - segment_s * x / 12
    return mtbf_s - segment_s * math.exp(-x) / -math.expm1(-x) if x < 700 else mtbf_s


@dataclass(frozen=True)
class GoodputRow:
    """One recovery policy's outcome."""

    policy: str
    goodput: float
    interval_s: float | None  # checkpoint interval (None: the policy does not roll back)
    restart_s: float
    mtbf_s: float
    lost_s: float = 0.0  # expected work lost per failure (expected_lost_s)

    def effective_step_s(self, step_s: float) -> float:
        return math.inf if self.goodput <= 0 else step_s / self.goodput

    def to_json(self) -> dict[str, float | str | None]:
        return {
            "policy": self.policy,
            "goodput": self.goodput,
            "interval_s": self.interval_s,
            "restart_s": self.restart_s,
            "mtbf_s": self.mtbf_s,
            "lost_work_s": self.lost_s,
        }


def goodput_table(fleet: Fleet, rates: FailureRates, ckpt: Checkpointing, *, step_s: float) -> list[GoodputRow]:
    """Goodput of each policy in :data:`POLICIES` for ``fleet`` (step time ``step_s`` without failures)."""
    mtbf = fleet.mtbf_s(rates)
    rows = []
    for policy, restart in (("restart", ckpt.restart_s), ("spares", ckpt.restart_s - ckpt.replace_s)):
        interval = ckpt.interval_s if ckpt.interval_s is not None else daly_interval(ckpt.write_s, mtbf)
        if math.isinf(interval):
            interval = math.inf
        goodput = restart_goodput(interval, ckpt.write_s, restart, mtbf)
        lost = expected_lost_s(interval + ckpt.write_s, mtbf)
        rows.append(GoodputRow(policy, goodput, interval, restart, mtbf, lost))
    hardware_per_h = sum(rate for kind, rate in fleet.failures_per_h(rates).items() if kind != "software")
    hosts_out = hardware_per_h * ckpt.repair_s / 3600.0
    capacity = max(0.0, 1.0 - hosts_out * fleet.gpus_per_host / fleet.gpus)
    rows.append(
        GoodputRow(
            "elastic",
            elastic_goodput(step_s, ckpt.elastic_recovery_s, mtbf, capacity),
            None,
            ckpt.elastic_recovery_s,
            mtbf,
            expected_lost_s(step_s, mtbf),
        )
    )
    return rows


def simulate_restarts(
    interval_s: float, write_s: float, restart_s: float, mtbf_s: float, *, horizon_s: float, seed: int
) -> tuple[float, float]:
    """Replay checkpoint-restart failure by failure for ``horizon_s`` of wall time: (goodput, its standard error by
    batch means over ten equal slices of the run)."""
    rng = np.random.default_rng(seed)
    segment_s = interval_s + write_s
    done_at: list[float] = []  # when each checkpointed segment of interval_s of work completed
    now = 0.0
    failure = rng.exponential(mtbf_s)
    while now < horizon_s:
        if failure < now + segment_s:  # the segment is lost; restart, failing again if a failure comes first
            now = failure
            failure = now + rng.exponential(mtbf_s)
            while failure < now + restart_s:
                now = failure
                failure = now + rng.exponential(mtbf_s)
            now += restart_s
            continue
        now += segment_s
        done_at.append(now)
    return _batch_means(np.asarray(done_at), np.full(len(done_at), interval_s), horizon_s)


def simulate_elastic(
    step_s: float, recovery_s: float, mtbf_s: float, *, horizon_s: float, seed: int
) -> tuple[float, float]:
    """Replay shrink-and-continue (the pause and the lost step; capacity is not modelled here) for ``horizon_s``:
    (goodput, standard error by batch means)."""
    if step_s <= 0:
        raise ValueError(f"step_s must be > 0, got {step_s}")
    rng = np.random.default_rng(seed)
    ends: list[float] = []
    works: list[float] = []
    now = 0.0
    while now < horizon_s:
        up = rng.exponential(mtbf_s)
        steps = math.floor(up / step_s)
        # the up period's whole steps; the one in flight at the failure is lost
        ends.append(now + steps * step_s)
        works.append(steps * step_s)
        now += up + recovery_s
    return _batch_means(np.asarray(ends), np.asarray(works), horizon_s)


def _batch_means(times: np.ndarray, work: np.ndarray, horizon_s: float, batches: int = 10) -> tuple[float, float]:
    """Useful work per wall second in each of ``batches`` slices of [0, horizon_s): their mean and standard error.
    Work is counted in the slice where it completed (a slice is many failures long, so the split matters little)."""
    keep = times <= horizon_s
    slot = np.minimum((times[keep] / horizon_s * batches).astype(np.int64), batches - 1)
    share = np.bincount(slot, weights=work[keep], minlength=batches) / (horizon_s / batches)
    return float(share.mean()), float(share.std(ddof=1) / math.sqrt(batches))


STORAGE_BPS = 100e9
"""Assumed aggregate checkpoint write bandwidth (bytes/s) when neither a write time nor a bandwidth is given: a
parallel file system or object store written by every host at once. State yours with --storage-gbps."""


@dataclass(frozen=True)
class FailureSettings:
    """What the planner needs to count failures: part rates, hosts, and how the job checkpoints."""

    rates: FailureRates = LLAMA3_RATES
    gpus_per_host: int = 8
    write_s: float | None = None  # None: the checkpoint's bytes at storage_Bps
    storage_Bps: float = STORAGE_BPS
    bytes_per_parameter: float = BYTES_PER_PARAMETER
    restart_s: float = 600.0
    replace_s: float = 300.0
    interval_s: float | None = None
    elastic_recovery_s: float | None = None  # None: the recovery model's, at the job's size
    recovery: RecoveryModel = field(default_factory=RecoveryModel)
    repair_s: float = 4 * 3600.0

    def __post_init__(self) -> None:
        if self.gpus_per_host < 1:
            raise ValueError(f"--gpus-per-host must be >= 1, got {self.gpus_per_host}")
        if not (math.isfinite(self.storage_Bps) and self.storage_Bps > 0):
            raise ValueError(f"--storage-gbps must be a number > 0, got {self.storage_Bps * 8 / 1e9:g}")

    def elastic_recovery(self, gpus: int, failures_per_h: dict[str, float]) -> ElasticRecovery:
        """Shrink-and-continue's pause per failure for ``gpus`` ranks: as given, or the recovery model's."""
        if self.elastic_recovery_s is not None:
            return ElasticRecovery(self.elastic_recovery_s, "given", "--elastic-recovery-s")
        return self.recovery.at(gpus, failures_per_h)

    def checkpointing(self, parameters: float, elastic_recovery_s: float) -> Checkpointing:
        write_s = self.write_s
        if write_s is None:
            write_s = checkpoint_bytes(parameters, self.bytes_per_parameter) / self.storage_Bps
        return Checkpointing(
            write_s=write_s,
            restart_s=self.restart_s,
            replace_s=self.replace_s,
            interval_s=self.interval_s,
            elastic_recovery_s=elastic_recovery_s,
            repair_s=self.repair_s,
        )


@dataclass(frozen=True)
class GoodputPlan:
    """Failures and goodput of one job size: its parts, their failure rates, and each recovery policy."""

    gpus: int
    counts: dict[str, int]
    failures_per_h: dict[str, float]
    mtbf_s: float
    checkpoint: Checkpointing
    rows: tuple[GoodputRow, ...]
    source: str
    recovery: ElasticRecovery

    def row(self, policy: str) -> GoodputRow:
        return next(r for r in self.rows if r.policy == policy)

    def to_json(self) -> dict[str, object]:
        return {
            "gpus": self.gpus,
            "counts": dict(self.counts),
            "failures_per_h": dict(self.failures_per_h),
            "mtbf_s": self.mtbf_s,
            "checkpoint_write_s": self.checkpoint.write_s,
            "restart_s": self.checkpoint.restart_s,
            "rates_source": self.source,
            "assumed": list(self.checkpoint.assumed),
            "policies": [r.to_json() for r in self.rows],
            "elastic_recovery": self.recovery.to_json(),
        }


@dataclass(frozen=True)
class Network:
    """The parts of a whole topology's network that can fail: its GPUs, its cables (links between two nodes that
    are neither GPU-to-NIC, PCIe, nor a GPU's NVLink-class link) and the switches those cables connect."""

    gpus: int
    cables: int
    switches: int

    @classmethod
    def of(cls, topology: Topology) -> Network:
        kind = topology.node_kind
        src, dst = topology.link_src, topology.link_dst
        gpu = int(NodeKind.GPU)
        nic = int(NodeKind.NIC)
        pcie = ((kind[src] == gpu) & (kind[dst] == nic)) | ((kind[src] == nic) & (kind[dst] == gpu))
        nvlink = ((kind[src] == gpu) | (kind[dst] == gpu)) & (topology.link_bandwidth_Bps >= NVLINK_BANDWIDTH_BPS)
        cable = ~pcie & ~nvlink
        network_switches = np.unique(np.concatenate([src[cable], dst[cable]]))
        switches = int(np.count_nonzero(kind[network_switches] == int(NodeKind.SWITCH)))
        # a cable is two directed links
        return cls(topology.num_gpus, int(np.count_nonzero(cable)) // 2, switches)


def fleet_of(network: Network | None, gpus: int, gpus_per_host: int) -> Fleet:
    """The parts a job of ``gpus`` uses: hosts of ``gpus_per_host``, one NIC per GPU, and the network's cables and
    switches in proportion to the GPUs the job takes of it. Without a network, three cables per GPU (a non-blocking
    three-tier Clos) and no switch counted apart."""
    if network is None:
        return Fleet(gpus, gpus_per_host)
    share = min(1.0, gpus / max(1, network.gpus))
    return Fleet(
        gpus,
        gpus_per_host,
        nics=gpus,
        cables=round(network.cables * share),
        switches=round(network.switches * share),
    )


def goodput_plan(
    settings: FailureSettings, *, gpus: int, parameters: float, step_s: float, network: Network | None = None
) -> GoodputPlan:
    """Failures and goodput of ``gpus`` GPUs of ``network`` (see :func:`fleet_of`) training a model of
    ``parameters`` at ``step_s`` per step."""
    fleet = fleet_of(network, gpus, settings.gpus_per_host)
    failures_per_h = fleet.failures_per_h(settings.rates)
    recovery = settings.elastic_recovery(gpus, failures_per_h)
    ckpt = settings.checkpointing(parameters, recovery.seconds)
    rows = tuple(goodput_table(fleet, settings.rates, ckpt, step_s=step_s))
    return GoodputPlan(
        gpus,
        fleet.counts(),
        failures_per_h,
        fleet.mtbf_s(settings.rates),
        ckpt,
        rows,
        settings.rates.source,
        recovery,
    )
