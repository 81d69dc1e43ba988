"""Creating and removing an emulated cluster: ``ip`` and ``tc`` commands, and the state file that makes removal exact.

Every object is recorded in the state file *before* it is created, so whatever happens next (an error half way,
Ctrl-C, SIGKILL of this process) :func:`remove` finds it. Removing a namespace removes the veth ends inside it,
and with one end gone the kernel removes its peer (and a namespace's firewall tables, the loss rules, go with it),
so the namespaces are all there is to remove. Nothing that is
not in a state file is ever touched, and every name carries the emulation's prefix ``ar<name>-``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from allreduce.emulate._layout import _NAME_OK, MIN_BURST_BYTES, WIRE_BURST_BYTES, Layout
from allreduce.emulate._layout import layout as make_layout
from allreduce.emulate._loss import GSO_MAX_SEGS, LossSpec, burst_hold_s, loss_commands
from allreduce.sim import Faults, apply_faults, resolve_links
from allreduce.topology import parse_topology

__all__ = [
    "COMMAND_TIMEOUT_S",
    "DEFAULT_LOSS_RATE_BPS",
    "DEFAULT_NAME",
    "DEFAULT_QUEUE_BYTES",
    "DEFAULT_RATE_BPS",
    "FRAME_BYTES",
    "MAX_BURST_BYTES",
    "MIN_BURST_SEGMENTS",
    "MIN_GSO_BURST_BYTES",
    "STATE_DIR",
    "EmulationError",
    "EmulationSpec",
    "build",
    "check_privileges",
    "existing_emulations",
    "load",
    "remove",
    "running",
]

STATE_DIR = Path(os.environ.get("ALLREDUCE_EMULATE_STATE_DIR", "/run/allreduce-emulate"))
"""Where state files live (one ``<name>.json`` per emulation); tmpfs, so a reboot forgets what a reboot removed."""

COMMAND_TIMEOUT_S = 30.0
"""Longest one ``ip``/``tc`` command may take before the build is abandoned (they take milliseconds)."""

FRAME_BYTES = 1514
"""A full-size Ethernet frame: 1,448 bytes of payload, 66 of headers (the emulate run's ``GOODPUT``)."""

MIN_BURST_SEGMENTS = 2
"""Fewest full frames a token bucket of one-MSS packets may hold (``--burst``)."""

MIN_GSO_BURST_BYTES = 128 * 1024
"""Smallest burst without loss: the token bucket drops a packet larger than its burst, and GSO packets reach 64 KiB."""

MAX_BURST_BYTES = 64 * 1024 * 1024
"""Largest burst accepted (``--burst``)."""

DEFAULT_QUEUE_BYTES = 2 * MIN_BURST_BYTES
"""Queue of every shaped link unless ``queue_bytes`` says otherwise: deep enough that TCP loses nothing at the
emulation's rates with the few flows a collective starts, so a plain run measures bandwidth, not loss."""


_FIVE_TUPLE_FIELDS = 0x0001 | 0x0002 | 0x0004 | 0x0010 | 0x0020
"""``fib_multipath_hash_fields``: source and destination address, protocol, source and destination port (the
kernel's FIB_MULTIPATH_HASH_FIELD_* bits), hashed by every router for every packet, so ``ip route get ... sport
... dport`` answers with the next hop a connection's packets take."""

DEFAULT_NAME = "emu"
"""Name of an emulation when none is given (namespaces are then ``aremu-<node>``)."""

DEFAULT_RATE_BPS = 200e6
"""Shaped rate of the fastest host link: at 200 Mbit/s per link, 2 cores move the traffic of 8 hosts without
becoming the bottleneck themselves, so what is measured is the network."""

DEFAULT_LOSS_RATE_BPS = 25e6
"""Shaped rate of the fastest host link of an emulation with packet loss, whose packets are one MSS each
(``gso_max_segs 1``): a loss-free 4-host emulation keeps the 2-core development machine's cores 85% busy at
100 Mbit/s, 57% at 50 and 32% at 25 (``/proc/stat``, 2026-12-07), and a busy host sends the ACKs a lossy
connection's small window waits for late, so what a loss costs shrinks with the rate until the cores are
mostly idle: the single lossy link at 1e-2 measured 1.38x, 1.13x and 1.04x the tail model's p50 at 100, 50 and
25 Mbit/s (docs/emulate.md, "The cores are part of what is measured")."""


class EmulationError(RuntimeError):
    """Creating or removing an emulation failed; the message names the command and what it said."""


def check_privileges() -> None:
    """Raise :class:`EmulationError` unless this process can create network namespaces (root and iproute2)."""
    if os.geteuid() != 0:
        raise EmulationError("emulated clusters need root (network namespaces and traffic shaping)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise EmulationError(f"emulated clusters need iproute2 ({' and '.join(missing)} not found on PATH)")


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


class _Commands:
    """Whether a command is running, and the stop signals that arrived meanwhile (see :func:`_run`)."""

    running = False
    deferred: list[int] = []  # noqa: RUF012 (one process-wide record, mutated in place)


def _run(args: Sequence[str], *, stdin: str | None = None) -> str:
    # A stop signal waits until the command has finished (milliseconds): an interrupt raised while Popen starts the
    # child would leave it running unwatched, and an `ip netns add` finishing after the cleanup listed what exists
    # would leave its namespace behind. Two guards, because blocking the signal in this thread is not enough: a
    # process-directed signal goes to any thread that does not block it (numpy's BLAS starts some), and Python then
    # runs the handler in the main thread at its next bytecode, mid-command. So the handlers of running() defer a
    # stop that arrives while a command runs, and it is raised here once the command has finished. (The child
    # inherits the mask: a timeout kills it with SIGKILL.)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    _Commands.running = True
    try:
        done = subprocess.run(
            list(args), input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise EmulationError(f"`{' '.join(args)}` did not finish in {COMMAND_TIMEOUT_S:g} s") from None
    finally:
        _Commands.running = False
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    if _Commands.deferred:
        signum = _Commands.deferred.pop()
        _Commands.deferred.clear()
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")
    if done.returncode != 0:
        said = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = next((line for line in said if "rror" in line), said[0] if said else f"exit {done.returncode}")
        raise EmulationError(f"`{' '.join(args)}` failed: {reason}")
    return done.stdout


@dataclass(frozen=True)
class EmulationSpec:
    """What to emulate: a topology (spec or file), a name, the rate of its fastest host link, degraded links
    (``(link, factor)``, as ``allreduce sim --degrade``), shallow queues (``(link, bytes)``), and packet loss:
    ``loss`` per link (``(link, spec)``; ``a<->b`` is both directions) and ``loss_all`` on every link
    direction (a link in ``loss`` keeps its own); ``burst``: the token buckets' burst in bytes (None:
    :data:`WIRE_BURST_BYTES` with loss, :data:`MIN_BURST_BYTES` without)."""

    topology: str
    name: str = DEFAULT_NAME
    rate_bps: float = DEFAULT_RATE_BPS
    degrade: tuple[tuple[str, float], ...] = ()
    queue: tuple[tuple[str, int], ...] = ()
    loss: tuple[tuple[str, LossSpec], ...] = ()
    loss_all: LossSpec | None = None
    burst: int | None = None

    def layout(self) -> Layout:
        base = parse_topology(self.topology)
        topology = apply_faults(base, Faults(degraded=self.degrade)) if self.degrade else base
        return make_layout(topology, name=self.name, rate_bps=self.rate_bps, scale_from=base)

    def queue_bytes(self, built: Layout) -> dict[int, int]:
        """The queues by link index (names resolved on the layout's topology; ``a<->b`` sets both directions)."""
        out: dict[int, int] = {}
        for link, size in self.queue:
            if size < 1:
                raise ValueError(f"--queue {link}={size}: a queue holds at least one byte")
            for index in resolve_links(built.topology, link):
                out[index] = size
        return out

    def losses(self, built: Layout) -> dict[int, LossSpec]:
        """The loss of every lossy link direction, by link index (names resolved on the layout's topology)."""
        out: dict[int, LossSpec] = {}
        if self.loss_all is not None:
            out = dict.fromkeys(range(built.topology.num_links), self.loss_all)
        for link, spec in self.loss:
            try:
                indices = resolve_links(built.topology, link)
            except ValueError as exc:
                raise ValueError(f"--loss {link}: {exc}") from None
            for index in indices:
                out[index] = spec
        return out

    def burst_bytes(self, built: Layout) -> int:
        """The token buckets' burst (bytes): ``burst``, else :data:`WIRE_BURST_BYTES` where links drop packets
        (one MSS a packet), else :data:`MIN_BURST_BYTES`. A burst below :data:`MIN_BURST_SEGMENTS` full frames, or
        without loss below :data:`MIN_GSO_BURST_BYTES` (a GSO packet larger than the burst would be dropped), or
        above :data:`MAX_BURST_BYTES` is a ValueError naming ``--burst``."""
        lossy = bool(self.losses(built))
        if self.burst is None:
            return WIRE_BURST_BYTES if lossy else MIN_BURST_BYTES
        low = MIN_BURST_SEGMENTS * FRAME_BYTES if lossy else MIN_GSO_BURST_BYTES
        if not low <= self.burst <= MAX_BURST_BYTES:
            why = "one-MSS packets" if lossy else "GSO packets of up to 64 KiB (no --loss)"
            raise ValueError(f"--burst {self.burst}: with {why} the burst must be {low:,} to {MAX_BURST_BYTES:,} bytes")
        return self.burst

    def loss_burst(self, built: Layout) -> float:
        """The mean burst of the lossy links (the tail model takes one for all: the largest), 1 if none."""
        return max((spec.burst for spec in self.losses(built).values()), default=1.0)

    def burst_hold_s(self, built: Layout) -> float:
        """How long a bursty link's bad state lives on average once no packet crosses it, the longest (the tail
        model's ``burst_hold_s``: :func:`allreduce.emulate._loss.burst_hold_s`); 0 if no link is bursty."""
        return burst_hold_s(built, self.losses(built))

    def to_json(self) -> dict[str, Any]:
        return {
            "topology": self.topology,
            "name": self.name,
            "rate_bps": self.rate_bps,
            "degrade": [list(d) for d in self.degrade],
            "queue": [list(q) for q in self.queue],
            "loss": [[link, spec.to_json()] for link, spec in self.loss],
            "loss_all": None if self.loss_all is None else self.loss_all.to_json(),
            "burst": self.burst,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EmulationSpec:
        return cls(
            topology=str(data["topology"]),
            name=str(data["name"]),
            rate_bps=float(data["rate_bps"]),
            degrade=tuple((str(link), float(f)) for link, f in data["degrade"]),
            queue=tuple((str(link), int(b)) for link, b in data["queue"]),
            loss=tuple((str(link), LossSpec(float(p), float(b))) for link, (p, b) in data.get("loss", [])),
            loss_all=None if data.get("loss_all") is None else LossSpec(*(float(v) for v in data["loss_all"])),
            burst=None if data.get("burst") is None else int(data["burst"]),
        )


@dataclass
class _State:
    path: Path
    spec: EmulationSpec
    namespaces: list[str]

    def save(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"spec": self.spec.to_json(), "namespaces": self.namespaces}))
        tmp.replace(self.path)  # atomic: a reader sees the old or the new list, never half of one

    @classmethod
    def load(cls, path: Path) -> _State:
        try:
            data = json.loads(path.read_text())
            return cls(path, EmulationSpec.from_json(data["spec"]), [str(n) for n in data["namespaces"]])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise EmulationError(f"{path}: not a readable emulation state file ({exc})") from None


def load(name: str, *, state_dir: Path = STATE_DIR) -> EmulationSpec:
    """The spec of the running emulation ``name`` (from its state file)."""
    path = _state_path(name, state_dir)
    if not path.exists():
        running_now = ", ".join(existing_emulations(state_dir)) or "none"
        raise EmulationError(f"no emulation named {name!r} is up (running: {running_now})")
    return _State.load(path).spec


def _state_path(name: str, state_dir: Path) -> Path:
    """Where the state of ``name`` lives: every verb (up, down, run, load) comes here first, so a name that is not
    one ``up`` accepts (``../x``, ``a/b``) is refused before any file is read, written or deleted."""
    if not isinstance(name, str) or not _NAME_OK.fullmatch(name):
        raise EmulationError(
            f"emulation name {name!r}: use 1 to 8 lowercase letters or digits (it names the state file in "
            f"{state_dir} and prefixes every namespace)"
        )
    return state_dir / f"{name}.json"


def existing_emulations(state_dir: Path = STATE_DIR) -> list[str]:
    """Names of the emulations that have a state file (built, or left half-built by a killed process)."""
    if not state_dir.is_dir():
        return []
    return sorted(p.stem for p in state_dir.glob("*.json") if _NAME_OK.fullmatch(p.stem))


def _namespaces_now() -> set[str]:
    out = _run(["ip", "-j", "netns", "list"]) or "[]"
    return {entry["name"] for entry in json.loads(out)}


def _rate(bits_per_s: float) -> str:
    return f"{max(round(bits_per_s), 8)}bit"


def build(spec: EmulationSpec, *, state_dir: Path = STATE_DIR) -> Layout:
    """Create the emulation ``spec`` describes and return its layout; on any failure remove what was created, then
    raise. Links without a queue in ``spec.queue`` get :data:`DEFAULT_QUEUE_BYTES`."""
    built = spec.layout()
    queues = spec.queue_bytes(built)
    losses = spec.losses(built)
    burst = spec.burst_bytes(built)
    check_privileges()
    if losses and shutil.which("nft") is None:
        raise EmulationError("packet loss needs nftables (apt-get install nftables): nft not found on PATH")
    path = _state_path(built.name, state_dir)
    if path.exists():
        raise EmulationError(
            f"an emulation named {built.name!r} exists already ({path}); remove it first (allreduce emulate down "
            f"--name {built.name})"
        )
    clash = sorted(set(built.namespaces) & _namespaces_now())
    if clash:
        raise EmulationError(f"network namespace(s) {', '.join(clash)} exist already and are not ours; choose --name")
    state = _State(path, spec, [])
    state.save()
    try:
        for ns in built.namespaces:
            state.namespaces.append(ns)
            state.save()
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        for node in built.routers():
            _run(
                [
                    "ip", "netns", "exec", built.namespaces[node], "sysctl", "-q", "-w",
                    "net.ipv4.ip_forward=1",
                    # A switch's ECMP: a hash of the 5-tuple (policy 3 = the fields below). Policy 1 would reuse a
                    # local socket's random flow hash, which TCP redraws after a timeout: no lookup can predict it.
                    "net.ipv4.fib_multipath_hash_policy=3",
                    f"net.ipv4.fib_multipath_hash_fields={_FIVE_TUPLE_FIELDS:#x}",
                    "net.ipv4.conf.all.rp_filter=0",  # ECMP returns by another path than it went
                    "net.ipv4.conf.default.rp_filter=0",
                ]
            )  # fmt: skip
        for g, address in enumerate(built.host_address):
            _run(["ip", "-n", built.host_namespace(g), "addr", "add", f"{address}/32", "dev", "lo"])
        for cable in built.cables:
            ns_a, ns_b = built.namespaces[cable.a], built.namespaces[cable.b]
            _run(
                [
                    "ip",
                    "link",
                    "add",
                    cable.a_dev,
                    "netns",
                    ns_a,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    cable.b_dev,
                    "netns",
                    ns_b,
                ]
            )
            for ns, dev, addr, peer, link, rate in (
                (ns_a, cable.a_dev, cable.a_addr, cable.b_addr, cable.link_ab, cable.rate_ab_bps),
                (ns_b, cable.b_dev, cable.b_addr, cable.a_addr, cable.link_ba, cable.rate_ba_bps),
            ):
                _run(["ip", "-n", ns, "addr", "add", addr, "peer", f"{peer}/32", "dev", dev])
                if losses:
                    # One MSS per packet: what a wire carries, what a drop loses and a token bucket counts.
                    _run(["ip", "-n", ns, "link", "set", dev, "gso_max_segs", str(GSO_MAX_SEGS)])
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
                limit = queues.get(link, DEFAULT_QUEUE_BYTES)
                _run(
                    ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", _rate(rate),
                     "burst", str(burst), "limit", str(max(limit, 1))]
                )  # fmt: skip
        for route in built.routes:
            ns = built.namespaces[route.node]
            command = ["ip", "-n", ns, "route", "add", f"{route.destination}/32"]
            if len(route.next_hops) == 1:
                addr, dev = route.next_hops[0]
                command += ["via", addr, "dev", dev]
            else:
                for addr, dev in route.next_hops:
                    command += ["nexthop", "via", addr, "dev", dev]
            if route.source is not None:
                command += ["src", route.source]
            _run(command)
        for command in loss_commands(built, losses):
            _run(command)
    except BaseException:
        with contextlib.suppress(EmulationError):
            remove(built.name, state_dir=state_dir)
        raise
    return built


def remove(name: str, *, state_dir: Path = STATE_DIR) -> list[str]:
    """Delete every namespace the state file of ``name`` lists (and that still exists), then the state file.

    Returns the namespaces deleted. Refuses names in the file that lack the emulation's prefix."""
    path = _state_path(name, state_dir)
    if not path.exists():
        running_now = ", ".join(existing_emulations(state_dir)) or "none"
        raise EmulationError(f"no emulation named {name!r} is up (running: {running_now})")
    state = _State.load(path)
    prefix = f"ar{name}-"
    foreign = [ns for ns in state.namespaces if not ns.startswith(prefix)]
    if foreign:
        raise EmulationError(
            f"{path} lists namespaces without the prefix {prefix!r} ({', '.join(foreign)}); not touching them"
        )
    present = _namespaces_now()
    removed = []
    for ns in reversed(state.namespaces):
        if ns in present:
            _run(["ip", "netns", "delete", ns])
            removed.append(ns)
    path.unlink(missing_ok=True)
    return removed


def _stop(signum: int, frame: FrameType | None) -> None:
    """running()'s handler of the stop signals: KeyboardInterrupt, once the command running (if any) has finished."""
    if _Commands.running:  # raised by _run once its command has finished
        _Commands.deferred.append(signum)
        return
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


@contextlib.contextmanager
def running(spec: EmulationSpec, *, state_dir: Path = STATE_DIR) -> Iterator[Layout]:
    """Build ``spec``, yield its layout, and remove it on every way out: return, exception, Ctrl-C, SIGTERM, SIGHUP.

    (SIGKILL cannot be caught: the state file stays, and ``allreduce emulate down`` removes the rest.)"""

    in_main_thread = threading.current_thread() is threading.main_thread()
    # SIGINT too (a BLAS thread may take it, see _run), unless ignored (a background job keeps ignoring it)
    stops = [sig for sig in _STOP_SIGNALS if sig != signal.SIGINT or signal.getsignal(sig) is not signal.SIG_IGN]
    previous = {sig: signal.getsignal(sig) for sig in stops} if in_main_thread else {}
    for sig in previous:
        signal.signal(sig, _stop)
    try:
        built = build(spec, state_dir=state_dir)
        try:
            yield built
        finally:
            remove(spec.name, state_dir=state_dir)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
