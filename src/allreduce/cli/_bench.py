"""``allreduce bench``: time all_reduce between N local ranks over a sweep of sizes (an nccl-tests table)."""

from __future__ import annotations

import argparse
import dataclasses

from allreduce.cli._args import algorithm_for_ranks
from allreduce.cli._json import dumps
from allreduce.cli._main import RANK_ENVIRONMENT_HELP, CLIError
from allreduce.runtime import DTYPES, OPS, RankFailedError
from allreduce.runtime.bench import BenchConfig, BenchRow, run_bench
from allreduce.schedules import Collective, algorithms
from allreduce.units import parse_size_range

__all__ = ["register", "render"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="time all_reduce between N local ranks (nccl-tests style table, every result checked)",
        description="Spawn N local ranks and time all_reduce for each size; every result is checked against "
        "the exact reduction of integer-valued inputs (#wrong counts the elements that differ).",
        epilog=f"environment variables (the ranks inherit them):\n{RANK_ENVIRONMENT_HELP}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-n", "--world-size", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--transport", choices=("shm", "tcp"), default="shm", help="(default shm)")
    parser.add_argument(
        "--algorithm",
        default="auto",
        help=f"auto (cost model, default), one of {', '.join(algorithms(Collective.ALL_REDUCE))}, or a user "
        "algorithm as module:function or file.py:function",
    )
    parser.add_argument(
        "--sizes",
        default="4KiB:256MiB",
        help="bytes per rank: a range lo:hi (powers of two) or a list a,b,c (default 4KiB:256MiB); refused if the "
        "largest does not fit in /dev/shm or memory",
    )
    parser.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)} (default float32)")
    parser.add_argument("--op", default="sum", help=f"one of {', '.join(OPS)} (default sum)")
    parser.add_argument("--iters", type=int, default=0, help="timed iterations per size (default: by size)")
    parser.add_argument(
        "--copy",
        action="store_true",
        help="use ordinary numpy arrays instead of group.empty() buffers: from their second call they are moved "
        "into shared memory from 1 MiB (on the C library's heap: all but their two end pages), read in place "
        "from 8 MiB until then, staged below",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="per-collective timeout in seconds (default 300, at least 1)"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.set_defaults(handler=_handle)


def render(rows: list[BenchRow], *, header: str) -> str:
    lines = [
        f"# {header}",
        f"# {'size':>12} {'count':>11} {'type':>9} {'redop':>6} {'algorithm':>19} {'time(us)':>10} "
        f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>7}",
    ]
    lines.extend(
        f"  {r.size_bytes:>12} {r.count:>11} {r.dtype:>9} {r.op:>6} {r.algorithm:>19} {r.time_s * 1e6:>10.1f} "
        f"{r.algbw_Bps / 1e9:>12.2f} {r.busbw_Bps / 1e9:>12.2f} {r.wrong:>7}"
        for r in rows
    )
    wrong = sum(r.wrong for r in rows)
    lines.append(f"# out of bounds values: {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    return "\n".join(lines)


def _handle(args: argparse.Namespace) -> int:
    algorithm = algorithm_for_ranks("--algorithm", args.algorithm)
    if args.world_size < 1 or args.world_size > 256:
        raise CLIError(f"-n: world size must be between 1 and 256, got {args.world_size}")
    if not args.timeout > 0:
        raise CLIError(f"--timeout must be > 0 seconds, got {args.timeout}")
    config = BenchConfig(
        world_size=args.world_size,
        sizes_bytes=tuple(parse_size_range(args.sizes, what="--sizes")),
        transport=args.transport,
        algorithm=algorithm,
        dtype=args.dtype,
        op=args.op,
        iters=args.iters,
        group_memory=not args.copy,
        timeout_s=args.timeout,
    )
    try:
        rows = run_bench(config)
    except RankFailedError as exc:
        raise CLIError(str(exc)) from None
    if args.json:
        print(dumps([dataclasses.asdict(r) for r in rows]))
    else:
        memory = "plain numpy arrays" if args.copy else "group.empty() buffers"
        print(
            render(
                rows,
                header=f"allreduce bench: N={args.world_size} transport={args.transport} "
                f"algorithm={algorithm} dtype={args.dtype} op={args.op}, {memory}",
            )
        )
    return 0 if all(r.wrong == 0 for r in rows) else 1
