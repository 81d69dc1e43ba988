"""``allreduce tune``: measure α, β, γ of a transport on this host and cache them for ``algorithm="auto"``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import numpy as np

from allreduce.cli._args import positive_int
from allreduce.cli._main import CLIError
from allreduce.runtime.bench import BenchConfig, run_bench
from allreduce.runtime.group import default_cost_model, save_cost_model, tune_file
from allreduce.runtime.transport import INJECT_ENV
from allreduce.schedules import CostModel
from allreduce.units import parse_bytes

__all__ = ["fit_cost_model", "register"]


DEFAULT_REPEATS = 5
"""Measurements per size: enough for a median that one descheduled run does not move, and a range that shows
how much the host's load moved the others."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "tune",
        help="measure the transport's latency and bandwidth on this host; auto uses them",
        description="Time ring all-reduce between N local ranks at a small and a large size (repeated; the "
        "median of each is fitted, the range over the repeats printed), fit "
        "t = 2(N-1)·α + 2(N-1)/N·S·β + (N-1)/N·S·γ (γ from a local numpy add), and cache α, β, γ per host "
        f"and transport (default file: {tune_file()}; set ALLREDUCE_TUNE_FILE to change it).",
    )
    parser.add_argument("-n", "--world-size", type=int, default=2, help="ranks to measure with (default 2)")
    parser.add_argument(
        "--transport", choices=("shm", "tcp", "both"), default="both", help="the transport to measure (default both)"
    )
    parser.add_argument("--small", default="4KiB", help="latency probe size (default 4KiB)")
    parser.add_argument("--large", default="64MiB", help="bandwidth probe size (default 64MiB)")
    parser.add_argument(
        "--repeats",
        type=positive_int("--repeats"),
        default=DEFAULT_REPEATS,
        help=f"measure both sizes this many times; the median is cached, the range printed (default {DEFAULT_REPEATS})",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the fit, do not write the cache")
    parser.set_defaults(handler=_handle)


def _reduce_Bps(size_bytes: int) -> float:
    a = np.ones(max(size_bytes // 4, 1), np.float32)
    b = np.ones_like(a)
    np.add(a, b, out=a)
    start = time.perf_counter()
    for _ in range(3):
        np.add(a, b, out=a)
    return 3 * a.nbytes / (time.perf_counter() - start)


def fit_cost_model(
    world_size: int, *, small_s: float, large_bytes: int, large_s: float, reduce_Bps: float
) -> CostModel:
    """α from the small size (per ring step), β from what the large size leaves after α and γ."""
    n = world_size
    steps = 2 * (n - 1)
    alpha = small_s / steps
    reduce_s = (n - 1) / n * large_bytes / reduce_Bps
    transfer_s = max(large_s - steps * alpha - reduce_s, large_s * 0.1)
    beta = transfer_s / (2 * (n - 1) / n * large_bytes)
    return CostModel(latency_s=alpha, bandwidth_Bps=1 / beta, reduce_bandwidth_Bps=reduce_Bps)


def _handle(args: argparse.Namespace) -> int:
    if args.world_size < 2:
        raise CLIError(f"-n: tuning needs at least 2 ranks, got {args.world_size}")
    injected = os.environ.get(INJECT_ENV, "")
    if injected.replace(";", "").strip() and not args.dry_run:
        raise CLIError(
            f"{INJECT_ENV} is set ({injected.strip()!r}): tuning would measure the injected faults and cache them in "
            f"{tune_file()}, which algorithm='auto' reads; unset it, or pass --dry-run to print the fit only"
        )
    small, large = parse_bytes(args.small, what="--small"), parse_bytes(args.large, what="--large")
    if not 0 < small < large or small % 4 or large % 4:
        raise CLIError(f"--small/--large: need 0 < small < large, multiples of 4 bytes; got {small}, {large}")
    transports = ("shm", "tcp") if args.transport == "both" else (args.transport,)
    reduce_Bps = _reduce_Bps(large)
    for transport in transports:
        # One start of the ranks measures every repeat: the sweep is small, large, small, large, ...
        rows = run_bench(
            BenchConfig(
                world_size=args.world_size,
                sizes_bytes=(small, large) * args.repeats,
                transport=transport,
                algorithm="ring",
            )
        )
        if any(r.wrong for r in rows):
            raise CLIError(f"{transport}: the measurement run gave wrong results; not caching")
        fits = [
            fit_cost_model(
                args.world_size,
                small_s=rows[k].time_s,
                large_bytes=large,
                large_s=rows[k + 1].time_s,
                reduce_Bps=reduce_Bps,
            )
            for k in range(0, len(rows), 2)
        ]
        model = fit_cost_model(
            args.world_size,
            small_s=statistics.median(r.time_s for r in rows[0::2]),
            large_bytes=large,
            large_s=statistics.median(r.time_s for r in rows[1::2]),
            reduce_Bps=reduce_Bps,
        )
        # what the fit cannot see: which calls move and reduce in one pass per step (shm: its eager snapshots)
        model = dataclasses.replace(model, fused_bytes=default_cost_model(transport).fused_bytes)
        alphas_us = [f.latency_s * 1e6 for f in fits]
        bandwidths_GBps = [f.bandwidth_Bps / 1e9 for f in fits]
        where = "(dry run, not saved)" if args.dry_run else f"-> {save_cost_model(transport, model)}"
        print(
            f"{transport}: alpha={model.latency_s * 1e6:.1f}us ({min(alphas_us):.1f}us to {max(alphas_us):.1f}us) "
            f"bandwidth={model.bandwidth_Bps / 1e9:.2f}GB/s ({min(bandwidths_GBps):.2f} to "
            f"{max(bandwidths_GBps):.2f}GB/s) reduce={reduce_Bps / 1e9:.2f}GB/s, median of {args.repeats} runs "
            f"{where}"
        )
    return 0
