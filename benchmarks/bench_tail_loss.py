"""The tail model against real Linux TCP under packet loss: a grid of emulated clusters that drop packets,
measured and predicted side by side.

    sudo .venv/bin/python benchmarks/bench_tail_loss.py --dir runs/tail-grid [--only SUBSTRING] [--no-wait]
    sudo .venv/bin/python benchmarks/bench_tail_loss.py --dir runs/bursts --only CASE --bursts REPS
    .venv/bin/python benchmarks/bench_tail_loss.py --dir runs/tail-grid --predict-only [--samples 20000]

Each case builds a 4-host two-leaf Clos with one spine (1:1, or 4:1 with ``oversub=4``: the uplinks carry a
quarter of the hosts' capacity) as network namespaces whose links drop TCP packets with the firewall's random
draws (``allreduce emulate up --loss``, nftables: one link direction, or every one; independent, or
Gilbert-Elliott bursts of 4 whose bad state expires milliseconds after it began; one-MSS packets), runs the
repetitions with the real runtime over TCP (CUBIC, the kernel's defaults: RACK-TLP, rto_min 200 ms, HZ=250,
delayed ACKs), and prints the measured p50/p99 of the slowest
rank's time (each repetition timed from the barrier before it) beside the tail model's
(``allreduce.emulate.tail_samples``: 2,000 samples, or ``--samples``, at the loss rates the firewall's counters
show, on the paths the kernel took) for the ``linux`` stack and for ``rfc6298`` (the model before it), the ratios
measured/predicted, the TCP segments the hosts retransmitted, and the share of repetitions (measured, and of the
``linux`` model's samples) 150 ms or more slower than the noise-free time: the tail's mass, which a p99 of 200
repetitions (their 2nd-3rd largest) shows only when it is well above 1%; and, for ``linux``, where each measured
percentile falls among the same percentile of as many draws from the model's samples (``spread``: the share of
draws below it; under 0.025 or above 0.975, outside the 95% interval the model itself gives a run of that many
repetitions). The summary lists every case out of the issue's per-case bounds (25% at p50, 50% at p99) with that
interval: a case out of its bound but inside the interval is one the model's own tail puts there in 5% or more of
such runs; the bounds are not changed by it. DCTCP is not in this kernel
(``CONFIG_TCP_CONG_DCTCP`` is not set), so every case runs CUBIC.

Resumable: every case's raw samples, counters and kernel paths are written to ``--dir`` as ``<case>.json`` when
it finishes, and a case whose file exists is not measured again, so an interrupted grid goes on where it
stopped; ``--predict-only`` recomputes every prediction from the stored files (no root, no emulation). Before
each case the benchmark waits until the 1-minute load average is below ``--max-load`` (4), unless
``--no-wait``; the load at the start and end of each case is stored and printed. Needs root, iproute2 and
nftables to measure. A stored case predicts with the bad state's life it ran with (``burst_hold_s`` in its
result; 1 s for the cases stored before the chain moved to nftables, whose ``xt_recent`` state held a burst up
to a second).

``--bursts REPS`` measures one case (``--only``) with the firewall's log (``log group``, read over NFLOG by a
reader per namespace) before and after the loss decision of every lossy link, in the loss rules' own table, so
every TCP packet that arrived and whether it was dropped are known in order: it prints the lengths of the runs of
dropped packets per link against the geometric law of the chain (``stay``, the probability that the packet after
a dropped one is dropped too), and every burst held over a silence of the link longer than its bad state's
timeout (a run of drops with such a gap between two of its packets: after the silence the chain is good, so
only a new burst starting at the first packet continues it), with the drops other links had meanwhile, and how
many were held over 50 ms.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import struct
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from allreduce.emulate import (
    DEFAULT_LOSS_RATE_BPS,
    LOSS_TABLE,
    TAIL_STACKS,
    EmulationSpec,
    LossSpec,
    bad_state_timeout_s,
    check_privileges,
    jiffy_s,
    lossy_end,
    predicted_topology,
    run,
    running,
    tail_samples,
)
from allreduce.schedules import make_schedule
from allreduce.topology import PathTable
from allreduce.units import parse_bandwidth

CLOS = "clos:leaves=2,spines=1,hosts_per_leaf=2"
CLOS_4_TO_1 = CLOS + ",oversub=4"
ONE_LINK = "leaf0->spine0"  # the ring's 1 -> 2 hop crosses it (linear placement)
SMALL_BYTES = 1 << 20  # sizes up to this get --reps-small repetitions
TAIL_SAMPLES = 2000  # the tail model's samples per case unless --samples (what `emulate run` predicts with)


@dataclass(frozen=True)
class Case:
    loss: str  # what --loss-all takes, or LINK=... for one link
    size_bytes: int
    algorithm: str = "ring"
    topology: str = CLOS

    @property
    def name(self) -> str:
        where, _, what = self.loss.partition("=") if "->" in self.loss else ("all", "", self.loss)
        what = what.replace("ge:p=", "ge").replace(",burst=", "x")
        tier = "4to1" if self.topology == CLOS_4_TO_1 else "1to1"
        short = "one" if where != "all" else "all"
        algorithm = "hd" if self.algorithm == "halving_doubling" else self.algorithm
        return f"{short}-{what}-{algorithm}-{self.size_bytes >> 10}k-{tier}"


def _grid() -> tuple[Case, ...]:
    """The issue's grid: one link and every link, independent and bursty, p from 1e-4 to 1e-2, ring and
    halving-doubling, 256 KiB to 8 MiB, a 1:1 and a 4:1 Clos (30 cases, a loss-free control first)."""
    kib256, mib, mib8 = 256 << 10, 1 << 20, 8 << 20
    one = f"{ONE_LINK}="
    return (
        Case(f"{one}1e-9", kib256),  # control: one-MSS packets, (practically) no loss
        Case("1e-4", kib256),
        Case(f"{one}1e-3", kib256),
        Case("1e-3", kib256),
        Case(f"{one}1e-2", kib256),
        Case("3e-3", kib256),
        Case("1e-2", kib256),
        Case(f"{one}ge:p=1e-3,burst=4", kib256),
        Case("ge:p=1e-3,burst=4", kib256),
        Case("ge:p=3e-3,burst=4", kib256),
        Case("1e-3", kib256, "halving_doubling"),
        Case("3e-3", kib256, "halving_doubling"),
        Case(f"{one}1e-2", kib256, "halving_doubling"),
        Case("1e-4", mib),
        Case("1e-3", mib),
        Case("3e-3", mib),
        Case(f"{one}1e-2", mib),
        Case("ge:p=1e-3,burst=4", mib),
        Case("1e-3", mib, "halving_doubling"),
        Case("1e-4", mib8),
        Case("1e-3", mib8),
        Case(f"{one}1e-3", mib8),
        Case("ge:p=1e-3,burst=4", mib8),
        Case("1e-3", mib8, "halving_doubling"),
        Case("1e-3", kib256, topology=CLOS_4_TO_1),
        Case("3e-3", kib256, topology=CLOS_4_TO_1),
        Case(f"{one}1e-2", kib256, topology=CLOS_4_TO_1),
        Case("1e-3", mib, topology=CLOS_4_TO_1),
        Case("ge:p=1e-3,burst=4", mib, topology=CLOS_4_TO_1),
        Case("1e-3", mib8, topology=CLOS_4_TO_1),
    )


CASES = _grid()


def _spec(case: Case, rate_bps: float) -> EmulationSpec:
    link, sep, value = case.loss.partition("=")
    if sep and "->" in link:
        loss = ((link, LossSpec.parse(value, what=link)),)
        return EmulationSpec(case.topology, name="tl", rate_bps=rate_bps, loss=loss)
    return EmulationSpec(case.topology, name="tl", rate_bps=rate_bps, loss_all=LossSpec.parse(case.loss, what="loss"))


def _load() -> float:
    return os.getloadavg()[0]


def _wait_for_quiet(max_load: float, longest_s: float) -> None:
    """Wait until the 1-minute load average is below ``max_load`` (at most ``longest_s``, then go on and say so)."""
    started = time.monotonic()
    while _load() >= max_load:
        waited = time.monotonic() - started
        if waited >= longest_s:
            print(f"# load {_load():.2f} still >= {max_load:g} after {waited:.0f} s: measuring anyway", flush=True)
            return
        time.sleep(10.0)


def _measure(case: Case, *, reps: int, rate_bps: float, realtime: bool = False) -> dict[str, Any]:
    spec = _spec(case, rate_bps)
    load_before = os.getloadavg()
    started = time.time()
    with running(spec) as built:
        result = run(
            built,
            algorithm=case.algorithm,
            sizes=[case.size_bytes],
            reps=reps,
            lossy_links=sorted(spec.losses(built)),
            loss_burst=spec.loss_burst(built),
            burst_hold_s=spec.burst_hold_s(built),
            burst_bytes=spec.burst_bytes(built),
            realtime=realtime,
        )
    return {
        "case": {
            "name": case.name,
            "loss": case.loss,
            "size_bytes": case.size_bytes,
            "algorithm": case.algorithm,
            "topology": case.topology,
        },
        "spec": spec.to_json(),
        "started": started,
        "seconds": time.time() - started,
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
        "result": result.to_json(),
    }


# The grid's rate: the emulator's own with loss (DEFAULT_LOSS_RATE_BPS says why it is 25 Mbit/s).
GRID_RATE_BPS = DEFAULT_LOSS_RATE_BPS

# The hold of a burst on a silent link for the cases stored before the chain moved to nftables: its state was an
# xt_recent entry, which counts whole seconds, and a bad state lasted up to 1 s.
XT_RECENT_HOLD_S = 1.0

# A repetition this much slower than the noise-free time paid a timer of the rto_min class (the one-packet probe or
# an RTO, ~205 ms) or several stalls: the share of such repetitions compares the tail where a p99 of 200 samples,
# the 2nd-3rd largest, swings with one repetition more or less.
SLOW_S = 0.15


@dataclass(frozen=True)
class Predicted:
    """One stack's prediction for a case: p50, p99, the share of samples SLOW_S or more above the noise-free time,
    and the samples (None where nothing was dropped: every sample is the noise-free time)."""

    p50: float
    p99: float
    slow: float
    seconds: np.ndarray[Any, np.dtype[np.float64]] | None = None


def _predict(stored: dict[str, Any], samples: int = TAIL_SAMPLES) -> dict[str, Predicted]:
    """Per stack, the tail model's prediction for a stored case, recomputed from its counters and paths with
    ``samples`` samples."""
    spec = EmulationSpec.from_json(stored["spec"])
    layout = spec.layout()
    result = stored["result"]
    (row,) = result["rows"]
    model = predicted_topology(layout, float(result["hop_latency_s"]))
    placement = [int(g) for g in result["placement"]]
    schedule = make_schedule("all_reduce", result["algorithm"], len(placement))
    paths = row.get("kernel_paths") or []
    routing = PathTable({(int(s), int(d)): tuple(int(x) for x in links) for s, d, links in paths}) if paths else None
    dropped = [(str(name), int(sent), int(drops)) for name, sent, drops in row["dropped"]]
    by_stack = dict(
        tail_samples(
            schedule,
            model,
            int(row["size_bytes"]),
            rank_gpu=placement,
            routing=routing,
            dropped=dropped,
            burst=spec.loss_burst(layout),
            burst_hold_s=float(result.get("burst_hold_s", XT_RECENT_HOLD_S)),
            samples=samples,
        )
    )
    free = float(row["predicted_s"])
    out = {}
    for stack in TAIL_STACKS:
        seconds = by_stack.get(stack)
        if seconds is None:  # nothing dropped: the noise-free time
            out[stack] = Predicted(free, free, 0.0)
            continue
        p50, p99 = (float(v) for v in np.percentile(seconds, [50, 99]))
        out[stack] = Predicted(p50, p99, float(np.mean(seconds >= free + SLOW_S)), seconds)
    return out


# The per-case bounds on |measured/predicted - 1|, at p50 and at p99.
BOUNDS = {50: 0.25, 99: 0.5}
# Draws of as many repetitions as a case measured, taken from the model's samples, for the spread of their
# percentiles (the seed fixed, so the table is the same run to run).
SPREAD_DRAWS = 4000


def _spread(
    seconds: np.ndarray[Any, np.dtype[np.float64]] | None, reps: int, q: float, measured: float
) -> tuple[float, float, float]:
    """Where ``measured``, the ``q``-th percentile of ``reps`` repetitions, falls among the same percentile of
    ``reps`` draws from the model's samples, were the model right: the share of draws whose percentile is below it
    (ties count half), and the draws' 2.5th and 97.5th percentiles. A p99 of 200 repetitions is their 3rd largest
    (and 1% of the 2nd), so it moves with one repetition more or less in the tail's class: a measured percentile
    outside its bound but inside this interval is what the model itself gives in 5% or more of such runs."""
    if seconds is None:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(0)
    drawn = np.percentile(rng.choice(seconds, size=(SPREAD_DRAWS, reps)), q, axis=1)
    below = float(np.mean(drawn < measured) + 0.5 * np.mean(drawn == measured))
    lo, hi = (float(v) for v in np.percentile(drawn, [2.5, 97.5]))
    return below, lo, hi


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(at), math.ceil(at)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)


HEADER = (
    f"{'case':<28} {'loss':>9} {'reps':>4} {'load':>5} {'meas p50':>9} {'p99':>8} {'linux p50':>9} {'p99':>8} "
    f"{'rfc p50':>8} {'p99':>8}  {'m/lin p50':>9} {'p99':>5} {'m/rfc p50':>9} {'p99':>5} {'retrans':>7}"
    f" {'slow meas':>9} {'linux':>6} {'spread p50':>10} {'p99':>5}"
)


@dataclass(frozen=True)
class Compared:
    """One case against one stack: measured / predicted at p50 and p99, and where each measured percentile falls
    among the model's percentiles of as many repetitions with that percentile's 95% interval (:func:`_spread`)."""

    ratio: dict[int, float]
    spread: dict[int, tuple[float, float, float]]


def _row(stored: dict[str, Any], predicted: dict[str, Predicted]) -> tuple[str, dict[str, Compared]]:
    (row,) = stored["result"]["rows"]
    seconds = [float(s) for s in row["seconds"]]
    measured = {50: _percentile(seconds, 50), 99: _percentile(seconds, 99)}
    p50, p99 = measured[50], measured[99]
    slow = statistics.mean(s >= float(row["predicted_s"]) + SLOW_S for s in seconds)
    rates = [drops / (sent + drops) for _, sent, drops in row["dropped"] if sent + drops]
    loss = statistics.mean(rates) if rates else 0.0
    lin, rfc = predicted["linux"], predicted["rfc6298"]
    compared = {
        stack: Compared(
            {50: p50 / pred.p50, 99: p99 / pred.p99},
            {q: _spread(pred.seconds, len(seconds), q, measured[q]) for q in (50, 99)},
        )
        for stack, pred in predicted.items()
    }
    spread = compared["linux"].spread
    text = (
        f"{stored['case']['name']:<28} {loss:>9.2e} {len(seconds):>4} {stored['load_before'][0]:>5.1f} "
        f"{p50 * 1e3:>7.1f}ms {p99 * 1e3:>6.1f}ms {lin.p50 * 1e3:>7.1f}ms {lin.p99 * 1e3:>6.1f}ms "
        f"{rfc.p50 * 1e3:>6.1f}ms {rfc.p99 * 1e3:>6.1f}ms  {p50 / lin.p50:>9.2f} {p99 / lin.p99:>5.2f} "
        f"{p50 / rfc.p50:>9.2f} {p99 / rfc.p99:>5.2f} {int(row['retransmissions']):>7} {slow:>9.1%} "
        f"{lin.slow:>6.1%} {spread[50][0]:>10.3f} {spread[99][0]:>5.3f}"
    )
    return text, compared


def _summary(stack: str, cases: list[tuple[str, Compared]]) -> list[str]:
    """The stack's medians of |measured/predicted - 1|, its worst cases, and every case out of the per-case bounds
    with the model's 95% interval for that percentile of as many repetitions."""
    lines = []
    for q, bound in BOUNDS.items():
        errors = [abs(c.ratio[q] - 1) for _, c in cases]
        out = [(name, c) for name, c in cases if abs(c.ratio[q] - 1) > bound]
        inside = [name for name, c in out if 0.025 <= c.spread[q][0] <= 0.975]
        lines.append(
            f"# {stack} p{q}: median |measured/predicted - 1| {statistics.median(errors):.1%}, worst "
            f"{max(errors):.1%}; {len(out)} of {len(cases)} cases out of {bound:.0%}"
            + (f", {len(inside)} of them inside the model's 95% interval for that many repetitions" if out else "")
            + (": " + ", ".join(inside) if inside else "")
        )
        for name, c in out:
            below, lo, hi = c.spread[q]
            lines.append(
                f"#   {name}: {c.ratio[q]:.2f}x; the model's p{q} of as many repetitions {lo * 1e3:.1f}-"
                f"{hi * 1e3:.1f} ms in 95% of draws, the measured one above {below:.1%} of them"
            )
    return lines


# The reader of the firewall's log in one namespace: binds an NFLOG group, writes (seconds, nanoseconds, prefix,
# the packet's first 60 bytes) per message until SIGTERM. A socket asking for receive timestamps makes the kernel
# stamp every packet it receives (NFULA_TIMESTAMP).
_NFLOG_READER = r"""
import signal, socket, struct, sys
group, out = int(sys.argv[1]), open(sys.argv[2], "wb")
def attr(kind, payload):
    body = struct.pack("=HH", 4 + len(payload), kind) + payload
    return body + bytes(-len(body) % 4)
def config(*attrs):
    body = struct.pack("=BBH", 0, 0, socket.htons(group)) + b"".join(attrs)
    return struct.pack("=IHHII", 16 + len(body), (4 << 8) | 1, 1, 1, 0) + body
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)
s.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)
s.bind((0, 0))
stamps = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
stamps.setsockopt(socket.SOL_SOCKET, 35, 1)
s.send(config(attr(1, b"\x01")))
s.send(config(attr(2, struct.pack(">IBB", 64, 2, 0)), attr(4, struct.pack(">I", 10))))
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
s.settimeout(0.2)
lost = 0
print("ready", flush=True)
while not stop:
    try:
        data = s.recv(1 << 20)
    except TimeoutError:
        continue
    except OSError:
        lost += 1
        continue
    at = 0
    while at + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, at)
        if length < 16:
            break
        if kind == 4 << 8:
            a, fields = at + 20, {}
            while a + 4 <= at + length:
                alen, akind = struct.unpack_from("=HH", data, a)
                if alen < 4:
                    break
                fields[akind & 0x3FFF] = data[a + 4 : a + alen]
                a += (alen + 3) & ~3
            sec, usec = struct.unpack(">QQ", fields.get(3, bytes(16))[:16])
            prefix = fields.get(10, b"").rstrip(b"\0")[:16]
            out.write(struct.pack("=QI16s60s", sec, usec * 1000, prefix, fields.get(9, b"")[:60]))
        at += (length + 3) & ~3
out.close()
sys.exit(1 if lost else 0)
"""
_RECORD = struct.Struct("=QI16s60s")
_NFLOG_GROUP = 7
HELD_GAP_S = 0.05  # a silence of the link this long within a burst: every flow crossing it stopped, long ago


def _capture(case: Case, *, reps: int, rate_bps: float, where: Path) -> dict[str, Any]:
    """Run ``case`` with every lossy link's arrivals logged before and after its loss rules; per link, the
    arrivals in order as (time, identity, source host, destination host, payload bytes, dropped)."""
    spec = _spec(case, rate_bps)
    load_before = os.getloadavg()
    with running(spec) as built:
        links = sorted(spec.losses(built))
        ends = {link: lossy_end(built, link)[:2] for link in links}
        for link, (ns, dev) in ends.items():
            # first in the loss rules' arrival chain, and last: a packet the link's chain dropped never gets there
            nft = ["ip", "netns", "exec", ns, "nft"]
            log = f'iifname "{dev}" ip protocol tcp log group {_NFLOG_GROUP} snaplen 64 prefix'
            subprocess.run([*nft, f'insert rule ip {LOSS_TABLE} arrive {log} "in{link}"'], check=True)
            subprocess.run([*nft, f'add rule ip {LOSS_TABLE} arrive {log} "ok{link}"'], check=True)
        readers: dict[str, subprocess.Popen[str]] = {}
        try:
            for ns in sorted({ns for ns, _ in ends.values()}):
                cmd = [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    sys.executable,
                    "-c",
                    _NFLOG_READER,
                    str(_NFLOG_GROUP),
                    str(where / ns),
                ]
                readers[ns] = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            for ns, reader in readers.items():
                if reader.stdout is None or reader.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"the firewall log's reader in {ns} did not start")
            started = time.time()
            result = run(
                built,
                algorithm=case.algorithm,
                sizes=[case.size_bytes],
                reps=reps,
                lossy_links=links,
                loss_burst=spec.loss_burst(built),
                burst_hold_s=spec.burst_hold_s(built),
                burst_bytes=spec.burst_bytes(built),
            )
            time.sleep(1.5)  # the log flushes every 0.1 s
        finally:
            for reader in readers.values():
                reader.terminate()
        lost = [ns for ns, reader in readers.items() if reader.wait() != 0]
        names = {link: built.topology.link_name(link) for link in links}
        stay = {link: 1 - spec.losses(built)[link].leave_probability() for link in links}
        timeout = {link: bad_state_timeout_s(spec.losses(built)[link], lossy_end(built, link)[2]) for link in links}
    arrived: dict[int, list[tuple[float, bytes, int, int, int]]] = {link: [] for link in links}
    passed: dict[int, set[bytes]] = {link: set() for link in links}
    for ns in readers:
        data = (where / ns).read_bytes()
        for sec, nsec, prefix, packet in _RECORD.iter_unpack(data[: len(data) // _RECORD.size * _RECORD.size]):
            label = prefix.rstrip(b"\0").decode()
            ihl = (packet[0] & 15) * 4
            total = int.from_bytes(packet[2:4], "big")
            doff = (packet[ihl + 12] >> 4) * 4
            identity = packet[4:6] + packet[12:20] + packet[ihl : ihl + 16]  # IP id, addresses, ports, seq, ack
            if label.startswith("in"):
                arrived[int(label[2:])].append(
                    (sec + nsec * 1e-9, identity, packet[15], packet[19], total - ihl - doff)
                )
            else:
                passed[int(label[2:])].add(identity)
    return {
        "names": names,
        "stay": stay,
        "timeout": timeout,
        "jiffy": jiffy_s(),
        "started": started,
        "lost_log": lost,
        "load": (load_before[0], os.getloadavg()[0]),
        "seconds": result.rows[0].seconds,
        "free_s": result.rows[0].predicted_s,
        "counted": {name: drops for name, _, drops in result.rows[0].dropped},
        "arrivals": {
            link: [(t, src, dst, size, identity not in passed[link]) for t, identity, src, dst, size in sorted(seq)]
            for link, seq in arrived.items()
        },
    }


def _runs(arrivals: list[tuple[float, int, int, int, bool]]) -> list[tuple[int, int]]:
    """(first, last) index of every run of dropped packets."""
    out, start = [], None
    for i, (*_, dropped) in enumerate(arrivals):
        if dropped and start is None:
            start = i
        elif not dropped and start is not None:
            out.append((start, i - 1))
            start = None
    if start is not None:
        out.append((start, len(arrivals) - 1))
    return out


def _report_bursts(captured: dict[str, Any]) -> list[str]:
    names, arrivals = captured["names"], captured["arrivals"]
    stay = statistics.mean(captured["stay"].values())
    # stored before the chain moved to nftables: its bad state lasted up to 1 s
    timeout = {link: captured.get("timeout", {}).get(link, XT_RECENT_HOLD_S) for link in arrivals}
    lines = [
        f"# {'link':<14} {'arrived':>7} {'dropped':>7} {'bursts':>6} {'mean':>5} {'>=4':>5} {'>=8':>5} "
        f"{'>=16':>5} {'longest':>7} {'T ms':>4} {'silent':>6} {'held':>4} {'counted':>7}"
    ]
    lengths, held, silent = [], [], 0
    for link, seq in arrivals.items():
        runs = _runs(seq)
        sizes = [last - first + 1 for first, last in runs]
        lengths += sizes
        link_held = link_silent = 0
        for first, last in runs:
            # silent: the link fell silent for HELD_GAP_S within the burst or before the first packet that passed;
            # held: a packet after a silence longer than the bad state's timeout was dropped too
            times = [a[0] for a in seq[first : last + 2]]
            gaps = [b - a for a, b in itertools.pairwise(times)]
            link_silent += bool(gaps) and max(gaps) >= HELD_GAP_S
            if any(gap >= timeout[link] for gap in gaps[: last - first]):
                link_held += 1
                held.append((seq[first][0], link, first, last))
        silent += link_silent
        if sizes:
            lines.append(
                f"# {names[link]:<14} {len(seq):>7} {sum(sizes):>7} {len(sizes):>6} {statistics.mean(sizes):>5.2f} "
                + " ".join(f"{statistics.mean(n >= k for n in sizes):>5.3f}" for k in (4, 8, 16))
                + f" {max(sizes):>7} {timeout[link] * 1e3:>4.0f} {link_silent:>6} {link_held:>4} "
                f"{captured['counted'].get(names[link], 0):>7}"
            )
    lines.append(
        f"# every link: {len(lengths)} bursts of mean {statistics.mean(lengths):.2f} packets; P(length >= k) "
        f"measured (count) against the chain's stay^(k-1), stay {stay:.4f}:"
    )
    for k in (2, 4, 8, 12, 16, 24):
        count = sum(n >= k for n in lengths)
        lines.append(f"#   k={k:<2} {count / len(lengths):.4f} ({count})  geometric {stay ** (k - 1):.4f}")
    # the packet after a dropped one, by the silence before it: the bad state lives T - J to T (J a jiffy)
    jiffy = captured.get("jiffy", 0.0)
    after: Counter[tuple[int, bool]] = Counter()
    for link, seq in arrivals.items():
        for a, b in itertools.pairwise(seq):
            if a[4]:
                gap = b[0] - a[0]
                after[(int(gap >= timeout[link] - jiffy) + int(gap >= timeout[link]), b[4])] += 1
    lines.append(
        "# the packet after a dropped one dropped too, by the silence before it (the bad state lives T - J to T; "
        f"the chain: stay {stay:.4f} before T - J, a new burst's g after T):"
    )
    for kind, what in enumerate(("under T - J", "T - J to T", "T or more")):
        n = after[(kind, True)] + after[(kind, False)]
        share = f"{after[(kind, True)] / n:.3f}" if n else "-"
        lines.append(f"#   {what:<12} {after[(kind, True)]:>5} of {n:>5}: {share}")
    lines.append(
        f"# bursts silent {HELD_GAP_S * 1e3:.0f} ms or more before a packet passed: {silent}; held (a packet "
        "dropped after a silence longer than the bad state's timeout T):"
    )
    for at, link, first, last in sorted(held):
        seq = arrivals[link]
        end = seq[last + 1][0] if last + 1 < len(seq) else seq[last][0]
        times = [a[0] for a in seq[first : last + 1]]
        quiet = next(i for i, (a, b) in enumerate(itertools.pairwise(times)) if b - a >= timeout[link])
        kinds = Counter(
            f"{a[1] - 1}>{a[2] - 1}{'d' if a[3] else 'a'}"
            for a in seq[max(first, first + quiet - 3) : first + quiet + 1]
        )
        later = [round((a[0] - at) * 1e3) for a in seq[first + quiet + 1 : last + 1]]
        others = sum(1 for other, s in arrivals.items() if other != link for a in s if a[4] and at < a[0] < end)
        lines.append(
            f"#   {at - captured['started']:8.3f} s {names[link]:<14} {quiet + 1:>2} dropped before the silence "
            f"(the last: {', '.join(f'{n} {k}' for k, n in kinds.most_common())}), then at {later} ms; first "
            f"passed {(end - at) * 1e3:.0f} ms after; other links' drops meanwhile {others}"
        )
    slow = [s - captured["free_s"] for s in captured["seconds"]]
    edges = (0.15, 0.35, 0.8, 1.45, 2.0, 2.9, math.inf)
    classes = [sum(a <= s < b for s in slow) for a, b in itertools.pairwise(edges)]
    lines.append(
        f"# {len(slow)} repetitions: p50 {_percentile(captured['seconds'], 50) * 1e3:.1f} ms, p99 "
        f"{_percentile(captured['seconds'], 99) * 1e3:.1f} ms; slower by 0.15-0.35, 0.35-0.8, 0.8-1.45, "
        f"1.45-2.0, 2.0-2.9, 2.9+ s: {classes}; held bursts {len(held)}; load {captured['load'][0]:.2f} -> "
        f"{captured['load'][1]:.2f}"
        + (f"; the log lost messages in {captured['lost_log']}" if captured["lost_log"] else "")
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, type=Path, help="where each case's raw samples are stored (JSON)")
    parser.add_argument("--predict-only", action="store_true", help="recompute the predictions of stored cases")
    parser.add_argument("--only", help="the cases whose name contains this")
    parser.add_argument("--reps", type=int, default=40, help="repetitions of cases above 1 MiB (default 40)")
    parser.add_argument("--reps-small", type=int, default=200, help="repetitions up to 1 MiB (default 200)")
    parser.add_argument("--max-load", type=float, default=4.0, help="wait for a load average below this")
    parser.add_argument("--max-wait", type=float, default=1800.0, help="longest wait for it per case (s)")
    parser.add_argument("--no-wait", action="store_true", help="measure whatever the load")
    parser.add_argument(
        "--rate",
        default=f"{GRID_RATE_BPS / 1e6:g}Mbps",
        help="fastest host link (default %(default)s, as `emulate up --loss`)",
    )
    parser.add_argument(
        "--realtime", action="store_true", help="ranks at SCHED_FIFO priority 10 (emulate run --realtime)"
    )
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--bursts", type=int, metavar="REPS", help="log every lossy link's drops in one case")
    parser.add_argument(
        "--samples",
        type=int,
        default=TAIL_SAMPLES,
        help=f"the tail model's samples per case and stack (default {TAIL_SAMPLES:,}; a p99 that sits on a class of "
        "about 1%% of them moves with the draws, 20,000 pins it)",
    )
    args = parser.parse_args(argv)
    if min(args.reps, args.reps_small) < 20:
        parser.error("--reps and --reps-small: at least 20 (the tail model runs beside 20 or more)")
    if not 100 <= args.samples <= 1_000_000:
        parser.error(f"--samples: 100 to 1,000,000, got {args.samples}")
    cases = [c for c in CASES if args.only is None or args.only in c.name]
    if args.list:
        print("\n".join(c.name for c in cases))
        return 0
    if not args.predict_only:
        check_privileges()
        args.dir.mkdir(parents=True, exist_ok=True)
    rate_bps = parse_bandwidth(args.rate, what="--rate") * 8
    if args.bursts is not None:
        if args.predict_only:
            parser.error("--bursts measures: not with --predict-only")
        if len(cases) != 1 or not 1 <= args.bursts <= 1000:
            parser.error(f"--bursts: one case (--only matched {len(cases)}) and 1 to 1,000 repetitions")
        captured = _capture(cases[0], reps=args.bursts, rate_bps=rate_bps, where=args.dir)
        print(f"# {cases[0].name}, {args.bursts} repetitions with every lossy link's drops logged")
        print("\n".join(_report_bursts(captured)))
        return 0
    print(
        f"# {len(cases)} cases; {args.rate}, CUBIC{', ranks at SCHED_FIFO' if args.realtime else ''}; "
        f"{args.samples:,} model samples per case; load average now "
        f"{_load():.2f}; stored in {args.dir}"
    )
    print(HEADER, flush=True)
    compared: dict[str, list[tuple[str, Compared]]] = {stack: [] for stack in TAIL_STACKS}
    started = time.monotonic()
    for case in cases:
        path = args.dir / f"{case.name}.json"
        if not path.exists():
            if args.predict_only:
                continue
            if not args.no_wait:
                _wait_for_quiet(args.max_load, args.max_wait)
            reps = args.reps_small if case.size_bytes <= SMALL_BYTES else args.reps
            stored = _measure(case, reps=reps, rate_bps=rate_bps, realtime=args.realtime)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(stored))
            tmp.replace(path)
        stored = json.loads(path.read_text())
        text, case_compared = _row(stored, _predict(stored, args.samples))
        for stack, one in case_compared.items():
            compared[stack].append((case.name, one))
        print(text, flush=True)
    for stack, cases_compared in compared.items():
        if cases_compared:
            print("\n".join(_summary(stack, cases_compared)))
    print(f"# {time.monotonic() - started:.0f} s; load average at end: {_load():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
