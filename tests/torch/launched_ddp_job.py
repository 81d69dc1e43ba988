"""A DDP job for the launcher tests, run unchanged under torchrun, under `allreduce run` and by hand.

Every rank joins torch.distributed on the "allreduce" backend (``init_method`` from the environment), runs
collectives, trains DDP on that backend, then DDP on Gloo whose buckets go through ``allreduce.torch.comm_hook``
on an "allreduce" subgroup; it records which thread called the backend and the hook, and saves everything to
``<argv[1]>/rank-<r>.pt``. The test module imports the model and the data from here for its reference.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations as objects (dist.GradBucket).
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

import torch
from torch import nn

STEPS = 4
BATCH = 4
FEATURES = 10
CLASSES = 4
LEARNING_RATE = 0.05
MOMENTUM = 0.9
# Rank r starts from seed MODEL_SEED + r: DDP's broadcast from rank 0 must make them equal before training.
MODEL_SEED = 200
# A small bucket cap (MiB) so the model's gradients travel in several buckets, several collectives per step.
BUCKET_CAP_MB = 0.001


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 24), nn.Tanh(), nn.Linear(24, CLASSES))


def dataset(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(7 + world_size)
    n = STEPS * world_size * BATCH
    return (
        torch.from_numpy(rng.standard_normal((n, FEATURES)).astype(np.float32)),
        torch.from_numpy(rng.integers(0, CLASSES, n)),
    )


def shard(step: int, rank: int, world_size: int) -> slice:
    start = (step * world_size + rank) * BATCH
    return slice(start, start + BATCH)


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)


class ThreadLog:
    """Which thread made each call: the main thread, or another one (named)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def record(self, what: str) -> None:
        current = threading.current_thread()
        where = "main" if current is threading.main_thread() else current.name
        with self._lock:
            self.calls.append((what, where))


def _watch_backend(log: ThreadLog) -> None:
    """Log the thread of every call torch makes into the allreduce backend (installed before any backend exists)."""
    from allreduce.torch._backend import _AllreduceBackend

    for name in ("allreduce", "broadcast", "allgather", "_allgather_base", "all_gather_single", "barrier"):
        original = getattr(_AllreduceBackend, name)

        def watched(self: Any, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            log.record(f"backend.{_name}")
            return _original(self, *args, **kwargs)

        setattr(_AllreduceBackend, name, watched)


def _train(ddp: nn.Module, model: nn.Module, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    optimizer = optimizer_for(model)
    x, y = dataset(world_size)
    for step in range(STEPS):
        window = shard(step, rank, world_size)
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x[window]), y[window]).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(out_dir: Path) -> None:
    import allreduce.torch

    log = ThreadLog()
    _watch_backend(log)
    dist.init_process_group("allreduce")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"rank": rank, "world_size": world_size, "backend": dist.get_backend()}

    summed = torch.arange(6, dtype=torch.int64) * (rank + 1)
    dist.all_reduce(summed)
    out["all_reduce"] = summed
    root = world_size - 1
    broadcast = torch.full((3,), float(rank))
    dist.broadcast(broadcast, src=root)
    out["broadcast"] = broadcast

    model = make_model(MODEL_SEED + rank)
    backend_ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    out["ddp on the backend"] = _train(backend_ddp, model, rank, world_size)

    gloo = dist.new_group(backend="gloo")
    hook_group = dist.new_group(backend="allreduce")
    out["hook group type"] = type(hook_group).__name__

    def watched_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        log.record("comm_hook")
        future = allreduce.torch.comm_hook(state, bucket)
        future.add_done_callback(lambda _: log.record("comm_hook future completed"))
        return future

    model = make_model(MODEL_SEED + rank)
    hooked_ddp = nn.parallel.DistributedDataParallel(model, process_group=gloo, bucket_cap_mb=BUCKET_CAP_MB)
    hooked_ddp.register_comm_hook(hook_group, watched_hook)
    out["ddp with the comm hook"] = _train(hooked_ddp, model, rank, world_size)

    dist.barrier()
    out["threads"] = sorted(set(log.calls))
    dist.destroy_process_group()
    torch.save(out, out_dir / f"rank-{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
