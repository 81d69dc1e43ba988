"""``allreduce demo``: the main job on the built-in default scenario, in a few minutes at most."""

from __future__ import annotations

import argparse

from allreduce.cli._explain import explain, render
from allreduce.schedules import CostModel

__all__ = ["register"]

# The default scenario: a 1,024-GPU cluster of 8-GPU nodes on 400 Gb/s links with 5 µs per step, the order of
# NCCL's per-hop network latency for rings over InfiniBand/RoCE (shared/reference/FIGURES.md).
DEMO_RANKS = 1024
DEMO_GROUP_SIZE = 8
DEMO_MODEL = CostModel(latency_s=5e-6, bandwidth_Bps=400e9 / 8)


def _section(title: str) -> None:
    print()
    print(title)
    print("=" * len(title))


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the built-in default scenario end to end",
        description=(
            "The built-in scenario: which all-reduce algorithm wins on a 1,024-GPU cluster and why, for a large and "
            "a small gradient buffer."
        ),
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    _section("1. Which algorithm, and why: α–β model of a 1,024-GPU cluster (allreduce explain)")
    for size in (2**30, 64 * 2**10):
        print()
        print(render(explain(DEMO_RANKS, size, DEMO_MODEL, group_size=DEMO_GROUP_SIZE)))
    return 0
