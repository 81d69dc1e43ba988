"""Parameter sweeps of the planner on any ``concurrent.futures.Executor``: a local process pool or a Dask cluster.

A case is a dict of plan parameters (``model``, ``gpus``, ``topology``, ``compute_ms``, ...: see
:data:`PARAMETERS`), or a single all-reduce (``size: 64MiB`` with ``gpus``, ``topology``, ``algorithm``: what
``allreduce sim`` computes, as a plan of one bucket and no compute). :func:`run_case` is a pure function of it,
so any executor can run it anywhere. A grid file (YAML) is either ``grid:`` (every combination of the listed
values, over the ``base:`` values) or ``cases:`` (a list); a grid is never expanded in memory: its cases are
generated as the executor takes them, a bounded number in flight. Results go to a CSV file one row per case as
cases finish; a case that raises is recorded with its error and the sweep goes on; a re-run skips the cases
whose id is already in the file with a result and runs the failed ones again (their rows are replaced). The
local pool's workers start as cases need them and die with the sweep's process, even when it is SIGKILLed. With
pyarrow installed, a Parquet copy is written at the end."""

from __future__ import annotations

import array
import csv
import ctypes
import hashlib
import importlib
import itertools
import json
import math
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import yaml

from allreduce.plan._planner import compute_seconds, plan_step
from allreduce.plan._request import PlanRequest
from allreduce.plan._step import BACKWARD_FRACTION, Compute
from allreduce.plan._workload import GRADIENT_DTYPES, Model, model_from_params, preset
from allreduce.report import read_at_most
from allreduce.schedules import load_algorithm
from allreduce.units import format_bytes, parse_bytes

__all__ = [
    "COLUMNS",
    "DEFAULT_IN_FLIGHT",
    "IN_FLIGHT_PER_WORKER",
    "MAX_WORKERS_PER_CPU",
    "PARAMETERS",
    "DaskExecutor",
    "Grid",
    "SweepSummary",
    "case_id",
    "expand_grid",
    "iter_grid",
    "load_grid",
    "make_executor",
    "max_workers",
    "read_grid",
    "request_of",
    "run_case",
    "run_sweep",
]

MiB = 2**20
# How long to try reaching a Dask scheduler before saying it cannot be reached (distributed's own default). A TCP
# connection to the address is tried first, for DASK_PROBE_TIMEOUT_S: a refused one is reported at once, and an
# address that does not answer within it is not a scheduler a sweep can use.
DASK_CONNECT_TIMEOUT_S = 30
DASK_PROBE_TIMEOUT_S = 5.0
_YAML_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, if built with it
# The largest grid file read: YAML is parsed whole, into objects about 90 times the text's size (100,000 listed
# cases, 2.7 MB of YAML: 249 MB peak under tracemalloc and 34 s with libyaml's loader at load average 12), so a
# list of cases stays under 40,000 or so; a grid: of lists generates any number.
MAX_GRID_BYTES = 1 << 20
# Local pool workers per CPU at most: a case is CPU-bound (one simulation), so workers beyond the CPUs only queue
# for them, each holding an interpreter with numpy: WORKER_BYTES at least, the RSS of a worker that had run 4 KiB
# all-reduce cases on switch:8 (44 MB, /proc/PID/status; larger topologies hold more).
MAX_WORKERS_PER_CPU = 4
WORKER_BYTES = 44 << 20
# Cases submitted and not yet finished, per worker: enough to keep every worker busy, few enough that a grid of
# 10^7 cases never sits in memory (a case is a dict of about 1 KB).
IN_FLIGHT_PER_WORKER = 4
DEFAULT_IN_FLIGHT = 256
# prctl(2): the signal a process gets when the thread that forked it exits.
PR_SET_PDEATHSIG = 1
# Case parameters and their defaults (None: required, or derived).
PARAMETERS: dict[str, Any] = {
    "model": None,
    "params": None,
    "gpus": None,
    "topology": None,
    "algorithm": "auto",
    "bucket_mb": 25.0,
    "first_bucket_mb": 1.0,
    "dtype": "bf16",
    "compute_ms": None,
    "gpu_tflops": None,
    "mfu": 0.4,
    "tokens_per_gpu": None,
    "samples_per_gpu": None,
    "backward_fraction": BACKWARD_FRACTION,
    "overlap": True,
    "accumulation": 1,
    "placement": "linear",
    "seed": 0,
    "oversubscription": 1.0,
    "engine": "auto",
    "size": None,
}
RESULTS = ("step_s", "compute_s", "waiting_s", "exposed_comm_s", "comm_s", "buckets", "algorithms", "seconds_to_run")
COLUMNS = ("case_id", *PARAMETERS, *RESULTS, "error")


def case_id(case: Mapping[str, Any]) -> str:
    """A stable id of a case's parameters (defaults filled in), so a re-run can tell which cases are done."""
    full = {key: case.get(key, default) for key, default in PARAMETERS.items()}
    text = json.dumps(full, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check(case: Mapping[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(set(case) - set(PARAMETERS))
    if unknown:
        raise ValueError(f"{where}: unknown parameter {unknown[0]!r}; known: {', '.join(PARAMETERS)}")
    return dict(case)


def _check_values(grid: Mapping[str, Any], where: str) -> None:
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"{where}: {key} must be a non-empty list of values")


def iter_grid(base: Mapping[str, Any], grid: Mapping[str, Sequence[Any]]) -> Iterator[dict[str, Any]]:
    """Every combination of ``grid``'s values over ``base``, generated one at a time (in ``expand_grid``'s order)."""
    _check_values(grid, "grid")
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        yield {**base, **dict(zip(keys, values, strict=True))}


def expand_grid(base: Mapping[str, Any], grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of ``grid``'s values over ``base``."""
    return list(iter_grid(base, grid))


@dataclass(frozen=True)
class Grid:
    """The cases of a grid file, generated as they are iterated: the combinations of ``grid`` over ``base``,
    then ``cases``. ``total`` is their number, known without generating them."""

    base: dict[str, Any]
    grid: dict[str, list[Any]] = field(default_factory=dict)
    cases: tuple[dict[str, Any], ...] = ()

    @property
    def total(self) -> int:
        combinations = math.prod(len(v) for v in self.grid.values()) if self.grid else 0
        return combinations + len(self.cases)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.grid:
            yield from iter_grid(self.base, self.grid)
        for case in self.cases:
            yield {**self.base, **case}


def read_grid(path: str | Path) -> Grid:
    """A YAML grid file (``base:`` + ``grid:``, and/or ``cases:``), checked; its cases are generated on iteration."""
    file = Path(path)
    try:
        raw = read_at_most(
            file,
            MAX_GRID_BYTES,
            why="the most a grid file may be (it is parsed whole, into about 90 times its size in memory); write "
            "many cases as a grid: of lists",
        )
        data = yaml.load(raw.decode("utf-8"), Loader=_YAML_LOADER)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: cannot read it ({exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{file}{line}: not valid YAML") from None
    if not isinstance(data, dict) or not ({"grid", "cases"} & set(data)):
        raise ValueError(f"{file}: expected a mapping with grid: (and base:) or cases:")
    extra = sorted(set(data) - {"base", "grid", "cases"})
    if extra:
        raise ValueError(f"{file}: unknown section {extra[0]!r} (expected base, grid, cases)")
    base = data.get("base") or {}
    if not isinstance(base, dict):
        raise ValueError(f"{file}: base: must map parameters to values")
    base = _check(base, f"{file}: base")
    grid: dict[str, list[Any]] = {}
    if "grid" in data:
        if not isinstance(data["grid"], dict):
            raise ValueError(f"{file}: grid: must map parameters to lists of values")
        grid = _check(data["grid"], f"{file}: grid")
        _check_values(grid, f"{file}: grid")
        # a value listed twice would make the same cases twice: they run once
        grid = {key: list({_key(v): v for v in values}.values()) for key, values in grid.items()}
    raw_cases = data.get("cases") or []
    if not isinstance(raw_cases, list):
        raise ValueError(f"{file}: cases: must be a list of mappings of parameters")
    cases: dict[str, dict[str, Any]] = {}
    for i, case in enumerate(raw_cases):
        if not isinstance(case, dict):
            raise ValueError(f"{file}: cases[{i}] must be a mapping of parameters")
        cases.setdefault(case_id({**base, **case}), _check(case, f"{file}: cases[{i}]"))
    return Grid(base, grid, tuple(cases.values()))


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def load_grid(path: str | Path) -> list[dict[str, Any]]:
    """The cases of a YAML grid file (``base:`` + ``grid:``, and/or ``cases:``), as a list (small grids; a sweep
    iterates :func:`read_grid`'s :class:`Grid`)."""
    return list(read_grid(path))


def _model(case: Mapping[str, Any]) -> Model:
    if case.get("model") is not None:
        return preset(str(case["model"]))
    if case.get("params") is not None:
        return model_from_params(float(case["params"]))
    raise ValueError("a case needs model or params")


def _all_reduce_case(full: dict[str, Any]) -> dict[str, Any]:
    """A ``size`` case as a plan: one bucket of ``size`` bytes (bf16 elements), no compute."""
    size = parse_bytes(str(full["size"]), what="size")
    if size <= 0 or size % GRADIENT_DTYPES["bf16"]:
        raise ValueError(f"size {full['size']!r}: a whole number of bf16 elements (even bytes) > 0")
    if full["model"] is not None or full["params"] is not None:
        raise ValueError("a case has either size (one all-reduce) or model/params (a training step)")
    bucket_mb = size / MiB
    return {
        **full,
        "params": size // GRADIENT_DTYPES["bf16"],
        "dtype": "bf16",
        "compute_ms": 0.0,
        "gpu_tflops": None,
        "overlap": False,
        "accumulation": 1,
        "bucket_mb": bucket_mb,
        "first_bucket_mb": bucket_mb,
    }


def _algorithm(text: str) -> str:
    """A registered name as it is; a ``module:function`` or ``file.py:function`` spec loaded (in the process that
    runs the case: a pool worker or a Dask worker) and named by its registered name."""
    return load_algorithm(text).name if ":" in text else text


def request_of(case: Mapping[str, Any]) -> PlanRequest:
    full = {key: case.get(key, default) for key, default in PARAMETERS.items()}
    if full["size"] is not None:
        full = _all_reduce_case(full)
    model = _model(full)
    for key in ("gpus", "topology"):
        if full[key] is None:
            raise ValueError(f"a case needs {key}")
    if full["compute_ms"] is not None:
        micro_batch_s = float(full["compute_ms"]) / 1e3
    elif full["gpu_tflops"] is not None:
        micro_batch_s = compute_seconds(
            model,
            gpu_tflops=float(full["gpu_tflops"]),
            mfu=float(full["mfu"]),
            tokens_per_gpu=full["tokens_per_gpu"],
            samples_per_gpu=full["samples_per_gpu"],
        )
    else:
        raise ValueError("a case needs compute_ms, or gpu_tflops with tokens_per_gpu")
    return PlanRequest(
        model=model,
        gpus=int(full["gpus"]),
        topology=str(full["topology"]),
        compute=Compute(
            micro_batch_s,
            backward_fraction=float(full["backward_fraction"]),
            accumulation_steps=int(full["accumulation"]),
            overlap=bool(full["overlap"]),
        ),
        gradient_dtype=str(full["dtype"]),
        bucket_cap_bytes=int(float(full["bucket_mb"]) * MiB),
        first_bucket_bytes=int(float(full["first_bucket_mb"]) * MiB),
        algorithm=_algorithm(str(full["algorithm"])),
        placement=str(full["placement"]),
        seed=int(full["seed"]),
        uplink_oversubscription=float(full["oversubscription"]),
        engine=str(full["engine"]),
    )


def run_case(case: Mapping[str, Any]) -> dict[str, Any]:
    """One CSV row: the case's parameters, its step time split, or its error. Never raises for a bad case."""
    row: dict[str, Any] = {key: case.get(key, default) for key, default in PARAMETERS.items()}
    row["case_id"] = case_id(case)
    started = time.perf_counter()
    try:
        result = plan_step(request_of(case))
    except Exception as exc:  # a failing case is a result: recorded, and the sweep goes on
        row["error"] = f"{type(exc).__name__}: {exc}"
        return row
    row.update(result.step.to_json())
    row["algorithms"] = "/".join(sorted({r.algorithm for r in result.runs}))
    row["seconds_to_run"] = time.perf_counter() - started
    row["error"] = ""
    return row


def _scheduler_address(address: str) -> tuple[str, int]:
    host, sep, port_text = address.removeprefix("tcp://").rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not sep or not host or not 0 < port < 65536:
        raise ValueError(f"--executor dask://{address.removeprefix('tcp://')}: write it as dask://HOST:PORT")
    return host.strip("[]"), port


def _probe_scheduler(address: str) -> None:
    """Refuse an address no TCP connection reaches, at once (distributed's client retries for its whole timeout)."""
    host, port = _scheduler_address(address)
    try:
        socket.create_connection((host, port), timeout=DASK_PROBE_TIMEOUT_S).close()
    except TimeoutError:
        raise ValueError(
            f"cannot reach the Dask scheduler at {host}:{port}: no answer within {DASK_PROBE_TIMEOUT_S:g} s"
        ) from None
    except OSError as exc:
        raise ValueError(f"cannot reach the Dask scheduler at {host}:{port} ({exc.strerror or exc})") from None


class DaskExecutor(Executor):
    """The executor of a Dask cluster, owning its client: ``shutdown`` closes the connection."""

    def __init__(self, address: str) -> None:
        _probe_scheduler(address)
        try:
            distributed = importlib.import_module("distributed")
        except ImportError:
            raise ValueError("dask://...: needs the distributed package (pip install 'allreduce[dask]')") from None
        try:
            self._client = distributed.Client(address, timeout=DASK_CONNECT_TIMEOUT_S)
        except OSError as exc:
            raise ValueError(f"cannot reach the Dask scheduler at {address} ({exc})") from None
        self._executor: Executor = self._client.get_executor()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return self._executor.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._executor.shutdown(wait=wait)
        self._client.close()


def _die_with_parent(parent_pid: int) -> None:
    """A pool worker's initializer: SIGKILL when the sweep's process dies (even by SIGKILL, which leaves it no
    chance to stop its pool); a worker whose parent died before this ran exits. Ctrl-C is the sweep's to handle
    (it reaches the whole process group): a worker interrupted mid-case would break the pool under it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def max_workers() -> int:
    """The most local pool workers: :data:`MAX_WORKERS_PER_CPU` per CPU this process may use."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return MAX_WORKERS_PER_CPU * max(cpus, 1)


def make_executor(spec: str | None, *, workers: int | None = None) -> Executor:
    """A local process pool (``spec`` None or "local"), or the executor of a Dask cluster at ``dask://HOST:PORT``.

    The pool's workers are spawned (not forked) as cases need them, each tied to this process so that it dies
    with it; ``workers`` is capped at :func:`max_workers`. The tie is to the thread that submitted the case that
    started the worker (``PR_SET_PDEATHSIG`` follows the forking thread): submit from a thread that outlives the
    pool."""
    if spec in (None, "local"):
        cap = max_workers()
        count = workers if workers is not None else cap // MAX_WORKERS_PER_CPU
        if count > cap:
            raise ValueError(
                f"--workers {count}: more than the cap of {cap} ({MAX_WORKERS_PER_CPU} per CPU of the "
                f"{cap // MAX_WORKERS_PER_CPU} this process may use): a case is CPU-bound, so more workers only "
                f"wait for a CPU, each holding {format_bytes(WORKER_BYTES)} or more "
                f"({format_bytes(count * WORKER_BYTES)} in all)"
            )
        return ProcessPoolExecutor(
            max_workers=count,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_die_with_parent,
            initargs=(os.getpid(),),
        )
    if spec.startswith("dask://"):
        return DaskExecutor("tcp://" + spec.removeprefix("dask://"))
    raise ValueError(f"--executor {spec!r}: use local or dask://HOST:PORT")


def _id_number(cid: str) -> int:
    return int(cid, 16)


def _previous_results(path: Path) -> npt.NDArray[np.uint64]:
    """The ids of the cases ``path`` holds a result for, sorted (8 bytes each, however long the file). Rows of
    failed cases are removed from the file (the file is rewritten beside itself and renamed over it), so that a
    re-run runs them again and the file keeps one row per case."""
    if not path.exists():
        return np.zeros(0, dtype=np.uint64)
    ids = array.array("Q")  # 8 bytes per row: a re-run of 10^7 cases holds 80 MB of ids, not 10^7 ints
    failed = 0
    with path.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            cid = row.get("case_id") or ""
            if row.get("error"):
                failed += 1
                continue
            try:
                ids.append(_id_number(cid))
            except ValueError:
                continue
    if failed:
        _drop_failed_rows(path)
    return np.unique(np.frombuffer(ids, dtype=np.uint64))


def _drop_failed_rows(path: Path) -> None:
    with path.open(newline="", encoding="utf-8") as src:
        reader = csv.DictReader(src)
        fields = list(reader.fieldnames or COLUMNS)
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", newline="", encoding="utf-8") as dst:
                writer = csv.DictWriter(dst, fieldnames=fields, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(row for row in reader if not row.get("error"))
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise


def _known(done: npt.NDArray[np.uint64], cid: str) -> bool:
    if not done.size:
        return False
    value = np.uint64(_id_number(cid))
    i = int(np.searchsorted(done, value))
    return i < done.size and done[i] == value


@dataclass(frozen=True)
class SweepSummary:
    total: int
    skipped: int
    ran: int
    failed: int
    wall_s: float
    output: Path
    parquet: Path | None

    @property
    def cases_per_s(self) -> float:
        return self.ran / self.wall_s if self.wall_s > 0 else 0.0


def _write_parquet(csv_path: Path) -> Path | None:
    try:
        pa_csv = importlib.import_module("pyarrow.csv")
        pq = importlib.import_module("pyarrow.parquet")
    except ImportError:
        return None
    out = csv_path.with_suffix(".parquet")
    pq.write_table(pa_csv.read_csv(csv_path), out)
    return out


_INTERRUPT_POLL_S = 0.1
"""How often a sweep waiting for its cases looks whether Ctrl-C arrived."""


def _interrupt_flag() -> tuple[threading.Event, Callable[[], None]]:
    """Ctrl-C as a flag the sweep's loop checks between cases, and how to put the old handler back. A
    KeyboardInterrupt raised wherever SIGINT happens to land can leave a lock of the process pool's taken, and
    shutting the pool down then waits forever (a loaded CI run saw it: 60 s without an exit); the flag makes the
    loop raise it itself, at a point of its choosing. Where SIGINT is not Python's default (ignored, or handled by
    the caller) or off the main thread, nothing changes."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return flag, lambda: None
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        return flag, lambda: None
    signal.signal(signal.SIGINT, lambda signum, frame: flag.set())

    def restore() -> None:
        signal.signal(signal.SIGINT, previous)

    return flag, restore


def run_sweep(
    cases: Iterable[Mapping[str, Any]],
    output: str | Path,
    executor: Executor,
    *,
    total: int | None = None,
    in_flight: int = DEFAULT_IN_FLIGHT,
    progress: Callable[[int, int | None, int], None] | None = None,
) -> SweepSummary:
    """Run the cases without a result in ``output`` on ``executor``, appending a row per case as it finishes.

    ``cases`` is consumed as the executor takes them, at most ``in_flight`` submitted and unfinished, so a grid
    of any size starts at once in bounded memory. ``progress(cases seen, total, failed)`` is called as cases
    finish or are skipped (``total`` as given: :attr:`Grid.total`)."""
    if in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight}")
    path = Path(output)
    done = _previous_results(path)
    started = time.perf_counter()
    seen = skipped = ran = failed = 0
    new_file = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new_file:
            writer.writeheader()
        pending: set[Future[dict[str, Any]]] = set()

        def collect() -> None:
            nonlocal ran, failed
            finished, _ = wait(pending, timeout=_INTERRUPT_POLL_S, return_when=FIRST_COMPLETED)
            if interrupted.is_set():
                raise KeyboardInterrupt  # here, between cases, never inside the executor's own locks
            for future in finished:
                pending.discard(future)
                row = future.result()
                failed += bool(row.get("error"))
                ran += 1
                writer.writerow(row)
            if finished:
                f.flush()
                if progress:
                    progress(skipped + ran, total, failed)

        if progress:
            progress(0, total, 0)
        interrupted, restore = _interrupt_flag()
        try:
            for case in cases:
                if interrupted.is_set():
                    raise KeyboardInterrupt
                seen += 1
                if _known(done, case_id(case)):
                    skipped += 1
                    continue
                while len(pending) >= in_flight:
                    collect()
                pending.add(executor.submit(run_case, dict(case)))
            while pending:
                collect()
            if progress:
                progress(skipped + ran, total, failed)
        finally:
            restore()
            for future in pending:
                future.cancel()
    wall_s = time.perf_counter() - started
    return SweepSummary(
        total=seen,
        skipped=skipped,
        ran=ran,
        failed=failed,
        wall_s=wall_s,
        output=path,
        parquet=_write_parquet(path),
    )
