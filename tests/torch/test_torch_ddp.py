"""torch's own DDP on allreduce, two ways: the "allreduce" torch.distributed backend, and the DDP comm hook.

Per world size one set of processes runs: the backend's collectives against closed forms, then 10 training
steps of DDP on the backend and of DDP (Gloo) with allreduce.torch.comm_hook on an allreduce shm group, each
compared with single-process training on the global batch, ranks bitwise identical after every step.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

import torch
from allreduce.runtime.launcher._spawn import spawn
from torch import nn

STEPS = 10
BATCH = 4
FEATURES = 10
CLASSES = 4


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


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def train_ddp(ddp: nn.Module, model: nn.Module, rank: int, world_size: int) -> dict[str, Any]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = dataset(world_size)
    digests = []
    for step in range(STEPS):
        start = step * world_size * BATCH + rank * BATCH
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x[start : start + BATCH]), y[start : start + BATCH]).backward()
        optimizer.step()
        digests.append(digest(model))
    return {"digests": digests, "params": {k: v.clone() for k, v in model.state_dict().items()}}


def _collectives(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    x = torch.arange(6, dtype=torch.int64) + 10 * rank
    dist.all_reduce(x)
    out["sum"] = x
    f = torch.full((5,), float(rank + 1))
    dist.all_reduce(f, op=dist.ReduceOp.AVG)
    out["avg"] = f
    m = torch.tensor([rank, -rank], dtype=torch.int32)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    out["max"] = m
    b = torch.full((3, 2), float(rank))
    dist.broadcast(b, src=world_size - 1)
    out["broadcast"] = b
    gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([rank, rank * rank]))
    out["all_gather"] = torch.stack(gathered)
    single = torch.zeros(2 * world_size, dtype=torch.int64)
    dist.all_gather_single(single, torch.tensor([rank, rank + 100]))
    out["all_gather_single"] = single
    rs = torch.zeros(3, dtype=torch.int64)
    dist.reduce_scatter(rs, [torch.full((3,), r + rank, dtype=torch.int64) for r in range(world_size)])
    out["reduce_scatter"] = rs
    rs_single = torch.zeros(2, dtype=torch.int64)
    dist.reduce_scatter_single(rs_single, torch.arange(2 * world_size, dtype=torch.int64) * (rank + 1))
    out["reduce_scatter_single"] = rs_single
    dist.barrier()
    try:
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)
    except ValueError as exc:
        out["bad op"] = str(exc)
    return out


def _worker() -> dict[str, Any]:
    import os

    import torch.distributed as dist

    import allreduce.torch
    from allreduce.runtime import init

    dist.init_process_group("allreduce", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"backend": dist.get_backend(), "collectives": _collectives(rank, world_size)}

    # torch's DDP, unchanged, on the allreduce backend. Ranks start different: DDP's broadcast fixes that.
    model = make_model(seed=200 + rank)
    out["ddp on backend"] = train_ddp(nn.parallel.DistributedDataParallel(model), model, rank, world_size)

    # torch's DDP on Gloo, its buckets averaged by allreduce's shared-memory group through the comm hook.
    gloo = dist.new_group(backend="gloo")
    # MASTER_PORT is torch's store: allreduce's rank 0 publishes a port of its own there, as under torchrun.
    torch_store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    with init(timeout_s=120, rendezvous_store=torch_store) as group:
        model = make_model(seed=200 + rank)
        ddp = nn.parallel.DistributedDataParallel(model, process_group=gloo, bucket_cap_mb=0.001)
        ddp.register_comm_hook(group, allreduce.torch.comm_hook)
        out["ddp with comm hook"] = train_ddp(ddp, model, rank, world_size)
    dist.destroy_process_group()
    return out


def reference(world_size: int) -> dict[str, torch.Tensor]:
    model = make_model(seed=200)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = dataset(world_size)
    for step in range(STEPS):
        window = slice(step * world_size * BATCH, (step + 1) * world_size * BATCH)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[window]), y[window]).backward()
        optimizer.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def expected_collectives(rank: int, n: int) -> dict[str, torch.Tensor]:
    ranks = torch.arange(n)
    return {
        "sum": torch.arange(6, dtype=torch.int64) * n + 10 * int(ranks.sum()),
        "avg": torch.full((5,), (n + 1) / 2),
        "max": torch.tensor([n - 1, 0], dtype=torch.int32),
        "broadcast": torch.full((3, 2), float(n - 1)),
        "all_gather": torch.stack([ranks, ranks * ranks], dim=1),
        "all_gather_single": torch.stack([ranks, ranks + 100], dim=1).reshape(-1),
        "reduce_scatter": torch.full((3,), n * rank + int(ranks.sum()), dtype=torch.int64),
        "reduce_scatter_single": torch.tensor([2 * rank, 2 * rank + 1]) * int((ranks + 1).sum()),
    }


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ddp_on_the_allreduce_backend_and_with_the_comm_hook_matches_single_process(world_size: int) -> None:
    per_rank = spawn(world_size, _worker, group=False, timeout_s=280, env={"OMP_NUM_THREADS": "1"})
    expected_params = reference(world_size)
    for rank, out in enumerate(per_rank):
        assert out["backend"] == "allreduce"
        got = out["collectives"]
        for name, value in expected_collectives(rank, world_size).items():
            assert torch.equal(got[name], value), f"rank {rank}: {name}: {got[name]} != {value}"
        assert "BAND is defined for integer and bool tensors" in got["bad op"]
        for case in ("ddp on backend", "ddp with comm hook"):
            assert out[case]["digests"] == per_rank[0][case]["digests"], f"{case}: rank {rank} diverged"
            for key, value in expected_params.items():
                torch.testing.assert_close(out[case]["params"][key], value, rtol=1e-4, atol=1e-5)
