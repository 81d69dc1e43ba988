"""DataParallel on allreduce vs torch DDP on Gloo: step time of the same model on N local ranks.

Both train the same MLP on the same batches with the same optimizer; only the gradient synchronisation differs.
The contenders alternate round by round in one run (the machine is shared and noisy: compare the ratios, not
absolute figures across runs). Each figure is rank 0's median step time over the timed steps of a round; the
table shows the median over rounds and the ratio to DDP.

    .venv/bin/python benchmarks/bench_train.py [--ranks 2] [--rounds 3] [--steps 40] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from typing import Any

WARMUP_STEPS = 5
FEATURES = 64
CLASSES = 10


def _worker(contender: str, hidden: int, batch: int, steps: int, bucket_mb: float) -> dict[str, float]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES)
    )
    close: Any
    if contender == "torch DDP (Gloo)":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=120))
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        rank = dist.get_rank()
        close = dist.destroy_process_group
    else:
        from allreduce.runtime import init
        from allreduce.train import DataParallel

        group = init(timeout_s=120)
        wrapped = DataParallel(model, group, bucket_size_mb=bucket_mb)
        rank = group.rank
        close = group.close
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (batch,), generator=generator)
    times = []
    for step in range(WARMUP_STEPS + steps):
        t0 = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(wrapped(x), y).backward()
        optimizer.step()
        if step >= WARMUP_STEPS:
            times.append(time.perf_counter() - t0)
    close()
    return {"step_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width: 64 -> H -> H -> 10")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    args = parser.parse_args()

    from allreduce.train import run_local

    params = FEATURES * args.hidden + args.hidden + args.hidden * args.hidden + args.hidden + args.hidden * CLASSES
    params += CLASSES
    contenders = ["torch DDP (Gloo)", "allreduce DataParallel (shm)"]
    results: dict[str, list[float]] = {c: [] for c in contenders}
    for round_index in range(args.rounds):
        # Alternate which contender goes first, so neither always runs on a warmer machine.
        order = contenders if round_index % 2 == 0 else contenders[::-1]
        for contender in order:
            per_rank = run_local(
                args.ranks, _worker, (contender, args.hidden, args.batch, args.steps, args.bucket_mb), timeout_s=300
            )
            results[contender].append(per_rank[0]["step_s"])

    ddp = statistics.median(results[contenders[0]])
    print(
        f"N={args.ranks} ranks, MLP 64-{args.hidden}-{args.hidden}-10 ({params:,} float32 parameters, "
        f"{params * 4 / 2**20:.1f} MiB of gradients), batch {args.batch}/rank, buckets {args.bucket_mb:g} MiB, "
        f"{args.rounds} alternating rounds × {args.steps} steps"
    )
    print()
    print("| contender | median step time | per-round medians | vs DDP |")
    print("|---|---|---|---|")
    for contender in contenders:
        median = statistics.median(results[contender])
        rounds = ", ".join(f"{t * 1e3:.2f}" for t in results[contender])
        print(f"| {contender} | {median * 1e3:.2f} ms | {rounds} ms | {median / ddp:.2f}× |")


if __name__ == "__main__":
    main()
