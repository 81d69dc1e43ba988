"""The fault campaign: real ranks started by hand, one injected fault each, every outcome classified.

    .venv/bin/python benchmarks/faults.py [--faults 1000] [--seed 1] [--jobs 2] [--json FILE] [--only SEED ...]

Each fault is one job of N = 2-8 ranks over shm or tcp, started as plain subprocesses with RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and ALLREDUCE_TOKEN (not through the launcher, so only the library stops the survivors).
The ranks all-reduce integer-valued data whose exact sum every rank knows, so any wrong element is caught. One
fault is injected per job (the kinds are in :data:`KINDS`, described in docs/faults.md) and the outcome is
classified:

- hang: a rank still alive at the case's hard deadline (it is killed);
- silent wrong: a rank returned a result other than the exact expected one, or a refused call changed its buffer;
- culprit named: every rank that raised names the faulty rank, peer or field (defined per kind in
  :func:`judge`), or, for attacks from outside the job, the job was unaffected;
- leftover processes: a rank that reported its result but had not exited by the deadline, or any process a rank
  started that is still alive;
- leftover /dev/shm files: files the job's ranks mapped or created that still exist after every rank exited.

Every case is a pure function of its seed; a failing case is printed with the command that re-runs it alone.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

KINDS = (
    "kill",
    "exit",
    "exit_mid",
    "stall",
    "mismatch_count",
    "mismatch_dtype",
    "mismatch_op",
    "mismatch_root",
    "mismatch_algorithm",
    "threads",
    "port_garbage",
    "port_oversized",
    "port_forged",
    "port_idle",
    "store_junk",
    "shm_corrupt",
    "fd_exhaustion",
    "many_groups",
)
"""Every fault kind; a case's kind is its seed modulo the number of kinds, so ``--only SEED`` needs nothing else."""

_FAILING_KINDS = ("kill", "exit", "exit_mid", "stall", "fd_exhaustion", "many_groups")
"""A rank goes away: the others must raise naming it."""
_KILLED_KINDS = ("kill", "fd_exhaustion", "many_groups")
"""The campaign SIGKILLs the victim once every rank is ready: fd_exhaustion with every rank holding thousands of
open files (its descriptors numbered past select's 1,024), many_groups with every rank in dozens of shm groups."""
_MISMATCH_FIELD = {
    "mismatch_count": "count",
    "mismatch_dtype": "dtype",
    "mismatch_op": "op",
    "mismatch_root": "root",
    "mismatch_algorithm": "algorithm",
}
_ATTACK_KINDS = ("port_garbage", "port_oversized", "port_forged", "port_idle", "store_junk")

STALL_TIMEOUT_S = 3.0
"""The collective timeout of a job with a stalled rank: short, so that the stall (which lasts until every other
rank has given up) costs seconds; long enough that a loaded machine does not time out before the stall."""

JOB_TIMEOUT_S = 20.0
"""The collective timeout of every other job: a death or a mismatch must be reported long before it."""

STARTUP_DEADLINE_S = 90.0
"""How long all ranks of a job may take to start, join and finish their first collective (8 Python processes
importing numpy on 2 loaded cores take seconds)."""

HARD_DEADLINE_MARGIN_S = 20.0
"""After the fault, a rank still alive at 3 x its collective timeout + this margin is hung: it is killed."""

MANY_GROUPS_OPEN_FILES = 600
"""Descriptors a many_groups rank opens before it joins: with its groups', they pass select's limit of 1,024."""

ATTACK_WINDOW_S = 1.0
"""How long the ranks keep running collectives while attacks are under way, after the last attack ended."""

SIZES_ELEMENTS = (256, 4096, 65536, 1 << 20, 1 << 22)
"""Elements per all-reduce (float32: 1 KiB to 16 MiB); the large ones put a kill in the middle of a transfer."""

PATTERN_PERIOD = 251
"""The data is ``i mod 251 + 3 * rank + iteration (+ salt)``: integers, so every sum is exact in float32 (at most
8 * (250 + 21 + 1,000,000) < 2**24 for a million iterations)."""

_STOP_FILE = "stop"
_MARKER_ENV = "FAULTS_CASE_ID"
_SHM_DIR = "/dev/shm"

# Handshake bytes as an outside client writes them (magic, version, greeting and hello layouts): an attacker does
# not use the library's code, so neither does the campaign.
_HS_MAGIC = b"ARHS"
_GREETING_BYTES = 46
_HELLO = struct.Struct("!4sBBiiI32s32s")
_STORE_REQUEST = struct.Struct("!BIII")


# --------------------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One fault: everything about it follows from ``seed``."""

    seed: int
    kind: str
    world_size: int
    transport: str
    victim: int
    count: int
    token: bool
    mode: str
    at_iteration: int
    delay_s: float
    timeout_s: float
    algorithm: str

    def command(self) -> str:
        return f"python benchmarks/faults.py --only {self.seed}"


def make_case(seed: int) -> Case:
    kind = KINDS[seed % len(KINDS)]
    rng = random.Random(seed)
    world_size = rng.randint(2, 8)
    transport = "shm" if kind == "shm_corrupt" else rng.choice(("shm", "tcp"))
    count = rng.choice(SIZES_ELEMENTS)
    if kind in ("threads", "shm_corrupt", "many_groups") or kind.startswith(("mismatch", "port", "store")):
        count = rng.choice(SIZES_ELEMENTS[:4])
    mode = ""
    if kind == "port_garbage":
        mode = rng.choice(("random", "http", "zeros"))
    elif kind == "port_oversized":
        mode = rng.choice(("hello_then_junk", "huge_stream"))
    elif kind == "port_forged":
        mode = rng.choice(("wrong_mac", "no_auth", "bad_version", "wrong_world", "wrong_service_rank"))
    elif kind == "port_idle":
        mode = rng.choice(("silent", "partial_hello", "greeting_only"))
    elif kind == "store_junk":
        mode = rng.choice(("no_token", "insider_requests", "insider_overwrite", "insider_raw", "claims_rank"))
    elif kind == "shm_corrupt":
        mode = rng.choice(("random", "zero", "minus_one", "plus_one", "bit_flip", "huge"))
    elif kind == "exit":
        mode = rng.choice(("sys_exit", "return_without_close"))
    elif kind == "fd_exhaustion":
        mode = str(rng.choice((1100, 2000, 4000)))  # descriptors each rank opens before it joins
    elif kind == "many_groups":
        mode = str(rng.randint(20, 60))  # extra shm groups each rank joins
    return Case(
        seed=seed,
        kind=kind,
        world_size=world_size,
        transport=transport,
        victim=rng.randrange(world_size),
        count=count,
        token=rng.random() < 0.8,
        mode=mode,
        at_iteration=rng.randint(1, 4),
        delay_s=round(rng.uniform(0.0, 0.4), 3),
        timeout_s=STALL_TIMEOUT_S if kind == "stall" else JOB_TIMEOUT_S,
        algorithm=rng.choice(("auto", "ring", "direct")),
    )


def case_seeds(faults: int, seed: int, kinds: tuple[str, ...]) -> list[int]:
    """``faults`` seeds cycling over ``kinds`` (each seed encodes its kind)."""
    rng = random.Random(seed)
    out = []
    for i in range(faults):
        kind = kinds[i % len(kinds)]
        out.append(rng.getrandbits(30) * len(KINDS) + KINDS.index(kind))
    return out


# --------------------------------------------------------------------------------------------------------
# The rank program (python faults.py --worker)
# --------------------------------------------------------------------------------------------------------
class WrongResultError(Exception):
    """A collective returned something other than the exact expected result (raised by the rank program)."""


def _die_with_parent() -> None:
    """The ranks die with the campaign (PR_SET_PDEATHSIG), so an interrupted campaign leaves nothing behind."""
    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:
        os._exit(70)


def worker() -> int:
    _die_with_parent()
    case = Case(**json.loads(os.environ["FAULTS_CASE"]))
    rank = int(os.environ["RANK"])
    out_dir = os.environ["FAULTS_DIR"]
    log = open(os.path.join(out_dir, f"rank{rank}.jsonl"), "a", buffering=1)  # noqa: SIM115 - lives as the process

    def emit(**fields: Any) -> None:
        log.write(json.dumps(fields) + "\n")
        log.flush()

    import allreduce
    from allreduce.runtime import MismatchError

    emit(event="start", pid=os.getpid())
    if case.kind == "fd_exhaustion":
        _open_files(int(case.mode))
    elif case.kind == "many_groups":
        _open_files(MANY_GROUPS_OPEN_FILES)
        # Dozens of groups on up to 8 ranks: their recorders would take gigabytes; this kind is about descriptors.
        os.environ["ALLREDUCE_STATS"] = "0"
    group = None
    status = 0
    try:
        group = allreduce.init(transport=case.transport, timeout_s=case.timeout_s)
        _run_rank(case, rank, group, emit=emit, mismatch=MismatchError, out=out_dir)
        emit(event="done")
    except WrongResultError as exc:
        emit(event="wrong", message=str(exc))
        status = 3
    except Exception as exc:
        emit(event="error", type=type(exc).__name__, peer=getattr(exc, "peer", None), message=str(exc))
        status = 1
    finally:
        if group is not None and not (case.kind == "exit" and case.mode == "return_without_close"):
            group.close()
        emit(event="closed")
    return status


def _open_files(count: int) -> list[int]:
    """Open ``count`` descriptors for the rank's life, so that what the group opens afterwards is numbered above."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = count + 1024
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else hard, hard))
    return [os.open(os.devnull, os.O_RDONLY) for _ in range(count)]


def _expected(base: Any, world_size: int, iteration: int, salt: int) -> Any:
    """The exact sum over ranks of :func:`_fill`'s data."""
    return world_size * base + 3 * world_size * (world_size - 1) // 2 + world_size * (iteration + salt)


def _fill(x: Any, base: Any, rank: int, iteration: int, salt: int = 0) -> None:
    x[...] = base
    x += 3 * rank + iteration + salt


def _check(x: Any, want: Any, what: str) -> None:
    import numpy as np

    if not np.array_equal(x, want):
        bad = int(np.flatnonzero(x != want)[0])
        raise WrongResultError(f"{what}: element {bad} is {x[bad]!r}, expected {want[bad]!r}")


def _run_rank(case: Case, rank: int, group: Any, *, emit: Callable[..., None], mismatch: Any, out: str) -> None:
    import numpy as np

    n, victim = case.world_size, case.victim
    base = (np.arange(case.count, dtype=np.int64) % PATTERN_PERIOD).astype(np.float32)
    x = np.empty(case.count, np.float32)
    algorithm = case.algorithm

    if case.kind == "many_groups":
        _loop_over_groups(case, rank, group, emit, base)
        return

    if case.kind in _FAILING_KINDS:
        if case.kind == "exit_mid" and rank == victim:
            # os._exit from another thread: the rank vanishes wherever its main thread is, mid-transfer included.
            threading.Timer(case.delay_s, os._exit, (1,)).start()
        for it in itertools.count():
            if case.kind == "exit" and rank == victim and it == case.at_iteration:
                if case.mode == "sys_exit":
                    sys.exit(1)
                return
            _fill(x, base, rank, it)
            group.all_reduce(x, algorithm=algorithm)
            _check(x, _expected(base, n, it, 0), f"iteration {it}")
            if it == 0:
                emit(event="ready")
        return

    if case.kind in _MISMATCH_FIELD:
        for it in range(case.at_iteration + 1):
            odd = rank == victim and it == case.at_iteration
            if case.kind == "mismatch_count" and odd:
                y = np.ones(case.count + 1, np.float32)
            elif case.kind == "mismatch_dtype" and odd:
                y = np.ones(case.count, np.float64)
            else:
                y = np.ones(case.count, np.float32)
            before = y.copy()
            try:
                if case.kind == "mismatch_root":
                    group.broadcast(y, root=1 if odd else 0)
                    _check(y, np.ones_like(y), f"iteration {it}")
                elif case.kind == "mismatch_op":
                    group.all_reduce(y, op="max" if odd else "sum", algorithm=algorithm)
                    _check(y, np.full_like(y, n), f"iteration {it}")
                else:
                    chosen = ("direct" if algorithm == "ring" else "ring") if odd else algorithm
                    if case.kind == "mismatch_algorithm" and algorithm == "auto":
                        chosen = "direct" if odd else "ring"
                    group.all_reduce(y, algorithm=chosen)
                    _check(y, np.full_like(y, n), f"iteration {it}")
            except mismatch:
                if not np.array_equal(y, before):
                    raise WrongResultError(f"iteration {it}: a refused call changed the buffer") from None
                raise
            if it == 0:
                emit(event="ready")
        raise WrongResultError(f"iteration {case.at_iteration}: the mismatched call was not refused")

    if case.kind == "threads":
        _race_threads(case, rank, group, np, base)
        return

    # Attacks and corruption: run until the campaign asks to stop; rank 0 decides, so every rank stops together.
    flag = np.zeros(1, np.int32)
    stop = os.path.join(out, _STOP_FILE)
    for it in itertools.count():
        flag[0] = 1 if rank == 0 and os.path.exists(stop) else 0
        group.broadcast(flag, root=0)
        if flag[0]:
            return
        _fill(x, base, rank, it)
        group.all_reduce(x, algorithm=algorithm)
        _check(x, _expected(base, n, it, 0), f"iteration {it}")
        if it == 0:
            emit(event="ready")


def _loop_over_groups(case: Case, rank: int, group: Any, emit: Callable[..., None], base: Any) -> None:
    """All-reduce on each of ``case.mode`` shm groups in turn (and the job's own group) until a rank dies."""
    import numpy as np

    from allreduce.runtime import ProcessGroup
    from allreduce.runtime.shm import ShmTransport

    n = case.world_size
    job = os.path.basename(os.environ["FAULTS_DIR"])
    groups = [group]
    try:
        for i in range(int(case.mode)):
            transport = ShmTransport(rank, n, f"{job}-g{i}", timeout_s=case.timeout_s)
            groups.append(ProcessGroup(transport, transport_name="shm", timeout_s=case.timeout_s))
        x = np.empty(case.count, np.float32)
        for it in itertools.count():
            _fill(x, base, rank, it)
            groups[it % len(groups)].all_reduce(x, algorithm=case.algorithm)
            _check(x, _expected(base, n, it, 0), f"iteration {it} (group {it % len(groups)})")
            if it == len(groups) - 1:
                emit(event="ready")
    finally:
        for extra in groups[1:]:
            extra.close()


_THREAD_CALLS = 12  # all-reduces per thread; enough for the two threads' calls to interleave differently
_THREAD_SALT = 1000  # thread 1's data is offset by this, so a call paired with the other thread's gives a wrong sum


def _race_threads(case: Case, rank: int, group: Any, np: Any, base: Any) -> None:
    rng = random.Random(case.seed * 31 + rank)
    pauses = [[rng.uniform(0, 0.003) for _ in range(_THREAD_CALLS)] for _ in range(2)]
    errors: list[BaseException] = []

    def body(thread: int) -> None:
        y = np.empty(case.count, np.float32)
        try:
            for it in range(_THREAD_CALLS):
                time.sleep(pauses[thread][it])
                _fill(y, base, rank, it, thread * _THREAD_SALT)
                group.all_reduce(y, algorithm=case.algorithm)
                _check(y, _expected(base, case.world_size, it, thread * _THREAD_SALT), f"thread {thread}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wrong = [e for e in errors if isinstance(e, WrongResultError)]
    if wrong:
        raise wrong[0]
    if errors:
        raise errors[0]


# --------------------------------------------------------------------------------------------------------
# The campaign side: start a job, inject, wait, classify
# --------------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one case did; ``problems`` empty means the library handled the fault as required."""

    case: Case
    wall_s: float = 0.0
    hung: list[int] = field(default_factory=list)
    wrong: list[int] = field(default_factory=list)
    named: bool = True
    unaffected: bool = False
    leftover_processes: int = 0
    leftover_shm: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    note: str = ""


class _Rank:
    """One rank forked by the zygote: the little of ``subprocess.Popen`` the campaign needs."""

    def __init__(self, pid: int, exit_path: str) -> None:
        self.pid = pid
        self._exit_path = exit_path
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(OSError, ValueError), open(self._exit_path) as f:
                self.returncode = int(f.read())
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout_s: float = 30.0) -> int | None:
        deadline = time.monotonic() + timeout_s
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.returncode


class Zygote:
    """A process that has imported numpy and allreduce once and forks every rank on request.

    Importing costs seconds per process on a loaded 2-core machine (8 ranks: ~6 s each); a forked rank starts in
    milliseconds. Each rank is still a process of its own with its own RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    and ALLREDUCE_TOKEN, joining through ``allreduce.init()`` as any hand-started rank does; nothing is shared
    but the imported modules (no group exists in the zygote)."""

    def __init__(self, python: str, script: str) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("ALLREDUCE_TOKEN", "ALLREDUCE_INJECT")}
        self._proc = subprocess.Popen(
            [python, script, "--zygote"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        self._lock = threading.Lock()

    def spawn(self, env: dict[str, str], out_dir: str, rank: int) -> _Rank:
        exit_path = os.path.join(out_dir, f"rank{rank}.exit")
        request = {"env": env, "stderr": os.path.join(out_dir, f"rank{rank}.err"), "exit": exit_path}
        with self._lock:
            assert self._proc.stdin is not None
            assert self._proc.stdout is not None
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            pid = int(self._proc.stdout.readline())
        return _Rank(pid, exit_path)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


_ZYGOTE_REAP_S = 0.02  # how often the zygote reaps its exited ranks (and so how late their exit codes appear)


def zygote() -> int:
    import selectors

    _die_with_parent()
    import numpy  # noqa: F401 - imported once here, inherited by every rank

    import allreduce.runtime.shm
    import allreduce.runtime.tcp  # noqa: F401

    exits: dict[int, str] = {}
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin, selectors.EVENT_READ)
    while True:
        ready = selector.select(_ZYGOTE_REAP_S)
        while exits:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            path = exits.pop(pid, None)
            if path is not None:
                with open(path + ".tmp", "w") as f:
                    f.write(str(os.waitstatus_to_exitcode(status)))
                os.replace(path + ".tmp", path)
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            for pid in exits:  # the campaign has gone: so do the ranks
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return 0
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            selector.close()
            err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)
            os.dup2(err, 2)
            os.environ.clear()
            os.environ.update(request["env"])
            sys.exit(worker())
        exits[pid] = request["exit"]
        print(pid, flush=True)


class _Job:
    """The ranks of one case: processes, their event logs, their /dev/shm files."""

    def __init__(self, case: Case, spawner: Zygote) -> None:
        self.case = case
        self.dir = tempfile.mkdtemp(prefix="faults-")
        self._port_reservation = _reserve_port()
        self.port = int(self._port_reservation.getsockname()[1])
        env = {k: v for k, v in os.environ.items() if k not in ("ALLREDUCE_TOKEN", "ALLREDUCE_INJECT")}
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.port),
            WORLD_SIZE=str(case.world_size),
            FAULTS_CASE=json.dumps(asdict(case)),
            FAULTS_DIR=self.dir,
        )
        self.token = uuid.uuid4().hex if case.token else None
        if self.token is not None:
            env["ALLREDUCE_TOKEN"] = self.token
        self.shm_files: set[str] = set()
        self.procs = [
            spawner.spawn({**env, "RANK": str(r), "LOCAL_RANK": str(r)}, self.dir, r) for r in range(case.world_size)
        ]

    def events(self, rank: int) -> list[dict[str, Any]]:
        path = os.path.join(self.dir, f"rank{rank}.jsonl")
        try:
            with open(path) as f:
                return [json.loads(line) for line in f if line.endswith("\n")]
        except OSError:
            return []

    def has_event(self, rank: int, event: str) -> bool:
        return any(e["event"] == event for e in self.events(rank))

    def wait_for(self, ranks: list[int], event: str, deadline: float) -> bool:
        while time.monotonic() < deadline:
            if all(self.has_event(r, event) or self.procs[r].poll() is not None for r in ranks):
                return all(self.has_event(r, event) for r in ranks)
            time.sleep(0.02)
        return False

    def record_shm(self) -> None:
        """The /dev/shm files each live rank maps (control blocks are unlinked early; data segments are not)."""
        for proc in self.procs:
            with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    path = parts[5].strip() if len(parts) == 6 else ""
                    if path.startswith(_SHM_DIR + "/"):
                        self.shm_files.add(path.removesuffix(" (deleted)"))

    def wait_exit(self, ranks: list[int], deadline: float) -> list[int]:
        """Wait for ``ranks`` to exit by ``deadline``; the ones still alive then."""
        while time.monotonic() < deadline:
            if all(self.procs[r].poll() is not None for r in ranks):
                return []
            if self.case.transport == "shm":
                self.record_shm()
            time.sleep(0.02)
        return [r for r in ranks if self.procs[r].poll() is None]

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
        for proc in self.procs:
            proc.wait()

    def listening_ports(self) -> list[int]:
        """Every TCP port a rank of this job listens on: the store and each rank's transport listener."""
        inodes: set[str] = set()
        for proc in self.procs:
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{proc.pid}/fd"):
                    with contextlib.suppress(OSError):
                        target = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
                        if target.startswith("socket:["):
                            inodes.add(target[8:-1])
        ports = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(OSError), open(table) as f:
                for line in list(f)[1:]:
                    cols = line.split()
                    if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                        ports.append(int(cols[1].rsplit(":", 1)[1], 16))
        return sorted(set(ports))

    def close(self) -> None:
        self._port_reservation.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _reserve_port() -> socket.socket:
    """A port no other bind(0) gets while the job starts; rank 0's store binds it (SO_REUSEADDR)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def _children_of(pids: set[int]) -> list[int]:
    """Live processes whose parent is one of ``pids`` (a rank must not leave anything running)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z" and int(fields[1]) in pids:
                    found.append(int(entry))
    return found


def _leftover_shm(job: _Job) -> list[str]:
    pids = [p.pid for p in job.procs]
    pid_pattern = re.compile(r"x(" + "|".join(map(str, pids)) + r")-\d+$")
    left = {p for p in job.shm_files if os.path.exists(p)}
    with contextlib.suppress(OSError):
        for name in os.listdir(_SHM_DIR):
            if pid_pattern.search(name):
                left.add(os.path.join(_SHM_DIR, name))
    for path in left:  # counted, then removed: the campaign itself leaves nothing behind
        with contextlib.suppress(OSError):
            os.unlink(path)
    return sorted(left)


# --------------------------------------------------------------------------------------------------------
# Injectors
# --------------------------------------------------------------------------------------------------------
def _attack_port(port: int, case: Case, rng: random.Random) -> None:
    """One connection from outside the job to ``port``, per the case's mode; every error is the attacker's."""
    kind, mode, n = case.kind, case.mode, case.world_size
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=3.0) as sock:
        if kind == "port_garbage":
            if mode == "http":
                sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            elif mode == "zeros":
                sock.sendall(bytes(rng.randint(1, 8192)))
            else:
                sock.sendall(rng.randbytes(rng.randint(1, 8192)))
            sock.recv(4096)
        elif kind == "port_oversized":
            if mode == "hello_then_junk":
                sock.recv(_GREETING_BYTES)
                hello = _HELLO.pack(_HS_MAGIC, 1, 0, rng.randrange(n), 0, n, rng.randbytes(32), bytes(32))
                sock.sendall(hello + rng.randbytes(1 << 20))
            else:
                for _ in range(64):  # 64 MiB, or until the endpoint closes the connection
                    sock.sendall(rng.randbytes(1 << 20))
        elif kind == "port_forged":
            greeting = sock.recv(_GREETING_BYTES)
            claimed = rng.randrange(n)
            version, flags, world, target = 1, 1, n, rng.randrange(n)
            if mode == "no_auth":
                flags = 0
            elif mode == "bad_version":
                version = rng.choice((0, 2, 255))
            elif mode == "wrong_world":
                world = n + rng.randint(1, 100)
            elif mode == "wrong_service_rank":
                claimed = rng.choice((-5, n, n + 7, 2**31 - 1))
            mac = bytes(32) if flags == 0 else rng.randbytes(32)
            if len(greeting) == _GREETING_BYTES:
                sock.sendall(_HELLO.pack(_HS_MAGIC, version, flags, claimed, target, world, rng.randbytes(32), mac))
            sock.recv(4096)
        elif kind == "port_idle":
            if mode == "partial_hello":
                sock.sendall(_HS_MAGIC + b"\x01")
            elif mode == "greeting_only":
                sock.recv(_GREETING_BYTES)
            time.sleep(rng.uniform(0.3, 1.5))


def _store_junk(job: _Job, case: Case, rng: random.Random, deadline: float) -> str:
    """A store client writing junk, racing the ranks' rendezvous; returns what it managed (for the report)."""
    from allreduce.runtime.tcp import ClientHello, connect_handshake

    insider = case.mode != "no_token"
    token = job.token.encode() if insider and job.token is not None else None
    rank = rng.randrange(case.world_size) if case.mode == "claims_rank" else -1
    while time.monotonic() < deadline:
        try:
            sock = socket.create_connection(("127.0.0.1", job.port), timeout=3.0)
        except OSError:
            time.sleep(0.01)
            continue
        with sock:
            host, port = sock.getsockname()[:2]
            address = f"{host}:{port}"
            try:
                connect_handshake(
                    sock, b"store", token, ClientHello(rank=rank, world_size=case.world_size, target=0), what="store"
                )
            except Exception as exc:
                return f"refused: {exc}"
            try:
                return f"client {address}: {_junk_requests(sock, case, rng)}"
            except OSError as exc:
                return f"client {address}: dropped: {exc}"
    return "store never up"


def _junk_requests(sock: socket.socket, case: Case, rng: random.Random) -> str:
    n = case.world_size
    if case.mode == "insider_raw":
        sock.sendall(rng.randbytes(rng.randint(1, 4096)))
        return "raw bytes sent"
    requests = []
    for _ in range(rng.randint(5, 40)):
        if case.mode == "insider_overwrite" or rng.random() < 0.3:
            key = rng.choice((f"tcp/addr/{rng.randrange(n)}", f"allreduce/host/{rng.randrange(n)}", "allreduce/job"))
            value = rng.choice((b"127.0.0.1:1", b"", rng.randbytes(rng.randint(1, 64)), b"\xff" * 40))
            requests.append(_STORE_REQUEST.pack(1, 0xFFFFFFFF, len(key), len(value)) + key.encode() + value)
        else:
            op = rng.choice((0, 2, 3, 4, 5, 6, 8, 9, 200, 255))
            key_bytes = rng.choice((rng.randbytes(rng.randint(1, 16)), b"\xff\xfe", b"a\x00b", b"x" * 300))
            value = rng.randbytes(rng.randint(0, 32))
            timeout_ms = rng.choice((0, 1, 50, 0xFFFFFFFF))
            requests.append(_STORE_REQUEST.pack(op, timeout_ms, len(key_bytes), len(value)) + key_bytes + value)
    if rng.random() < 0.3:  # a declared length far beyond what follows
        requests.append(_STORE_REQUEST.pack(1, 0, 4, 0x7FFFFFFF) + b"junk")
    sock.settimeout(2.0)
    sock.sendall(b"".join(requests))
    with contextlib.suppress(OSError):
        sock.recv(1 << 16)
    return f"{len(requests)} requests sent"


def _corrupt_control_block(job: _Job, case: Case, rng: random.Random) -> str:
    """Overwrite one word of the victim's control block (in its own mapping, via /proc/PID/mem)."""
    from allreduce.runtime.shm._layout import ControlHeader

    pid = job.procs[case.victim].pid
    start = None
    suffix = f"-ctl-{case.victim}"
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip().removesuffix(" (deleted)").endswith(suffix):
                start = int(parts[0].split("-")[0], 16)
                break
    if start is None:
        return "no control block mapped"
    name, offset = rng.choice(_control_words(ControlHeader, case.world_size))
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(start + offset)
        (current,) = struct.unpack("<q", mem.read(8))
        value = {
            "random": struct.unpack("<q", rng.randbytes(8))[0],
            "zero": 0,
            "minus_one": -1,
            "plus_one": current + 1,
            "bit_flip": current ^ (1 << rng.randrange(63)),
            "huge": 1 << 62,
        }[case.mode]
        mem.seek(start + offset)
        mem.write(struct.pack("<q", value))
    return f"{name}: {current} -> {value}"


def _control_words(header: Any, world_size: int) -> list[tuple[str, int]]:
    """(name, byte offset) of every control word of the header: the scalar words, each descriptor slot's stamp,
    length and first payload words, and the "asleep" words of the group's ranks."""
    words = []
    slot_bytes = header.descriptors.size // 2
    for name, ctype in header._fields_:
        offset = getattr(header, name).offset
        if name == "descriptors":
            for parity in range(2):
                slot = offset + parity * slot_bytes
                words += [(f"descriptor slot {parity} stamp", slot), (f"descriptor slot {parity} length", slot + 8)]
                words += [(f"descriptor slot {parity} payload word {i}", slot + 16 + 8 * i) for i in range(4)]
        elif name == "sleepers":
            words += [(f"sleepers[{r}]", offset + 8 * r) for r in range(world_size)]
        elif ctypes.sizeof(ctype) == 8:
            words.append((name, offset))
    return words


def _inject(job: _Job, case: Case) -> str:
    """Run the case's fault against the job; returns a note for the report."""
    rng = random.Random(case.seed ^ 0x5EED)
    everyone = list(range(case.world_size))
    startup = time.monotonic() + STARTUP_DEADLINE_S
    if case.kind == "store_junk":
        note = _store_junk(job, case, rng, startup)
        if not job.wait_for(everyone, "ready", startup):
            return note
        time.sleep(ATTACK_WINDOW_S)
        _touch(job, _STOP_FILE)
        return note
    if case.kind in _MISMATCH_FIELD or case.kind in {"exit", "exit_mid"}:
        return ""
    if case.kind == "threads":
        return ""
    if not job.wait_for(everyone, "ready", startup):
        return "not every rank got ready"
    if case.transport == "shm":
        job.record_shm()
    time.sleep(case.delay_s)
    victim = job.procs[case.victim]
    if case.kind in _KILLED_KINDS:
        victim.kill()
        return ""
    if case.kind == "stall":
        os.kill(victim.pid, signal.SIGSTOP)
        others = [r for r in everyone if r != case.victim]
        job.wait_exit(others, time.monotonic() + 3 * case.timeout_s + HARD_DEADLINE_MARGIN_S)
        os.kill(victim.pid, signal.SIGCONT)
        return ""
    if case.kind == "shm_corrupt":
        try:
            note = _corrupt_control_block(job, case, rng)
        except OSError as exc:
            note = f"could not corrupt: {exc}"
        time.sleep(ATTACK_WINDOW_S)
        _touch(job, _STOP_FILE)
        return note
    ports = job.listening_ports()
    threads = [threading.Thread(target=_attack_port, args=(p, case, random.Random(rng.random()))) for p in ports]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(ATTACK_WINDOW_S)
    _touch(job, _STOP_FILE)
    return f"attacked ports {ports}"


def _touch(job: _Job, name: str) -> None:
    with open(os.path.join(job.dir, name), "w"):
        pass


# --------------------------------------------------------------------------------------------------------
# Judging
# --------------------------------------------------------------------------------------------------------
def names_rank(message: str, peer: Any, rank: int) -> bool:
    """Whether an error names ``rank``: its ``peer`` is that rank, or its message says "rank R" / "ranks ..., R"."""
    return peer == rank or re.search(rf"\branks? (?:\d+(?:, | and ))*{rank}\b", message) is not None


def judge(outcome: Outcome) -> None:
    """Fill ``named``, ``unaffected``, ``wrong`` and ``problems`` from the ranks' events (see docs/faults.md)."""
    case, ranks = outcome.case, outcome.ranks
    last = {r: info.get("result", {}) for r, info in ranks.items()}
    outcome.wrong = [r for r, e in last.items() if e.get("event") == "wrong"]
    errors = {r: e for r, e in last.items() if e.get("event") == "error"}
    done = [r for r, e in last.items() if e.get("event") == "done"]
    survivors = [r for r in range(case.world_size) if r != case.victim]
    if case.kind in _FAILING_KINDS:
        outcome.named = all(
            r in errors and names_rank(errors[r]["message"], errors[r]["peer"], case.victim) for r in survivors
        )
    elif case.kind in _MISMATCH_FIELD:
        field_name = _MISMATCH_FIELD[case.kind]
        outcome.named = all(
            r in errors
            and errors[r]["type"] == "MismatchError"
            and f"different {field_name}" in errors[r]["message"]
            and re.search(rf"\brank {case.victim}: ", errors[r]["message"]) is not None
            for r in range(case.world_size)
        )
    elif case.kind == "threads":
        outcome.unaffected = len(done) == case.world_size
        outcome.named = outcome.unaffected or all(
            r in errors and "thread" in errors[r]["message"] for r in range(case.world_size) if r not in done
        )
    elif case.kind == "shm_corrupt":
        outcome.unaffected = len(done) == case.world_size
        word = outcome.note.split("[", 1)[0]
        outcome.named = outcome.unaffected or all(
            r in errors
            and (names_rank(errors[r]["message"], errors[r]["peer"], case.victim) or word in errors[r]["message"])
            for r in range(case.world_size)
            if r not in done
        )
    elif case.kind == "store_junk" and case.mode != "no_token":
        # A client with the job's token is, to the store, part of the job: it may take a rank's seat before the
        # rank does (the token is the job's identity). Required: the job is unaffected, or every rank that raised
        # names that client (its address), as for a faulty rank.
        outcome.unaffected = len(done) == case.world_size
        found = re.search(r"client (\S+):", outcome.note)
        outcome.named = outcome.unaffected or (
            found is not None
            and all(
                r in errors and found.group(1) in errors[r]["message"] for r in range(case.world_size) if r not in done
            )
        )
    else:  # attacks from outside the job: the job must not notice
        outcome.unaffected = len(done) == case.world_size
        outcome.named = outcome.unaffected
    if outcome.hung:
        outcome.problems.append(f"hang: rank(s) {outcome.hung} alive at the deadline")
    if outcome.wrong:
        outcome.problems.append(f"silent wrong result on rank(s) {outcome.wrong}")
    if not outcome.named:
        detail = "; ".join(
            f"rank {r}: {e.get('event')} {e.get('type', '')} {e.get('message', '')[:300]}" for r, e in last.items()
        )
        outcome.problems.append(f"culprit not named ({detail})")
    if outcome.leftover_processes:
        outcome.problems.append(f"{outcome.leftover_processes} leftover process(es)")
    if outcome.leftover_shm:
        outcome.problems.append(f"leftover /dev/shm files {outcome.leftover_shm}")


def run_case(case: Case, spawner: Zygote) -> Outcome:
    started = time.monotonic()
    outcome = Outcome(case)
    job = _Job(case, spawner)
    leftovers: list[int] = []
    try:
        try:
            outcome.note = _inject(job, case)
        except Exception as exc:
            outcome.note = f"injector failed: {type(exc).__name__}: {exc}"
        deadline = time.monotonic() + 3 * case.timeout_s + HARD_DEADLINE_MARGIN_S
        if case.kind in _MISMATCH_FIELD or case.kind in ("exit", "exit_mid", "threads"):
            deadline += STARTUP_DEADLINE_S  # the injector did not wait for the ranks to start
        alive = job.wait_exit(list(range(case.world_size)), deadline)
        children = _children_of({p.pid for p in job.procs})
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.kill_all()
        for r in range(case.world_size):
            events = job.events(r)
            results = [e for e in events if e["event"] in ("done", "error", "wrong")]
            if r in alive:  # still running at the deadline: hung, or finished and stuck on the way out
                (outcome.hung if not results else leftovers).append(r)
            info: dict[str, Any] = {"exit": job.procs[r].returncode, "result": results[-1] if results else {}}
            if not results and r != case.victim:
                with contextlib.suppress(OSError), open(os.path.join(job.dir, f"rank{r}.err"), "rb") as f:
                    info["stderr"] = f.read()[-2000:].decode(errors="replace")
            outcome.ranks[r] = info
        if case.kind in (*_KILLED_KINDS, "exit_mid") or (case.kind == "exit" and case.mode == "sys_exit"):
            outcome.ranks.pop(case.victim, None)
        outcome.leftover_processes = len(leftovers) + len(children)
        outcome.leftover_shm = _leftover_shm(job)
        judge(outcome)
    finally:
        job.kill_all()
        job.close()
        outcome.wall_s = time.monotonic() - started
    return outcome


# --------------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------------
def summarise(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    rows = []
    for kind in (*KINDS, "total"):
        mine = [o for o in outcomes if kind in ("total", o.case.kind)]
        if not mine:
            continue
        rows.append(
            {
                "kind": kind,
                "faults": len(mine),
                "hangs": sum(1 for o in mine if o.hung),
                "silent_wrong": sum(1 for o in mine if o.wrong),
                "culprit_named_pct": 100.0 * sum(1 for o in mine if o.named) / len(mine),
                "unaffected": sum(1 for o in mine if o.unaffected),
                "leftover_processes": sum(o.leftover_processes for o in mine),
                "leftover_shm_files": sum(len(o.leftover_shm) for o in mine),
                "failed_cases": sum(1 for o in mine if o.problems),
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    header = (
        "kind",
        "faults",
        "hangs",
        "silent wrong",
        "culprit named",
        "unaffected",
        "leftover procs",
        "leftover shm",
    )
    lines = [header]
    lines += [
        (
            row["kind"],
            str(row["faults"]),
            str(row["hangs"]),
            str(row["silent_wrong"]),
            f"{row['culprit_named_pct']:.1f}%",
            str(row["unaffected"]),
            str(row["leftover_processes"]),
            str(row["leftover_shm_files"]),
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for i, line in enumerate(lines):
        out.append(
            "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(line, widths, strict=True)))
        )
        if i == 0 or i == len(lines) - 2:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=1000, help="number of faults (default 1000)")
    parser.add_argument("--seed", type=int, default=1, help="master seed (default 1)")
    parser.add_argument("--jobs", type=int, default=2, help="jobs run at once (default 2)")
    parser.add_argument("--json", metavar="FILE", help="write every case and the summary as JSON")
    parser.add_argument("--only", type=int, action="append", metavar="SEED", help="run only this case (repeatable)")
    parser.add_argument("--kinds", help=f"comma-separated subset of: {', '.join(KINDS)}")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker()
    if args.zygote:
        return zygote()
    kinds = tuple(args.kinds.split(",")) if args.kinds else KINDS
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--kinds: unknown kind(s) {', '.join(unknown)}")
    seeds = args.only or case_seeds(args.faults, args.seed, kinds)
    cases = [make_case(s) for s in seeds]
    script = os.path.abspath(__file__)
    load_before = os.getloadavg()
    started = time.monotonic()
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    spawner = Zygote(sys.executable, script)

    def one(case: Case) -> Outcome:
        outcome = run_case(case, spawner)
        with lock:
            outcomes.append(outcome)
            verdict = "ok" if not outcome.problems else "FAIL " + " | ".join(outcome.problems)
            print(
                f"[{len(outcomes)}/{len(cases)}] seed={case.seed} {case.kind}/{case.mode or '-'} N={case.world_size} "
                f"victim={case.victim} {case.transport} {outcome.wall_s:.1f}s: {verdict[:600]}",
                file=sys.stderr,
                flush=True,
            )
        return outcome

    try:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            list(pool.map(one, cases))
    finally:
        spawner.close()
    wall_s = time.monotonic() - started
    load_after = os.getloadavg()
    outcomes.sort(key=lambda o: seeds.index(o.case.seed))
    rows = summarise(outcomes)
    command = "python benchmarks/faults.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"command: {command}")
    print(
        f"wall time {wall_s:.0f} s, {args.jobs} job(s) at once; load average {load_before[0]:.1f} at start, "
        f"{load_after[0]:.1f} at end (1-min), {os.cpu_count()} cores"
    )
    print(format_table(rows))
    failing = [o for o in outcomes if o.problems]
    for o in failing:
        print(
            f"FAIL seed={o.case.seed} ({o.case.kind}/{o.case.mode or '-'}, N={o.case.world_size}, victim "
            f"{o.case.victim}, {o.case.transport}): {' | '.join(o.problems)[:1500]}\n    re-run: {o.case.command()}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": command,
                    "wall_s": wall_s,
                    "load_average": [load_before, load_after],
                    "summary": rows,
                    "cases": [
                        {**asdict(o.case), **{k: v for k, v in asdict(o).items() if k != "case"}} for o in outcomes
                    ],
                },
                f,
                indent=1,
                default=str,
            )
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
