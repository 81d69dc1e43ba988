"""DataParallel on allreduce vs torch DDP on Gloo: step time of the same model on N local ranks.

Every contender trains the same MLP on the same batches with the same optimizer; only the gradient synchronisation
differs. All contenders live in the same N processes (a Gloo process group for DDP next to an allreduce shm group)
and take turns in blocks of steps, the order alternating block by block, so they share the machine's conditions
(it is shared and noisy: compare the ratios, not absolute figures across runs). Each figure is rank 0's median
step time over a block (forward, backward with the synchronisation, optimizer step); the table shows the median
over blocks and the ratio to DDP.

    .venv/bin/python benchmarks/bench_train.py [--ranks 2] [--rounds 6] [--steps 30] [--hidden 1024] [--bucket-mb 25]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from typing import Any

WARMUP_STEPS = 5
FEATURES = 64
CLASSES = 10
CONTENDERS = ("torch DDP (Gloo)", "allreduce DataParallel (shm)", "allreduce DataParallel (shm, overlap=False)")


def _worker(hidden: int, batch: int, steps: int, rounds: int, bucket_mb: float) -> dict[str, list[float]]:
    import torch.distributed as dist

    import torch
    from allreduce.runtime import init
    from allreduce.train import DataParallel
    from torch import nn

    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    # MASTER_PORT is torch's store: allreduce's rank 0 publishes a port of its own there.
    torch_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    group = init(timeout_s=120, rendezvous_store=torch_store)

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES)
        )

    wrapped: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    for contender in CONTENDERS:
        model = mlp()
        if contender == CONTENDERS[0]:
            wrapper: nn.Module = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        else:
            overlap = "overlap=False" not in contender
            wrapper = DataParallel(model, group, bucket_size_mb=bucket_mb, overlap=overlap)
        wrapped[contender] = (wrapper, torch.optim.SGD(model.parameters(), lr=0.01))
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (batch,), generator=generator)

    def block(contender: str, count: int) -> float:
        model, optimizer = wrapped[contender]
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    for contender in CONTENDERS:
        block(contender, WARMUP_STEPS)
    medians: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    for round_index in range(rounds):
        # Alternate the order, so that no contender always runs right after the same one.
        order = CONTENDERS if round_index % 2 == 0 else CONTENDERS[::-1]
        for contender in order:
            medians[contender].append(block(contender, steps))
    group.close()
    dist.destroy_process_group()
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per contender per round")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width: 64 -> H -> H -> 10")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    args = parser.parse_args()

    from allreduce.runtime.launcher._spawn import spawn

    params = FEATURES * args.hidden + args.hidden + args.hidden * args.hidden + args.hidden + args.hidden * CLASSES
    params += CLASSES
    load_before = os.getloadavg()[0]
    shape = (args.hidden, args.batch, args.steps, args.rounds, args.bucket_mb)
    per_rank = spawn(args.ranks, _worker, *shape, group=False, timeout_s=600)
    results: dict[str, Any] = per_rank[0]
    load_after = os.getloadavg()[0]

    ddp = statistics.median(results[CONTENDERS[0]])
    print(
        f"N={args.ranks} ranks, MLP 64-{args.hidden}-{args.hidden}-10 ({params:,} float32 parameters, "
        f"{params * 4 / 2**20:.1f} MiB of gradients), batch {args.batch}/rank, buckets {args.bucket_mb:g} MiB, "
        f"{args.rounds} alternating rounds × {args.steps} steps, {os.cpu_count()} cores, "
        f"load average {load_before:.2f} before / {load_after:.2f} after"
    )
    print()
    print("| contender | median step time | per-round medians | vs DDP |")
    print("|---|---|---|---|")
    for contender in CONTENDERS:
        median = statistics.median(results[contender])
        rounds = ", ".join(f"{t * 1e3:.2f}" for t in results[contender])
        print(f"| {contender} | {median * 1e3:.2f} ms | {rounds} ms | {median / ddp:.2f}× |")


if __name__ == "__main__":
    main()
