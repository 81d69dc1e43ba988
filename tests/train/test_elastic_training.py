"""Training goes on after a rank dies: DataParallel's survivors shrink the group, regroup their buckets, re-run the
failed step on the data re-sharded over them (keeping the global batch) and stay identical replicas.

The ranks run under spawn_elastic (a rank's death does not stop the others), one SIGKILLed in the middle of
training.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from typing import Any

import pytest

pytest.importorskip("torch")

from allreduce.runtime import Departure, spawn_elastic

GLOBAL_BATCH = 48
STEPS = 8
KILL_AT = 3


def _train(victim: int, files: dict[str, str], kill_at: int, mid_call: bool, transport: str) -> dict[str, Any]:
    """Train STEPS steps of GLOBAL_BATCH samples; ``victim`` SIGKILLs itself before step ``kill_at`` (``mid_call``:
    at the start of the last step of the ring all-reduce of step ``kill_at``'s last bucket). Rank 0 saves the state
    it starts step KILL_AT with to ``files["checkpoint"]``; with ``files["resume"]`` every rank starts there from
    that state."""
    rank = int(os.environ["RANK"])
    checkpoint, resume = files.get("checkpoint"), files.get("resume")
    import allreduce
    import torch
    from allreduce.runtime.transport._inject import parse_injection
    from allreduce.train import DataParallel, sync_state
    from allreduce.train._digits import load_digits, make_mlp

    torch.set_num_threads(1)
    group = allreduce.init(transport=transport, timeout_s=60)
    data = load_digits(seed=0)
    net = make_mlp((32,), seed=rank)
    state = torch.load(resume) if resume else None
    if state is not None:
        net.load_state_dict(state["model"])
    model = DataParallel(net, group, bucket_size_mb=0.01, algorithm="ring")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    loss_fn = torch.nn.CrossEntropyLoss()
    report: dict[str, Any] = {"rank": rank, "errors": [], "losses": []}
    if mid_call and rank == victim:  # counted from here: one all-reduce per bucket and step, 2(N-1) ring steps each
        last_bucket = (kill_at + 1) * model.num_buckets - 1
        spec = f"kill:rank={rank}:call={last_bucket}:step={2 * (group.world_size - 1) - 1}"
        group.transport.injection = parse_injection(spec, rank, group.world_size)
    step = KILL_AT if resume else 0
    while step < STEPS:
        if step == KILL_AT and rank == 0 and checkpoint and not report["errors"]:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint)
        per_rank = GLOBAL_BATCH // group.world_size  # the global batch is kept: each survivor takes more
        start = step * GLOBAL_BATCH + group.rank * per_rank
        idx = torch.arange(start, start + per_rank) % len(data.train_y)
        if step == kill_at and rank == victim and not mid_call:
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(data.train_x[idx]), data.train_y[idx])
        try:
            loss.backward()
        except allreduce.CollectiveError as exc:
            report["errors"].append((step, type(exc).__name__, exc.peer))
            group = group.shrink()
            model.regroup(group)  # after a split by one call: the parameters of the first rank ahead
            if group.ahead_ranks:  # which may have finished this step: then so has this rank, with its update
                finished = sync_state(group, model, optimizer, {"step": step})["step"]
                if finished != step:
                    report["losses"].append(float(loss.item()))
                    step = finished
            continue  # the step the ranks ahead failed, or this one, again on the survivors
        optimizer.step()
        report["losses"].append(float(loss.item()))
        step += 1
    digest = hashlib.sha256()
    for p in model.module.parameters():
        digest.update(p.detach().numpy().tobytes())
    report["params"] = digest.hexdigest()
    report["world_size"] = group.world_size
    group.close()
    return report


def _run(
    world_size: int, victim: int, kill_at: int = KILL_AT, *, mid_call: bool = False, transport: str = "shm",
    **files: str,
) -> tuple[list[dict[str, Any]], list[Departure]]:  # fmt: skip
    """Run :func:`_train` on ``world_size`` ranks: the reports of those that finish, and the rank that died."""
    dies = 0 <= victim < world_size
    outcome = spawn_elastic(
        world_size, _train, victim, files, kill_at, mid_call, transport, min_ranks=world_size - dies, timeout_s=240
    )
    return list(outcome.results.values()), outcome.departures


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[Departure], str]:
    """4 ranks, rank 2 SIGKILLed before step KILL_AT (rank 0 saved the state it started that step with): the
    survivors' reports, the departures and the checkpoint's path. One run for the tests that read it."""
    checkpoint = str(tmp_path_factory.mktemp("killed") / "state.pt")
    reports, departures = _run(4, 2, checkpoint=checkpoint)
    return reports, departures, checkpoint


@pytest.mark.slow
def test_survivors_of_a_killed_rank_keep_training_as_identical_replicas(
    killed: tuple[list[dict[str, Any]], list[Departure], str],
) -> None:
    victim = 2
    reports, departures, _ = killed
    assert [(d.rank, d.how) for d in departures] == [(victim, "was killed by SIGKILL")]
    assert sorted(r["rank"] for r in reports) == [0, 1, 3]
    for r in reports:
        assert r["errors"] == [(KILL_AT, "PeerFailureError", victim)], r
        assert r["world_size"] == 3
        assert len(r["losses"]) == STEPS
    assert len({r["params"] for r in reports}) == 1  # replicas, bit for bit
    assert len({tuple(r["losses"][:KILL_AT]) for r in reports}) == 3  # before: each rank its own shard


@pytest.mark.slow
def test_the_survivors_end_where_a_fresh_group_of_their_size_started_from_the_same_state_ends(
    killed: tuple[list[dict[str, Any]], list[Departure], str],
) -> None:
    """Shrinking is invisible in the result: 3 survivors of 4 that re-run step KILL_AT end bit for bit where 3 fresh
    ranks end when they start at step KILL_AT from the state the 4 had then (same global batches, same sums)."""
    survivors, _, checkpoint = killed
    fresh, _ = _run(3, -1, resume=checkpoint)
    assert len({r["params"] for r in survivors}) == 1
    assert {r["params"] for r in fresh} == {survivors[0]["params"]}


REJOIN_AT = 5


def _rejoining() -> dict[str, Any]:
    """A member of 4 (rank 2 dies before step KILL_AT, the others shrink); from step REJOIN_AT the members call
    grow() until the restarted rank 2 is back, move the model over and hand it the optimizer state and the step."""
    rank = int(os.environ["RANK"])
    import allreduce
    import torch
    from allreduce.train import DataParallel, sync_state
    from allreduce.train._digits import load_digits, make_mlp

    torch.set_num_threads(1)
    group = allreduce.init(transport="shm", timeout_s=60)
    joining = os.environ.get("ALLREDUCE_JOIN") == "1"
    data = load_digits(seed=0)
    model = DataParallel(make_mlp((32,), seed=rank), group, bucket_size_mb=0.01)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn = torch.nn.CrossEntropyLoss()
    step, sizes = 0, []
    if joining:
        step = sync_state(group, model, optimizer)["step"]
    while step < STEPS:
        if step >= REJOIN_AT and group.world_size < 4 and not joining:
            grown = group.grow()
            if grown is group:
                time.sleep(0.01)
                continue
            group = grown
            model.regroup(group, joined=True)
            sync_state(group, model, optimizer, {"step": step})
        if step == KILL_AT and rank == 2 and not joining:
            os.kill(os.getpid(), signal.SIGKILL)
        per_rank = GLOBAL_BATCH // group.world_size
        start = step * GLOBAL_BATCH + group.rank * per_rank
        idx = torch.arange(start, start + per_rank) % len(data.train_y)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(data.train_x[idx]), data.train_y[idx])
        try:
            loss.backward()
        except allreduce.CollectiveError:
            group = group.shrink()
            model.regroup(group)
            continue
        optimizer.step()
        sizes.append(group.world_size)
        step += 1
    digest = hashlib.sha256()
    for p in model.module.parameters():
        digest.update(p.detach().numpy().tobytes())
    for p in model.parameters():
        for _, value in sorted(optimizer.state[p].items()):
            digest.update(value.detach().numpy().tobytes())
    group.close()
    return {"rank": rank, "joined": joining, "sizes": sizes, "state": digest.hexdigest()}


@pytest.mark.slow
def test_a_restarted_rank_rejoins_training_with_the_model_and_optimizer_state_of_the_others() -> None:
    outcome = spawn_elastic(4, _rejoining, min_ranks=3, max_restarts=1, timeout_s=240)
    assert [(d.rank, d.how, d.restarted) for d in outcome.departures] == [(2, "was killed by SIGKILL", True)]
    reports = list(outcome.results.values())  # rank 2's is its restart's
    assert sorted((r["rank"], r["joined"]) for r in reports) == [(0, False), (1, False), (2, True), (3, False)]
    members = [r for r in reports if not r["joined"]]
    for r in members:  # 4 ranks, 3 after the death, 4 again from step REJOIN_AT
        assert r["sizes"] == [4] * KILL_AT + [3] * (REJOIN_AT - KILL_AT) + [4] * (STEPS - REJOIN_AT)
    assert next(r for r in reports if r["joined"])["sizes"] == [4] * (STEPS - REJOIN_AT)
    assert len({r["state"] for r in reports}) == 1  # parameters and optimizer state, bit for bit


@pytest.fixture(scope="module")
def after_the_step() -> list[dict[str, Any]]:
    """The survivors' reports when rank 3 of 4 dies before step KILL_AT + 1, over shm (the ring sums in the same
    order over tcp: both transports' split runs end here)."""
    return _run(4, 3, KILL_AT + 1, transport="shm")[0]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_death_that_splits_the_survivors_by_one_call_leaves_them_where_a_death_after_that_step_does(
    transport: str, after_the_step: list[dict[str, Any]]
) -> None:
    """Rank 3 dies at the last ring step of step KILL_AT's last bucket: rank 1 finishes that step (and applies it),
    rank 0 raises in it (rank 2 finished it with these buckets over shm, where with 64 KiB calls it raised). After the
    shrink they take rank 1's parameters, optimizer state and step, and all three end bit for bit where the
    survivors of a death before step KILL_AT + 1 end."""
    split, _ = _run(4, 3, KILL_AT, mid_call=True, transport=transport)
    after = after_the_step
    errors = {r["rank"]: r["errors"] for r in split}
    assert errors[0] == [(KILL_AT, "PeerFailureError", 3)]  # the victim's successor waits on it at that step
    assert errors[1] == [(KILL_AT + 1, "PeerFailureError", 3)]  # it had all it needed from ranks 0 and 2
    assert errors[2] in ([(KILL_AT, "PeerFailureError", 3)], [(KILL_AT + 1, "PeerFailureError", 3)])
    assert all(len(r["losses"]) == STEPS for r in split)
    assert {r["params"] for r in split} == {r["params"] for r in after}
    assert len({r["params"] for r in after}) == 1
