"""The tail model against real Linux TCP under packet loss: emulated clusters that drop packets, measured and
predicted side by side.

    sudo .venv/bin/python benchmarks/bench_tail_loss.py [--reps 40] [--only SUBSTRING] [--rate 100Mbps]

Each case builds a 4-host two-leaf Clos (one spine, so the lossy link is on the ring's path whatever the ECMP
hash) as network namespaces whose links drop TCP packets with the firewall's random match (`allreduce emulate
up --loss`, one-MSS packets), runs `--reps` all-reduces with the real runtime over TCP (CUBIC, the kernel's
defaults: RACK-TLP, rto_min 200 ms, HZ=250 on this machine), and prints the measured p50/p99 of the slowest
rank's time beside the tail model's (`allreduce.sim.simulate_tail`, 2,000 samples) at the loss rates the
firewall's counters show, for the `linux` stack and for `rfc6298` (the model before it), with the ratios
measured/predicted, and the TCP segments the hosts retransmitted. Needs root, iproute2 and iptables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

from allreduce.emulate import DEFAULT_LOSS_RATE_BPS, EmulationSpec, LossSpec, check_privileges, run, running
from allreduce.units import format_bytes, parse_bandwidth

TOPOLOGY = "clos:leaves=2,spines=1,hosts_per_leaf=2"
ONE_LINK = "leaf0->spine0"  # the ring's 1 -> 2 hop crosses it (linear placement)


@dataclass(frozen=True)
class Case:
    name: str
    loss: str  # what --loss-all takes, or LINK=... for one link
    size_bytes: int
    algorithm: str = "ring"


CASES = (
    # A control: one-MSS packets as in every case, (practically) no loss: what the machine's load costs.
    Case("control, no loss", f"{ONE_LINK}=1e-9", 256 << 10),
    Case("every link 1e-4", "1e-4", 256 << 10),
    Case("one link 1e-3", f"{ONE_LINK}=1e-3", 256 << 10),
    Case("every link 1e-3", "1e-3", 256 << 10),
    Case("one link 1e-2", f"{ONE_LINK}=1e-2", 256 << 10),
    Case("every link 3e-3", "3e-3", 256 << 10),
    Case("every link 1e-2", "1e-2", 256 << 10),
    Case("one link ge 1e-3 x4", f"{ONE_LINK}=ge:p=1e-3,burst=4", 256 << 10),
    Case("every link 1e-3", "1e-3", 1 << 20),
    Case("every link 1e-3, hd", "1e-3", 256 << 10, "halving_doubling"),
)


def _spec(case: Case, name: str, rate_bps: float) -> EmulationSpec:
    link, sep, value = case.loss.partition("=")
    if sep:
        return EmulationSpec(TOPOLOGY, name=name, rate_bps=rate_bps, loss=((link, LossSpec.parse(value, what=link)),))
    return EmulationSpec(TOPOLOGY, name=name, rate_bps=rate_bps, loss_all=LossSpec.parse(case.loss, what="loss"))


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=40, help="repetitions per case (default 40; at least 20)")
    parser.add_argument("--only", help="run the cases whose name contains this")
    parser.add_argument("--rate", default=f"{DEFAULT_LOSS_RATE_BPS / 1e6:g}Mbps", help="fastest host link")
    args = parser.parse_args(argv)
    check_privileges()
    rate_bps = parse_bandwidth(args.rate, what="--rate") * 8
    cases = [c for c in CASES if args.only is None or args.only in c.name]
    print(f"# load average at start: {_load()}; {TOPOLOGY}, {args.rate}, CUBIC, {args.reps} repetitions per case")
    print(
        f"{'case':<22} {'size':>8} {'algorithm':<16} {'loss':>9} {'measured p50':>12} {'p99':>9} "
        f"{'linux p50':>10} {'p99':>9} {'rfc6298 p50':>11} {'p99':>9}  {'m/linux p50':>11} {'p99':>6} "
        f"{'m/rfc p50':>9} {'p99':>6} {'retrans':>7}"
    )
    started = time.monotonic()
    ratios: dict[str, list[tuple[float, float]]] = {"linux": [], "rfc6298": []}
    for case in cases:
        spec = _spec(case, "tl", rate_bps)
        with running(spec) as built:
            result = run(
                built,
                algorithm=case.algorithm,
                sizes=[case.size_bytes],
                reps=args.reps,
                lossy_links=sorted(spec.losses(built)),
            )
        (row,) = result.rows
        p50, p99 = row.percentile_s(50), row.percentile_s(99)
        rates = [drops / (sent + drops) for _, sent, drops in row.dropped]
        loss = statistics.mean(rates) if rates else 0.0
        tails = dict(row.predicted_tails)
        cells = []
        for stack in ("linux", "rfc6298"):
            # nothing dropped: the model's time is the noise-free prediction
            t50, _, t99, _ = tails.get(stack, (row.predicted_s,) * 4)
            cells.append((t50, t99))
            ratios[stack].append((p50 / t50, p99 / t99))
        (l50, l99), (r50, r99) = cells
        print(
            f"{case.name:<22} {format_bytes(case.size_bytes):>8} {case.algorithm:<16} {loss:>9.2e} "
            f"{p50 * 1e3:>10.1f}ms {p99 * 1e3:>7.1f}ms {l50 * 1e3:>8.1f}ms {l99 * 1e3:>7.1f}ms "
            f"{r50 * 1e3:>9.1f}ms {r99 * 1e3:>7.1f}ms  {p50 / l50:>11.2f} {p99 / l99:>6.2f} "
            f"{p50 / r50:>9.2f} {p99 / r99:>6.2f} {row.retransmissions:>7}",
            flush=True,
        )
    for stack, values in ratios.items():
        if values:
            mid50 = statistics.median(abs(a - 1) for a, _ in values)
            mid99 = statistics.median(abs(b - 1) for _, b in values)
            print(f"# {stack}: median |measured/predicted - 1| p50 {mid50:.1%}, p99 {mid99:.1%}")
    print(f"# {len(cases)} cases in {time.monotonic() - started:.0f} s; load average at end: {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
