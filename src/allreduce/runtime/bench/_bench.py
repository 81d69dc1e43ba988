"""Measuring the runtime: N local rank processes time all_reduce over a sweep of sizes, results checked.

The measurement shared by ``allreduce bench``, ``allreduce tune`` and the runtime benchmark, which present it.
Every size is first run once on integer-valued data (exact in every dtype, so float sums are exact) and compared
with the closed-form reduction; then it is timed. The reported time is the slowest rank's mean over the timed iterations
(nccl-tests conventions: algbw = size / time, busbw = algbw × the collective's bus factor).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.runtime.group._group import DTYPES, OPS, ProcessGroup
from allreduce.runtime.launcher._spawn import spawn
from allreduce.runtime.shm import SHM_DIR
from allreduce.schedules import Collective, bus_factor
from allreduce.units import format_bytes

__all__ = [
    "MIN_BENCH_TIMEOUT_S",
    "BenchConfig",
    "BenchRow",
    "check_bench_fits",
    "default_iters",
    "expected_result",
    "pattern",
    "run_bench",
]

MIN_BENCH_TIMEOUT_S = 1.0
"""The shortest per-collective timeout a measurement accepts: below a second the ranks' start (a Python process
importing numpy, the rendezvous) cannot finish, so a shorter timeout only ever reports a spurious failure."""
_CHECK_BYTES_PER_ELEMENT = 16
"""Working memory per element of a rank beyond its buffer: the check's int64 element index and float64 exact
reduction (8 bytes each), alive together with the buffer and its expected value."""


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. ``iters=0``: pick per size (:func:`default_iters`). ``group_memory``: buffers from
    ``group.empty()`` (shared memory, no staging copies) instead of ordinary numpy arrays."""

    world_size: int
    sizes_bytes: tuple[int, ...]
    transport: str = "shm"
    algorithm: str = "auto"
    dtype: str = "float32"
    op: str = "sum"
    iters: int = 0
    group_memory: bool = True
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"-n: world size must be >= 1, got {self.world_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype: unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.op not in OPS:
            raise ValueError(f"--op: unknown op {self.op!r}; choose one of {', '.join(OPS)}")
        if self.op == "avg" and DTYPES[self.dtype].kind in "iu":
            raise ValueError(f"--op: avg is not defined for integer dtype {self.dtype}")
        if self.iters < 0:
            raise ValueError(f"--iters must be >= 0, got {self.iters}")
        if not self.sizes_bytes:
            raise ValueError("--sizes: no sizes to measure")
        if not self.timeout_s >= MIN_BENCH_TIMEOUT_S:
            raise ValueError(
                f"--timeout must be at least {MIN_BENCH_TIMEOUT_S:g} s (the ranks' start takes about that), "
                f"got {self.timeout_s:g}"
            )
        itemsize = DTYPES[self.dtype].itemsize
        for size in self.sizes_bytes:
            if size <= 0:
                raise ValueError(f"--sizes: {size} bytes; every size must hold at least one {self.dtype} element")
            if size % itemsize:
                raise ValueError(f"--sizes: {size} bytes is not a whole number of {self.dtype} elements")


@dataclass(frozen=True)
class BenchRow:
    size_bytes: int
    count: int
    dtype: str
    op: str
    algorithm: str
    transport: str
    world_size: int
    iters: int
    time_s: float
    algbw_Bps: float
    busbw_Bps: float
    wrong: int


def default_iters(size_bytes: int) -> int:
    """About 256 MiB of traffic per size, between 5 and 1000 iterations."""
    return max(5, min(1000, (256 << 20) // max(size_bytes, 1)))


def pattern(dtype: np.dtype[Any], count: int, rank: int, op: str) -> npt.NDArray[Any]:
    """Rank ``rank``'s integer-valued input (small enough that 8 ranks' sums are exact even in bfloat16)."""
    i = np.arange(count, dtype=np.int64)
    values = 1 + ((i + rank) % 2) if op == "prod" else (i % 13) + rank
    return values.astype(dtype)


def expected_result(dtype: np.dtype[Any], count: int, world_size: int, op: str) -> npt.NDArray[Any]:
    """The closed-form reduction of :func:`pattern` over ``world_size`` ranks."""
    i = np.arange(count, dtype=np.int64)
    n = world_size
    if op in ("sum", "avg"):
        exact = (n * (i % 13) + n * (n - 1) // 2).astype(np.float64)
        if op == "avg":
            return (exact / n).astype(dtype)
    elif op == "min":
        exact = (i % 13).astype(np.float64)
    elif op == "max":
        exact = (i % 13 + n - 1).astype(np.float64)
    else:
        # ranks r with (i + r) odd contribute a 2: n//2 of them for even i, (n+1)//2 for odd i
        twos = np.where(i % 2 == 0, n // 2, (n + 1) // 2)
        exact = np.power(2.0, twos)
    if dtype.kind in "iu":
        return exact.astype(np.int64).astype(dtype)
    return exact.astype(dtype)


def _count_wrong(got: npt.NDArray[Any], want: npt.NDArray[Any], op: str) -> int:
    if op == "avg":
        bad = ~np.isclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-2, atol=1e-2)
    else:
        bad = got.view(np.uint8).reshape(got.size, -1) != want.view(np.uint8).reshape(want.size, -1)
        bad = bad.any(axis=1) if bad.ndim == 2 else bad
    return int(np.count_nonzero(bad))


def _measure_rank(group: ProcessGroup, config: BenchConfig) -> list[tuple[int, str, int, float, int]]:
    dtype = DTYPES[config.dtype]
    out = []
    for size in config.sizes_bytes:
        count = size // dtype.itemsize
        x = group.empty(count, dtype) if config.group_memory else np.empty(count, dtype)
        x[...] = pattern(dtype, count, group.rank, config.op)
        group.all_reduce(x, op=config.op, algorithm=config.algorithm)
        wrong = _count_wrong(x, expected_result(dtype, count, group.world_size, config.op), config.op)
        name = group.choose_algorithm(count, dtype) if config.algorithm == "auto" else config.algorithm
        iters = config.iters or default_iters(size)
        with np.errstate(all="ignore"):  # repeated in-place sums overflow; the timing does not care
            for _ in range(max(1, iters // 10)):
                group.all_reduce(x, op=config.op, algorithm=config.algorithm)
            group.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                group.all_reduce(x, op=config.op, algorithm=config.algorithm)
            elapsed = time.perf_counter() - start
        out.append((size, name, iters, elapsed / iters, wrong))
        del x
    return out


def _memory_available_bytes() -> int:
    """What the kernel estimates can be allocated without swapping (MemAvailable), or the free physical pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_bench_fits(config: BenchConfig) -> None:
    """Refuse, before any rank starts, a sweep whose largest size does not fit this machine: every rank holds
    its buffer (in ``/dev/shm`` for ``group.empty()`` buffers over shm) and the check's working arrays.

    Raises ValueError naming both figures: what the sweep needs and what ``/dev/shm`` (statvfs) and memory
    (MemAvailable) have."""
    size = max(config.sizes_bytes)
    count = size // DTYPES[config.dtype].itemsize
    shm_need = config.world_size * size if config.group_memory and config.transport == "shm" else 0
    memory_need = config.world_size * (2 * size + _CHECK_BYTES_PER_ELEMENT * count)
    shm_free = 0
    if shm_need:
        shm = os.statvfs(SHM_DIR)
        shm_free = shm.f_bavail * shm.f_frsize
    memory_free = _memory_available_bytes()
    if shm_need > shm_free or memory_need > memory_free:
        shm_text = f"{format_bytes(shm_need)} of {SHM_DIR} ({format_bytes(shm_free)} free) and " if shm_need else ""
        raise ValueError(
            f"--sizes: {format_bytes(size)} per rank on {config.world_size} ranks needs {shm_text}"
            f"{format_bytes(memory_need)} of memory ({format_bytes(memory_free)} available)"
        )


def run_bench(config: BenchConfig) -> list[BenchRow]:
    """Spawn ``config.world_size`` local ranks, measure, and return one row per size.

    Raises ValueError if the largest size does not fit (:func:`check_bench_fits`), and
    :class:`~allreduce.runtime.launcher._spawn.RankFailedError` naming the rank when one fails."""
    check_bench_fits(config)
    per_rank = spawn(
        config.world_size,
        _measure_rank,
        config,
        init_options={"transport": config.transport, "timeout_s": config.timeout_s},
        # The whole sweep gets twice the per-collective timeout.
        timeout_s=config.timeout_s * 2,
    )
    rows = []
    factor = bus_factor(Collective.ALL_REDUCE, config.world_size)
    for k, size in enumerate(config.sizes_bytes):
        entries = [per_rank[r][k] for r in range(config.world_size)]
        time_s = max(e[3] for e in entries)
        algbw = size / time_s if time_s > 0 else 0.0
        rows.append(
            BenchRow(
                size_bytes=size,
                count=size // DTYPES[config.dtype].itemsize,
                dtype=config.dtype,
                op=config.op,
                algorithm=entries[0][1],
                transport=config.transport,
                world_size=config.world_size,
                iters=entries[0][2],
                time_s=time_s,
                algbw_Bps=algbw,
                busbw_Bps=algbw * factor,
                wrong=sum(e[4] for e in entries),
            )
        )
    return rows
