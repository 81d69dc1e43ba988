"""``allreduce demo``: the main job on the built-in default scenario, in a few minutes at most."""

from __future__ import annotations

import argparse
import time

from allreduce.cli._explain import explain, render
from allreduce.schedules import CostModel

__all__ = ["register"]

# The default scenario: a 1,024-GPU cluster of 8-GPU nodes on 400 Gb/s links with 5 µs per step, the order of
# NCCL's per-hop network latency for rings over InfiniBand/RoCE.
DEMO_RANKS = 1024
DEMO_GROUP_SIZE = 8
DEMO_MODEL = CostModel(latency_s=5e-6, bandwidth_Bps=400e9 / 8)


DEMO_REPORT = "allreduce-demo-report.html"
"""Where the demo writes its report (in the current directory)."""
EMULATE_COMMAND = (
    "allreduce emulate run --topology clos:leaves=2,spines=2,hosts_per_leaf=2 --algorithm ring --sizes 1MiB,8MiB"
)


def _emulate_hint() -> str:
    """What the demo says about emulation: it builds network namespaces, which needs root, so the demo never runs
    it; it names the command (and, without root, says why it would not run here)."""
    import os
    import shutil

    lines = [
        "Builds the topology as network namespaces with shaped veth links, runs a real 4-rank all-reduce across",
        "them over TCP, and prints each measurement beside the simulator's prediction. Try:",
        f"  sudo .venv/bin/{EMULATE_COMMAND}",
    ]
    if os.geteuid() != 0 or shutil.which("ip") is None:
        lines.append("(this shell is not root with iproute2, so it would refuse here: it needs both)")
    return "\n".join(lines)


def _section(title: str) -> None:
    print()
    print(title)
    print("=" * len(title))


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the built-in default scenario end to end",
        description=(
            "The built-in scenario, end to end: which all-reduce algorithm wins on a 1,024-GPU cluster and why "
            "(explain); a real 4-rank all-reduce on this machine (bench); the same schedules on simulated "
            "1,024-GPU fat-tree and oversubscribed Clos fabrics with a degraded link (sim); the tail of that "
            "all-reduce under packet loss, a congested port and a straggler, with the culprit named (tail); a real "
            "4-rank run with one injected straggler that group.stats() names; a short 2-rank data-parallel "
            "training run with its step-time breakdown (train); a training step of Llama-2-7B on 1,024 simulated "
            "GPUs with its HTML report (plan, report); and the command that checks the simulator against an "
            "emulated cluster (emulate)."
        ),
    )
    p.add_argument(
        "--report", default=DEMO_REPORT, metavar="FILE", help="where to write the HTML report (default %(default)s)"
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    _section("1. Which algorithm, and why: α–β model of a 1,024-GPU cluster (allreduce explain)")
    for size in (2**30, 64 * 2**10):
        print()
        print(render(explain(DEMO_RANKS, size, DEMO_MODEL, group_size=DEMO_GROUP_SIZE)))

    _section("2. The real thing: all-reduce between 4 processes on this machine (allreduce bench -n 4)")
    print()
    from allreduce.cli._bench import render as render_bench
    from allreduce.runtime.bench import BenchConfig, run_bench

    config = BenchConfig(world_size=4, sizes_bytes=tuple(4 * 4**k * 2**10 for k in range(7)), timeout_s=120.0)
    print(render_bench(run_bench(config), header="N=4 transport=shm algorithm=auto dtype=float32 op=sum"))
    print("(every result checked against the exact sum; 4 ranks share 2 cores here, so this measures scheduling too)")

    _section("3. What the network does to it: simulated 1,024-GPU clusters (allreduce sim)")
    print()
    from allreduce.cli._demo_sim import demo_report

    print(demo_report())

    _section("4. The tail: a lost packet, a congested port, a straggler (allreduce tail)")
    print()
    from allreduce.cli._tail import demo_section as tail_demo
    from allreduce.sim import LossModel

    # the stack the TCP rows below charge (the library's default), in the words of its kernel settings
    print(f"tcp stack {LossModel(fabric='tcp').stack.settings()}")
    print(tail_demo())

    _section("5. The tail on real processes: one injected straggler among 4 ranks (group.stats())")
    print()
    from allreduce.cli._stats_demo import demo_section as stats_demo

    print(stats_demo())

    _section("6. Data-parallel training on allreduce: 2 ranks, digits MLP (allreduce train -n 2)")
    print()
    from allreduce.train import demo as train_demo

    print(train_demo(world_size=2, epochs=1))

    _section("7. A training step at scale: Llama-2-7B on 1,024 simulated GPUs (allreduce plan, allreduce report)")
    print()
    from allreduce.cli._plan import demo_section as plan_demo

    text, _ = plan_demo(args.report)
    print(text)
    print("(open the report in a browser: one self-contained HTML file, nothing fetched)")

    _section("8. The simulator against real TCP: an emulated cluster (allreduce emulate, needs root)")
    print()
    print(_emulate_hint())
    print(f"\ndemo finished in {time.perf_counter() - started:.0f} s")
    return 0
