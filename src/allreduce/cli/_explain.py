"""``allreduce explain``: every registered algorithm of a collective (all-reduce unless ``--collective`` names
another) under the α–β–γ model, the fastest, and why."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

from allreduce.cli._args import (
    AlgorithmSelection,
    add_algorithm_argument,
    add_collective_argument,
    positive_bytes,
    positive_int,
)
from allreduce.cli._json import dumps
from allreduce.cli._main import CLIError
from allreduce.schedules import (
    Collective,
    CostModel,
    Prediction,
    Schedule,
    algorithms,
    get_algorithm,
    make_schedule,
    predict,
    predict_seconds,
)
from allreduce.units import (
    NOT_A_NUMBER,
    format_bandwidth,
    format_bytes,
    format_seconds,
    parse_bandwidth,
    parse_seconds,
)

__all__ = ["MAX_EXPLAIN_RANKS", "Explanation", "explain", "register", "render"]

# Pipelined algorithms (those that take ``chunks``) pick their chunk count the way a tuner would: the best of
# these under the model.
_TREE_CHUNKS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Algorithms for small groups whose modelling costs O(N^2): direct has one flow pattern per step for N-1 steps
# (2N(N-1) flows, about _QUADRATIC_BYTES_PER_FLOW each in the timing recurrence: 800 MB and 6 s at 4,096 ranks),
# naive N(N-1) transfers in its one step (260 MB at 1,024 ranks). Named explicitly, a quadratic algorithm is
# explained up to _QUADRATIC_MAX_RANKS or the registry's max_ranks (naive's 2,048); `all` leaves it out above a
# quarter of that, a sixteenth of the memory: about 50-65 MB (peak RSS over the interpreter's).
_QUADRATIC_MAX_RANKS = 4096
_QUADRATIC_BYTES_PER_FLOW = 24
"""Peak bytes per flow of direct's cost-model prediction (tracemalloc: 807 MB for its 33.5 M flows at 4,096)."""
MAX_EXPLAIN_RANKS = 1 << 17
"""The most ranks explain accepts (131,072, the largest cluster the project models): about 1 GB and 10 s for
every algorithm. Above it the streams of the O(N log N) algorithms and the pipelined trees' chunk search grow
past what a workstation holds (2^20 ranks took 7.7 GB and two minutes)."""
_EXPLAIN_BYTES_PER_RANK = 8 << 10
"""Peak memory per rank of explaining every algorithm (measured: 1.0 GB at 131,072 ranks, 7.7 GB at 2^20)."""
_DEFAULT_GROUP_SIZE = 8
# The crossover is bisected over log2(size) in [0, 50]: 40 halvings pin it to 50·2^-40 octaves, a relative error
# of 3e-11, far below the 4 digits printed (each halving evaluates both schedules).
_BISECTION_STEPS = 40


@dataclass(frozen=True)
class Candidate:
    """One algorithm as explained: its prediction and how it was configured."""

    prediction: Prediction
    detail: str
    schedule: Schedule


@dataclass(frozen=True)
class Explanation:
    world_size: int
    size_bytes: int
    model: CostModel
    candidates: tuple[Candidate, ...]  # fastest first
    skipped: tuple[str, ...]  # one line per algorithm left out, with the reason
    crossover_bytes: float | None  # where the two best swap places, if they do between 1 B and 1 PiB
    collective: Collective = Collective.ALL_REDUCE

    @property
    def best(self) -> Candidate:
        return self.candidates[0]


def _schedules(  # noqa: PLR0917 (one private call site)
    world_size: int,
    size_bytes: float,
    model: CostModel,
    group_size: int | None,
    segments: int,
    selection: AlgorithmSelection,
    say: Callable[[str], None],
    collective: Collective,
) -> tuple[list[tuple[Schedule, str]], list[str]]:
    chosen: list[tuple[Schedule, str]] = []
    skipped: list[str] = []
    names = selection.checked().names
    for index, name in enumerate(names):
        say(f"{name} ({index + 1} of {len(names)})")
        entry = get_algorithm(collective, name)
        limit = min(_QUADRATIC_MAX_RANKS, entry.max_ranks or _QUADRATIC_MAX_RANKS) if entry.quadratic else None
        all_limit = limit // 4 if limit is not None else 0
        if limit is not None and world_size > all_limit and not selection.explicit:
            skipped.append(f"{name}: left out above {all_limit} ranks (a small-group algorithm; ask for it by name)")
            continue
        if limit is not None and world_size > limit:
            need = format_bytes(2 * world_size * (world_size - 1) * _QUADRATIC_BYTES_PER_FLOW)
            raise ValueError(
                f"--ranks {world_size}: {name} is explained on at most {limit:,} ranks (its model costs O(N^2) "
                f"flows: {world_size} ranks would need about {need} of memory)"
            )
        detail = ""
        g = group_size
        if "group_size" in entry.parameters:
            if g is None:
                if world_size % _DEFAULT_GROUP_SIZE or world_size <= _DEFAULT_GROUP_SIZE:
                    why = (
                        f"{name}: needs --group-size (the default {_DEFAULT_GROUP_SIZE} does not divide "
                        f"{world_size} ranks into several groups)"
                    )
                    if selection.explicit:
                        raise CLIError(why)
                    skipped.append(why)
                    continue
                g = _DEFAULT_GROUP_SIZE
            detail = f"group size {g}"
        try:
            if "chunks" in entry.parameters:
                schedule, detail = _best_chunks(name, world_size, size_bytes, model, segments, g, say)
            else:
                schedule = make_schedule(collective, name, world_size, group_size=g, segments=segments)
        except ValueError as exc:
            if selection.explicit:
                raise
            skipped.append(f"{name}: {exc}")
            continue
        chosen.append((schedule, detail))
    return chosen, skipped


def _best_chunks(  # noqa: PLR0917 (one private call site)
    name: str,
    world_size: int,
    size_bytes: float,
    model: CostModel,
    segments: int,
    group_size: int | None,
    say: Callable[[str], None],
) -> tuple[Schedule, str]:
    best: tuple[float, Schedule, int] | None = None
    for chunks in _TREE_CHUNKS:
        say(f"{name}, {chunks} chunks")
        schedule = make_schedule(
            Collective.ALL_REDUCE, name, world_size, chunks=chunks, group_size=group_size, segments=segments
        )
        seconds = predict_seconds(schedule, size_bytes, model)
        if best is None or seconds < best[0]:
            best = (seconds, schedule, chunks)
    assert best is not None
    return best[1], f"{best[2]} chunks"


def explain(
    world_size: int,
    size_bytes: int,
    model: CostModel,
    *,
    group_size: int | None = None,
    segments: int = 1,
    selection: AlgorithmSelection | None = None,
    progress: Callable[[str], None] | None = None,
    collective: Collective = Collective.ALL_REDUCE,
) -> Explanation:
    """Predict the selected algorithms of ``collective`` (default: every registered one) for ``world_size`` ranks
    and ``size_bytes`` per rank (all-to-all: what each rank sends, all destinations together). ``progress`` is
    told what is being modelled as the work goes on (at 131,072 ranks every algorithm takes tens of seconds in
    all)."""
    say = progress or (lambda _text: None)
    if world_size < 1:
        raise ValueError(f"--ranks must be >= 1, got {world_size}")
    if world_size > MAX_EXPLAIN_RANKS:
        need = format_bytes(world_size * _EXPLAIN_BYTES_PER_RANK)
        raise ValueError(
            f"--ranks {world_size}: more than the cap of {MAX_EXPLAIN_RANKS:,} ranks (explaining would need about "
            f"{need} of memory)"
        )
    if size_bytes <= 0:
        raise ValueError(f"--size must be > 0 bytes, got {size_bytes}")
    if group_size is not None:
        if group_size < 1:
            raise ValueError(f"--group-size must be >= 1, got {group_size}")
        if world_size % group_size:
            raise ValueError(f"--ranks {world_size} is not divisible by --group-size {group_size}")
    if segments < 1:
        raise ValueError(f"--segments must be >= 1, got {segments}")
    if selection is None:
        selection = AlgorithmSelection(algorithms(collective), explicit=False)
    chosen, skipped = _schedules(world_size, size_bytes, model, group_size, segments, selection, say, collective)
    if not chosen:
        raise CLIError("no algorithm left to explain: " + "; ".join(skipped))
    order = algorithms(collective)
    say("predicting each algorithm")
    candidates = sorted(
        (Candidate(predict(s, size_bytes, model), detail, s) for s, detail in chosen),
        key=lambda c: (c.prediction.seconds, order.index(c.prediction.name)),
    )
    crossover = None
    if len(candidates) >= 2:
        say("the crossover of the two fastest")
        crossover = _crossover(candidates[0].schedule, candidates[1].schedule, size_bytes, model)
    return Explanation(world_size, size_bytes, model, tuple(candidates), tuple(skipped), crossover, collective)


_TIE_RELATIVE = 1e-9
"""Predicted times within this relative difference are a tie (the cost model's sums round differently)."""


def _crossover(first: Schedule, second: Schedule, size_bytes: float, model: CostModel) -> float | None:
    """The buffer size nearest ``size_bytes`` at which ``first`` and ``second`` take equal time, if any."""

    def gap(log_size: float) -> float:
        s = 2.0**log_size
        a, b = predict_seconds(first, s, model), predict_seconds(second, s, model)
        # equal up to rounding (two schedules with the same cost): no sign, so no crossover from noise
        return 0.0 if abs(a - b) <= _TIE_RELATIVE * max(abs(a), abs(b)) else a - b

    here = math.log2(size_bytes)
    at_here = gap(here)
    for far in (0.0, 50.0):  # 1 byte, 1 PiB
        at_far = gap(far)
        if (at_far > 0) == (at_here > 0) or at_far == 0.0 or at_here == 0.0:
            continue
        lo, hi = (far, here) if far < here else (here, far)
        g_lo = gap(lo)
        for _ in range(_BISECTION_STEPS):
            mid = (lo + hi) / 2
            g_mid = gap(mid)
            if (g_mid > 0) == (g_lo > 0):
                lo, g_lo = mid, g_mid
            else:
                hi = mid
        return float(2.0 ** ((lo + hi) / 2))
    return None


def _row_name(c: Candidate) -> str:
    return f"{c.prediction.name} ({c.detail})" if c.detail else c.prediction.name


def _gb_per_s(bandwidth_Bps: float) -> str:
    """The table's bandwidth column: GB/s with two decimals, n/a where the time is 0 (one rank)."""
    return f"{bandwidth_Bps / 1e9:.2f} GB/s" if math.isfinite(bandwidth_Bps) else NOT_A_NUMBER


def render(e: Explanation) -> str:
    """The human table and the one-sentence why."""
    m = e.model
    gamma = "" if m.reduce_bandwidth_Bps is None else f", reduce {format_bandwidth(m.reduce_bandwidth_Bps)}"
    lines = [
        f"{e.collective.value.replace('_', '-').capitalize()} of {format_bytes(e.size_bytes)} per rank on "
        f"{e.world_size} ranks "
        f"(α = {format_seconds(m.latency_s)} per step, link {format_bandwidth(m.bandwidth_Bps)}{gamma})",
        "",
    ]
    header = ("algorithm", "time", "algbw", "busbw", "steps", "sent/rank", "bound")
    rows = []
    for i, c in enumerate(e.candidates):
        p = c.prediction
        rows.append(
            (
                ("* " if i == 0 else "  ") + _row_name(c),
                format_seconds(p.seconds),
                _gb_per_s(p.algbw_Bps),
                _gb_per_s(p.busbw_Bps),
                str(p.steps),
                format_bytes(p.bytes_sent_per_rank),
                p.bound,
            )
        )
    widths = [max(len(r[k]) for r in [("  " + header[0], *header[1:]), *rows]) for k in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if k in (0, 6) else f"{{:>{w}}}" for k, w in enumerate(widths))
    lines.append(fmt.format("  " + header[0], *header[1:]).rstrip())
    lines.extend(fmt.format(*r).rstrip() for r in rows)
    lines.append("")
    lines.append(why(e))
    lines.extend(f"(note: {s})" for s in e.skipped)
    return "\n".join(lines)


def why(e: Explanation) -> str:
    """One sentence: which term dominates the winner, and what it has that the others lack."""
    best = e.best.prediction
    others = [c.prediction for c in e.candidates]
    terms = (
        f"latency {format_seconds(best.latency_s)}, transfer {format_seconds(best.transfer_s)}"
        + (f", reduction {format_seconds(best.reduce_s)}" if best.reduce_s else "")
        + f" of {format_seconds(best.seconds)}"
    )
    least_bytes = min(p.bytes_sent_per_rank for p in others)
    sends_least = best.bytes_sent_per_rank <= least_bytes * (1 + 1e-9)
    lean = [p for p in others if p.bytes_sent_per_rank <= least_bytes * (1 + 1e-9)]
    fewest_steps = min(p.steps for p in others)
    if best.bound == "latency":
        if best.steps == fewest_steps:
            reason = f"it takes the fewest steps of any algorithm ({best.steps})"
        else:
            reason = f"its {best.steps} steps cost less than the alternatives' steps and bytes together"
        reason = f"latency-bound ({terms}): {reason}"
    else:
        if sends_least and best.steps == min(p.steps for p in lean):
            reason = (
                f"it sends the least data per rank ({format_bytes(best.bytes_sent_per_rank)}) and, of the "
                f"algorithms that do, takes the fewest steps ({best.steps})"
            )
        elif sends_least:
            reason = f"it sends the least data per rank ({format_bytes(best.bytes_sent_per_rank)})"
        else:
            reason = (
                f"its {format_bytes(best.bytes_sent_per_rank)} per rank in {best.steps} steps give the shortest "
                "critical path"
            )
        reason = f"bandwidth-bound ({terms}): {reason}"
    text = f"* {_row_name(e.best)} is fastest, {reason}."
    if len(e.candidates) > 1:
        runner = e.candidates[1]
        a, b = e.best.prediction.seconds, runner.prediction.seconds
        if abs(a - b) <= _TIE_RELATIVE * max(a, b):
            text += f" The runner-up, {_row_name(runner)}, takes the same time in this model."
        elif e.crossover_bytes is None:
            text += f" It beats the runner-up, {_row_name(runner)}, at every size from 1 B to 1 PiB."
        else:
            side = "below" if e.crossover_bytes < e.size_bytes else "above"
            text += (
                f" Crossover with the runner-up, {_row_name(runner)}, at {format_bytes(e.crossover_bytes)}: "
                f"{side} that size {runner.prediction.name} is faster."
            )
    return text


def as_json(e: Explanation) -> dict[str, object]:
    return {
        "collective": e.collective.value,
        "ranks": e.world_size,
        "size_bytes": e.size_bytes,
        "algorithms": [
            {
                "name": c.prediction.name,
                "seconds": c.prediction.seconds,
                "algbw_GBps": c.prediction.algbw_Bps / 1e9,
                "busbw_GBps": c.prediction.busbw_Bps / 1e9,
                "steps": c.prediction.steps,
                "bytes_sent_per_rank": c.prediction.bytes_sent_per_rank,
                "bound": c.prediction.bound,
                "latency_s": c.prediction.latency_s,
                "transfer_s": c.prediction.transfer_s,
                "reduce_s": c.prediction.reduce_s,
                "detail": c.detail,
            }
            for c in e.candidates
        ],
        "best": e.best.prediction.name,
        "why": why(e),
        "crossover_bytes": e.crossover_bytes,
        "skipped": list(e.skipped),
    }


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "explain",
        help="predict every algorithm of a collective with the α–β–γ model and say which wins and why",
        description=(
            "Predict the time of every algorithm of a collective (default all_reduce) for N ranks and a buffer of "
            "SIZE bytes per rank (all_to_all: what each rank sends), from each schedule's critical path under the "
            "α–β–γ model (α: per-step latency, β: 1/link bandwidth, γ: 1/reduction bandwidth). algbw = SIZE/time; "
            "busbw = algbw × 2(N-1)/N for all_reduce, (N-1)/N for reduce_scatter, all_gather, all_to_all, gather "
            "and scatter, 1 for broadcast and reduce (nccl-tests)."
        ),
        epilog="example: allreduce explain --ranks 1024 --size 1GiB --bandwidth 400Gbps --latency 5us --group-size 8",
    )
    p.add_argument(
        "--ranks",
        "-n",
        required=True,
        type=positive_int("--ranks"),
        help=f"number of ranks N (at most {MAX_EXPLAIN_RANKS:,})",
    )
    p.add_argument("--size", required=True, help="bytes per rank: 4KiB, 64MiB, 1GB, 512")
    add_collective_argument(p)
    p.add_argument("--bandwidth", required=True, help="link bandwidth per rank: 400Gbps, 100Gb/s, 50GB/s")
    p.add_argument("--latency", required=True, help="α, per-step latency: 5us, 2ms, 100ns")
    p.add_argument(
        "--reduce-bandwidth", help="reduction throughput (γ = 1/this), e.g. 100GB/s; omitted: reductions are free"
    )
    p.add_argument(
        "--group-size",
        type=positive_int("--group-size"),
        help=f"ranks per node for hierarchical (default {_DEFAULT_GROUP_SIZE} when it divides N)",
    )
    p.add_argument(
        "--segments",
        type=positive_int("--segments"),
        default=1,
        help="pipeline each transfer in this many segments (overlaps transfer and reduction; default 1)",
    )
    add_algorithm_argument(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    size = positive_bytes(args.size, flag="--size")
    model = CostModel(
        latency_s=parse_seconds(args.latency, what="--latency"),
        bandwidth_Bps=parse_bandwidth(args.bandwidth, what="--bandwidth"),
        reduce_bandwidth_Bps=(
            None if args.reduce_bandwidth is None else parse_bandwidth(args.reduce_bandwidth, what="--reduce-bandwidth")
        ),
    )
    if args.group_size is not None and args.ranks % args.group_size:
        raise CLIError(f"--ranks {args.ranks} is not divisible by --group-size {args.group_size}")
    status = sys.stderr.isatty()

    def show(text: str) -> None:
        print(f"\rexplaining {args.ranks:,} ranks: {text}...\033[K", end="", file=sys.stderr, flush=True)

    try:
        e = explain(
            args.ranks,
            size,
            model,
            group_size=args.group_size,
            segments=args.segments,
            selection=args.algorithm.for_collective(Collective(args.collective)),
            progress=show if status else None,
            collective=Collective(args.collective),
        )
    finally:
        if status:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
    if args.json:
        print(dumps(as_json(e)))
    else:
        print(render(e))
    return 0
