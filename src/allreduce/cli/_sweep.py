"""``allreduce sweep``: run a grid of plan cases on a local process pool or a Dask cluster."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from allreduce.cli._args import positive_int
from allreduce.cli._main import CLIError
from allreduce.cli._plan import HelpFormatter
from allreduce.plan import (
    DEFAULT_IN_FLIGHT,
    IN_FLIGHT_PER_WORKER,
    MAX_WORKERS_PER_CPU,
    make_executor,
    max_workers,
    read_grid,
    run_sweep,
)

__all__ = ["register", "run"]

# Width of the progress bar, in characters.
BAR_WIDTH = 30


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "sweep",
        help="run a grid of plan cases on a process pool or a Dask cluster; CSV (+ Parquet) and a report",
        description=(
            "Run every case of GRID.yaml (base: + grid: for every combination, or cases: for a list; the keys\n"
            "are plan's options with underscores: model, gpus, topology, compute_ms, bucket_mb, ...). Each case\n"
            "is a pure function of its parameters, so it runs on any executor. A failing case is recorded with\n"
            "its error; a re-run skips the cases already in the output file and runs the failed ones again.\n"
            "The grid is never expanded in memory: cases start at once, a few per worker in flight."
        ),
        epilog=(
            "example GRID.yaml:\n"
            "  base: {model: llama2-7b, compute_ms: 400}\n"
            "  grid:\n"
            "    gpus: [64, 128, 256]\n"
            "    topology: ['fat-tree:k=16', 'clos:leaves=32,spines=8,hosts_per_leaf=32,oversub=4']\n"
            "    algorithm: [ring, double_binary_tree]\n"
            "examples:\n"
            "  allreduce sweep grid.yaml -o results.csv --report sweep.html\n"
            "  allreduce sweep grid.yaml -o results.csv --executor dask://127.0.0.1:8786"
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("grid", metavar="GRID.yaml", help="the cases")
    p.add_argument("--output", "-o", default="sweep.csv", help="results CSV, appended to")
    p.add_argument(
        "--executor",
        default="local",
        help="local or dask://HOST:PORT (a Dask scheduler)",
    )
    p.add_argument(
        "--workers",
        type=positive_int("--workers"),
        help=f"local pool size (default: CPU count; at most {MAX_WORKERS_PER_CPU} per CPU), started as cases need them",
    )
    p.add_argument("--report", metavar="FILE", help="also write the HTML report of all rows to FILE")
    p.set_defaults(handler=run)


def _bar(enabled: bool) -> Callable[[int, int | None, int], None] | None:
    if not enabled:
        return None

    def show(done: int, total: int | None, failed: int) -> None:
        if total:
            filled = BAR_WIDTH * min(done, total) // total
            bar = "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "] "
        else:
            bar = ""
        of = f"/{total}" if total else ""
        print(f"\r{bar}{done}{of} cases, {failed} failed\033[K", end="", file=sys.stderr, flush=True)

    return show


def run(args: argparse.Namespace) -> int:
    grid = read_grid(args.grid)
    if not grid.total:
        raise CLIError(f"{args.grid}: no cases")
    executor = make_executor(args.executor, workers=args.workers)
    local = args.executor in (None, "local")
    workers = args.workers or max_workers() // MAX_WORKERS_PER_CPU
    status = sys.stderr.isatty()
    try:
        summary = run_sweep(
            grid,
            args.output,
            executor,
            total=grid.total,
            in_flight=IN_FLIGHT_PER_WORKER * workers if local else DEFAULT_IN_FLIGHT,
            progress=_bar(status),
        )
    except OSError as exc:
        raise CLIError(f"--output {args.output}: cannot write it ({exc.strerror})") from None
    finally:
        executor.shutdown(cancel_futures=True)
    if status:
        print(file=sys.stderr)
    print(
        f"{summary.total} cases: {summary.ran} ran ({summary.failed} failed), {summary.skipped} already in "
        f"{summary.output}; {summary.wall_s:.1f} s, {summary.cases_per_s:.1f} cases/s"
    )
    if summary.parquet:
        print(f"parquet: {summary.parquet}")
    if args.report:
        from allreduce.report import load_documents, write_report

        write_report(args.report, load_documents([summary.output]), title="allreduce sweep")
        print(f"report: {args.report}")
    return 0
