"""Parameter sweeps of the planner on any ``concurrent.futures.Executor``: a local process pool or a Dask cluster.

A case is a dict of plan parameters (``model``, ``gpus``, ``topology``, ``compute_ms``, ...: see
:data:`PARAMETERS`), or a single all-reduce (``size: 64MiB`` with ``gpus``, ``topology``, ``algorithm``: what
``allreduce sim`` computes, as a plan of one bucket and no compute). :func:`run_case` is a pure function of it,
so any executor can run it anywhere. A grid file (YAML) is either ``grid:`` (every combination of the listed
values, over the ``base:`` values) or ``cases:`` (a list). Results go to a CSV file one row per case as cases
finish; a case that raises is recorded with its error and the sweep goes on; a re-run skips the cases whose id
is already in the file. With pyarrow installed, a Parquet copy is written at the end."""

from __future__ import annotations

import csv
import hashlib
import importlib
import itertools
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from allreduce.plan._planner import PlanRequest, compute_seconds, plan_step
from allreduce.plan._step import BACKWARD_FRACTION, Compute
from allreduce.plan._workload import GRADIENT_DTYPES, Model, model_from_params, preset
from allreduce.schedules import load_algorithm
from allreduce.units import parse_bytes

__all__ = [
    "COLUMNS",
    "PARAMETERS",
    "DaskExecutor",
    "SweepSummary",
    "case_id",
    "expand_grid",
    "load_grid",
    "make_executor",
    "request_of",
    "run_case",
    "run_sweep",
]

MiB = 2**20
# How long to try reaching a Dask scheduler before saying it cannot be reached (distributed's own default).
DASK_CONNECT_TIMEOUT_S = 30
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


def expand_grid(base: Mapping[str, Any], grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of ``grid``'s values over ``base``."""
    keys = list(grid)
    for key in keys:
        if not isinstance(grid[key], list) or not grid[key]:
            raise ValueError(f"grid: {key} must be a non-empty list of values")
    return [{**base, **dict(zip(keys, values, strict=True))} for values in itertools.product(*(grid[k] for k in keys))]


def load_grid(path: str | Path) -> list[dict[str, Any]]:
    """The cases of a YAML grid file (``base:`` + ``grid:``, and/or ``cases:``)."""
    file = Path(path)
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
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
    base = _check(data.get("base") or {}, f"{file}: base")
    cases: list[dict[str, Any]] = []
    if "grid" in data:
        if not isinstance(data["grid"], dict):
            raise ValueError(f"{file}: grid: must map parameters to lists of values")
        _check(data["grid"], f"{file}: grid")
        cases += expand_grid(base, data["grid"])
    for i, case in enumerate(data.get("cases") or []):
        if not isinstance(case, dict):
            raise ValueError(f"{file}: cases[{i}] must be a mapping of parameters")
        cases.append({**base, **_check(case, f"{file}: cases[{i}]")})
    return cases


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


class DaskExecutor(Executor):
    """The executor of a Dask cluster, owning its client: ``shutdown`` closes the connection."""

    def __init__(self, address: str) -> None:
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


def make_executor(spec: str | None, *, workers: int | None = None) -> Executor:
    """A local process pool (``spec`` None or "local"), or the executor of a Dask cluster at ``dask://HOST:PORT``."""
    if spec in (None, "local"):
        return ProcessPoolExecutor(max_workers=workers)
    if spec.startswith("dask://"):
        return DaskExecutor("tcp://" + spec.removeprefix("dask://"))
    raise ValueError(f"--executor {spec!r}: use local or dask://HOST:PORT")


def _done_ids(path: Path) -> set[str]:
    if not path.exists():
        return set()
    with path.open(newline="", encoding="utf-8") as f:
        return {row["case_id"] for row in csv.DictReader(f) if row.get("case_id")}


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


def run_sweep(
    cases: Iterable[Mapping[str, Any]],
    output: str | Path,
    executor: Executor,
    *,
    progress: Callable[[int, int, int], None] | None = None,
) -> SweepSummary:
    """Run the cases not yet in ``output`` on ``executor``, appending a row per case as it finishes."""
    path = Path(output)
    all_cases = list(cases)
    done = _done_ids(path)
    todo: dict[str, Mapping[str, Any]] = {}
    for case in all_cases:
        cid = case_id(case)
        if cid not in done:
            todo.setdefault(cid, case)
    started = time.perf_counter()
    failed = 0
    finished = 0
    new_file = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new_file:
            writer.writeheader()
        futures: list[Future[dict[str, Any]]] = [executor.submit(run_case, dict(c)) for c in todo.values()]
        if progress:
            progress(0, len(futures), 0)
        for future in as_completed(futures):
            row = future.result()
            failed += bool(row.get("error"))
            finished += 1
            writer.writerow(row)
            f.flush()
            if progress:
                progress(finished, len(futures), failed)
    wall_s = time.perf_counter() - started
    return SweepSummary(
        total=len(all_cases),
        skipped=len(all_cases) - len(todo),
        ran=finished,
        failed=failed,
        wall_s=wall_s,
        output=path,
        parquet=_write_parquet(path),
    )
