"""``allreduce emulate``: a real cluster of network namespaces built from a topology, the runtime run across it."""

from __future__ import annotations

import argparse

from allreduce.cli._args import algorithm_for_ranks, non_negative_int, positive_int
from allreduce.cli._json import dumps
from allreduce.cli._main import CLIError
from allreduce.emulate import (
    BURST_NOTE_SHARE,
    DEFAULT_CONGESTION,
    DEFAULT_LOSS_RATE_BPS,
    DEFAULT_NAME,
    DEFAULT_RATE_BPS,
    MAX_HOSTS,
    MIN_BURST_BYTES,
    TAIL_MIN_REPS,
    WIRE_BURST_BYTES,
    EmulationError,
    EmulationSpec,
    LossSpec,
    RunResult,
    build,
    check_privileges,
    existing_emulations,
    load,
    remove,
    run,
    running,
)
from allreduce.units import (
    format_bandwidth,
    format_bytes,
    format_seconds,
    parse_bandwidth,
    parse_bytes,
    parse_size_range,
)

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "emulate",
        help="build a topology as network namespaces on this machine and run the real runtime across it (root)",
        description=(
            "An emulated cluster: one network namespace per host and per switch, veth cables, switches that route\n"
            "(ECMP across equal paths, L4 hash), every link direction shaped with a token bucket at its bandwidth\n"
            "scaled so the fastest host link runs at --rate (relative speeds kept). `run` starts one rank per host\n"
            "over TCP and prints each measurement beside the simulator's prediction for the same network.\n"
            f"Needs root and iproute2; at most {MAX_HOSTS} hosts."
        ),
        epilog=(
            "examples:\n"
            "  allreduce emulate up --topology clos:leaves=2,spines=2,hosts_per_leaf=4\n"
            "  allreduce emulate run --algorithm ring --sizes 1MiB,8MiB,32MiB\n"
            "  allreduce emulate down\n"
            "  allreduce emulate run --topology clos:leaves=2,spines=2,hosts_per_leaf=2,oversub=4 --sizes 8MiB"
            "   (up, run, down)"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)

    def spec_arguments(q: argparse.ArgumentParser, *, required: bool) -> None:
        q.add_argument(
            "--topology",
            "-t",
            required=required,
            help="a spec (clos:..., fat-tree:k=4, ...) or a .yaml/.json file, as for `allreduce sim`",
        )
        q.add_argument(
            "--rate",
            help=f"shaped rate of the fastest host link (default {DEFAULT_RATE_BPS / 1e6:g}Mbps, "
            f"{DEFAULT_LOSS_RATE_BPS / 1e6:g}Mbps with --loss/--loss-all: one-MSS packets cost more CPU); every "
            "link keeps its ratio to it",
        )
        q.add_argument(
            "--degrade", action="append", default=[], metavar="LINK=FACTOR", help="run LINK at FACTOR x its rate"
        )
        q.add_argument(
            "--queue",
            action="append",
            default=[],
            metavar="LINK=BYTES",
            help="a shallow queue on LINK (e.g. 'leaf0->spine0=64KiB'): a congested port that drops packets",
        )
        q.add_argument(
            "--loss",
            action="append",
            default=[],
            metavar="LINK=P",
            help="LINK drops TCP packets with probability P ('leaf0->spine0=1e-3'; 'a<->b' both directions), or in "
            "bursts: 'LINK=ge:p=1e-3,burst=4' (Gilbert-Elliott, mean burst 4 packets)",
        )
        q.add_argument("--loss-all", metavar="P", help="every link direction drops TCP packets: P or ge:p=P,burst=B")
        q.add_argument(
            "--burst",
            metavar="BYTES",
            help=f"the links' token-bucket burst (default {format_bytes(WIRE_BURST_BYTES)} with --loss/--loss-all, "
            f"{format_bytes(MIN_BURST_BYTES)} without): what a link idle long enough sends at the veth's speed",
        )

    up = verbs.add_parser("up", help="build the emulated cluster and leave it up")
    spec_arguments(up, required=True)
    up.add_argument("--name", default=DEFAULT_NAME, help="name of this emulation (default %(default)s)")
    down = verbs.add_parser("down", help="remove an emulated cluster (exactly what `up` created)")
    down.add_argument("--name", default=DEFAULT_NAME, help="name of the emulation (default %(default)s)")
    down.add_argument("--all", action="store_true", help="remove every emulation with a state file")
    verbs.add_parser("status", help="list the emulations that are up")
    go = verbs.add_parser("run", help="time all-reduce across the hosts, with the simulator's prediction beside it")
    spec_arguments(go, required=False)
    go.add_argument("--name", default=DEFAULT_NAME, help="emulation to use (default %(default)s)")
    go.add_argument("--algorithm", "-a", default="ring", help="all-reduce algorithm (default %(default)s)")
    go.add_argument("--sizes", default="1MiB,8MiB,32MiB", help="bytes per rank (default %(default)s)")
    go.add_argument("--reps", type=positive_int("--reps"), default=3, help="timed repetitions (default %(default)s)")
    go.add_argument("--ranks", "-n", type=positive_int("--ranks"), help="number of ranks (default: every host)")
    go.add_argument(
        "--placement", default="linear", help="linear (default), random, or host indices by rank: 0,4,1,5,..."
    )
    go.add_argument("--seed", type=non_negative_int("--seed"), default=0, help="seed of random placement")
    go.add_argument(
        "--congestion",
        default=DEFAULT_CONGESTION,
        help="TCP congestion control of the ranks' connections (default %(default)s, stock Linux's; 'default' keeps "
        "the kernel's: BBR's rate estimate is misled by the emulated links' token-bucket burst, see docs/emulate.md)",
    )
    go.add_argument(
        "--realtime",
        action="store_true",
        help="run every rank at SCHED_FIFO priority 10, as a host with cores of its own would (docs/emulate.md)",
    )
    go.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_main)


def _pairs(values: list[str], flag: str, convert: type[float] | type[int]) -> tuple[tuple[str, float], ...]:
    out = []
    for text in values:
        link, sep, value = text.rpartition("=")
        if not sep or not link.strip():
            raise CLIError(f"{flag} {text!r}: write it as LINK=VALUE, e.g. 'leaf0->spine1=0.1'")
        try:
            number = float(value) if convert is float else float(parse_bytes(value, what=flag))
        except ValueError:
            raise CLIError(f"{flag} {text!r}: {value!r} is not a number") from None
        if not number > 0:
            raise CLIError(f"{flag} {text!r}: the value must be greater than 0")
        out.append((link.strip(), number))
    return tuple(out)


def _placement(text: str) -> str | list[int]:
    if text in ("linear", "random"):
        return text
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise CLIError(f"--placement {text!r}: use linear, random, or host indices such as 0,4,1,5") from None


def _spec(args: argparse.Namespace) -> EmulationSpec:
    lossy = bool(args.loss or args.loss_all)
    if args.rate is not None:
        rate = parse_bandwidth(args.rate, what="--rate")
    else:
        rate = (DEFAULT_LOSS_RATE_BPS if lossy else DEFAULT_RATE_BPS) / 8
    degrade = _pairs(args.degrade, "--degrade", float)
    queue = tuple((link, int(b)) for link, b in _pairs(args.queue, "--queue", int))
    loss = []
    for text in args.loss:
        link, sep, value = text.partition("=")
        if not sep or not link.strip():
            raise CLIError(f"--loss {text!r}: write it as LINK=P or LINK=ge:p=P,burst=B, e.g. 'leaf0->spine0=1e-3'")
        loss.append((link.strip(), LossSpec.parse(value, what=f"--loss {link.strip()}")))
    loss_all = LossSpec.parse(args.loss_all, what="--loss-all") if args.loss_all else None
    burst = None if args.burst is None else int(parse_bytes(args.burst, what="--burst"))
    spec = EmulationSpec(
        args.topology,
        name=args.name,
        rate_bps=rate * 8,
        degrade=degrade,
        queue=queue,
        loss=tuple(loss),
        loss_all=loss_all,
        burst=burst,
    )
    if burst is not None:
        spec.burst_bytes(spec.layout())  # a ValueError naming --burst before anything is built
    return spec


def _format(result: RunResult, spec: EmulationSpec) -> str:
    built = spec.layout()
    asked_loss = {built.topology.link_name(link): loss.describe() for link, loss in spec.losses(built).items()}
    lines = [
        f"{spec.topology}: {len(result.placement)} ranks, {result.algorithm}, fastest host link "
        f"{format_bandwidth(result.rate_bps / 8)}, one hop {format_seconds(result.hop_latency_s)} (UDP echo), TCP "
        f"congestion control {result.congestion}" + (", ranks at SCHED_FIFO" if result.realtime else ""),
        f"{'size':>9} {'measured':>10} {'(min-max)':>21} {'predicted':>10} {'(ECMP luck)':>21} {'ratio':>6}  "
        f"{'exact':>5}  "
        f"{'busiest link (counters)':<24} {'sim bottleneck':<18} {'agree':>5} {'retrans':>7}",
    ]
    for row in result.rows:
        spread = f"{format_seconds(min(row.seconds))}-{format_seconds(max(row.seconds))}"
        luck = f"{format_seconds(row.predicted_range_s[0])}-{format_seconds(row.predicted_range_s[1])}"
        lines.append(
            f"{format_bytes(row.size_bytes):>9} {format_seconds(row.median_s):>10} {spread:>21} "
            f"{format_seconds(row.predicted_s):>10} {luck:>21} {row.ratio:>6.3f}{'*' if row.burst_bound else ' '} "
            f"{'yes' if row.exact else 'NO':>5}  "
            f"{row.busiest_link:<24} {row.predicted_bottleneck:<18} {'yes' if row.bottleneck_agrees else 'no':>5} "
            f"{row.retransmissions:>7}"
        )
    if result.rows and len(result.rows[0].seconds) >= TAIL_MIN_REPS:
        lines.append("the tail over the repetitions (a dropped packet costs a retransmission; watch retrans):")
        for row in result.rows:
            lines.append(
                f"{format_bytes(row.size_bytes):>9}  p50 {format_seconds(row.percentile_s(50))}  p90 "
                f"{format_seconds(row.percentile_s(90))}  p99 {format_seconds(row.percentile_s(99))}  max "
                f"{format_seconds(max(row.seconds))}  ({len(row.seconds)} repetitions, {row.retransmissions} "
                "retransmitted segments)"
            )
            for link, sent, drops in row.dropped:
                asked = f", asked {asked_loss[link]}" if link in asked_loss else ""
                lines.append(
                    f"{'':>9}  {link} dropped {drops:,} of {sent + drops:,} packets ({drops / (sent + drops):.2e}"
                    f"{asked})"
                )
            for stack, (p50, p90, p99, most) in row.predicted_tails:
                lines.append(
                    f"{'':>9}  the tail model at those rates (TCP {stack:<7}): p50 {format_seconds(p50)}  p90 "
                    f"{format_seconds(p90)}  p99 {format_seconds(p99)}  max {format_seconds(most)}"
                )
    if any(row.burst_bound for row in result.rows):
        lines.append(
            f"* the links' token-bucket burst ({format_bytes(result.burst_bytes)}) is {BURST_NOTE_SHARE:.0%} "
            "or more of what the busiest link carried per repetition: that much leaves at the veth's speed, not the "
            "shaped rate the prediction assumes, so the burst decides this size (a ratio below 1 is the emulator's, "
            "not the model's); sizes whose busiest link carries 10x the burst measure the network"
        )
    how = {row.paths for row in result.rows}
    split = "the paths the kernel chose" if how == {"kernel"} else "the closest hash seed (paths unreadable)"
    lines.append(f"predicted: the simulator routing every flow on {split}; (ECMP luck): over 16 hash seeds")
    lines.append("busiest link: most bytes per second of its shaped rate; agree: the sim's bottleneck is that busy")
    lines.append("ratio = measured median / predicted; every result was checked exactly against the expected sum")
    return "\n".join(lines)


def _main(args: argparse.Namespace) -> int:
    try:
        if args.verb == "status":
            names = existing_emulations()
            print("\n".join(names) if names else "no emulation is up")
            return 0
        check_privileges()
        if args.verb == "up":
            spec = _spec(args)
            built = build(spec)
            lossy = spec.losses(built)
            print(
                f"emulation {args.name!r} is up: {built.num_hosts} hosts, {len(built.namespaces)} namespaces, "
                f"{len(built.cables)} cables"
                + (f", {len(lossy)} link directions dropping TCP packets" if lossy else "")
                + f"; remove it with `allreduce emulate down --name {args.name}`"
            )
            return 0
        if args.verb == "down":
            names = existing_emulations() if args.all else [args.name]
            for name in names:
                removed = remove(name)
                print(f"emulation {name!r} removed ({len(removed)} namespaces)")
            return 0
        sizes = parse_size_range(args.sizes, what="--sizes")
        placement = _placement(args.placement)
        algorithm = algorithm_for_ranks("--algorithm", args.algorithm)  # a spec is registered in every rank too
        if args.topology is not None:
            spec = _spec(args)
            with running(spec) as built:
                result = run(built, algorithm=algorithm, sizes=sizes, reps=args.reps, ranks=args.ranks,
                             placement=placement, seed=args.seed, congestion=args.congestion,
                             lossy_links=sorted(spec.losses(built)), loss_burst=spec.loss_burst(built),
                             burst_hold_s=spec.burst_hold_s(built), burst_bytes=spec.burst_bytes(built),
                             realtime=args.realtime)  # fmt: skip
        else:
            spec = load(args.name)
            built = spec.layout()
            result = run(built, algorithm=algorithm, sizes=sizes, reps=args.reps, ranks=args.ranks,
                         placement=placement, seed=args.seed, congestion=args.congestion,
                         lossy_links=sorted(spec.losses(built)), loss_burst=spec.loss_burst(built),
                         burst_hold_s=spec.burst_hold_s(built), burst_bytes=spec.burst_bytes(built),
                         realtime=args.realtime)  # fmt: skip
    except EmulationError as exc:
        raise CLIError(str(exc)) from None
    if args.json:
        print(dumps({"spec": spec.to_json(), **result.to_json()}))
    else:
        print(_format(result, spec))
    return 0
