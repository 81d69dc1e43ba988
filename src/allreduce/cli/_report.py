"""``allreduce report``: one self-contained HTML page (and optionally PNG figures) from saved results."""

from __future__ import annotations

import argparse

from allreduce.cli._main import CLIError
from allreduce.cli._plan import HelpFormatter
from allreduce.report import figures_of, load_documents, write_pngs, write_report

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "report",
        help="write a self-contained HTML report with figures from plan, sweep, sim or tail results",
        description=(
            "Read results (the JSON of `allreduce plan --json`, `sim --json`, `tail --json` or `bench --json`, or a\n"
            "sweep's CSV) and write one HTML file that opens without network access: tables, and figures with\n"
            "captions that say what to read from them. Measured bench rows are drawn beside a plan's predicted busbw."
        ),
        epilog=(
            "examples:\n"
            "  allreduce plan --model llama2-7b --gpus 1024 --topology fat-tree:k=16 --compute-ms 400 --json "
            "> plan.json\n"
            "  allreduce report plan.json -o report.html --png figures/\n"
            "  allreduce bench -n 4 --sizes 4KiB:64MiB --json > bench.json\n"
            "  allreduce report plan.json bench.json -o report.html\n"
            "  allreduce tail -t fat-tree:k=8 --size 256MiB --loss 1e-6 --rto 4ms --json > tail.json\n"
            "  allreduce report tail.json -o tail.html"
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("results", nargs="+", metavar="RESULT", help="JSON (plan, sim, tail, bench) or CSV (sweep) files")
    p.add_argument("--output", "-o", default="allreduce-report.html", help="the HTML file to write")
    p.add_argument("--png", metavar="DIR", help="also write each figure as DIR/<figure>.png (needs matplotlib)")
    p.add_argument("--title", default="allreduce report", help="the page title")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    documents = load_documents(args.results)
    try:
        path = write_report(args.output, documents, title=args.title)
    except OSError as exc:
        raise CLIError(f"--output {args.output}: cannot write it ({exc.strerror})") from None
    print(f"report: {path}")
    if args.png:
        try:
            pngs = write_pngs(figures_of(documents), args.png)
        except OSError as exc:
            raise CLIError(f"--png {args.png}: cannot write there ({exc.strerror})") from None
        print(f"figures: {len(pngs)} PNG files in {args.png}")
    return 0
