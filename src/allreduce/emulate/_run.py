"""Running the real runtime across an emulated cluster, and the simulator's prediction beside each measurement.

One rank per host namespace (the tcp transport, a fresh token per run), timed after a barrier; the time of a
repetition is that of the slowest rank, and a row reports the median and the range over repetitions. Beside
it, the simulator's prediction for the same topology, placement and size, on the emulated network as it really
is:

- every link at its shaped rate times the TCP goodput share ``1448/1514``: a full-size segment carries 1,448
  bytes of payload in a 1,514-byte Ethernet frame (20 B IPv4 + 20 B TCP + 12 B timestamp option + 14 B
  Ethernet header), and the token bucket counts whole frames;
- every hop at the latency measured on this emulation by a UDP echo between two hosts (half the median round
  trip, divided by the hops between them), which includes the per-message cost of the kernel and of Python.

Counters read before and after each size: bytes sent on every shaped direction (the busiest link is the one
the network saturated) and TCP retransmissions in every host namespace.

ECMP: the kernel hashes each connection's addresses and ports onto one of the equal paths, and the simulator
hashes with a seed of its own, so the two rarely pick the same paths. The prediction beside a measurement is
the simulator's for the split the kernel actually made: every rank reports its connections, the kernel is asked
which path each took (:mod:`._paths`), and the simulator routes every flow on exactly that path. Where that
cannot be read (two connections between one pair of hosts hashed apart), the fallback is the closest of
:data:`ECMP_SEEDS` hash seeds by per-link bytes, and the row says so. The range over all seeds is reported too:
it is what ECMP luck alone can do to this collective.

Loss: every shaped link's queue counts the packets it sent and dropped (``tc -s qdisc``), and a link made lossy
(``lossy_links``) the TCP packets that reached its far end and those its firewall rule dropped there. Where
packets were dropped (a shallow ``--queue``: a congested port; ``--loss``), the loss rate per link is dropped /
(sent + dropped), and with at least :data:`TAIL_MIN_REPS` repetitions the row also carries the tail model's
p50, p90, p99 and max (:func:`allreduce.sim.simulate_tail`) for the TCP stacks of :data:`TAIL_STACKS` at exactly
those link loss rates, beside the measured percentiles.

Congestion control: the ranks' data connections use ``congestion`` (default :data:`DEFAULT_CONGESTION`, stock
Linux's; ``"default"`` keeps the kernel's, BBR on some machines). BBR estimates the bottleneck's rate from the
delivery rate of each round trip, and a token bucket's burst (1 MiB here, which Python senders need to reach the
rate) lets data leave at the veth's speed until the bucket is empty: measured in a host namespace during a 32 MiB
ring, BBR's estimate reached 14-35 Gbit/s on a 200 Mbit/s link, it stopped pacing, and with ACKs queued behind
data in the hosts' uplinks (smoothed RTT 25 ms, against a minimum of 11 us) its window fell short of the link:
32 MiB rings ran 1.12-1.22x the fluid model's time, against 0.98-0.99x with CUBIC, interleaved runs
(docs/emulate.md). The fluid model describes a congestion control that keeps a bottleneck busy; a switch port
has no burst above its line rate to mislead one.

Real-time ranks (``realtime``): the emulated hosts and switches share this machine's cores, and the forwarding of
every packet is charged to the rank that sent or received it (a loss-free 4-host emulation keeps two cores 85% busy
at 100 Mbit/s). A rank woken by its socket then waits behind the other ranks and any other process, and a window
that loss has shrunk waits on every late ACK. With ``realtime`` each rank runs at ``SCHED_FIFO``
:data:`RANK_RT_PRIORITY` (the kernel's real-time throttling keeps 5% of each core for everything else): on a quiet
machine that changed nothing measured, under a load of 6-8 it kept a quiet machine's times (docs/emulate.md).

Bottleneck: the link the counters show busiest is the one with the most bytes per second of its shaped rate
(the largest share of the run it was busy); the simulator's bottleneck *agrees* when its measured busy share is
within :data:`BUSY_TIE` of that maximum (in a ring on equal links, every link is equally busy).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from allreduce.emulate._layout import MIN_BURST_BYTES, Layout, _hops_to
from allreduce.emulate._loss import read_counters
from allreduce.emulate._netns import COMMAND_TIMEOUT_S, EmulationError
from allreduce.emulate._paths import Connection, kernel_paths
from allreduce.emulate._rank import RT_PRIORITY_ENV
from allreduce.runtime.launcher import die_with_parent, stop_signal_handlers
from allreduce.runtime.tcp import CONGESTION_ENV, congestion_control
from allreduce.schedules import Schedule, make_schedule
from allreduce.sim import LossModel, TailConfig, simulate, simulate_tail
from allreduce.topology import NodeKind, PathTable, Topology, place

__all__ = [
    "BURST_NOTE_SHARE",
    "DEFAULT_CONGESTION",
    "GOODPUT",
    "RANK_RT_PRIORITY",
    "TAIL_STACKS",
    "Measurement",
    "RunResult",
    "measure_hop_latency",
    "predicted_topology",
    "realtime_refusal",
    "run",
    "tail_predictions",
    "tail_samples",
]

T = TypeVar("T")

GOODPUT = 1448 / 1514
"""Share of a shaped link's rate that carries TCP payload (see the module docstring)."""

ECMP_SEEDS = 16
"""Hash seeds the simulator tries for each measurement (their spread is reported; the closest to the counters is
the prediction)."""

BUSY_TIE = 0.05
"""Links whose busy share is within this fraction of the busiest link's count as equally busy (counter noise: a
few retransmitted segments, ACKs)."""

BURST_NOTE_SHARE = 0.1
"""A row is marked as decided by the token buckets' burst when the burst (:data:`MIN_BURST_BYTES`) is at least this
share of what the busiest link carried per repetition: that much can leave at the veth's speed, not the shaped
rate the prediction assumes (a first run at 256 KiB on a ring of 4 measured 0.33 of the prediction)."""

RANK_RT_PRIORITY = 10
"""The ``SCHED_FIFO`` priority of the ranks of a ``realtime`` run: above every ordinary process, below the kernel's
own real-time threads (50 for interrupt threads)."""

TAIL_MIN_REPS = 20
"""Repetitions from which a row's percentiles mean something, and the tail model is run beside them."""

TAIL_SAMPLES = 2000
"""Samples of the tail model per row (its p99 then rests on 20 samples above it)."""

DEFAULT_CONGESTION = "cubic"
"""The TCP congestion control of the ranks' data connections unless told otherwise: stock Linux's default, which
keeps a shaped link busy as the fluid model assumes (see the module docstring for BBR)."""

RANK_GRACE_S = 2.0
"""After an interrupt or a failure, how long the ranks get to exit on SIGTERM before SIGKILL."""

_ECHO_ROUND_TRIPS = 200
_STORE_PORT = 29500  # a fresh namespace: nothing else listens there, so no port can be taken


@dataclass(frozen=True)
class Measurement:
    """One size: the slowest rank's seconds per repetition, and what the simulator predicted."""

    size_bytes: int
    seconds: tuple[float, ...]
    predicted_s: float
    predicted_range_s: tuple[float, float]  # over ECMP hash seeds
    exact: bool
    busiest_link: str
    busiest_link_bytes: int
    predicted_bottleneck: str
    retransmissions: int
    paths: str  # "kernel": the prediction routes every flow where the kernel sent it; else the closest hash seed
    bottleneck_agrees: bool  # the simulator's bottleneck is (one of) the busiest links by the counters
    dropped: tuple[tuple[str, int, int], ...] = ()  # (link, packets sent, packets dropped) where a queue dropped
    predicted_tail_s: tuple[float, float] | None = None  # (p50, p99) of the tail model at the measured loss
    # per TCP stack of the tail model: (stack, (p50, p90, p99, max)) at the measured loss
    predicted_tails: tuple[tuple[str, tuple[float, float, float, float]], ...] = ()
    burst_share: float = 0.0  # the links' burst over the busiest link's bytes per repetition (at most 1)
    # the paths the kernel took, (source GPU, destination GPU, links): what the predictions routed on
    kernel_paths: tuple[tuple[int, int, tuple[int, ...]], ...] = ()

    @property
    def burst_bound(self) -> bool:
        """Whether the token buckets' burst, not the shaped rate, may decide this row (see BURST_NOTE_SHARE)."""
        return self.burst_share >= BURST_NOTE_SHARE

    @property
    def median_s(self) -> float:
        return float(statistics.median(self.seconds))

    def percentile_s(self, q: float) -> float:
        """The ``q``-th percentile (0-100) of the slowest rank's time over the repetitions."""
        return float(np.percentile(np.asarray(self.seconds), q))

    @property
    def ratio(self) -> float:
        """Measured over predicted (1.0: the simulator was right)."""
        return self.median_s / self.predicted_s if self.predicted_s > 0 else float("nan")


@dataclass(frozen=True)
class RunResult:
    topology: str
    algorithm: str
    placement: tuple[int, ...]
    rate_bps: float
    hop_latency_s: float
    rows: tuple[Measurement, ...]
    congestion: str = "default"  # the ranks' TCP congestion control ("default": the kernel's)
    burst_hold_s: float = 0.0  # the predictions' hold of a burst on a silent link (the firewall's bad state's life)
    burst_bytes: int = MIN_BURST_BYTES  # the links' token-bucket burst (EmulationSpec.burst_bytes)
    realtime: bool = False  # the ranks ran at SCHED_FIFO priority RANK_RT_PRIORITY

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for row, measured in zip(out["rows"], self.rows, strict=True):
            row["median_s"] = measured.median_s
            row["p99_s"] = measured.percentile_s(99)
            row["ratio"] = measured.ratio
            row["burst_bound"] = measured.burst_bound
        return out


def _ns_python(namespace: str, code: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, sys.executable, "-c", code, *args]


_ECHO_SERVER = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
s.settimeout(10.0)
for _ in range(int(sys.argv[2])):
    data, addr = s.recvfrom(64)
    s.sendto(data, addr)
"""

_ECHO_CLIENT = """
import socket, sys, time, statistics
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(5.0)
rtts = []
for i in range(int(sys.argv[3])):
    t = time.perf_counter()
    s.sendto(b"x", (sys.argv[1], int(sys.argv[2])))
    s.recvfrom(64)
    rtts.append(time.perf_counter() - t)
print(statistics.median(rtts))
"""


def measure_hop_latency(layout: Layout, gpu_a: int = 0, gpu_b: int | None = None) -> float:
    """One hop's latency on this emulation: half the median UDP round trip between two hosts, per hop."""
    topology = layout.topology
    gpu_b = topology.num_gpus - 1 if gpu_b is None else gpu_b
    server = subprocess.Popen(
        _ns_python(layout.host_namespace(gpu_b), _ECHO_SERVER, layout.host_address[gpu_b], str(_ECHO_ROUND_TRIPS)),
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=die_with_parent(os.getpid()),  # noqa: PLW1509 (prctl and getppid only)
    )
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        done = subprocess.run(
            _ns_python(
                layout.host_namespace(gpu_a), _ECHO_CLIENT, layout.host_address[gpu_b], port, str(_ECHO_ROUND_TRIPS)
            ),
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            raise EmulationError(f"UDP echo from {layout.host_namespace(gpu_a)} failed: {done.stderr.strip()[-200:]}")
        rtt_s = float(done.stdout)
    finally:
        server.kill()
        server.communicate()
    adjacency: list[list[int]] = [[] for _ in range(topology.num_nodes)]
    for cable in layout.cables:
        adjacency[cable.a].append(cable.b)
        adjacency[cable.b].append(cable.a)
    transit = topology.node_kind != int(NodeKind.GPU)
    if topology.gpu_transit:
        transit[:] = True
    hops = _hops_to(topology, adjacency, int(topology.gpu_node[gpu_b]), transit)[int(topology.gpu_node[gpu_a])]
    return rtt_s / 2 / max(hops, 1)


def predicted_topology(layout: Layout, hop_latency_s: float) -> Any:
    """The topology as emulated: shaped rates times :data:`GOODPUT`, every hop at ``hop_latency_s``."""
    topology = layout.topology
    return replace(
        topology,
        link_bandwidth_Bps=topology.link_bandwidth_Bps * layout.scale * GOODPUT,
        link_latency_s=np.full(topology.num_links, hop_latency_s),
    )


def _by_direction(layout: Layout, command: list[str], read: Callable[[Any], dict[str, T]]) -> dict[int, T]:
    """Per shaped direction, by topology link index, what ``read`` makes of ``command`` (an ``ip`` or ``tc``
    listing in JSON, run in every namespace) for the device that sends in that direction."""
    out: dict[int, T] = {}
    for ns_index, ns in enumerate(layout.namespaces):
        data = json.loads(subprocess.run([command[0], "-n", ns, *command[1:]], capture_output=True, text=True,
                                         timeout=COMMAND_TIMEOUT_S, check=True).stdout)  # fmt: skip
        stats = read(data)
        for cable in layout.cables:
            if cable.a == ns_index and cable.a_dev in stats:
                out[cable.link_ab] = stats[cable.a_dev]
            if cable.b == ns_index and cable.b_dev in stats:
                out[cable.link_ba] = stats[cable.b_dev]
    return out


def _tx_bytes(layout: Layout) -> dict[int, int]:
    """Bytes sent so far on every shaped direction, by topology link index."""
    return _by_direction(
        layout,
        ["ip", "-s", "-j", "link", "show"],
        lambda data: {entry["ifname"]: int(entry["stats64"]["tx"]["bytes"]) for entry in data},
    )


def _queue_counters(layout: Layout) -> dict[int, tuple[int, int]]:
    """(packets sent, packets dropped) so far by every shaped direction's token bucket, by topology link index."""
    return _by_direction(
        layout,
        ["tc", "-s", "-j", "qdisc", "show"],
        lambda data: {
            q["dev"]: (int(q.get("packets", 0)), int(q.get("drops", 0))) for q in data if q.get("kind") == "tbf"
        },
    )


def _retransmissions(layout: Layout) -> int:
    total = 0
    for g in range(layout.num_hosts):
        snmp = subprocess.run(["ip", "netns", "exec", layout.host_namespace(g), "cat", "/proc/net/snmp"],
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=True).stdout  # fmt: skip
        tcp = [line.split() for line in snmp.splitlines() if line.startswith("Tcp:")]
        total += int(tcp[1][tcp[0].index("RetransSegs")])
    return total


def _stop_ranks(procs: Sequence[subprocess.Popen[str]], grace_s: float = RANK_GRACE_S) -> None:
    """SIGTERM every rank's process group, SIGKILL after ``grace_s``, and reap them (as ``allreduce run`` does)."""
    for stop, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, stop)
        deadline = time.monotonic() + wait_s
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        if all(proc.poll() is not None for proc in procs):
            break
    for proc in procs:
        with contextlib.suppress(ValueError, OSError, subprocess.TimeoutExpired):
            proc.communicate(timeout=1.0)  # close the pipes


def _interrupt(signum: int) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def realtime_refusal(priority: int = RANK_RT_PRIORITY) -> str | None:
    """Why a rank could not run at ``SCHED_FIFO`` ``priority`` here (not root, or a cgroup without real-time
    runtime), asked of a child interpreter; None if it can."""
    code = f"import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param({int(priority)}))"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


def _run_ranks(layout: Layout, rank_gpu: list[int], *, algorithm: str, sizes: list[int], reps: int,
               timeout_s: float, congestion: str, realtime: bool) -> list[dict[str, Any]]:  # fmt: skip
    """Run one rank per host and collect their reports. The ranks never outlive this call: each is SIGKILLed by
    the kernel if this process dies (``PR_SET_PDEATHSIG``, kept across ``ip netns exec``, which execs the rank in
    place), leads a process group of its own, and on every way out but a return (an error, a rank that did not
    finish, SIGINT/SIGTERM/SIGHUP, which become KeyboardInterrupt here) every group is stopped before this
    raises."""
    procs: list[subprocess.Popen[str]] = []
    with stop_signal_handlers(_interrupt):
        try:
            return _start_and_wait(layout, rank_gpu, procs, algorithm=algorithm, sizes=sizes, reps=reps,
                                   timeout_s=timeout_s, congestion=congestion, realtime=realtime)  # fmt: skip
        except BaseException:
            _stop_ranks(procs)
            raise


def _start_and_wait(layout: Layout, rank_gpu: list[int], procs: list[subprocess.Popen[str]], *, algorithm: str,
                    sizes: list[int], reps: int, timeout_s: float,
                    congestion: str, realtime: bool) -> list[dict[str, Any]]:  # fmt: skip
    n = len(rank_gpu)
    spec = json.dumps({"algorithm": algorithm, "sizes": sizes, "reps": reps, "timeout_s": timeout_s})
    env_common = dict(os.environ)
    env_common.update(
        WORLD_SIZE=str(n),
        MASTER_ADDR=layout.host_address[rank_gpu[0]],
        MASTER_PORT=str(_STORE_PORT),
        ALLREDUCE_TOKEN=secrets.token_hex(16),
    )
    env_common.pop(CONGESTION_ENV, None)
    env_common.pop(RT_PRIORITY_ENV, None)
    if realtime:
        env_common[RT_PRIORITY_ENV] = str(RANK_RT_PRIORITY)
    if congestion != "default":
        env_common[CONGESTION_ENV] = congestion
    in_child = die_with_parent(os.getpid())
    for rank, gpu in enumerate(rank_gpu):
        env = dict(env_common, RANK=str(rank))
        cmd = ["ip", "netns", "exec", layout.host_namespace(gpu), sys.executable, "-m", "allreduce.emulate._rank", spec]
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                process_group=0,
                # Only prctl and getppid run between fork and exec (the libc function is resolved already).
                preexec_fn=in_child,  # noqa: PLW1509
            )
        )
    results, errors = [], []
    deadline = time.monotonic() + timeout_s * (1 + reps) * max(len(sizes), 1)
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            raise EmulationError(f"rank {rank} on {layout.host_namespace(rank_gpu[rank])} did not finish") from None
        if proc.returncode != 0:
            errors.append(f"rank {rank}: {err.strip().splitlines()[-1] if err.strip() else proc.returncode}")
        else:
            report = json.loads(out.strip().splitlines()[-1])
            if realtime and not report.get("realtime"):
                errors.append(f"rank {rank}: did not run at real-time priority")
            results.append(report)
    if errors:
        raise EmulationError("; ".join(errors))
    return results


TAIL_STACKS = ("linux", "rfc6298")
"""The tail model's TCP stacks shown beside a measurement with loss: Linux's recovery, and the RFC 6298 model."""


Tails = tuple[tuple[str, tuple[float, float, float, float]], ...]


def tail_samples(schedule: Schedule, model: Topology, size: int, *, rank_gpu: Sequence[int],
                 routing: PathTable | None, dropped: Sequence[tuple[str, int, int]], burst: float = 1.0,
                 burst_hold_s: float = 0.0, stacks: Sequence[str] = TAIL_STACKS,
                 samples: int = TAIL_SAMPLES) -> tuple[tuple[str, npt.NDArray[np.float64]], ...]:  # fmt: skip
    """Per TCP stack of ``stacks``, the tail model's samples of the collective's time at the loss rates the counters
    showed (``dropped``: (link, packets sent, packets dropped)), in bursts of ``burst`` packets (nothing where
    nothing was dropped), a burst held on a silent link for ``burst_hold_s`` (the firewall's chain is clocked by
    the link's packets, and its bad state expires that long after it began on average:
    :func:`allreduce.emulate._loss.burst_hold_s`). ``model`` is :func:`predicted_topology`'s, ``routing`` the
    kernel's paths."""
    if not dropped:
        return ()
    links = tuple((name, drops / (sent + drops)) for name, sent, drops in dropped)
    out = []
    for stack in stacks:
        # every repetition is timed from the barrier before it: its agreement is charged too
        hold = burst_hold_s if burst > 1 else 0.0
        loss = LossModel(fabric="tcp", links=links, tcp=stack, barrier=True, burst=burst, burst_hold_s=hold)
        config = TailConfig(samples=samples, seed=0, loss=loss)
        result = simulate_tail(schedule, model, size_bytes=float(size), config=config, placement=rank_gpu,
                               routing=routing)  # fmt: skip
        out.append((stack, result.collective_s))
    return tuple(out)


def tail_predictions(schedule: Schedule, model: Topology, size: int, *, rank_gpu: Sequence[int],
                     routing: PathTable | None, dropped: Sequence[tuple[str, int, int]], burst: float = 1.0,
                     burst_hold_s: float = 0.0, stacks: Sequence[str] = TAIL_STACKS,
                     samples: int = TAIL_SAMPLES) -> Tails:  # fmt: skip
    """Per TCP stack of ``stacks``, the tail model's (p50, p90, p99, max) of :func:`tail_samples`."""
    out = []
    for stack, seconds in tail_samples(schedule, model, size, rank_gpu=rank_gpu, routing=routing, dropped=dropped,
                                       burst=burst, burst_hold_s=burst_hold_s, stacks=stacks,
                                       samples=samples):  # fmt: skip
        p50, p90, p99 = (float(v) for v in np.percentile(seconds, [50, 90, 99]))
        out.append((stack, (p50, p90, p99, float(seconds.max()))))
    return tuple(out)


def run(
    layout: Layout,
    *,
    algorithm: str = "ring",
    sizes: list[int],
    reps: int = 3,
    ranks: int | None = None,
    placement: str | Sequence[int] = "linear",
    seed: int = 0,
    timeout_s: float = 120.0,
    congestion: str = DEFAULT_CONGESTION,
    lossy_links: Sequence[int] = (),
    loss_burst: float = 1.0,
    burst_hold_s: float = 0.0,
    burst_bytes: int = MIN_BURST_BYTES,
    realtime: bool = False,
) -> RunResult:
    """Measure ``algorithm`` at ``sizes`` on the running emulation ``layout`` and predict each with the simulator.
    ``congestion``: the TCP congestion control of the ranks' data connections (``"default"``: the kernel's);
    ``lossy_links``: the links that drop packets by the firewall's rules (their counters are read), in bursts
    of ``loss_burst`` packets on average (the tail model's ``burst``), whose bad state lives ``burst_hold_s``
    on average on a silent link (its ``burst_hold_s``: ``EmulationSpec.burst_hold_s``); ``burst_bytes``: the
    links' token-bucket burst (``EmulationSpec.burst_bytes``), which decides the rows marked ``burst_bound``;
    ``realtime``: every rank runs at ``SCHED_FIFO`` priority :data:`RANK_RT_PRIORITY` (the module docstring says
    why); EmulationError, before anything starts, where the kernel refuses it."""
    if congestion != "default":
        congestion_control(congestion)  # ValueError naming what this kernel has, before anything starts
    if realtime and (refusal := realtime_refusal()) is not None:
        raise EmulationError(f"realtime: a rank cannot run at SCHED_FIFO priority {RANK_RT_PRIORITY} here ({refusal})")
    topology = layout.topology
    n = ranks or topology.num_gpus
    if not 2 <= n <= topology.num_gpus:
        raise ValueError(f"ranks: {n} does not fit {topology.name}, which has {topology.num_gpus} hosts (2 at least)")
    schedule = make_schedule("all_reduce", algorithm, n)
    rank_gpu = [int(g) for g in place(n, topology, placement, seed=seed)]
    hop_latency_s = measure_hop_latency(layout, rank_gpu[0], rank_gpu[-1])
    model = predicted_topology(layout, hop_latency_s)
    shaped_Bps = topology.link_bandwidth_Bps * layout.scale
    rows = []
    for size in sizes:
        before, retrans_before, queues_before = _tx_bytes(layout), _retransmissions(layout), _queue_counters(layout)
        injected_before = read_counters(layout, list(lossy_links)) if lossy_links else {}
        results = _run_ranks(layout, rank_gpu, algorithm=algorithm, sizes=[size], reps=reps, timeout_s=timeout_s,
                              congestion=congestion, realtime=realtime)  # fmt: skip
        after, retrans_after, queues_after = _tx_bytes(layout), _retransmissions(layout), _queue_counters(layout)
        # A lossy link's firewall counts the TCP packets that reached its far end and those it dropped there.
        injected = {
            link: (arrived - injected_before[link][0], drops - injected_before[link][1])
            for link, (arrived, drops) in (read_counters(layout, list(lossy_links)) if lossy_links else {}).items()
        }
        dropped = tuple(
            (
                topology.link_name(link),
                sent - queues_before.get(link, (0, 0))[0],
                drops - queues_before.get(link, (0, 0))[1],
            )
            for link, (sent, drops) in sorted(queues_after.items())
            if drops > queues_before.get(link, (0, 0))[1] and link not in injected
        ) + tuple(
            (
                topology.link_name(link),
                arrived - firewall,
                firewall + queues_after.get(link, (0, 0))[1] - queues_before.get(link, (0, 0))[1],
            )
            for link, (arrived, firewall) in sorted(injected.items())
            if firewall > 0 or queues_after.get(link, (0, 0))[1] > queues_before.get(link, (0, 0))[1]
        )
        slowest = tuple(max(r["times_s"][str(size)][k] for r in results) for k in range(reps))
        sent = {link: after.get(link, 0) - before.get(link, 0) for link in after}
        busy = {link: sent[link] / float(shaped_Bps[link]) for link in sent}
        busiest = max(busy, key=lambda link: busy[link])
        observed = np.array([sent.get(link, 0) for link in range(topology.num_links)], dtype=np.float64) / (reps + 1)
        candidates = [
            simulate(schedule, model, size_bytes=float(size), placement=rank_gpu, seed=s) for s in range(ECMP_SEEDS)
        ]
        connections = [Connection(rank_gpu[int(r["rank"])], *c) for r in results for c in r.get("connections", [])]
        try:
            table = kernel_paths(layout, connections, ignore_ports=frozenset({_STORE_PORT}))
            predicted = simulate(schedule, model, size_bytes=float(size), placement=rank_gpu, routing=table)
            paths = "kernel"
            routing: PathTable | None = table
        except (EmulationError, ValueError) as exc:
            print(f"emulate: the kernel's paths could not be used ({exc}); predicting the closest hash seed",
                  file=sys.stderr)  # fmt: skip
            predicted = min(candidates, key=lambda c: float(np.abs(c.link_bytes - observed).sum()))
            paths = "closest hash seed"
            routing = None
        times = [c.seconds for c in candidates]
        per_repetition = max(sent.values(), default=0) / (reps + 1)  # the warm-up moved as much as each repetition
        burst_share = min(1.0, burst_bytes / per_repetition) if per_repetition > 0 else 1.0
        bottleneck = predicted.bottlenecks[0] if predicted.bottlenecks else None
        agrees = bottleneck is not None and busy.get(bottleneck.link, 0.0) >= (1 - BUSY_TIE) * busy[busiest]
        tails = (
            tail_predictions(
                schedule,
                model,
                size,
                rank_gpu=rank_gpu,
                routing=routing,
                dropped=dropped,
                burst=loss_burst,
                burst_hold_s=burst_hold_s,
            )
            if reps >= TAIL_MIN_REPS
            else ()
        )
        rows.append(
            Measurement(
                size_bytes=size,
                seconds=slowest,
                predicted_s=predicted.seconds,
                predicted_range_s=(min(times), max(times)),
                exact=all(r["exact"] for r in results),
                busiest_link=topology.link_name(busiest),
                busiest_link_bytes=sent[busiest],
                predicted_bottleneck=bottleneck.name if bottleneck is not None else "-",
                retransmissions=retrans_after - retrans_before,
                paths=paths,
                bottleneck_agrees=agrees,
                dropped=dropped,
                predicted_tail_s=(tails[0][1][0], tails[0][1][2]) if tails else None,
                predicted_tails=tails,
                burst_share=burst_share,
                kernel_paths=()
                if routing is None
                else tuple((src, dst, tuple(links)) for (src, dst), links in sorted(routing.paths.items())),
            )
        )
    return RunResult(topology.name, algorithm, tuple(rank_gpu), layout.rate_bps, hop_latency_s, tuple(rows), congestion,
                     burst_hold_s if loss_burst > 1 else 0.0, burst_bytes, realtime)  # fmt: skip
