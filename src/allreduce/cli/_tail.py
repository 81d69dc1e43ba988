"""``allreduce tail``: Monte Carlo of all-reduce with packet loss, jitter and faults; percentiles and culprits."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt

from allreduce.cli._args import add_algorithm_argument, add_mitigate_argument, non_negative_int, positive_int
from allreduce.cli._json import dumps
from allreduce.cli._main import CLIError
from allreduce.schedules import Schedule, replan_schedule, ring_all_reduce
from allreduce.sim import (
    DEFAULT_EXACT_BUDGET_S,
    DISTRIBUTIONS,
    MAX_MITIGATE_RANKS,
    TAIL_EXACT_MAX_RANKS,
    TAIL_MEMORY_LIMIT_BYTES,
    TCP_STACKS,
    Mitigation,
    TailConfig,
    TailResult,
    mitigate_ring,
    tail_memory_bytes,
)
from allreduce.topology import Topology
from allreduce.units import NOT_A_NUMBER, format_bytes, format_seconds, parse_bytes

__all__ = ["demo_section", "register", "run"]

# Bars of the text histogram, and its width in characters.
HISTOGRAM_BINS = 12
HISTOGRAM_WIDTH = 40
# What a DIST argument may be, for --help.
_KINDS = (
    f"KIND:PARAMETERS with KIND one of {', '.join(DISTRIBUTIONS)} (constant:1ms, exponential:mean=1ms, "
    "lognormal:median=1ms,p99=5ms, uniform:low=0,high=2ms, empirical:FILE.csv) or a bare time"
)
# Runs with more (ranks x steps x samples) than this show a progress bar on a terminal.
PROGRESS_MIN_WORK = 10**8


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "tail",
        help="Monte Carlo of all-reduce with packet loss, jitter, stragglers and link faults: percentiles, culprits",
        description=(
            "Simulate an all-reduce many times with random packet loss (TCP or RoCE retransmission), latency\n"
            "jitter per transfer, compute jitter per rank and links that fail, flap or degrade mid-run. Prints\n"
            "p50/p90/p99/p99.9/max/mean of the step time per algorithm, its slowdown over the noise-free run,\n"
            "the ranks and links that caused each sample's largest delay on the critical path, and a histogram.\n"
            "Models and formulas: docs/tail.md."
        ),
        epilog=(
            "examples:\n"
            "  allreduce tail -t fat-tree:k=16 --size 1GiB --loss 1e-6 --fabric tcp --rto 200ms --samples 1000\n"
            "  allreduce tail -t fat-tree:k=8 --size 256MiB --jitter-rank lognormal:median=1ms,p99=5ms\n"
            "  allreduce tail -t fat-tree:k=8 --size 64MiB --link-down 'edge0->agg0@100us+2ms' --samples 100"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--topology", "-t", required=True, help="a spec (fat-tree:k=16, rail:..., ...) or a file")
    p.add_argument("--ranks", "-n", type=positive_int("--ranks"), help="number of ranks (default: every GPU)")
    p.add_argument("--size", required=True, help="bytes per rank: 64MiB, 1GiB")
    add_algorithm_argument(p, default="ring")
    p.add_argument("--group-size", type=positive_int("--group-size"), help="ranks per node for hierarchical")
    p.add_argument(
        "--chunks",
        type=positive_int("--chunks"),
        default=8,
        help="pipeline chunks of double_binary_tree (default %(default)s)",
    )
    p.add_argument("--placement", default="linear", help="linear (default), random, or a FILE of GPU indices")
    p.add_argument(
        "--routing", choices=("ecmp", "spray", "shortest", "dimension_order"), help="default: the topology's"
    )
    p.add_argument(
        "--seed",
        type=non_negative_int("--seed"),
        default=0,
        help="seed of the samples, placement, ECMP (default %(default)s)",
    )
    p.add_argument(
        "--samples",
        "-k",
        type=_count("--samples"),
        default=1000,
        help=f"Monte Carlo samples (default %(default)s; at most what fits {TAIL_MEMORY_LIMIT_BYTES / 2**30:g} GiB)",
    )
    p.add_argument(
        "--loss",
        default="0",
        metavar="P",
        help="probability that a link drops a packet, e.g. 1e-6 (default %(default)s)",
    )
    p.add_argument("--loss-link", action="append", default=[], metavar="LINK=P", help="loss probability of one link")
    p.add_argument(
        "--loss-burst",
        default="1",
        metavar="B",
        help="mean burst of lost packets on every lossy link (default %(default)s: independent losses; above 1: a "
        "Gilbert-Elliott chain of the same long-run rate, as 'allreduce emulate up --loss LINK=ge:p=P,burst=B')",
    )
    p.add_argument("--fabric", choices=("roce", "tcp"), default="roce", help="retransmission model (default roce)")
    p.add_argument(
        "--tcp",
        choices=tuple(TCP_STACKS),
        default="linux",
        help="TCP stack (default %(default)s: RACK-TLP, rto_min 200ms, HZ=250; tuned: rto_min 5ms, HZ=1000; "
        "rfc6298: 3 duplicate ACKs or the RTO, no probe); its settings are printed",
    )
    p.add_argument("--mtu", help="packet size (default 4KiB for roce, 1500 for tcp)")
    p.add_argument(
        "--rto",
        help="retransmission timeout (roce: default 4.096us*2^20; tcp rfc6298: default 200ms) or, for the tcp "
        "stacks linux and tuned, their minimum RTO (rto_min: 200ms, 5ms)",
    )
    p.add_argument(
        "--no-agreement",
        action="store_true",
        help="tcp: do not charge losses of the runtime's agreement messages that start every collective",
    )
    p.add_argument("--jitter-link", metavar="DIST", help=f"extra latency per transfer: {_KINDS}")
    p.add_argument("--jitter-rank", metavar="DIST", help=f"compute jitter, when each rank arrives: {_KINDS}")
    p.add_argument("--link-down", action="append", default=[], metavar="LINK@T+D", help="LINK down at T for D")
    p.add_argument("--flap", action="append", default=[], metavar="LINK@T/PERIOD*DUTY", help="LINK flapping from T")
    p.add_argument("--degrade-at", action="append", default=[], metavar="LINK@T=FACTOR", help="LINK slower from T")
    p.add_argument("--degrade", action="append", default=[], metavar="LINK=FACTOR", help="LINK at FACTOR throughout")
    p.add_argument("--fail", action="append", default=[], metavar="LINK", help="remove LINK throughout")
    p.add_argument("--slow-rank", action="append", default=[], metavar="R=SECONDS", help="SECONDS more per step")
    p.add_argument(
        "--ecmp-seeds",
        type=non_negative_int("--ecmp-seeds"),
        default=0,
        help="ECMP hash seeds to draw (default %(default)s: the run's one seed)",
    )
    p.add_argument(
        "--engine",
        choices=("auto", "fast", "event"),
        default="auto",
        help="auto (default): samples the fast engine cannot certify exact are re-run by the event engine on "
        f"<= {TAIL_EXACT_MAX_RANKS:,} ranks if they fit --exact-budget; fast; event: every sample",
    )
    p.add_argument(
        "--exact-budget",
        type=_budget,
        default=DEFAULT_EXACT_BUDGET_S,
        metavar="SECONDS",
        help="--engine auto: the CPU seconds the event engine's re-runs may be planned to take (default "
        "%(default)g; planned from their transfers, so the same samples are re-run on any machine)",
    )
    add_mitigate_argument(p, what="the tail")
    p.add_argument("--no-attribution", action="store_true", help="skip naming culprits (faster with loss/jitter)")
    p.add_argument("--top", type=non_negative_int("--top"), default=5, help="culprits to list (default 5)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--csv", metavar="FILE", help="write every sample to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="write the step-time CDF to FILE.png (needs matplotlib)")
    p.set_defaults(handler=run)


# The largest --exact-budget: a day.
MAX_EXACT_BUDGET_S = 86_400.0


def _budget(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--exact-budget: {text!r} is not a number of seconds") from None
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_EXACT_BUDGET_S):
        raise argparse.ArgumentTypeError(f"--exact-budget: {text} must be between 0 and {MAX_EXACT_BUDGET_S:g}")
    return seconds


def _count(name: str) -> Callable[[str], int]:
    """An argparse type for a count >= 1, written as a whole number or in exponent form (``1e6``)."""

    def parse(text: str) -> int:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a whole number, got {text!r}") from None
        if not (math.isfinite(value) and value == int(value)):
            raise argparse.ArgumentTypeError(f"{name} must be a whole number, got {text!r}")
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {text}")
        return int(value)

    return parse


def _check_output(flag: str, path: str) -> None:
    """Refuse an output path that cannot be written, before any simulation runs."""
    target = Path(path)
    if target.is_dir():
        raise CLIError(f"{flag} {path}: is a directory")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise CLIError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise CLIError(f"{flag} {path}: not writable")


def _probability(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise CLIError(f"{what} {text!r}: not a number") from None
    if not (math.isfinite(value) and 0 <= value < 1):
        raise CLIError(f"{what} {text!r}: a probability must be in [0, 1)")
    return value


def _burst(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise CLIError(f"--loss-burst {text!r}: not a number of packets") from None
    if not (math.isfinite(value) and value >= 1):
        raise CLIError(f"--loss-burst {text!r}: the mean burst is at least 1 packet (1: independent losses)")
    return value


def _config(args: argparse.Namespace, topology: Topology) -> TailConfig:
    from allreduce.sim import LossModel, parse_distribution, parse_time, parse_timed_fault, resolve_links

    links = []
    for text in args.loss_link:
        link, sep, value = text.rpartition("=")
        if not sep or not link.strip():
            raise CLIError(f"--loss-link {text!r}: write it as LINK=P, e.g. 'leaf0->spine1=1e-4'")
        links.append((link.strip(), _probability(value, f"--loss-link {link.strip()}")))
    mtu = parse_bytes(args.mtu, what="--mtu") if args.mtu else None
    if mtu is not None and mtu <= 0:
        raise CLIError(f"--mtu {args.mtu!r}: must be > 0 bytes")
    rto = parse_time(args.rto, what="--rto") if args.rto else None
    if rto is not None and rto <= 0:
        raise CLIError(f"--rto {args.rto!r}: must be > 0")
    try:
        loss = LossModel(
            _probability(args.loss, "--loss"),
            args.fabric,
            mtu,
            rto,
            tuple(links),
            tcp=args.tcp,
            agreement=not args.no_agreement,
            burst=_burst(args.loss_burst),
        )
    except ValueError as exc:  # the burst's upper bound is the model's
        raise CLIError(f"--loss-burst {args.loss_burst!r}: {exc}") from None
    try:
        link_jitter = parse_distribution(args.jitter_link) if args.jitter_link else None
        rank_jitter = parse_distribution(args.jitter_rank) if args.jitter_rank else None
    except ValueError as exc:
        flag = "--jitter-link" if args.jitter_link and str(args.jitter_link) in str(exc) else "--jitter-rank"
        raise CLIError(f"{flag}: {exc}") from None
    timed = []
    for kind, flag, texts in (
        ("down", "--link-down", args.link_down),
        ("flap", "--flap", args.flap),
        ("degrade", "--degrade-at", args.degrade_at),
    ):
        for text in texts:
            try:
                timed.append(parse_timed_fault(kind, text))
            except ValueError as exc:
                raise CLIError(f"{flag}: {exc}") from None
    for name in [link for link, _ in links] + [f.link for f in timed]:
        resolve_links(topology, name)
    return TailConfig(
        samples=args.samples,
        seed=args.seed,
        loss=loss,
        link_jitter=link_jitter,
        rank_jitter=rank_jitter,
        timed_faults=tuple(timed),
        ecmp_seeds=args.ecmp_seeds,
        attribution=not args.no_attribution,
        engine=args.engine,
    )


# ------------------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------------------
def render_table(results: list[TailResult]) -> list[str]:
    lines = [
        f"{'algorithm':<20} {'noise-free':>10} {'p50':>10} {'p90':>10} {'p99':>10} {'p99.9':>10} {'max':>10} "
        f"{'mean':>10} {'p99/free':>8}  method"
    ]
    for r in results:
        p = r.percentiles("step")
        cells = " ".join(f"{format_seconds(p[key]):>10}" for key in ("p50", "p90", "p99", "p99.9", "max", "mean"))
        # a run that takes no time (one rank) has no slowdown ratio: n/a rather than inf
        ratio = f"{p['p99'] / r.baseline_s:>7.2f}x" if r.baseline_s > 0 else f"{NOT_A_NUMBER:>8}"
        method = r.engine + ("" if r.exact else " ~")
        lines.append(f"{r.name:<20} {format_seconds(r.baseline_s):>10} {cells} {ratio}  {method}")
    return lines


def render_engines(results: list[TailResult]) -> list[str]:
    """How many samples of each algorithm each engine computed."""
    lines = ["samples by engine (fast: the fast engine's recurrence, certified exact; ~: not certified; event):"]
    for r in results:
        counts = r.engine_counts()
        parts = [f"{counts[name]} {name}" for name in ("fast", "fast ~", "event") if counts[name]]
        lines.append(f"  {r.name:<20} {', '.join(parts)}")
    return lines


def render_attribution(result: TailResult, top: int) -> list[str]:
    """The ranks and the links that caused each sample's largest delay on the critical path, most often first."""
    if not result.attribution(1):
        return [f"{result.name}: no sample had a delay on its critical path to blame"]
    lines = [f"what held {result.name} back (the cause of each sample's largest delay on the critical path):"]
    for kind in ("rank", "link"):
        lines.extend(
            f"  {c.name if kind == 'rank' else 'link ' + c.name:<30} set it in {c.fraction:6.1%} of samples   "
            f"(mean delay {format_seconds(c.mean_delay_s)})"
            for c in result.attribution(top, kind)
        )
    return lines


def render_histogram(
    values: npt.NDArray[np.float64], *, bins: int = HISTOGRAM_BINS, width: int = HISTOGRAM_WIDTH
) -> list[str]:
    """A text histogram with the cumulative fraction at each bar's right edge."""
    lo, hi = float(values.min()), float(values.max())
    if hi <= lo:
        return [f"  every sample took {format_seconds(lo)}"]
    counts, edges = np.histogram(values, bins=bins, range=(lo, hi))
    peak = max(int(counts.max()), 1)
    total = 0
    lines = []
    for i, count in enumerate(counts):
        total += int(count)
        bar = "#" * math.ceil(width * int(count) / peak) if count else ""
        lines.append(
            f"  {format_seconds(float(edges[i])):>10} - {format_seconds(float(edges[i + 1])):>10} "
            f"{bar:<{width}} {int(count):>6}  {total / values.size:7.2%}"
        )
    return lines


def _write_csv(path: str, results: list[TailResult]) -> None:
    try:
        with Path(path).open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(
                [
                    "algorithm",
                    "sample",
                    "step_s",
                    "collective_s",
                    "culprit",
                    "culprit_delay_s",
                    "lost_transfers",
                    "timeouts",
                ]
            )
            for r in results:
                for i in range(r.samples):
                    writer.writerow(
                        [
                            r.name,
                            i,
                            repr(float(r.step_s[i])),
                            repr(float(r.collective_s[i])),
                            r.culprit_name(int(r.culprit[i]))[1],
                            repr(float(r.culprit_delay_s[i])),
                            int(r.lost_transfers[i]),
                            int(r.timeouts[i]),
                        ]
                    )
    except OSError as exc:
        raise CLIError(f"--csv {path}: cannot write it ({exc.strerror})") from None


def _write_plot(path: str, results: list[TailResult], title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CLIError(f"--plot {path}: needs matplotlib (pip install matplotlib)") from None
    figure, axes = plt.subplots(figsize=(7, 4))
    for r in results:
        values = np.sort(r.step_s)
        axes.plot(values * 1e3, np.arange(1, values.size + 1) / values.size, label=r.name)
    axes.set_xlabel("step time (ms)")
    axes.set_ylabel("fraction of samples")
    axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend()
    try:
        figure.savefig(path, dpi=120, bbox_inches="tight")
    except OSError as exc:
        raise CLIError(f"--plot {path}: cannot write it ({exc.strerror})") from None
    finally:
        plt.close(figure)


REPLANNED = "ring_replanned"
"""The name of the re-planned ring's row (``--mitigate``); a schedule re-planned around a slow rank is named for its
algorithm (``double_binary_tree_replanned``)."""


def _replanned_name(m: Mitigation) -> str:
    return REPLANNED if m.algorithm == "ring" else f"{m.algorithm}_replanned"


def _replanned_schedule(m: Mitigation) -> Schedule:
    """The schedule re-planning picked, built as the runtime builds it (a ring order, or around a slow rank another
    algorithm with that rank where it moves the fewest bytes)."""
    return dataclasses.replace(replan_schedule(m.algorithm, m.order, chunks=m.chunks), name=_replanned_name(m))


def _ring_rows(m: Mitigation, results: list[TailResult]) -> tuple[TailResult, TailResult]:
    """The ring as placed and the re-planned schedule among ``results`` (both there under ``--mitigate``)."""
    by_name = {r.name: r for r in results}
    return by_name["ring"], by_name[_replanned_name(m)]


def _mitigation_json(m: Mitigation, results: list[TailResult]) -> dict[str, object]:
    placed, replanned = _ring_rows(m, results)
    out: dict[str, object] = {
        "algorithm": m.algorithm,
        "chunks": m.chunks,
        "slow_ranks": list(m.slow_ranks),
        "order": list(m.order),
        "rounds": m.rounds,
        "slowest_link_before_GBps": m.slowest_before_Bps / 1e9,
        "slowest_link_after_GBps": m.slowest_after_Bps / 1e9,
        "note": m.note,
    }
    for q in (50, 99):
        out[f"p{q}_before_s"] = float(np.percentile(placed.step_s, q))
        out[f"p{q}_after_s"] = float(np.percentile(replanned.step_s, q))
    return out


def _render_mitigation(m: Mitigation, results: list[TailResult]) -> list[str]:
    placed, replanned = _ring_rows(m, results)
    p50, p99 = (tuple(float(np.percentile(r.step_s, q)) for r in (placed, replanned)) for q in (50, 99))
    around = (
        f"the {m.algorithm}{f' ({m.chunks} chunks)' if m.chunks else ''} re-planned around slow rank"
        f"{'s' if len(m.slow_ranks) > 1 else ''} {','.join(map(str, m.slow_ranks))}"
        if m.algorithm != "ring"
        else "the ring re-planned around its slow links"
    )
    lines = [
        f"re-planning (--mitigate): the ring as placed against {around} ({_replanned_name(m)}): "
        f"p50 {format_seconds(p50[0])} -> {format_seconds(p50[1])}, p99 {format_seconds(p99[0])} -> "
        f"{format_seconds(p99[1])}; slowest ring link {m.slowest_before_Bps / 1e9:.3g} -> "
        f"{m.slowest_after_Bps / 1e9:.3g} GB/s",
    ]
    if tuple(m.order) != tuple(range(len(m.order))):
        lines.append(f"  order {','.join(map(str, m.order[:32]))}{',...' if len(m.order) > 32 else ''}")
    if m.note:
        lines.append(f"  {m.note}")
    return lines


def run(args: argparse.Namespace) -> int:
    from allreduce.cli._sim import _faults, _placement, _schedules
    from allreduce.sim import simulate_tail
    from allreduce.topology import parse_topology

    if args.csv:
        _check_output("--csv", args.csv)
    if args.plot:
        _check_output("--plot", args.plot)
        if importlib.util.find_spec("matplotlib") is None:
            raise CLIError(f"--plot {args.plot}: needs matplotlib (pip install matplotlib)")
    topology = parse_topology(args.topology)
    world_size = args.ranks if args.ranks is not None else topology.num_gpus
    if world_size > topology.num_gpus:
        raise CLIError(f"--ranks {world_size}: {topology.name} has only {topology.num_gpus} GPUs")
    need = tail_memory_bytes(world_size, args.samples)
    if need > TAIL_MEMORY_LIMIT_BYTES:
        most = TAIL_MEMORY_LIMIT_BYTES // tail_memory_bytes(world_size, 1)
        raise CLIError(
            f"--samples {args.samples:,}: {world_size:,} ranks x {args.samples:,} samples need about "
            f"{need / 2**30:,.1f} GiB, over the limit of {TAIL_MEMORY_LIMIT_BYTES / 2**30:g} GiB; at most "
            f"{most:,} samples at this size"
        )
    size = parse_bytes(args.size, what="--size")
    if size <= 0:
        raise CLIError(f"--size must be greater than 0 bytes, got {args.size!r}")
    faults = _faults(args, topology, world_size)
    config = _config(args, topology)
    placement = _placement(args.placement)
    schedules, skipped = _schedules(args, topology, world_size)
    if not schedules:
        raise CLIError("no algorithm left to simulate: " + "; ".join(skipped))
    mitigation = None
    if args.mitigate:
        if not 2 <= world_size <= MAX_MITIGATE_RANKS:
            raise CLIError(
                f"--mitigate: re-planning is predicted for 2..{MAX_MITIGATE_RANKS:,} ranks, got {world_size:,}"
            )
        mitigation = mitigate_ring(topology, world_size, size_bytes=size, placement=placement, routing=args.routing,
                                   seed=args.seed, faults=faults, beyond_ring=True)  # fmt: skip
        if not any(schedule.name == "ring" for schedule in schedules):
            schedules.append(ring_all_reduce(world_size))
        schedules.append(_replanned_schedule(mitigation))
    results = []
    show = sys.stderr.isatty() and not args.json
    for i, schedule in enumerate(schedules):
        steps = sum(phase.repeat for phase in schedule.phases())
        label = f"{schedule.name} ({i + 1}/{len(schedules)})"

        def bar(fraction: float, label: str = label) -> None:
            filled = int(30 * fraction)
            print(f"\r{label} [{'#' * filled}{'.' * (30 - filled)}] {fraction:4.0%}\033[K", end="", file=sys.stderr)
            sys.stderr.flush()

        wants_bar = show and world_size * steps * args.samples >= PROGRESS_MIN_WORK
        results.append(
            simulate_tail(
                schedule,
                topology,
                size_bytes=size,
                config=config,
                placement=placement,
                routing=args.routing,
                seed=args.seed,
                faults=faults,
                progress=bar if wants_bar else None,
                exact_budget_s=args.exact_budget,
            )
        )
        if wants_bar:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
    if args.csv:
        _write_csv(args.csv, results)
    header = (
        f"{world_size} ranks, {format_bytes(size)} per rank on {topology.name}; {args.samples} samples, "
        f"seed {args.seed}; noise: {results[0].description}"
    )
    stack = config.loss.stack.settings() if config.loss and config.loss.fabric == "tcp" else None
    if args.plot:
        _write_plot(args.plot, results, header)
    if args.json:
        print(
            dumps(
                {
                    "topology": topology.name,
                    "ranks": world_size,
                    "size_bytes": size,
                    "samples": args.samples,
                    "seed": args.seed,
                    "tcp": None if stack is None else {"stack": config.loss.tcp, "settings": stack},
                    "algorithms": [r.to_json(top=args.top) for r in results],
                    "skipped": skipped,
                    **({"mitigation": _mitigation_json(mitigation, results)} if mitigation else {}),
                }
            )
        )
        return 0
    lines = [header]
    if stack is not None:
        lines.append(f"tcp stack {stack}")
    lines += ["", "step time (arrival + all-reduce) over the samples:", *render_table(results)]
    lines += ["", *render_engines(results)]
    for r in results:
        if r.culprit.max() >= 0 or not args.no_attribution:
            lines += ["", *render_attribution(r, args.top)]
    worst = max(results, key=lambda r: float(np.percentile(r.step_s, 99)))
    lines += ["", f"histogram of {worst.name}'s step time (count, cumulative fraction):"]
    lines += render_histogram(worst.step_s)
    if not all(r.exact for r in results):
        lines.append(
            "(~ samples the fast engine's recurrence could not certify exact and the event engine did not re-run: "
            "see --engine and docs/tail.md)"
        )
    if mitigation is not None:
        lines += ["", *_render_mitigation(mitigation, results)]
    lines.extend(f"(note: {s})" for s in skipped)
    if args.csv:
        lines.append(f"samples: {args.csv}")
    if args.plot:
        lines.append(f"plot: {args.plot}")
    print("\n".join(lines))
    return 0


# ------------------------------------------------------------------------------------------------------------
# The demo's tail section
# ------------------------------------------------------------------------------------------------------------
# The demo's scenario: 1 GiB ring all-reduce on a simulated 1,024-GPU fat-tree (k=16, 400 Gb/s, 1 µs per hop).
DEMO_SIZE_BYTES = 2**30
DEMO_SAMPLES = 100
# Linux's minimum RTO, and a tuned data-centre stack's.
DEMO_RTOS_S = (0.2, 0.004)
DEMO_LOSSES = (1e-6, 1e-7)
# One congested port: a host link running at a tenth of its bandwidth; one straggler: a rank arriving 5 ms late.
DEMO_CONGESTED_LINK = "gpu517->edge64"
DEMO_CONGESTION_FACTOR = 0.1
DEMO_STRAGGLER_RANK = 517
DEMO_STRAGGLER_S = 5e-3


def demo_section() -> str:
    """The tail on a simulated 1,024-GPU fat-tree: what one dropped packet per 10^6 or 10^7 costs with a 200 ms
    and a 4 ms retransmission timeout (TCP), and what one congested port or one straggler costs, with the
    culprit named."""
    from allreduce.schedules import all_reduce
    from allreduce.sim import LinkDegrade, LossModel, simulate_tail
    from allreduce.topology import fat_tree

    topology = fat_tree(16)
    ring = all_reduce("ring", 1024)
    lines = [
        f"1 GiB ring all-reduce on 1,024 GPUs ({topology.name}), {DEMO_SAMPLES} samples each; TCP over a 1,500 B MTU",
        "",
        f"{'case':<44} {'p50':>10} {'p99':>10} {'p99.9':>10}  culprit (share of samples)",
    ]

    def row(label: str, config: TailConfig) -> TailResult:
        result = simulate_tail(ring, topology, size_bytes=DEMO_SIZE_BYTES, config=config)
        p = result.percentiles("step")
        top = result.attribution(1)
        who = f"{top[0].name} ({top[0].fraction:.0%})" if top else "-"
        if config.loss:
            who = f"{result.timeouts.mean():.1f} timeouts per step; most often {who}"
        cells = " ".join(f"{format_seconds(p[k]):>10}" for k in ("p50", "p99", "p99.9"))
        lines.append(f"{label:<44} {cells}  {who}")
        return result

    free = row("noise-free", TailConfig(samples=1))
    medians = {}
    for loss in DEMO_LOSSES:
        for rto in DEMO_RTOS_S:
            config = TailConfig(samples=DEMO_SAMPLES, seed=1, loss=LossModel(loss, "tcp", rto_s=rto))
            medians[loss, rto] = row(f"1 packet in {1 / loss:.0e} lost, RTO {format_seconds(rto)}", config)
    congested = LinkDegrade(DEMO_CONGESTED_LINK, 0.0, factor=DEMO_CONGESTION_FACTOR)
    port = row(
        f"one congested port ({DEMO_CONGESTED_LINK} at {DEMO_CONGESTION_FACTOR:.0%})",
        TailConfig(samples=1, timed_faults=(congested,)),
    )
    late = row(
        f"one straggler (rank {DEMO_STRAGGLER_RANK}, {format_seconds(DEMO_STRAGGLER_S)} late)",
        TailConfig(samples=1, stragglers=((DEMO_STRAGGLER_RANK, DEMO_STRAGGLER_S),)),
    )
    worst = medians[DEMO_LOSSES[0], DEMO_RTOS_S[0]].percentiles("step")["p50"]
    tuned = medians[DEMO_LOSSES[0], DEMO_RTOS_S[1]].percentiles("step")["p50"]
    lines += [
        "",
        f"-> one packet in a million lost makes the median step {worst / free.baseline_s:.0f}x slower with a "
        f"{format_seconds(DEMO_RTOS_S[0])} RTO, {tuned / free.baseline_s:.1f}x with {format_seconds(DEMO_RTOS_S[1])}: "
        "a tail loss stalls every rank",
        f"-> one port at {DEMO_CONGESTION_FACTOR:.0%} costs {port.step_s[0] / free.baseline_s:.1f}x; one rank "
        f"{format_seconds(DEMO_STRAGGLER_S)} late costs every rank {format_seconds(late.step_s[0] - free.baseline_s)}",
        "(the culprit: the cause of each sample's largest delay on the critical path; allreduce tail names it)",
    ]
    return "\n".join(lines)
