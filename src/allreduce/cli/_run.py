"""``allreduce run -n N -- COMMAND ...``: start N local ranks with the torchrun environment and watch them."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import textwrap

from allreduce.cli._args import algorithm_for_ranks
from allreduce.cli._main import RANK_ENVIRONMENT_HELP, CLIError
from allreduce.runtime import launch
from allreduce.runtime.launcher import DEFAULT_GRACE_S, MAX_RESTARTS
from allreduce.runtime.stats import TRACE_ENV, check_trace_path

__all__ = ["register"]

_HELP_WIDTH = 78
"""Columns of the pre-wrapped description (the epilog's environment table is laid out by hand, so argparse must
not re-wrap either)."""


_PYTHON_NAMES = ("python", "python3")
"""Commands that stand for this interpreter."""


def _handle(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CLIError("no command to run: allreduce run -n N -- python script.py [args...]")
    if command[0] in _PYTHON_NAMES:
        # The ranks import allreduce: the `python` first on PATH may be another interpreter (a venv that is not
        # activated), where that fails with ModuleNotFoundError.
        command[0] = sys.executable
    if args.nproc < 1:
        raise CLIError(f"-n/--nproc must be >= 1, got {args.nproc}")
    if not args.grace >= 0:
        raise CLIError(f"--grace must be >= 0 seconds, got {args.grace}")
    for spec in args.algorithm:
        algorithm_for_ranks("--algorithm", spec)
    env: dict[str, str] = {}
    if args.trace:
        try:
            env[TRACE_ENV] = str(check_trace_path(args.trace))
        except ValueError as exc:
            raise CLIError(f"--trace: {exc}") from None
    min_ranks = _elastic_options(args)
    result = launch(
        command,
        world_size=args.nproc,
        master_port=args.master_port,
        grace_s=args.grace,
        env=env,
        stats=args.stats,
        min_ranks=min_ranks,
        max_restarts=args.max_restarts or 0,
    )
    if result.departures:
        gone = ", ".join(f"rank {d.rank}" + (" (restarted)" if d.restarted else "") for d in result.departures)
        print(f"allreduce run: elastic: the job went on through {len(result.departures)} failure(s): {gone}",
              file=sys.stderr)  # fmt: skip
    code = result.exit_code
    if code == 128 + signal.SIGPIPE:
        # Our reader has gone (`| head`): what is left in stdout's buffer has nowhere to go, and flushing it
        # at exit would print a BrokenPipeError.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return code
    if args.stats:
        if result.stats_table is not None:
            sys.stdout.write(result.stats_table)
        else:
            print("allreduce run: --stats: no rank made a process group, or it was not closed", file=sys.stderr)
    if args.trace and os.path.exists(env[TRACE_ENV]):
        print(f"allreduce run: trace written to {env[TRACE_ENV]} (open it in ui.perfetto.dev)", file=sys.stderr)
    return code


def _elastic_options(args: argparse.Namespace) -> int | None:
    """--min-ranks (default: all but one) with --elastic; refused without it, as --max-restarts is."""
    if not args.elastic:
        for flag, value in (("--min-ranks", args.min_ranks), ("--max-restarts", args.max_restarts)):
            if value is not None:
                raise CLIError(f"{flag} needs --elastic")
        return None
    min_ranks = int(args.nproc - 1 if args.min_ranks is None else args.min_ranks)
    if not 1 <= min_ranks <= args.nproc:
        raise CLIError(f"--min-ranks must be in 1..{args.nproc} (-n), got {min_ranks}")
    if args.max_restarts is not None and not 0 <= args.max_restarts <= MAX_RESTARTS:
        raise CLIError(f"--max-restarts must be in 0..{MAX_RESTARTS}, got {args.max_restarts}")
    return max(min_ranks, 1)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "run",
        help="start N local ranks of a command (like torchrun), prefixing their output with [rank k]",
        description=textwrap.fill(
            "Start N copies of COMMAND on this host with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, "
            "MASTER_ADDR=127.0.0.1, MASTER_PORT (reserved for the job, so nothing else takes it) and "
            "ALLREDUCE_TOKEN (random per job unless already set) in the environment (and PYTHONUNBUFFERED=1), so "
            "that allreduce.init() - or torch.distributed - finds its peers and refuses strangers. Every output line "
            "is prefixed with [rank k]. Ctrl-C (SIGINT), SIGTERM and SIGHUP are forwarded to every rank; a second "
            "Ctrl-C kills them. If a rank fails on its own, the others are stopped; ranks that fail only because "
            "a peer failed (PeerFailureError) are named as having reacted, and run exits with the status of the "
            "rank that failed first (128+signal if it was killed), naming it. If run's output is closed "
            "(run ... | head) the ranks are stopped and run exits with 141. Every stop sends SIGTERM, then "
            "SIGKILL after --grace seconds. Ranks die with run, even if it is killed with SIGKILL, and the "
            "shared memory they leave is removed. The number of ranks is capped (see the error beyond it). Ranks get "
            "no stdin.",
            width=_HELP_WIDTH,
        ),
        epilog=(
            "environment variables:\n"
            "  ALLREDUCE_TOKEN        the job's shared secret: random per job unless set;\n"
            "                         set it when MASTER_ADDR is not a loopback address\n"
            "  ALLREDUCE_DEBUG        set to 1: an internal error of run prints its traceback\n"
            "  ALLREDUCE_FAILURE_DIR  set by run in each rank: where the rank reports an\n"
            "                         uncaught exception (how run tells causes from reactions)\n"
            "read by every rank:\n"
            f"{RANK_ENVIRONMENT_HELP}"
            "\n"
            "A COMMAND of python or python3 runs as this interpreter (the one allreduce is installed in, whether or\n"
            "not its environment is activated); give a path (/usr/bin/python3) for another one.\n"
            "\n"
            "example: allreduce run -n 4 -- python train.py --epochs 3"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-n", "--nproc", required=True, type=int, metavar="N", help="number of ranks to start")
    p.add_argument(
        "--master-port",
        type=int,
        default=None,
        metavar="P",
        help="rank 0's store port (default: one reserved for the job)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help=f"after SIGTERM (a failure, an interrupt, a closed output), wait this long before SIGKILL "
        f"(default: {DEFAULT_GRACE_S:g})",
    )
    p.add_argument(
        "--algorithm",
        action="append",
        default=[],
        metavar="SPEC",
        help="a user algorithm (module:function or file.py:function) to verify here and register in every rank, "
        "so that group.all_reduce(x, algorithm=NAME) finds it; repeatable",
    )
    p.add_argument(
        "--stats",
        action="store_true",
        help="print one table for all ranks at exit: per-rank and per-link waits over the last 1,000 collectives, "
        "the slowest rank and link named (the ranks' process groups compute it when they close)",
    )
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="write every rank's collectives and steps as a Chrome/Perfetto trace (the format of allreduce sim "
        "--trace)",
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="keep the job going when a rank fails (the others shrink their group: group.shrink()) while at least "
        "--min-ranks run; rank 0, which hosts the store, still ends the job (docs/elastic.md)",
    )
    p.add_argument(
        "--min-ranks",
        type=int,
        metavar="K",
        help="with --elastic: the fewest ranks the job goes on with (default: N-1)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        metavar="R",
        help="with --elastic: start a failed rank again, up to R times in all, with ALLREDUCE_JOIN=1 so that "
        "allreduce.init() joins the running group (its members admit it with group.grow()); default 0",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs, after --")
    p.set_defaults(handler=_handle)
