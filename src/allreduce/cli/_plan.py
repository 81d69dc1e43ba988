"""``allreduce plan``: the cost of a training step for a model on a cluster, its scaling, and what-ifs."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

from allreduce.cli._args import algorithm_selection, non_negative_int, positive_int
from allreduce.cli._json import dumps
from allreduce.cli._main import CLIError
from allreduce.plan import (
    AUTO,
    BACKWARD_FRACTION,
    GRADIENT_DTYPES,
    LLAMA3_RATES,
    PRESETS,
    RUNTIME_LEASE_S,
    RUNTIME_TIMEOUT_S,
    STORAGE_BPS,
    WHAT_IF_LOSS_PROBABILITY,
    Compute,
    FailureSettings,
    GoodputPlan,
    MeasuredBackward,
    Model,
    Plan,
    PlanRequest,
    RecoveryModel,
    compute_seconds,
    duration,
    format_count,
    measure_recovery,
    measure_spec,
    model_from_module,
    model_from_params,
    plan,
    preset,
    rates_with,
    read_profile,
)
from allreduce.runtime import MAX_LEASE_S, MIN_LEASE_S
from allreduce.sim import Distribution, parse_distribution
from allreduce.units import format_bytes, format_seconds

__all__ = ["HelpFormatter", "demo_section", "plan_from_args", "register", "render", "request_from_args", "run"]

MiB = 2**20
# The demo: a Llama-2-7B-sized model on 1,024 GPUs of a k=16 fat tree, H100-class bf16 dense peak (989 TFLOPS)
# at 40% model FLOPs utilization, 4,096 tokens per GPU per step.
DEMO_ARGS = (
    "--model",
    "llama2-7b",
    "--gpus",
    "1024",
    "--topology",
    "fat-tree:k=16",
    "--gpu-tflops",
    "989",
    "--mfu",
    "0.4",
    "--tokens-per-gpu",
    "4096",
)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Examples kept as written; every option's default shown (floats short, unset and off ones left out)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        shown = f"{default:.4g}" if isinstance(default, float) else str(default)
        return f"{text} (default: {shown})"


def _positive_float(name: str, *, at_most: float | None = None) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not value > 0 or (at_most is not None and value > at_most):
            bound = f" and <= {at_most:g}" if at_most is not None else ""
            raise argparse.ArgumentTypeError(f"{name} must be > 0{bound}, got {text!r}")
        return value

    return parse


def _lease(name: str) -> Callable[[str], float]:
    """A lease in seconds: 0 (the heartbeat off), or within the runtime's bounds."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number of seconds, got {text!r}") from None
        if value != 0 and not MIN_LEASE_S <= value <= MAX_LEASE_S:
            raise argparse.ArgumentTypeError(
                f"{name} must be 0 (the heartbeat off) or {MIN_LEASE_S:g} to {MAX_LEASE_S:g} s, got {text!r}"
            )
        return value

    return parse


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", "-m", choices=tuple(PRESETS), help="a model preset")
    which.add_argument("--params", type=_positive_float("--params"), help="a transformer of this many parameters: 7e9")
    which.add_argument("--module", metavar="MODULE:FUNCTION", help="a torch.nn.Module that FUNCTION() returns")
    which.add_argument(
        "--profile",
        metavar="TRACE",
        help="a torch.profiler Chrome trace of one training step (JSON, recorded with record_shapes=True, on any "
        "machine) or a Chakra execution trace of one (protobuf, perhaps gzipped; replayed along its dependencies): "
        "the gradients' sizes and when backward finished each",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="with --module: run forward and backward here and time when each gradient is ready (FUNCTION must "
        "return (module, inputs)); the step then overlaps buckets as measured, not at a fixed rate",
    )
    p.add_argument("--gpus", "-n", type=positive_int("--gpus"), required=True, help="data-parallel GPUs")
    p.add_argument("--topology", "-t", required=True, help="a spec (fat-tree:k=16, clos:..., rail:...) or a file")
    p.add_argument(
        "--algorithm",
        "-a",
        default=AUTO,
        help="all-reduce algorithm: a registered name (allreduce explain -a all lists them), or module:function "
        "or file.py:function of your own (loaded, verified, registered); auto: the fastest per bucket size in the "
        "simulator",
    )
    p.add_argument("--bucket-mb", type=_positive_float("--bucket-mb"), default=25.0, help="DDP bucket cap in MiB")
    p.add_argument(
        "--first-bucket-mb", type=_positive_float("--first-bucket-mb"), default=1.0, help="DDP's first bucket in MiB"
    )
    p.add_argument("--dtype", choices=tuple(GRADIENT_DTYPES), default="bf16", help="gradient element type")
    compute = p.add_argument_group(
        "compute per step (--compute-ms, --compute DIST, or FLOPs from --gpu-tflops and --mfu)"
    )
    compute.add_argument("--compute-ms", type=float, help="forward + backward of one micro-batch, milliseconds")
    compute.add_argument(
        "--compute",
        metavar="DIST",
        help="compute per micro-batch as a distribution over GPUs and steps: lognormal:median=300ms,p99=400ms, "
        "empirical:steps.csv (as allreduce tail); adds p50/p99 step times",
    )
    compute.add_argument(
        "--gpu-tflops",
        type=_positive_float("--gpu-tflops"),
        help="the GPU's peak TFLOPS (with --measure or --profile: the step's counted FLOPs run at this x --mfu)",
    )
    compute.add_argument(
        "--mfu", type=_positive_float("--mfu", at_most=1.0), default=0.4, help="model FLOPs utilization"
    )
    compute.add_argument("--tokens-per-gpu", type=_positive_float("--tokens-per-gpu"), help="tokens per micro-batch")
    compute.add_argument("--samples-per-gpu", type=_positive_float("--samples-per-gpu"), help="images (CNN presets)")
    compute.add_argument(
        "--backward-fraction",
        type=_positive_float("--backward-fraction", at_most=1.0),
        default=BACKWARD_FRACTION,
        help="share of compute that is backward, when bucket all-reduces may run",
    )
    compute.add_argument("--no-overlap", action="store_true", help="all-reduce only after backward ends")
    compute.add_argument("--accumulation", type=positive_int("--accumulation"), default=1, help="micro-batches/step")
    p.add_argument("--placement", choices=("linear", "random"), default="linear", help="rank to GPU mapping")
    p.add_argument("--seed", type=non_negative_int("--seed"), default=0, help="seed of placement and ECMP")
    p.add_argument("--group-size", type=positive_int("--group-size"), help="ranks per node for hierarchical")
    p.add_argument(
        "--engine",
        choices=("auto", "fast", "event"),
        default="auto",
        help="the simulator engine (see allreduce sim --help)",
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "plan",
        help="step time of a model on a cluster: compute, exposed all-reduce, scaling and what-ifs",
        description=(
            "Estimate one training step of data-parallel training: the gradient in DDP buckets (reverse\n"
            "registration order, a small first bucket), each bucket's all-reduce simulated on the topology,\n"
            "overlapped with backward. Prints the step split into compute, waiting and exposed communication,\n"
            "the scaling table from 8 GPUs (doubling, same per-GPU batch), the bottleneck, and what one change\n"
            "would do."
        ),
        epilog=(
            "examples:\n"
            "  allreduce plan --model llama2-7b --gpus 1024 --topology fat-tree:k=16 --gpu-tflops 989 --mfu 0.4 "
            "--tokens-per-gpu 4096\n"
            "  allreduce plan --params 1.3e9 --gpus 64 --topology switch:64 --compute-ms 250 --json > plan.json\n"
            "  allreduce report plan.json -o report.html"
        ),
        formatter_class=HelpFormatter,
    )
    _add_workload_arguments(p)
    p.add_argument("--no-scaling", action="store_true", help="skip the scaling table")
    p.add_argument("--no-what-if", action="store_true", help="skip the what-if table")
    p.add_argument(
        "--loss",
        type=float,
        default=WHAT_IF_LOSS_PROBABILITY,
        metavar="P",
        help="packet loss per link of the what-if loss rows (RoCE 4.29 s timeout, TCP 200 ms and 4 ms RTO); 0: none",
    )
    _add_failure_arguments(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (what `allreduce report` reads)")
    p.add_argument("--report", metavar="FILE", help="also write the HTML report to FILE")
    p.set_defaults(handler=run)


def _add_failure_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group(
        "failures (goodput)",
        "A synchronous job stops when any part it uses fails: per-part rates from the Llama 3 report (419\n"
        "interruptions of 16,384 GPUs in 54 days, docs/plan.md), checkpoints at Daly's optimum interval unless\n"
        "given; the times marked assumed are not from a study: set yours.",
    )
    group.add_argument("--no-failures", action="store_true", help="leave failures and goodput out")
    group.add_argument("--gpus-per-host", type=positive_int("--gpus-per-host"), default=8, help="GPUs per host")
    group.add_argument(
        "--failure-rates",
        metavar="PART=RATE,...",
        help="failures per part-hour of any of gpu, host, nic, cable, switch, software (per GPU), e.g. "
        "gpu=2e-5,switch=1e-6; the parts not named keep the Llama 3 report's rates (docs/plan.md)",
    )
    group.add_argument("--ckpt-write-s", type=_positive_float("--ckpt-write-s"), help="checkpoint write time (s)")
    group.add_argument(
        "--storage-gbps",
        type=_positive_float("--storage-gbps"),
        default=STORAGE_BPS * 8 / 1e9,
        help="aggregate checkpoint write bandwidth, Gbit/s (assumed), when --ckpt-write-s is not given; the "
        "checkpoint holds 14 bytes per parameter (bf16 weights, fp32 master weights, Adam's two moments)",
    )
    group.add_argument("--ckpt-interval-s", type=_positive_float("--ckpt-interval-s"), help="default: Daly's optimum")
    group.add_argument("--restart-s", type=float, default=600.0, help="a failure to training again (assumed)")
    group.add_argument("--replace-s", type=float, default=300.0, help="of that, waiting for a new host (assumed)")
    group.add_argument(
        "--elastic-recovery-s",
        type=float,
        help="shrink-and-continue's pause per failure, given (default: the runtime's kill benchmark, moved to the "
        "job's size: its detection and shrink, the store requests of the agreement, the timeout for silent failures)",
    )
    group.add_argument(
        "--measure-recovery",
        nargs="?",
        const="shm",
        choices=("shm", "tcp"),
        metavar="TRANSPORT",
        help="measure the shrink here first: SIGKILL one of 4 local ranks (shm, or tcp) in an all-reduce loop and "
        "time the kill to the survivors' next step, then move it to the job's size",
    )
    group.add_argument(
        "--elastic-timeout-s",
        type=_positive_float("--elastic-timeout-s"),
        default=RUNTIME_TIMEOUT_S,
        help="the group's timeout (allreduce.init(timeout_s=...)): how long survivors take to give up on a silent "
        "host, and the shrink to leave it out",
    )
    group.add_argument(
        "--elastic-lease-s",
        type=_lease("--elastic-lease-s"),
        default=RUNTIME_LEASE_S,
        help="the group's lease (allreduce.init(lease_s=...)): the store declares a silent host dead after it, "
        f"so the survivors shrink then (0: the heartbeat off, two timeouts; else {MIN_LEASE_S:g} to {MAX_LEASE_S:g})",
    )
    group.add_argument("--repair-h", type=float, default=4.0, help="hours a failed host stays out (assumed)")


def failures_from_args(args: argparse.Namespace) -> FailureSettings | None:
    if args.no_failures:
        if args.measure_recovery is not None:
            raise CLIError("--measure-recovery measures the elastic pause of goodput, which --no-failures leaves out")
        return None
    for flag, value in (
        ("--restart-s", args.restart_s),
        ("--replace-s", args.replace_s),
        ("--elastic-recovery-s", 0.0 if args.elastic_recovery_s is None else args.elastic_recovery_s),
        ("--repair-h", args.repair_h),
    ):
        if not (math.isfinite(value) and 0 <= value <= 1e6):
            raise CLIError(f"{flag} must be a number of {'hours' if flag == '--repair-h' else 'seconds'} in [0, 1e6]")
    if args.replace_s > args.restart_s:
        raise CLIError(f"--replace-s ({args.replace_s:g}) is part of --restart-s ({args.restart_s:g}): not more")
    rates = LLAMA3_RATES
    if args.failure_rates is not None:
        try:
            rates = rates_with(LLAMA3_RATES, args.failure_rates)
        except ValueError as exc:
            raise CLIError(f"--failure-rates: {exc}") from None
    return FailureSettings(
        rates=rates,
        recovery=_recovery_model(args),
        gpus_per_host=args.gpus_per_host,
        write_s=args.ckpt_write_s,
        storage_Bps=args.storage_gbps * 1e9 / 8,
        restart_s=args.restart_s,
        replace_s=args.replace_s,
        interval_s=args.ckpt_interval_s,
        elastic_recovery_s=args.elastic_recovery_s,
        repair_s=args.repair_h * 3600,
    )


def _recovery_model(args: argparse.Namespace) -> RecoveryModel:
    """The elastic recovery model: the runtime's stored measurement, or one made here (--measure-recovery)."""
    if args.measure_recovery is None:
        return RecoveryModel(timeout_s=args.elastic_timeout_s, lease_s=args.elastic_lease_s)
    if args.elastic_recovery_s is not None:
        raise CLIError("give --elastic-recovery-s or --measure-recovery, not both")
    if sys.stderr.isatty() and not args.json:
        print(f"measuring elastic recovery: 4 ranks over {args.measure_recovery}, one killed...", file=sys.stderr)
    try:
        measurement = measure_recovery(transport=args.measure_recovery)
    except (RuntimeError, OSError) as exc:
        raise CLIError(f"--measure-recovery: the measurement failed: {exc}") from None
    return RecoveryModel(measurement, timeout_s=args.elastic_timeout_s, basis="measured", lease_s=args.elastic_lease_s)


def _measured(args: argparse.Namespace) -> MeasuredBackward | None:
    """The measured or profiled step, for --measure or --profile."""
    if args.measure and args.module is None:
        raise CLIError("--measure runs a model: give it with --module MODULE:FUNCTION")
    try:
        if args.profile is not None:
            return read_profile(args.profile)
        if args.measure:
            return measure_spec(args.module)
    except ValueError as exc:
        raise CLIError(f"--{'profile' if args.profile else 'measure'}: {exc}") from None
    return None


def _model(args: argparse.Namespace, measured: MeasuredBackward | None) -> Model:
    if measured is not None:
        return measured.model(args.module or f"profile {Path(args.profile).name}")
    if args.model is not None:
        return preset(args.model)
    if args.params is not None:
        return model_from_params(args.params)
    return model_from_module(args.module)


def _algorithm(text: str) -> str:
    """``--algorithm``: auto, or the one registered algorithm it names (a spec is loaded and registered)."""
    if text == AUTO:
        return AUTO
    selection = algorithm_selection("--algorithm")(text).checked()
    if not selection.explicit or len(selection.names) != 1:
        raise CLIError(f"--algorithm {text!r}: name one algorithm (or auto: the fastest per bucket size)")
    return selection.names[0]


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    algorithm = _algorithm(args.algorithm)
    measured = _measured(args)
    model = _model(args, measured)
    distribution: Distribution | None = None
    if args.compute is not None and (args.compute_ms is not None or args.gpu_tflops is not None):
        raise CLIError("give one of --compute-ms, --compute DIST or --gpu-tflops, not several")
    if args.compute is not None:
        try:
            distribution = parse_distribution(args.compute)
        except ValueError as exc:
            raise CLIError(f"--compute: {exc}") from None
        micro_batch_s = distribution.quantile(0.5)
    elif args.compute_ms is not None:
        if args.compute_ms < 0:
            raise CLIError(f"--compute-ms must be >= 0, got {args.compute_ms:g}")
        if args.gpu_tflops is not None:
            raise CLIError("give --compute-ms or --gpu-tflops, not both")
        micro_batch_s = args.compute_ms / 1e3
    elif args.gpu_tflops is not None and measured is not None:
        try:
            measured = measured.on_gpu(gpu_tflops=args.gpu_tflops, mfu=args.mfu)
        except ValueError as exc:
            raise CLIError(f"--gpu-tflops: {exc}") from None
        micro_batch_s = measured.compute_s
    elif args.gpu_tflops is not None:
        micro_batch_s = compute_seconds(
            model,
            gpu_tflops=args.gpu_tflops,
            mfu=args.mfu,
            tokens_per_gpu=args.tokens_per_gpu,
            samples_per_gpu=args.samples_per_gpu,
        )
    elif measured is not None:
        micro_batch_s = measured.compute_s  # as measured (or profiled): forward and backward
    else:
        raise CLIError(
            "say how long compute takes: --compute-ms, --compute DIST, or --gpu-tflops with --tokens-per-gpu"
        )
    if measured is not None and micro_batch_s != measured.compute_s:
        measured = measured.scaled(micro_batch_s, f"{measured.source}, scaled to {format_seconds(micro_batch_s)}")
    compute = Compute(
        micro_batch_s,
        backward_fraction=measured.backward_share if measured is not None else args.backward_fraction,
        accumulation_steps=args.accumulation,
        overlap=not args.no_overlap,
    )
    return PlanRequest(
        model=model,
        gpus=args.gpus,
        topology=args.topology,
        compute=compute,
        gradient_dtype=args.dtype,
        bucket_cap_bytes=int(args.bucket_mb * MiB),
        first_bucket_bytes=int(args.first_bucket_mb * MiB),
        algorithm=algorithm,
        group_size=args.group_size,
        placement=args.placement,
        seed=args.seed,
        engine=args.engine,
        compute_distribution=distribution,
        measured=measured,
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.2f}"


def _share(part: float, whole: float) -> str:
    return f"{part / whole if whole else 1.0:.1%}"


def render(result: Plan) -> str:
    base = result.base
    request, step = base.request, base.step
    count = format_count(request.model.params)
    size = "" if request.model.name.startswith(count) else f"{count} parameters, "
    lines = [
        f"{request.model.name} ({size}{request.gradient_dtype} gradients) on {request.gpus} GPUs of {request.topology}",
        f"{len(step.bucket_bytes)} buckets (first {format_bytes(step.bucket_bytes[0])}, cap "
        f"{format_bytes(request.bucket_cap_bytes)}); all-reduce: "
        + ", ".join(
            f"{r.count} x {format_bytes(r.size_bytes)} by {r.algorithm} in {format_seconds(r.seconds)}"
            for r in base.runs
        ),
        *([f"backward timing: {request.measured.describe()}"] if request.measured else []),
        "",
        f"step time      {format_seconds(step.step_s)}"
        + (
            f"  (p50 {format_seconds(result.quantiles.p50.step_s)}, p99 {format_seconds(result.quantiles.p99.step_s)}"
            f": {result.quantiles.method})"
            if result.quantiles
            else ""
        ),
        f"  compute      {format_seconds(step.compute_s)}  ({_share(step.compute_s, step.step_s)})",
        f"  waiting      {format_seconds(step.waiting_s)}",
        f"  exposed comm {format_seconds(step.exposed_comm_s)}  (of {format_seconds(step.comm_s)} all-reduce in all)",
    ]
    if result.goodput:
        restart = result.goodput.row("restart")
        lines.append(
            f"with failures  {format_seconds(restart.effective_step_s(step.step_s))} per useful step (goodput "
            f"{restart.goodput:.1%}, restarting from checkpoints; other policies below)"
        )
    lines += [
        f"bottleneck: {result.bottleneck}",
    ]
    if result.scaling:
        spread = any(row.quantiles for row in result.scaling)
        lines += [
            "",
            "scaling (same per-GPU batch)",
            f"{'GPUs':>8} {'step ms':>10} {'exposed ms':>10} {'efficiency':>10}  "
            + (f"{'goodput':>8} {'w/ fails':>8}  " if result.goodput else "")
            + (f"{'p50 ms':>10} {'p99 ms':>10}  " if spread else "")
            + "algorithm",
        ]
        first = result.scaling[0].goodput
        lines.extend(
            f"{row.gpus:>8} {_ms(row.step.step_s)} {_ms(row.step.exposed_comm_s)} {row.efficiency:>10.1%}  "
            + (
                f"{row.goodput:>8.1%} {row.efficiency * row.goodput / first:>8.1%}  "
                if row.goodput is not None and first
                else ""
            )
            + (f"{_ms(row.quantiles.p50.step_s)} {_ms(row.quantiles.p99.step_s)}  " if row.quantiles else "")
            + row.algorithm
            for row in result.scaling
        )
        if result.goodput:
            lines.append(
                "(goodput: restarting from checkpoints; w/ fails: the efficiency with failures counted, against the "
                "first row's goodput)"
            )
    if result.what_ifs:
        lines += ["", *_what_if_lines(result)]
    if result.goodput:
        lines += ["", *_goodput_lines(result.goodput, step.step_s)]
    lines.extend(f"(note: {n})" for n in result.notes)
    return "\n".join(lines)


def _what_if_lines(result: Plan) -> list[str]:
    """The what-if table; with failures counted, each row's step per useful step beside it, and a row per recovery
    policy (its "vs base" compares steps per useful step, restarting from checkpoints in the base)."""
    step = result.base.step
    spread = any(w.quantiles for w in result.what_ifs)
    restart = result.goodput.row("restart").goodput if result.goodput else None
    lines = [
        "what if (one change each)",
        f"{'change':<44} {'step ms':>10} {'vs base':>9} {'exposed ms':>10}"
        + (f" {'w/ fails ms':>11}" if restart is not None else "")
        + (f" {'p99 ms':>10}" if spread else ""),
    ]

    def per_useful_step(step_s: float, goodput: float | None) -> str:
        return "" if goodput is None else f" {step_s / goodput * 1e3 if goodput > 0 else math.inf:>11.2f}"

    lines.append(
        f"{'(base)':<44} {_ms(step.step_s)} {'':>9} {_ms(step.exposed_comm_s)}{per_useful_step(step.step_s, restart)}"
    )
    for w in result.what_ifs:
        if w.step is None:
            lines.append(f"{w.change:<44} {'n/a':>10}  {w.note}")
            continue
        if w.goodput is not None and restart:
            delta = restart / w.goodput - 1 if w.goodput > 0 else math.inf
        else:
            delta = w.step.step_s / step.step_s - 1 if step.step_s else 0.0
        goodput = w.goodput if w.goodput is not None else restart
        p99 = f" {_ms(w.quantiles.p99.step_s)}" if w.quantiles else ""
        lines.append(
            f"{w.change:<44} {_ms(w.step.step_s)} {delta:>+9.1%} {_ms(w.step.exposed_comm_s)}"
            f"{per_useful_step(w.step.step_s, goodput)}{p99}"
        )
    if restart is not None:
        lines.append(
            "(w/ fails: each row's step per useful step, restarting from checkpoints; a failures: row's under its "
            "own policy, and its vs base compares those)"
        )
    return lines


def _goodput_lines(g: GoodputPlan, step_s: float) -> list[str]:
    total = sum(g.failures_per_h.values())
    shares = ", ".join(
        f"{kind} {rate / total:.0%}" for kind, rate in sorted(g.failures_per_h.items(), key=lambda kv: -kv[1]) if rate
    )
    plural = {"gpu": "GPUs", "host": "hosts", "nic": "NICs", "cable": "cables", "switch": "switches"}
    counts = ", ".join(f"{n:,} {plural[kind]}" for kind, n in g.counts.items() if kind in plural and n)
    ckpt = g.checkpoint
    interval = g.row("restart").interval_s
    assumed = ", ".join(name.removesuffix("_s").replace("_", " ") for name in ckpt.assumed)
    lines = [
        f"failures on {g.gpus:,} GPUs ({counts}): one every {duration(g.mtbf_s)} ({shares})",
        f"  rates: {g.source}",
        f"  checkpoint written in {format_seconds(ckpt.write_s)} every {format_seconds(interval or 0)} of training "
        f"({'given' if ckpt.interval_s else 'Daly'}); restart {format_seconds(ckpt.restart_s)}; assumed: {assumed}",
        *(f"  {line}" for line in g.recovery.describe()),
        f"{'recovery policy':<40} {'goodput':>8} {'effective step ms':>18} {'pause per failure':>18} "
        f"{'work lost per failure':>22}",
    ]
    described = {
        "restart": "restart from the last checkpoint",
        "spares": "the same, with hot spare hosts",
        "elastic": "shrink and continue (group.shrink)",
    }
    lines.extend(
        f"{described[r.policy]:<40} {r.goodput:>8.1%} {_ms(r.effective_step_s(step_s)):>18} "
        f"{duration(r.restart_s):>18} {duration(r.lost_s):>22}"
        for r in g.rows
    )
    return lines


def _progress(enabled: bool) -> Callable[[str], None] | None:
    def show(text: str) -> None:
        print(f"\rplanning: {text}...\033[K", end="", file=sys.stderr, flush=True)

    return show if enabled else None


def plan_from_args(args: argparse.Namespace, *, curve: bool, progress: Callable[[str], None] | None = None) -> Plan:
    """The plan ``allreduce plan ARGS`` makes (``curve``: with the busbw curve the report draws)."""
    request = request_from_args(args)
    if not 0 <= args.loss < 1:
        raise CLIError(f"--loss {args.loss:g}: a probability per packet must be in [0, 1)")
    return plan(
        request,
        loss_probability=args.loss,
        scaling=not args.no_scaling,
        what_ifs=not args.no_what_if,
        curve=curve,
        progress=progress,
        failures=failures_from_args(args),
    )


def run(args: argparse.Namespace) -> int:
    status = sys.stderr.isatty() and not args.json
    # the busbw curve is drawn in the report, not printed
    result = plan_from_args(args, curve=bool(args.json or args.report), progress=_progress(status))
    if status:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    if args.report:
        from allreduce.report import write_report

        try:
            write_report(args.report, [result.to_json()])
        except OSError as exc:
            raise CLIError(f"--report {args.report}: cannot write it ({exc.strerror})") from None
    if args.json:
        print(dumps(result.to_json()))
    else:
        print(render(result))
        if args.report:
            print(f"report: {args.report}")
    return 0


def demo_section(report_path: str | Path = "allreduce-plan-report.html") -> tuple[str, Path]:
    """The demo's last act: plan Llama-2-7B on 1,024 GPUs, write the report; returns (text to print, path)."""
    from allreduce.cli._main import build_parser
    from allreduce.report import write_report

    args = build_parser().parse_args(["plan", *DEMO_ARGS])
    result = plan_from_args(args, curve=True)  # as `allreduce plan` prints it, failures counted
    path = Path(report_path)
    write_report(path, [result.to_json()])
    command = "allreduce plan " + " ".join(DEMO_ARGS)
    return f"$ {command}\n{render(result)}\nreport: {path}", path
