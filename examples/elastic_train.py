"""Elastic data-parallel training of the digits MLP: survives a rank's death and takes its restart back.

Run it under the launcher in elastic mode; rank 2 SIGKILLs itself before step 5, the others shrink and go on,
the launcher restarts it (ALLREDUCE_JOIN=1), and the members admit it at their next step:

    allreduce run -n 3 --elastic --max-restarts 1 -- python examples/elastic_train.py --kill-rank 2@5

Every rank prints one line per change of the group and, at the end, a digest of its parameters and optimizer
state: the same on every rank (they are replicas).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time

import allreduce
import torch
from allreduce.train import DataParallel, epoch_permutation, global_batch_shard, load_digits, make_mlp, sync_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="global steps to train (default 12)")
    parser.add_argument("--global-batch", type=int, default=96, help="samples per step over all ranks (default 96)")
    parser.add_argument("--kill-rank", metavar="R@STEP", help="rank R SIGKILLs itself before STEP (first run only)")
    parser.add_argument(
        "--rejoin-wait",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="after a shrink, wait up to this long at the next step for a restarted rank to rejoin (default 30)",
    )
    args = parser.parse_args()
    victim, kill_at = (int(x) for x in args.kill_rank.split("@")) if args.kill_rank else (-1, -1)

    torch.set_num_threads(1)
    joining = os.environ.get("ALLREDUCE_JOIN") == "1"
    group = allreduce.init(timeout_s=60)
    me = int(os.environ["RANK"])  # the seat: kept across restarts, unlike group.rank
    data = load_digits(seed=0)
    model = DataParallel(make_mlp((64,), seed=me), group)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn = torch.nn.CrossEntropyLoss()
    perm = epoch_permutation(len(data.train_y), epoch=0)
    steps_per_pass = len(perm) // args.global_batch
    step = sync_state(group, model, optimizer)["step"] if joining else 0
    if joining:
        print(f"joined at step {step} as rank {group.rank} of {group.world_size}")
    full, shrunk_at = group.world_size, None
    while step < args.steps:
        grown = group.grow()  # a step boundary: admit whoever asked to join
        if grown is group and shrunk_at is not None and time.monotonic() - shrunk_at < args.rejoin_wait:
            time.sleep(0.05)  # a replacement is on its way (the launcher restarts failed ranks): wait for it
            continue
        if grown is not group:
            group = grown
            model.regroup(group, joined=True)
            sync_state(group, model, optimizer, {"step": step})
            print(f"step {step}: the group grew to {group.world_size}")
        if group.world_size == full:
            shrunk_at = None
        if me == victim and step == kill_at and not joining:
            os.kill(os.getpid(), signal.SIGKILL)
        idx = global_batch_shard(
            perm,
            step=step % steps_per_pass,
            global_batch=args.global_batch,
            rank=group.rank,
            world_size=group.world_size,
        )
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(data.train_x[idx]), data.train_y[idx]) * (len(idx) * group.world_size / args.global_batch)
        try:
            loss.backward()
        except allreduce.CollectiveError as exc:
            group = group.shrink()
            model.regroup(group)  # after a split by one call: the parameters of the first rank ahead
            if group.ahead_ranks:  # which may have finished this step: its optimizer state and step
                step = sync_state(group, model, optimizer, {"step": step})["step"]
            shrunk_at = time.monotonic()
            print(f"step {step}: {type(exc).__name__} naming rank {exc.peer}; shrank to {group.world_size}")
            continue  # the step the survivors did not all finish, again on the survivors
        optimizer.step()
        step += 1
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
        for _, value in sorted(optimizer.state[p].items()):
            digest.update(value.detach().numpy().tobytes())
    print(f"done: {args.steps} steps, {group.world_size} ranks, state {digest.hexdigest()[:16]}")
    group.close()


if __name__ == "__main__":
    main()
