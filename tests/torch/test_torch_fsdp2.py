"""FSDP2, DeviceMesh and DTensor on the "allreduce" backend, bitwise against the same on Gloo.

Two ranks train one model with ``fully_shard`` (per layer and at the root) over a DeviceMesh of the backend's
default group (``init_device_mesh("cpu", ...)``) and over one of a Gloo group, from the same start and data; the
parameters must be equal bit for bit after every step. DTensor's redistributions and ``destroy_process_group``
of a subgroup run too.
"""

from __future__ import annotations

from typing import Any

import pytest

import torch
from allreduce.runtime.launcher._spawn import spawn

STEPS = 4


def _train(mesh: Any, rank: int) -> list[list[float]]:
    from torch.distributed.fsdp import fully_shard

    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    history = []
    for _ in range(STEPS):
        nn.functional.mse_loss(model(torch.randn(6, 8, generator=data)), torch.zeros(6, 4)).backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append(torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]).tolist())
    return history


def _worker() -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import allreduce.torch  # noqa: F401

    dist.init_process_group("allreduce")
    rank = dist.get_rank()
    out: dict[str, Any] = {"group name": dist.group.WORLD.group_name}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gloo_mesh = DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")
    out["fsdp2 allreduce"] = _train(mesh, rank)
    out["fsdp2 gloo"] = _train(gloo_mesh, rank)

    sharded = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    out["shard to replicate"] = sharded.redistribute(mesh, [Replicate()]).to_local().tolist()
    partial = DTensor.from_local(torch.full((2,), float(rank + 1)), mesh, [Partial()])
    out["partial to replicate"] = partial.redistribute(mesh, [Replicate()]).to_local().tolist()
    out["partial to shard"] = (
        (DTensor.from_local(torch.arange(4.0) * (rank + 1), mesh, [Partial()]).redistribute(mesh, [Shard(0)]))
        .to_local()
        .tolist()
    )

    sub = dist.new_group(backend="allreduce")
    dist.all_reduce(torch.ones(1), group=sub)
    dist.destroy_process_group(sub)
    out["subgroup destroyed"] = sub not in dist.distributed_c10d._world.pg_map
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return spawn(2, _worker, group=False, timeout_s=240, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_fsdp2_on_the_backend_trains_bitwise_like_gloo(per_rank: list[dict[str, Any]]) -> None:
    for out in per_rank:
        assert out["group name"]
        assert out["fsdp2 allreduce"] == out["fsdp2 gloo"]
    assert per_rank[0]["fsdp2 allreduce"] == per_rank[1]["fsdp2 allreduce"]


@pytest.mark.slow
def test_dtensor_redistributes_over_the_backend(per_rank: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(per_rank):
        assert out["shard to replicate"] == [float(i) for i in range(8)]
        assert out["partial to replicate"] == [3.0, 3.0]
        assert out["partial to shard"] == [3.0 * i for i in range(4)][2 * rank : 2 * rank + 2]


@pytest.mark.slow
def test_a_subgroup_is_destroyed(per_rank: list[dict[str, Any]]) -> None:
    assert all(out["subgroup destroyed"] for out in per_rank)
