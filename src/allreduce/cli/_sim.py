"""``allreduce sim``: run all-reduce schedules (or another collective's, ``--collective``) on a cluster topology
with the flow-level simulator."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from allreduce.cli._args import (
    add_algorithm_argument,
    add_collective_argument,
    add_mitigate_argument,
    non_negative_int,
    positive_bytes,
    positive_int,
    world_size_on,
)
from allreduce.cli._json import dumps
from allreduce.cli._main import CLIError
from allreduce.schedules import Collective, Schedule, get_algorithm, make_schedule
from allreduce.sim import (
    AUTO_EXACT_MAX_RANKS,
    AUTO_EXACT_MAX_TRANSFERS,
    FAST_ERROR_RANGE,
    MAX_MITIGATE_RANKS,
    Faults,
    Mitigation,
    SimResult,
    mitigate_ring,
    simulate,
    write_trace,
)
from allreduce.topology import Topology, parse_topology
from allreduce.units import format_bandwidth, format_bytes, format_seconds, parse_bytes, parse_seconds

__all__ = ["ELEMENT_BYTES", "MAX_CHUNKS", "MAX_SIM_RANKS", "check_chunks", "register", "run"]

_T = TypeVar("_T")

# Direct all-reduce has one flow pattern per step (its peers move), so simulating it costs O(N^2) routing and
# rate solves; naive puts N(N-1) flows in its one step. Algorithms for small groups, left out of ``all`` above
# this many ranks (named explicitly, they are simulated).
DIRECT_MAX_RANKS = 256
# Largest group size for hierarchical when neither --group-size nor the topology says what a node is (a node of
# 8 GPUs, as DGX/HGX servers): the largest divisor of the ranks up to it is used.
FALLBACK_GROUP_SIZE = 8
ROUTINGS = ("ecmp", "spray", "shortest", "dimension_order")
MAX_CHUNKS = 4096
"""The most pipeline chunks sim accepts. Every chunk is a step of every rank, so the simulator's time and memory
grow with it (double_binary_tree on 16 ranks: 1,024 chunks 4 s and 100 MB, 65,536 chunks 4 minutes and 2.7 GB).
The best chunk count of a pipelined tree, sqrt(depth · size · β / α), stays below it up to 16 GiB per rank at
400 Gb/s and 1 µs on 131,072 ranks (depth 17: about 2,400)."""
MAX_SIM_RANKS = 1 << 17
"""The most ranks sim accepts (131,072, the largest cluster the simulator is benchmarked on: hierarchical on a
rail-optimized network of that size peaks at 340 MB). A topology may hold more GPUs; pass --ranks to use some."""
_SIM_BYTES_PER_RANK = 4 << 10
"""Peak memory per rank of a simulation, rounded up from the measurements above (2.6 KB per rank at 131,072,
4.5 KB for ring at 16,384), for the estimate in the refusal."""
ELEMENT_BYTES = 4
"""Bytes per element when counting the elements of --size: float32, the usual gradient dtype. A chunk needs at
least one element, or the schedule moves empty blocks."""

_TOPOLOGY_HELP = """\
topology specs (KIND:ARG,KEY=VALUE,...; bandwidths take units: 400Gbps, 50GB/s; latencies: 1us, 500ns):
  fat-tree:k=16               k (even): k pods, k^3/4 GPUs; bw, lat
  clos:leaves=32,spines=8,hosts_per_leaf=32,oversub=4
                              leaves, spines, hosts_per_leaf (hosts), oversub, cores, pods, core_oversub,
                              bw, lat
  rail:nodes=128,gpus=8       nodes, gpus (per node), nvlink, nvlink_lat, nic, pcie, nodes_per_unit, spines,
                              oversub, mesh (NVLink full mesh instead of an NVSwitch), lat
  torus:8x8x8                 dimensions (or dims=), bw, lat
  dragonfly:groups=9,routers=4,hosts=2
                              groups, routers, hosts, global_links, bw, local_bw, global_bw, lat
  switch:64, ring:8, full:8   GPU count (or n=), bw, lat
  FILE.yaml / FILE.json       nodes and links listed one by one: see docs/topology-files.md
link names (for --degrade, --fail and the bottleneck report): SRC->DST by node name, e.g. gpu0->edge0,
edge0->agg1, agg1->core2 (fat-tree), leaf0->spine1 (clos), gpu3->nvs0, nic3->rail3 (rail), r0.1->r0.0
(dragonfly), gpu0->switch0 (switch);
nodes are numbered from 0 per kind (gpu, nic, switches of each tier)"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "sim",
        help="simulate all-reduce on a cluster topology (flow-level, max-min fair links) and name the bottleneck",
        description=(
            "Run all-reduce schedules on a topology with a flow-level network model: concurrent flows share\n"
            "every link max-min fairly; a transfer takes its path latency plus its bytes at its fair rate; a\n"
            "rank's next step starts when the data it needs has arrived. Prints the predicted time, algbw and\n"
            "busbw (nccl-tests definitions) per algorithm and the links the critical path waited on."
        ),
        epilog=(
            _TOPOLOGY_HELP + "\n\n"
            "examples:\n"
            "  allreduce sim --topology fat-tree:k=16 --size 1GiB\n"
            "  allreduce sim --topology clos:leaves=32,spines=8,hosts_per_leaf=32,oversub=4 --ranks 1024 --size 1GiB "
            "--placement random\n"
            "  allreduce sim --topology fat-tree:k=8 --size 256MiB --algorithm ring --degrade 'gpu5->edge2=0.1'"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--topology",
        "-t",
        required=True,
        help="a spec (fat-tree:k=16, clos:..., rail:..., torus:8x8x8, ...) or a .yaml/.json file",
    )
    p.add_argument(
        "--ranks",
        "-n",
        type=positive_int("--ranks"),
        help=f"number of ranks (default: every GPU; at most {MAX_SIM_RANKS:,})",
    )
    p.add_argument("--size", required=True, help="bytes per rank: 4KiB, 64MiB, 1GiB (all_to_all: what each sends)")
    add_collective_argument(p)
    add_algorithm_argument(p)
    p.add_argument("--group-size", type=positive_int("--group-size"), help="ranks per node for hierarchical")
    p.add_argument(
        "--chunks",
        type=positive_int("--chunks"),
        default=8,
        help=f"pipeline chunks of double_binary_tree and others (default 8; at most {MAX_CHUNKS:,} and the "
        f"{ELEMENT_BYTES}-byte elements of --size)",
    )
    p.add_argument(
        "--placement",
        default="linear",
        help="linear (default), random, GPU indices by rank (0,4,1,5,...), or a FILE of them",
    )
    p.add_argument(
        "--seed",
        type=non_negative_int("--seed"),
        default=0,
        help="seed of random placement and of ECMP hashing (default 0)",
    )
    p.add_argument("--routing", choices=ROUTINGS, help="default: the topology's (ECMP; dimension_order on tori)")
    p.add_argument(
        "--degrade", action="append", default=[], metavar="LINK=FACTOR", help="run LINK at FACTOR x its bandwidth"
    )
    p.add_argument("--fail", action="append", default=[], metavar="LINK", help="remove LINK (traffic reroutes)")
    p.add_argument(
        "--slow-rank", action="append", default=[], metavar="R=SECONDS", help="add SECONDS to each step of rank R"
    )
    p.add_argument(
        "--engine",
        choices=("auto", "fast", "event"),
        default="auto",
        help="fast (per flow pattern; exact where it can certify so, else approximate: marked ~), "
        f"event (exact, per transfer), or auto (default): exact on <= {AUTO_EXACT_MAX_RANKS:,} ranks and "
        f"<= {AUTO_EXACT_MAX_TRANSFERS or 0:,} transfers (fast where it is exact, else event), fast beyond",
    )
    p.add_argument("--top", type=non_negative_int("--top"), default=3, help="bottleneck links to list (default 3)")
    add_mitigate_argument(p, what="the predicted time")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace of per-rank steps to FILE")
    p.set_defaults(handler=run)


# ------------------------------------------------------------------------------------------------------------
# Argument parsing
# ------------------------------------------------------------------------------------------------------------
def _split(text: str, flag: str, example: str) -> tuple[str, str]:
    left, sep, right = text.rpartition("=")
    if not sep or not left.strip() or not right.strip():
        raise CLIError(f"{flag} {text!r}: write it as {example}")
    return left.strip(), right.strip()


def _convert(convert: Callable[[str], _T], part: str, *, error: str) -> _T:
    """``convert(part)``, or :class:`CLIError` saying ``error`` where it refuses ``part`` (a ValueError)."""
    try:
        return convert(part)
    except ValueError:
        raise CLIError(error) from None


def _degraded_link(text: str) -> tuple[str, float]:
    """One ``--degrade LINK=FACTOR``."""
    link, factor_text = _split(text, "--degrade", "LINK=FACTOR, e.g. 'leaf0->spine1=0.1'")
    factor = _convert(float, factor_text, error=f"--degrade {text!r}: the factor {factor_text!r} is not a number")
    if not factor > 0:
        raise CLIError(f"--degrade {text!r}: the factor must be > 0 (use --fail to remove a link)")
    return link, factor


def _slow_rank(text: str, world_size: int) -> tuple[int, float]:
    """One ``--slow-rank R=SECONDS``: the delay in seconds, or with a unit (50us)."""
    rank_text, seconds_text = _split(text, "--slow-rank", "R=SECONDS, e.g. 3=50us")
    rank = _convert(int, rank_text, error=f"--slow-rank {text!r}: the rank {rank_text!r} is not a whole number")
    if not 0 <= rank < world_size:
        raise CLIError(f"--slow-rank {text!r}: rank {rank} is not in 0..{world_size - 1}")
    try:
        seconds = float(seconds_text)
    except ValueError:
        seconds = parse_seconds(seconds_text, what=f"--slow-rank {text!r}")
    if seconds < 0:
        raise CLIError(f"--slow-rank {text!r}: the delay must be >= 0")
    return rank, seconds


def _faults(args: argparse.Namespace, topology: Topology, world_size: int) -> Faults:
    degraded = [_degraded_link(text) for text in args.degrade]
    slow = [_slow_rank(text, world_size) for text in args.slow_rank]
    faults = Faults(degraded=tuple(degraded), failed=tuple(args.fail), slow_ranks=tuple(slow))
    # Resolve the link names now, so a typo is reported before any simulation runs.
    from allreduce.sim import resolve_links

    for name in [d[0] for d in degraded] + list(args.fail):
        resolve_links(topology, name)
    return faults


def _inline_placement(text: str) -> list[int]:
    """GPU indices written on the command line: 0,4,1,5 (commas and/or spaces)."""
    gpus: list[int] = []
    for position, token in enumerate(t for t in re.split(r"[\s,]+", text.strip()) if t):
        try:
            gpus.append(int(token))
        except ValueError:
            raise CLIError(
                f"--placement: item {position} ({token[:20]!r}) is not a GPU index; give linear, random, a list "
                "of GPU indices such as 0,4,1,5, or a file of them"
            ) from None
    return gpus


def _placement(text: str) -> str | list[int]:
    if text in ("linear", "random"):
        return text
    path = Path(text)
    try:
        is_file = path.is_file()
    except OSError:  # a name too long for a path: an inline list
        is_file = False
    if not is_file and "," in text:
        return _inline_placement(text)
    if not is_file:
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise CLIError(
            f"--placement {shown!r}: expected linear, random, a list of GPU indices such as 0,4,1,5, or a "
            "readable file of them"
        )
    try:
        content = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"--placement {text}: cannot read it ({exc})") from None
    if content.lstrip().startswith("["):
        try:
            values = json.loads(content)
        except json.JSONDecodeError as exc:
            raise CLIError(f"{text}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise CLIError(f"{text}: expected a JSON list of GPU indices (whole numbers)")
        return list(values)
    gpus: list[int] = []
    for lineno, line in enumerate(content.splitlines(), start=1):
        for token in re.split(r"[\s,]+", line.split("#", 1)[0].strip()):
            if not token:
                continue
            try:
                gpus.append(int(token))
            except ValueError:
                raise CLIError(f"{text}:{lineno}: {token!r} is not a GPU index") from None
    return gpus


def check_chunks(chunks: int, size_bytes: int) -> None:
    """Refuse more pipeline chunks than :data:`MAX_CHUNKS` or than the buffer has (float32) elements."""
    elements = size_bytes // ELEMENT_BYTES
    if chunks > elements:
        raise ValueError(
            f"--chunks {chunks}: more chunks than the {elements:,} elements ({ELEMENT_BYTES}-byte) of --size "
            f"{size_bytes} bytes"
        )
    if chunks > MAX_CHUNKS:
        raise ValueError(
            f"--chunks {chunks}: more than the cap of {MAX_CHUNKS:,} chunks (each chunk is a pipeline step of every "
            "rank; the best chunk count of a tree stays below the cap)"
        )


def _group_size(args: argparse.Namespace, topology: Topology, world_size: int) -> tuple[int | None, str]:
    """The hierarchical group size and where it came from, or None and why hierarchical is left out."""
    if args.group_size is not None:
        if world_size % args.group_size:
            raise CLIError(f"--ranks {world_size} is not divisible by --group-size {args.group_size}")
        return args.group_size, f"group size {args.group_size}"
    structure = topology.structure
    for attribute, what in (("gpus_per_node", "GPUs per node"), ("hosts_per_leaf", "hosts per leaf")):
        g = getattr(structure, attribute, None)
        if isinstance(g, int) and 1 < g < world_size and world_size % g == 0:
            return g, f"group size {g} ({what})"
    divisors = [g for g in range(2, min(FALLBACK_GROUP_SIZE, world_size - 1) + 1) if world_size % g == 0]
    if divisors:
        g = divisors[-1]
        if g == FALLBACK_GROUP_SIZE:
            return g, f"group size {g}"
        return g, f"group size {g} (the largest divisor of {world_size} ranks up to {FALLBACK_GROUP_SIZE})"
    return None, (
        f"hierarchical: needs --group-size (no group size up to {FALLBACK_GROUP_SIZE} divides {world_size} ranks "
        "into several groups)"
    )


def _schedules(args: argparse.Namespace, topology: Topology, world_size: int) -> tuple[list[Schedule], list[str]]:
    collective = Collective(getattr(args, "collective", Collective.ALL_REDUCE.value))  # tail models all-reduce
    selection = args.algorithm.for_collective(collective).checked()
    explicit = selection.explicit
    schedules: list[Schedule] = []
    skipped: list[str] = []
    for name in selection.names:
        entry = get_algorithm(collective, name)
        if entry.quadratic and world_size > DIRECT_MAX_RANKS and not explicit:
            skipped.append(f"{name}: left out above {DIRECT_MAX_RANKS} ranks (O(N^2) flows; ask for it by name)")
            continue
        if "chunks" in entry.parameters:
            try:
                check_chunks(args.chunks, parse_bytes(args.size, what="--size"))
            except ValueError as exc:
                if explicit:
                    raise
                skipped.append(f"{name}: {exc}")
                continue
        group_size = None
        if "group_size" in entry.parameters:
            group_size, why = _group_size(args, topology, world_size)
            if group_size is None:
                if explicit:
                    raise CLIError(why.replace("hierarchical", name, 1))
                skipped.append(why.replace("hierarchical", name, 1))
                continue
        try:
            schedules.append(make_schedule(collective, name, world_size, chunks=args.chunks, group_size=group_size))
        except ValueError as exc:
            if explicit:
                raise
            skipped.append(f"{name}: {exc}")
    return schedules, skipped


# ------------------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """What one ``allreduce sim`` run simulated."""

    topology: Topology
    world_size: int
    size_bytes: int
    results: list[SimResult]
    skipped: list[str]
    collective: Collective = Collective.ALL_REDUCE

    @property
    def best(self) -> SimResult:
        return min(self.results, key=lambda r: r.seconds)


def as_json(outcome: Outcome, top: int) -> dict[str, object]:
    results, best = outcome.results, outcome.best
    return {
        "collective": outcome.collective.value,
        "topology": outcome.topology.name,
        "ranks": outcome.world_size,
        "size_bytes": outcome.size_bytes,
        "algorithms": [r.to_json(bottlenecks=top) for r in results],
        "best": best.name,
        "bottlenecks": best.to_json(bottlenecks=top)["bottlenecks"],
        "skipped": outcome.skipped,
    }


def _mitigation_json(m: Mitigation) -> dict[str, object]:
    return {
        "algorithm": m.algorithm,
        "chunks": m.chunks,
        "order": list(m.order),
        "slow_ranks": list(m.slow_ranks),
        "ring_seconds": m.before.seconds,
        "replanned_seconds": m.after.seconds,
        "speedup": m.speedup,
        "slowest_link_before_GBps": m.slowest_before_Bps / 1e9,
        "slowest_link_after_GBps": m.slowest_after_Bps / 1e9,
        "note": m.note,
    }


def _render_mitigation(m: Mitigation) -> str:
    """What re-planning would gain, as the text output's last lines."""
    lines = [
        "",
        f"re-planning (--mitigate): ring as placed {format_seconds(m.before.seconds)}, re-planned {m.algorithm}"
        f"{f' ({m.chunks} chunks)' if m.chunks else ''} {format_seconds(m.after.seconds)} ({m.speedup:.2f}x); "
        "slowest ring link "
        f"{m.slowest_before_Bps / 1e9:.3g} -> {m.slowest_after_Bps / 1e9:.3g} GB/s",
    ]
    if tuple(m.order) != tuple(range(len(m.order))):
        shown = ",".join(map(str, m.order[:32])) + (",..." if len(m.order) > 32 else "")
        lines.append(f"  order {shown}")
    if m.note:
        lines.append(f"  {m.note}")
    return "\n".join(lines)


def _error_range(name: str) -> str:
    """The fast engine's measured error for an algorithm, for a result it could not certify."""
    if name not in FAST_ERROR_RANGE:
        return f"(~ {name}: no measured error range for the fast engine; --engine event gives the exact time)"
    low, high = FAST_ERROR_RANGE[name]
    return f"(~ {name}: {low:+.0%} to {high:+.0%} of the exact time, measured on 6 fabrics at 256 and 1,024 ranks)"


def _collective_of(outcome: Outcome) -> str:
    """The collective as the header names it: unnamed for all-reduce, the one sim runs unless told."""
    return "" if outcome.collective is Collective.ALL_REDUCE else f"{outcome.collective.value} of "


def render(outcome: Outcome, top: int, context: str) -> str:
    results, best = outcome.results, outcome.best
    lines = [
        f"{outcome.world_size} ranks, {_collective_of(outcome)}{format_bytes(outcome.size_bytes)} per rank on "
        f"{outcome.topology.name} "
        f"({context})",
        "",
        f"{'algorithm':<20} {'time':>10} {'algbw':>11} {'busbw':>11}  {'engine':<6} slowest link (utilization)",
    ]
    for r in sorted(results, key=lambda r: r.seconds):
        first = r.bottlenecks[0] if r.bottlenecks else None
        where = f"{first.name} ({first.utilization:.0%})" if first else "-"
        lines.append(
            f"{r.name:<20} {format_seconds(r.seconds):>10} {format_bandwidth(r.algbw_Bps):>11} "
            f"{format_bandwidth(r.busbw_Bps):>11}  {r.engine + ('' if r.exact else '~'):<6} {where}"
        )
    lines += ["", f"best: {best.name}"]
    if best.bottlenecks:
        lines.append(f"links the critical path of {best.name} waited on:")
        for b in best.bottlenecks[:top]:
            lines.append(f"  {b.name:<24} utilization {b.utilization:6.1%}   waited {format_seconds(b.waited_s)}")
        more = best.critical_links - min(top, len(best.bottlenecks))
        if more > 0:
            lines.append(f"  ... and {more} more links it waited on")
    else:
        lines.append(f"{best.name} waited on no link: its time is path latency and rank delays")
    if not all(r.exact for r in results):
        lines.append("(~ approximate: ranks drifted out of lockstep while sharing links, which the fast engine")
        lines.append("   does not model; it tends to overstate the time. --engine event is exact, and slower)")
        lines.extend(_error_range(r.name) for r in results if not r.exact)
    lines.extend(f"(note: {s})" for s in outcome.skipped)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    topology = parse_topology(args.topology)
    world_size = world_size_on(topology, args.ranks)
    if world_size > MAX_SIM_RANKS:
        raise CLIError(
            f"--ranks {world_size}: more than the cap of {MAX_SIM_RANKS:,} ranks (simulating would need about "
            f"{format_bytes(world_size * _SIM_BYTES_PER_RANK)} of memory; pass --ranks to simulate fewer)"
        )
    size = positive_bytes(args.size, flag="--size")
    faults = _faults(args, topology, world_size)
    placement = _placement(args.placement)
    if args.mitigate and args.collective != Collective.ALL_REDUCE.value:
        raise CLIError(f"--mitigate re-plans the all-reduce ring; it does not apply to --collective {args.collective}")
    if args.mitigate and not 2 <= world_size <= MAX_MITIGATE_RANKS:
        raise CLIError(f"--mitigate: re-planning is predicted for 2..{MAX_MITIGATE_RANKS:,} ranks, got {world_size:,}")
    schedules, skipped = _schedules(args, topology, world_size)
    if not schedules:
        raise CLIError("no algorithm left to simulate: " + "; ".join(skipped))
    # The event engine can take a while (a minute for ring on 256 randomly placed torus ranks): on a terminal,
    # say which algorithm is being simulated.
    status = sys.stderr.isatty() and not args.json
    results = []
    for i, schedule in enumerate(schedules):
        label = f"simulating {schedule.name} ({i + 1}/{len(schedules)})"

        def show(fraction: float | None = None, label: str = label) -> None:
            done = "" if fraction is None else f": event engine, {fraction:.0%} of transfers delivered"
            print(f"\r{label}{done}...\033[K", end="", file=sys.stderr, flush=True)

        if status:
            show()
        results.append(
            simulate(
                schedule,
                topology,
                size_bytes=size,
                placement=placement,
                routing=args.routing,
                seed=args.seed,
                faults=faults,
                engine=args.engine,
                progress=show if status else None,
            )
        )
    if status:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    if args.trace:
        try:
            write_trace(args.trace, results)
        except OSError as exc:
            raise CLIError(f"--trace {args.trace}: cannot write it ({exc.strerror})") from None
    outcome = Outcome(topology, world_size, size, results, skipped, Collective(args.collective))
    mitigation = None
    if args.mitigate:
        mitigation = mitigate_ring(
            topology, world_size, size_bytes=size, placement=placement, routing=args.routing, seed=args.seed,
            faults=faults, engine=args.engine, beyond_ring=True,
        )  # fmt: skip
    if args.json:
        print(
            dumps(
                {**as_json(outcome, args.top), **({"mitigation": _mitigation_json(mitigation)} if mitigation else {})}
            )
        )
    else:
        routing = args.routing or topology.default_routing
        shown = args.placement if len(args.placement) <= 40 else args.placement[:37] + "..."
        placement_text = args.placement if isinstance(placement, str) else f"placement from {shown}"
        context = (
            f"placement {placement_text}, routing {routing}"
            if isinstance(placement, str)
            else (f"{placement_text}, routing {routing}")
        )
        if faults:
            context += ", faults: " + ", ".join(
                [f"{link} x{f:g}" for link, f in faults.degraded]
                + [f"{link} failed" for link in faults.failed]
                + [f"rank {r} +{format_seconds(s)}/step" for r, s in faults.slow_ranks]
            )
        print(render(outcome, args.top, context))
        if mitigation is not None:
            print(_render_mitigation(mitigation))
        if args.trace:
            shown = min(world_size, results[0].trace_start_s.shape[1])
            print(f"trace: {args.trace} (ranks 0-{shown - 1} of {world_size}; open in ui.perfetto.dev)")
    return 0
