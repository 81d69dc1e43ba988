"""A real data-parallel training run and where its step time goes.

Every rank trains the digits MLP on its shard with :class:`DataParallel` and records, per step: the step's wall
time; the communication span (first bucket launched -> all buckets reduced); the exposed part of it (what the
step waited for after backward's last gradient); and the rank's own compute (the step minus the exposed
communication). Ranks return their records to the launching process, which lines the steps up: step k is the
same collective on every rank, so ``max over ranks of compute[k] - own compute[k]`` is how long a rank waited for
the slowest one at step k, and the rank with the most compute is named the slowest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from allreduce.runtime import transport_names

if TYPE_CHECKING:
    from allreduce.runtime import Departure

__all__ = ["TRANSPORTS", "EpochReport", "TrainConfig", "TrainResult", "demo", "format_result", "train", "train_rank"]


# auto and the registered transports: allreduce's own (init()); torch: allreduce schedules over torch.distributed.
TRANSPORTS: tuple[str, ...] = ("auto", *transport_names(), "torch")


@dataclass(frozen=True)
class TrainConfig:
    """One training run. ``batch_size`` is per rank; ``slow_rank`` sleeps ``slow_s`` per step inside compute."""

    world_size: int = 2
    epochs: int = 3
    batch_size: int = 32
    learning_rate: float = 1e-2
    hidden: tuple[int, ...] = (128, 64)
    algorithm: str = "auto"
    transport: str = "auto"
    bucket_size_mb: float = 25.0
    slow_rank: int | None = None
    slow_s: float = 0.0
    kill_rank: int | None = None
    kill_step: int = 0
    seed: int = 0
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for what, value in (("world_size", self.world_size), ("epochs", self.epochs), ("batch size", self.batch_size)):
            if value < 1:
                raise ValueError(f"{what} must be >= 1, got {value}")
        if self.bucket_size_mb <= 0:
            raise ValueError(f"bucket size must be > 0 MB, got {self.bucket_size_mb}")
        if self.slow_rank is not None and not 0 <= self.slow_rank < self.world_size:
            raise ValueError(
                f"slow rank {self.slow_rank} is not a rank of {self.world_size} ranks (0..{self.world_size - 1})"
            )
        known = ("auto", *transport_names(), "torch")  # with the transports registered since import
        if self.transport not in known:
            raise ValueError(f"transport {self.transport!r} is not one of {', '.join(known)}")
        if self.slow_s < 0:
            raise ValueError(f"slow-rank delay must be >= 0 s, got {self.slow_s}")
        if self.kill_rank is not None:
            self._check_kill()

    def _check_kill(self) -> None:
        if self.world_size < 2:
            raise ValueError("killing a rank needs at least 2 ranks (one must survive)")
        if not 0 <= (self.kill_rank or 0) < self.world_size:
            raise ValueError(
                f"kill rank {self.kill_rank} is not a rank of {self.world_size} ranks (0..{self.world_size - 1})"
            )
        if self.kill_rank == 0:
            raise ValueError(
                "rank 0 hosts the group's store: its death is not survivable (see docs/elastic.md); kill another rank"
            )
        if self.transport == "torch":
            raise ValueError("a killed rank is survived on allreduce's own transports (shm, tcp), not on torch")
        if self.kill_step < 0:
            raise ValueError(f"kill step must be >= 0, got {self.kill_step}")

    @property
    def global_batch(self) -> int:
        """Samples per step over all ranks; kept when the group shrinks (each survivor takes a larger shard)."""
        return self.world_size * self.batch_size


@dataclass(frozen=True)
class _RankRecord:
    """What one rank measured: arrays of shape (epochs, steps)."""

    rank: int
    step_s: np.ndarray[Any, Any]
    compute_s: np.ndarray[Any, Any]
    comm_s: np.ndarray[Any, Any]
    exposed_comm_s: np.ndarray[Any, Any]
    loss: np.ndarray[Any, Any]
    accuracy: list[float]
    params_sha256: str
    group: str
    buckets: int
    shrinks: tuple[_Shrink, ...] = ()


@dataclass(frozen=True)
class _Shrink:
    """A survivor's view of one rank's death: the step that failed, and when it went on (``time.monotonic()``)."""

    step: int
    error: str
    peer: int | None
    failed_at: float
    shrink_s: float
    resumed_at: float  # the end of the re-run step
    world_size: int
    shard: int  # this rank's samples per step after the shrink


@dataclass(frozen=True)
class EpochReport:
    epoch: int
    loss: float
    accuracy: float
    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    wait_s: float


@dataclass(frozen=True)
class TrainResult:
    config: TrainConfig
    epochs: list[EpochReport]
    slowest_rank: int
    compute_per_rank_s: list[float]
    steps_per_epoch: int
    buckets: int
    group: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"epochs": [asdict(e) for e in self.epochs], "slowest_rank": self.slowest_rank}
        if "elastic" in self.extra:
            out["elastic"] = self.extra["elastic"]
        return out


def _make_group(config: TrainConfig) -> tuple[Any, Callable[[], None], str]:
    """allreduce's process group on the ranks started by :func:`train` (rendezvous from the environment)."""
    if config.transport != "torch":
        from allreduce.runtime import init

        group = init(transport=config.transport, timeout_s=config.timeout_s)
        return group, group.close, f"allreduce {group.transport_name} transport"
    import datetime

    import torch.distributed as dist

    from allreduce.torch import torch_group

    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=config.timeout_s))
    torch_pg = torch_group(timeout_s=config.timeout_s)

    def close() -> None:
        torch_pg.close()
        dist.destroy_process_group()

    return torch_pg, close, "allreduce schedules over torch.distributed (Gloo isend/irecv)"


def train_rank(config: TrainConfig) -> _RankRecord:
    """One rank's training (run inside a rank process started by :func:`train`).

    With ``config.kill_rank`` set, that rank SIGKILLs itself before global step ``config.kill_step``; the others
    raise in backward (the all-reduce lost a peer), shrink the group, move the buckets to it and run the same step
    again on the same global batch, cut over the survivors (:func:`global_batch_shard`), whose losses are weighted
    by their shard so the averaged gradient is the global batch's mean whatever the shards' sizes.
    """
    import torch
    from allreduce.runtime import CollectiveError
    from allreduce.train._data_parallel import DataParallel
    from allreduce.train._digits import epoch_permutation, global_batch_shard, load_digits, make_mlp
    from allreduce.train._elastic import sync_state
    from torch import nn

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    group, close, group_name = _make_group(config)
    original = group
    try:
        rank = group.rank
        data = load_digits(seed=config.seed)
        model = DataParallel(
            make_mlp(config.hidden, seed=config.seed + rank),  # different on purpose: the broadcast must fix it
            group,
            bucket_size_mb=config.bucket_size_mb,
            algorithm=config.algorithm,
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
        loss_fn = nn.CrossEntropyLoss()
        slow_s = config.slow_s if config.slow_rank == rank else 0.0
        records: dict[str, list[list[float]]] = {k: [] for k in ("step", "compute", "comm", "exposed", "loss")}
        accuracy: list[float] = []
        shrinks: list[_Shrink] = []
        steps = len(data.train_y) // config.global_batch
        for epoch in range(config.epochs):
            perm = epoch_permutation(len(data.train_y), epoch=epoch, seed=config.seed)
            for row in records.values():
                row.append([])
            model.train()
            step = 0
            while step < steps:
                global_step = epoch * steps + step
                idx = global_batch_shard(
                    perm, step=step, global_batch=config.global_batch, rank=group.rank, world_size=group.world_size
                )
                if rank == config.kill_rank and global_step == config.kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)  # the injected failure: no goodbye, as a crash would
                t0 = time.perf_counter()
                if slow_s:
                    time.sleep(slow_s)  # the injected slow worker: extra compute time, not synchronisation
                loss = loss_fn(model(data.train_x[idx]), data.train_y[idx])
                share = len(idx) * group.world_size / config.global_batch
                optimizer.zero_grad(set_to_none=True)
                try:
                    # returns with gradients averaged over the ranks; a shard's mean weighted by its share of the
                    # global batch keeps that average the global batch's mean after a shrink (1.0 before one)
                    (loss if share == 1.0 else loss * share).backward()
                except CollectiveError as exc:
                    if config.kill_rank is None:
                        raise
                    failed_at = time.monotonic()
                    group = group.shrink()
                    model.regroup(group)  # after a split by one call: the parameters of the first rank ahead
                    resumes_at = global_step
                    if group.ahead_ranks:  # which may have finished this step: its optimizer state and step
                        resumes_at = int(sync_state(group, model, optimizer, {"step": global_step})["step"])
                    shrinks.append(
                        _Shrink(
                            step=global_step,
                            error=type(exc).__name__,
                            peer=getattr(exc, "peer", None),
                            failed_at=failed_at,
                            shrink_s=time.monotonic() - failed_at,
                            resumed_at=float("nan"),
                            world_size=group.world_size,
                            shard=0,
                        )
                    )
                    if resumes_at == global_step:
                        continue  # the same step again, on the survivors
                    # the ranks ahead finished this step with every rank's gradients; this rank now holds its update
                    assert resumes_at == global_step + 1, (resumes_at, global_step)
                else:
                    optimizer.step()
                    if shrinks and math.isnan(shrinks[-1].resumed_at):  # the step re-run after a shrink is done
                        shrinks[-1] = dataclasses.replace(shrinks[-1], resumed_at=time.monotonic(), shard=len(idx))
                step_s = time.perf_counter() - t0
                stats = model.last_sync  # None for a step taken from the ranks ahead: its communication not timed
                comm_s, exposed_s = (stats.comm_s, stats.exposed_comm_s) if stats is not None else (0.0, 0.0)
                records["step"][-1].append(step_s)
                records["compute"][-1].append(step_s - exposed_s)
                records["comm"][-1].append(comm_s)
                records["exposed"][-1].append(exposed_s)
                records["loss"][-1].append(float(loss.item()))
                step += 1
            model.eval()
            with torch.no_grad():
                predicted = model(data.test_x).argmax(dim=1)
            accuracy.append(float((predicted == data.test_y).float().mean().item()))
        digest = hashlib.sha256()
        for p in model.module.parameters():
            digest.update(p.detach().numpy().tobytes())
        return _RankRecord(
            rank=rank,
            step_s=np.asarray(records["step"]),
            compute_s=np.asarray(records["compute"]),
            comm_s=np.asarray(records["comm"]),
            exposed_comm_s=np.asarray(records["exposed"]),
            loss=np.asarray(records["loss"]),
            accuracy=accuracy,
            params_sha256=digest.hexdigest(),
            group=group_name,
            buckets=model.num_buckets,
            shrinks=tuple(shrinks),
        )
    finally:
        (close if group is original else group.close)()  # a shrink closed the group it replaced


def summarize(config: TrainConfig, records: list[_RankRecord]) -> TrainResult:
    """Line up the ranks' steps: means over ranks and steps per epoch, wait for the slowest, its name."""
    if len({r.params_sha256 for r in records}) != 1:
        differing = [r.rank for r in records if r.params_sha256 != records[0].params_sha256]
        raise RuntimeError(f"ranks {differing} ended with parameters different from rank 0's: synchronisation failed")
    compute = np.stack([r.compute_s for r in records])  # (ranks, epochs, steps)
    wait = compute.max(axis=0, keepdims=True) - compute
    epochs = [
        EpochReport(
            epoch=e + 1,
            loss=float(np.mean([r.loss[e] for r in records])),
            accuracy=records[0].accuracy[e],
            step_s=float(np.mean([r.step_s[e] for r in records])),
            compute_s=float(compute[:, e].mean()),
            comm_s=float(np.mean([r.comm_s[e] for r in records])),
            exposed_comm_s=float(np.mean([r.exposed_comm_s[e] for r in records])),
            wait_s=float(wait[:, e].mean()),
        )
        for e in range(config.epochs)
    ]
    per_rank = compute.mean(axis=(1, 2))
    return TrainResult(
        config=config,
        epochs=epochs,
        slowest_rank=records[int(per_rank.argmax())].rank,
        compute_per_rank_s=[float(c) for c in per_rank],
        steps_per_epoch=int(compute.shape[2]),
        buckets=records[0].buckets,
        group=records[0].group,
    )


def train(config: TrainConfig) -> TrainResult:
    """Run ``config`` on ``config.world_size`` fresh local processes and summarise where the step time went."""
    from allreduce.runtime import spawn, spawn_elastic
    from allreduce.train._digits import num_train_samples

    # Refuse before starting N processes: every rank needs at least one full batch per epoch.
    num_train = num_train_samples()
    if config.world_size * config.batch_size > num_train:
        raise ValueError(
            f"batch size {config.batch_size} per rank × {config.world_size} ranks exceeds the "
            f"{num_train} training samples"
        )
    steps = num_train // config.global_batch
    if config.kill_rank is None:
        return summarize(config, spawn(config.world_size, train_rank, config, group=False, timeout_s=config.timeout_s))
    if config.kill_step >= config.epochs * steps:
        raise ValueError(
            f"kill step {config.kill_step} is past the run's last step ({config.epochs} epochs × {steps} steps: "
            f"0..{config.epochs * steps - 1})"
        )
    outcome = spawn_elastic(
        config.world_size, train_rank, config, min_ranks=config.world_size - 1, timeout_s=config.timeout_s
    )
    result = summarize(config, list(outcome.results.values()))
    result.extra["elastic"] = _elastic_summary(config, outcome.departures, list(outcome.results.values()))
    return result


def _elastic_summary(config: TrainConfig, departures: list[Departure], records: list[_RankRecord]) -> dict[str, Any]:
    """What the survivors of the killed rank saw: when they raised, how long the shrink took, when they went on."""
    if len(departures) != 1 or any(len(r.shrinks) != 1 for r in records):
        seen = {r.rank: [(s.step, s.error) for s in r.shrinks] for r in records}
        raise RuntimeError(f"expected rank {config.kill_rank} to die once and every survivor to shrink once: {seen}")
    gone = departures[0]
    shrinks = [r.shrinks[0] for r in records]
    return {
        "killed_rank": gone.rank,
        "how": gone.how,
        "step": config.kill_step,
        "failed_step": sorted({s.step for s in shrinks}),
        "errors": sorted({f"{s.error} naming rank {s.peer}" for s in shrinks}),
        "survivors": [r.rank for r in records],
        "raised_after_s": max(s.failed_at for s in shrinks) - gone.at,
        "shrink_s": max(s.shrink_s for s in shrinks),
        "next_step_after_s": max(s.resumed_at for s in shrinks) - gone.at,
        "shards": [s.shard for s in shrinks],
        "global_batch": config.global_batch,
    }


def format_result(result: TrainResult) -> str:
    """The per-epoch table and the slowest rank, as ``allreduce train`` prints them."""
    from allreduce.units import format_seconds

    c = result.config
    lines = [
        f"{c.world_size} ranks × batch {c.batch_size} (global {c.world_size * c.batch_size}), "
        f"{result.steps_per_epoch} steps/epoch, algorithm {c.algorithm}, {result.buckets} gradient bucket(s) "
        f"of ≤ {c.bucket_size_mb:g} MiB; {result.group}",
        "per step, mean over ranks: compute = forward+backward+optimizer, comm = all-reduce in flight,",
        "exposed = comm not hidden behind backward, wait = of that, waiting for the slowest rank",
        "",
        f"{'epoch':>5}  {'loss':>7}  {'accuracy':>8}  {'step':>9}  {'compute':>9}  {'comm':>9}  {'exposed':>9}  "
        f"{'wait':>9}",
    ]
    lines.extend(
        f"{e.epoch:>5}  {e.loss:>7.4f}  {e.accuracy:>8.3f}  {format_seconds(e.step_s):>9}  "
        f"{format_seconds(e.compute_s):>9}  {format_seconds(e.comm_s):>9}  {format_seconds(e.exposed_comm_s):>9}  "
        f"{format_seconds(e.wait_s):>9}"
        for e in result.epochs
    )
    ranks = result.extra.get("elastic", {}).get("survivors") or list(range(len(result.compute_per_rank_s)))
    compute = dict(zip(ranks, result.compute_per_rank_s, strict=True))
    others = [s for r, s in compute.items() if r != result.slowest_rank]
    slowest = compute[result.slowest_rank]
    tail = f" vs {format_seconds(float(np.mean(others)))} on the others" if others else ""
    lines += ["", f"slowest rank: {result.slowest_rank} (compute {format_seconds(slowest)}/step{tail})"]
    if "elastic" in result.extra:
        lines += _format_elastic(result.extra["elastic"], result.steps_per_epoch)
    return "\n".join(lines)


def _format_elastic(e: dict[str, Any], steps_per_epoch: int) -> list[str]:
    from allreduce.units import format_seconds

    step = e["step"]
    survivors = ", ".join(map(str, e["survivors"]))
    shards = "/".join(map(str, e["shards"]))
    return [
        "",
        f"rank {e['killed_rank']} {e['how']} before step {step} (epoch {step // steps_per_epoch + 1}); "
        f"survivors {survivors} went on without it:",
        f"  raised {', '.join(e['errors'])} in step {', '.join(map(str, e['failed_step']))} "
        f"{format_seconds(max(e['raised_after_s'], 0.0))} after the launcher saw the exit",
        f"  shrank to {len(e['survivors'])} ranks in {format_seconds(e['shrink_s'])}, re-ran the step and finished it "
        f"{format_seconds(e['next_step_after_s'])} after the exit",
        f"  global batch {e['global_batch']} kept: {shards} samples per survivor; parameters identical on all "
        f"{len(e['survivors'])}",
    ]


def demo(world_size: int = 2, epochs: int = 1) -> str:
    """A short training run with its breakdown, as text (for ``allreduce demo``)."""
    return format_result(train(TrainConfig(world_size=world_size, epochs=epochs)))
