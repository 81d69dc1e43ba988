"""Entry point: one argparse parser, one module per subcommand.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets ``handler`` to a
function ``(args) -> int``. Handlers raise :class:`CLIError` (or :class:`allreduce.units.UnitError`,
``ValueError`` from the library) for bad input: the user sees one line and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence

__all__ = ["RANK_ENVIRONMENT_HELP", "CLIError", "main"]

RANK_ENVIRONMENT_HELP = """\
  ALLREDUCE_STATS       on by default: every group records its waits; 1: each group also prints its
                        per-rank and per-link table on stderr when it closes; 0: recording off
  ALLREDUCE_TRACE       FILE: every rank's collectives and steps written to FILE as a Perfetto trace
                        (as run --trace)
  ALLREDUCE_INJECT      faults to inject, e.g. 'delay:rank=2:1ms', 'pace:link=0->1:rate=50MB/s',
                        'hold:rank=1:p=0.01:ms=20' (';' between effects; off unless set)
"""
"""The variables every rank reads (the ranks of run, bench and train inherit them), for the epilogs."""

_ENVIRONMENT_HELP = f"""\
environment variables:
  ALLREDUCE_TOKEN       shared secret of a job's ranks: every TCP connection (store and peers) proves it
                        (required when MASTER_ADDR is not a loopback address)
  ALLREDUCE_ALGORITHMS  comma-separated module:function or file.py:function algorithms of your own, loaded,
                        verified and registered in every process (the ranks inherit it)
{RANK_ENVIRONMENT_HELP.rstrip()}
  ALLREDUCE_TUNE_FILE   where `allreduce tune` caches the measured latency and bandwidth that auto reads
  ALLREDUCE_DEBUG       set to 1: an internal error prints its traceback

run `allreduce COMMAND --help` for a command's options and defaults"""

# Subcommand modules, in the order `allreduce --help` lists them.
_COMMANDS: tuple[str, ...] = (
    "allreduce.cli._explain",
    "allreduce.cli._demo",
    "allreduce.cli._sim",
    "allreduce.cli._tail",
    "allreduce.cli._bench",
    "allreduce.cli._tune",
    "allreduce.cli._run",
    "allreduce.cli._train",
    "allreduce.cli._plan",
    "allreduce.cli._report",
    "allreduce.cli._sweep",
    "allreduce.cli._emulate",
)


class CLIError(Exception):
    """Bad input from the command line; printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="allreduce",
        description="Gradient All-Reduce: verified schedules, a fast runtime, and a network simulator.",
        epilog=_ENVIRONMENT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from allreduce import __version__

    parser.add_argument("--version", action="version", version=f"allreduce {__version__}")
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
    for module_name in _COMMANDS:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.subcommand is None:
        parser.print_help()
        return 2
    prog = f"allreduce {args.subcommand}"
    try:
        code: int = args.handler(args)
    except CLIError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # UnitError, ScheduleError and argument checks of the library
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `allreduce ... | head`: the reader left; not an error of ours.
        sys.stderr.close()
        return 0
    except Exception as exc:
        if os.environ.get("ALLREDUCE_DEBUG"):
            traceback.print_exc()
        print(
            f"{prog}: internal error: {type(exc).__name__}: {exc} (set ALLREDUCE_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
