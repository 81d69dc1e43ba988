"""The "allreduce" torch.distributed backend under DDP against Gloo: step time, and how fast a dead rank is noticed.

``steps``: DDP on the backend and DDP on a Gloo group train the same model on the same batches in the same N
processes, taking turns in blocks of steps (the order alternating block by block, so both see the machine's
conditions); each figure is rank 0's median step time over a block, the table the median over blocks and the
ratio to Gloo, and whether the two runs' parameters are equal bit for bit. ``--model big`` is an MLP of 25.2 M
parameters (100 MB of float32 gradients a step); ``--wrap fsdp2`` trains with ``fully_shard`` (each layer and
the root) over a DeviceMesh of each group instead of DDP, comparing the full parameters.

``kill``: N ranks train under DDP; at step 5 the last rank SIGKILLs itself, writing the wall-clock time first;
every survivor writes the time its backward raised. The table gives, per backend, the time from the kill to the
exception on the slowest survivor (median and max over the repeats), and whether every survivor raised.

    .venv/bin/python benchmarks/bench_torch.py steps [--ranks 2] [--rounds 6] [--steps 20] [--model cnn|mlp|big]
        [--wrap ddp|fsdp2]
    .venv/bin/python benchmarks/bench_torch.py kill [--ranks 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WARMUP_STEPS = 3
KILL_AT_STEP = 5
BACKENDS = ("gloo", "allreduce")
BIG_WIDTH = 1024


def _model(kind: str) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * 8 * 8, 256),
            nn.ReLU(),
            nn.Linear(256, 10),
        )
    if kind == "big":  # 1024*4096 + 4096*4096 + 4096*1024 + 1024*10 weights and their biases: 25.19 M
        return nn.Sequential(
            nn.Linear(BIG_WIDTH, 4096),
            nn.ReLU(),
            nn.Linear(4096, 4096),
            nn.ReLU(),
            nn.Linear(4096, BIG_WIDTH),
            nn.ReLU(),
            nn.Linear(BIG_WIDTH, 10),
        )
    return nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


def _batch(kind: str, rank: int, step: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 * rank + step)
    if kind == "cnn":
        x = torch.randn(16, 3, 32, 32, generator=g)
    else:
        x = torch.randn(8, BIG_WIDTH, generator=g) if kind == "big" else torch.randn(32, 64, generator=g)
    return x, torch.randint(0, 10, (x.shape[0],), generator=g)


def _steps_rank(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import allreduce.torch  # noqa: F401
    import torch
    from torch import nn

    dist.init_process_group("allreduce", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    groups = {"allreduce": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    runs = {name: _wrapped(args, group) for name, group in groups.items()}
    times: dict[str, list[float]] = {name: [] for name in groups}
    step = dict.fromkeys(groups, 0)
    for block in range(args.rounds):
        order = BACKENDS if block % 2 == 0 else BACKENDS[::-1]
        for name in order:
            _, ddp, optimizer = runs[name]
            per_step = []
            for i in range(args.steps + (WARMUP_STEPS if block == 0 else 0)):
                x, y = _batch(args.model, rank, step[name])
                step[name] += 1
                started = time.perf_counter()
                optimizer.zero_grad()
                nn.functional.cross_entropy(ddp(x), y).backward()
                optimizer.step()
                if i >= (WARMUP_STEPS if block == 0 else 0):
                    per_step.append(time.perf_counter() - started)
            times[name].append(statistics.median(per_step))
    pairs = list(zip(_full(runs["allreduce"][0]), _full(runs["gloo"][0]), strict=True))
    equal = all(torch.equal(a, b) for a, b in pairs)
    # Beyond 2 ranks the two sum each element's N contributions in different orders (each its own algorithm's),
    # so the last bits may differ: how far apart, relative to the parameters' size.
    max_diff = max(float((a - b).abs().max()) for a, b in pairs)
    scale = max(float(a.abs().max()) for a, _ in pairs)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"times": times, "equal": equal, "max_diff": max_diff, "scale": scale}))
    dist.destroy_process_group()


def _wrapped(args: argparse.Namespace, group: Any) -> tuple[Any, Any, Any]:
    """(model, what runs a step, optimizer): DDP over ``group``, or fully_shard over a DeviceMesh of it."""
    import torch
    from torch import nn

    model = _model(args.model)
    if args.wrap == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model, process_group=group)
    else:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            if isinstance(layer, nn.Linear | nn.Conv2d):
                fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    return model, wrapped, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _full(model: Any) -> list[Any]:
    """The model's parameters as whole tensors (an FSDP2 parameter is a DTensor of shards: gathered)."""
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]


def _kill_rank(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import allreduce.torch  # noqa: F401
    import torch
    from torch import nn

    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _model("mlp")
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    record: dict[str, Any] = {"raised": None}
    try:
        for step in range(KILL_AT_STEP + 50):
            x, y = _batch("mlp", rank, step)
            loss = nn.functional.cross_entropy(ddp(x), y)
            if step == KILL_AT_STEP and rank == world_size - 1:
                Path(args.out, "killed").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    except Exception as exc:
        record = {"raised": type(exc).__name__, "at": time.time(), "message": str(exc)[:300]}
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps(record))
    os._exit(0)  # the group is broken: leave without waiting for it


def _launch(rank_args: list[str], ranks: int, env: dict[str, str]) -> list[int]:
    from allreduce.runtime.launcher._spawn import reserve_port

    with reserve_port() as reservation:
        port = str(reservation.getsockname()[1])
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, *rank_args],
                env={**env, "RANK": str(r), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
            )
            for r in range(ranks)
        ]
        return [proc.wait(timeout=600) for proc in procs]


def _steps(args: argparse.Namespace) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "steps.json"))
        rank_args = ["_steps_rank", "--model", args.model, "--wrap", args.wrap]
        rank_args += ["--rounds", str(args.rounds), "--steps", str(args.steps)]
        codes = _launch([*rank_args, "--out", out], args.ranks, env)
        if any(codes):
            raise SystemExit(f"a rank failed: exit codes {codes}")
        result = json.loads(Path(out).read_text())
    gloo = statistics.median(result["times"]["gloo"])
    print(
        f"{args.wrap.upper()}, {args.model}, {args.ranks} ranks, {args.rounds} blocks of {args.steps} steps "
        "(rank 0's median)"
    )
    print(f"{'backend':<12} {'ms/step':>8} {'vs Gloo':>8}")
    for name in BACKENDS:
        median = statistics.median(result["times"][name])
        print(f"{name:<12} {median * 1e3:8.2f} {median / gloo:8.2f}")
    print(
        f"parameters bitwise equal: {result['equal']} (largest difference {result['max_diff']:.3g}, "
        f"largest parameter {result['scale']:.3g})"
    )


def _kill(args: argparse.Namespace) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"SIGKILL of rank {args.ranks - 1} at DDP step {KILL_AT_STEP}, {args.ranks} ranks, {args.repeats} repeats")
    print(f"{'backend':<12} {'median ms':>10} {'max ms':>8} {'all raised':>11}")
    for backend in BACKENDS:
        latencies, all_raised = [], True
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                _launch(["_kill_rank", "--backend", backend, "--out", tmp], args.ranks, env)
                killed = float(Path(tmp, "killed").read_text())
                survivors = [json.loads(Path(tmp, f"rank-{r}.json").read_text()) for r in range(args.ranks - 1)]
            all_raised &= all(s["raised"] for s in survivors)
            latencies.append(max(s.get("at", float("inf")) for s in survivors) - killed)
        print(
            f"{backend:<12} {statistics.median(latencies) * 1e3:10.1f} {max(latencies) * 1e3:8.1f} {all_raised!s:>11}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["steps", "kill", "_steps_rank", "_kill_rank"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", choices=["cnn", "mlp", "big"], default="cnn")
    parser.add_argument("--wrap", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", choices=BACKENDS, default="allreduce")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if not 2 <= args.ranks <= 8:
        parser.error("--ranks: 2 to 8")
    started = time.monotonic()
    {"steps": _steps, "kill": _kill, "_steps_rank": _steps_rank, "_kill_rank": _kill_rank}[args.mode](args)
    if not args.mode.startswith("_"):
        print(f"wall {time.monotonic() - started:.0f} s, load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
