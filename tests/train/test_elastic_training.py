"""Training goes on after a rank dies: DataParallel's survivors shrink the group, regroup their buckets, re-run the
failed step on the data re-sharded over them (keeping the global batch) and stay identical replicas.

Plain processes with the rendezvous variables, one SIGKILLed in the middle of training.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
from typing import Any

import pytest

pytest.importorskip("torch")

from allreduce.runtime._spawn import new_token, rank_environment, reserve_port

GLOBAL_BATCH = 48
STEPS = 8
KILL_AT = 3


def _train(rank: int, env: dict[str, str], victim: int, out: Any, files: dict[str, str]) -> None:
    """Train STEPS steps of GLOBAL_BATCH samples; ``victim`` SIGKILLs itself before step KILL_AT. Rank 0 saves the
    state it starts step KILL_AT with to ``files["checkpoint"]``; with ``files["resume"]`` every rank starts there
    from that state."""
    os.environ.update(env)
    checkpoint, resume = files.get("checkpoint"), files.get("resume")
    import allreduce
    import torch
    from allreduce.train import DataParallel
    from allreduce.train._digits import load_digits, make_mlp

    torch.set_num_threads(1)
    group = allreduce.init(transport="shm", timeout_s=60)
    data = load_digits(seed=0)
    net = make_mlp((32,), seed=rank)
    state = torch.load(resume) if resume else None
    if state is not None:
        net.load_state_dict(state["model"])
    model = DataParallel(net, group, bucket_size_mb=0.01)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    loss_fn = torch.nn.CrossEntropyLoss()
    report: dict[str, Any] = {"rank": rank, "errors": [], "losses": []}
    step = KILL_AT if resume else 0
    while step < STEPS:
        if step == KILL_AT and rank == 0 and checkpoint and not report["errors"]:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint)
        per_rank = GLOBAL_BATCH // group.world_size  # the global batch is kept: each survivor takes more
        start = step * GLOBAL_BATCH + group.rank * per_rank
        idx = torch.arange(start, start + per_rank) % len(data.train_y)
        if step == KILL_AT and rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(data.train_x[idx]), data.train_y[idx])
        try:
            loss.backward()
        except allreduce.CollectiveError as exc:
            report["errors"].append((step, type(exc).__name__, exc.peer))
            group = group.shrink()
            model.regroup(group)
            continue  # the same step again, on the survivors
        optimizer.step()
        report["losses"].append(float(loss.item()))
        step += 1
    digest = hashlib.sha256()
    for p in model.module.parameters():
        digest.update(p.detach().numpy().tobytes())
    report["params"] = digest.hexdigest()
    report["world_size"] = group.world_size
    group.close()
    out.put(report)


def _run(world_size: int, victim: int, **files: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """Start ``world_size`` plain processes running :func:`_train`; the reports of those that finish."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    reservation = reserve_port()
    port, token = int(reservation.getsockname()[1]), new_token()
    procs = [
        ctx.Process(
            target=_train,
            args=(r, rank_environment(r, world_size, master_port=port, token=token), victim, out, files),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    reservation.close()
    try:
        reports = [out.get(timeout=240) for _ in range(world_size - (0 <= victim < world_size))]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return reports, procs


@pytest.mark.slow
def test_survivors_of_a_killed_rank_keep_training_as_identical_replicas() -> None:
    world_size, victim = 4, 2
    reports, procs = _run(world_size, victim)
    assert procs[victim].exitcode == -signal.SIGKILL
    assert sorted(r["rank"] for r in reports) == [0, 1, 3]
    for r in reports:
        assert r["errors"] == [(KILL_AT, "PeerFailureError", victim)], r
        assert r["world_size"] == 3
        assert len(r["losses"]) == STEPS
    assert len({r["params"] for r in reports}) == 1  # replicas, bit for bit
    assert len({tuple(r["losses"][:KILL_AT]) for r in reports}) == 3  # before: each rank its own shard


@pytest.mark.slow
def test_the_survivors_end_where_a_fresh_group_of_their_size_started_from_the_same_state_ends(tmp_path: Any) -> None:
    """Shrinking is invisible in the result: 3 survivors of 4 that re-run step KILL_AT end bit for bit where 3 fresh
    ranks end when they start at step KILL_AT from the state the 4 had then (same global batches, same sums)."""
    checkpoint = str(tmp_path / "state.pt")
    survivors, _ = _run(4, 2, checkpoint=checkpoint)
    fresh, _ = _run(3, -1, resume=checkpoint)
    assert len({r["params"] for r in survivors}) == 1
    assert {r["params"] for r in fresh} == {survivors[0]["params"]}
