"""``allreduce train``: a real data-parallel training run on N local ranks, and where its step time goes."""

from __future__ import annotations

import argparse
from typing import Any

from allreduce.cli._json import dumps
from allreduce.cli._main import CLIError
from allreduce.schedules import Collective, get_algorithm
from allreduce.units import parse_seconds

__all__ = ["register"]


def _algorithm(text: str) -> str:
    """``auto`` or a registered all-reduce algorithm (plug-ins included)."""
    if text == "auto":
        return text
    try:
        return get_algorithm(Collective.ALL_REDUCE, text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _slow_rank(text: str) -> tuple[int, float]:
    rank_text, sep, delay_text = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected RANK=SECONDS (e.g. 2=0.05 or 2=50ms), got {text!r}")
    try:
        rank = int(rank_text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the rank in {text!r} is not an integer") from None
    try:
        delay_s = float(delay_text)
    except ValueError:
        try:
            delay_s = parse_seconds(delay_text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"the delay in {text!r}: {exc}") from None
    return rank, delay_s


def _kill_rank(text: str) -> tuple[int, int]:
    rank_text, sep, step_text = text.partition("@")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected RANK@STEP (e.g. 2@40), got {text!r}")
    try:
        return int(rank_text), int(step_text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the rank and the step in {text!r} must be integers") from None


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from allreduce.train import TRANSPORTS

    p = subparsers.add_parser(
        "train",
        help="train an MLP on scikit-learn's digits on N local ranks and break the step time down",
        description=(
            "Data-parallel training of a small MLP on scikit-learn's handwritten digits (shipped with scikit-learn, "
            "nothing downloaded): N local ranks, each on its own shard, gradients averaged in buckets while "
            "backward runs. Prints per epoch the loss, the held-out accuracy and the step-time breakdown."
        ),
    )
    p.add_argument("-n", "--ranks", type=int, default=2, metavar="N", help="number of local ranks (default 2)")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training set (default 3)")
    p.add_argument(
        "--batch-size", type=int, default=32, metavar="PER_RANK", help="samples per rank per step (default 32)"
    )
    p.add_argument(
        "--algorithm",
        default="auto",
        type=_algorithm,
        help="all-reduce algorithm for the gradient buckets (default auto: the cost model picks)",
    )
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MiB (default 25)")
    p.add_argument(
        "--transport",
        default="auto",
        choices=TRANSPORTS,
        help="auto/shm/tcp: allreduce's own transports; torch: allreduce schedules over torch.distributed (Gloo)",
    )
    p.add_argument(
        "--slow-rank",
        type=_slow_rank,
        metavar="R=SECONDS",
        help="make rank R sleep SECONDS per step in compute (one slow worker slows every worker)",
    )
    p.add_argument(
        "--kill-rank",
        type=_kill_rank,
        metavar="R@STEP",
        help="SIGKILL rank R before global step STEP (counted from 0 over all epochs); the survivors shrink the "
        "group, re-run the step on the same global batch and go on (not rank 0: it hosts the store)",
    )
    p.add_argument("--json", action="store_true", help="print the per-epoch figures as JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from allreduce.train import RankFailedError, format_result, train

    if args.ranks < 1:
        raise CLIError(f"-n must be >= 1, got {args.ranks}")
    slow_rank, slow_s = args.slow_rank if args.slow_rank else (None, 0.0)
    kill_rank, kill_step = args.kill_rank if args.kill_rank else (None, 0)
    try:
        config = _config(args, slow_rank, slow_s, kill_rank, kill_step)
        result = train(config)
    except RankFailedError as exc:
        raise CLIError(str(exc)) from None
    if args.json:
        print(dumps(result.to_json()))
    else:
        print(format_result(result))
    return 0


def _config(
    args: argparse.Namespace, slow_rank: int | None, slow_s: float, kill_rank: int | None, kill_step: int
) -> Any:
    from allreduce.train import TrainConfig

    return TrainConfig(
        world_size=args.ranks,
        epochs=args.epochs,
        batch_size=args.batch_size,
        algorithm=args.algorithm,
        transport=args.transport,
        bucket_size_mb=args.bucket_mb,
        slow_rank=slow_rank,
        slow_s=slow_s,
        kill_rank=kill_rank,
        kill_step=kill_step,
    )
