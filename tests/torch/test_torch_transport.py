"""TorchTransport: every all-reduce schedule over torch.distributed isend/irecv (Gloo on loopback), real processes.

One set of N processes per world size runs every case that needs a working group of that size (each torch
process start-up costs seconds on two cores); the tests share its results. Only the failure tests (a silent peer,
a dead peer) start processes of their own. Data is integer-valued, so the expected result is an exact closed form.
"""

from __future__ import annotations

import datetime
import functools
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from allreduce.runtime import compile_plan
from allreduce.runtime.launcher._spawn import RankFailedError, spawn
from allreduce.schedules import algorithms, all_reduce

COUNTS = (0, 1, 3, 7, 1000, 4099)


def _init_gloo(timeout_s: float = 60.0) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))


def _cases(world_size: int) -> list[tuple[str, int, int]]:
    cases = []
    for algorithm in algorithms(automatic=True):
        if algorithm == "hierarchical" and world_size % 2:
            continue
        for segments in (1, 3):
            cases.extend((algorithm, segments, count) for count in COUNTS)
    return cases


def _schedule(algorithm: str, world_size: int, segments: int) -> Any:
    group_size = 2 if algorithm == "hierarchical" else None
    return all_reduce(algorithm, world_size, group_size=group_size, segments=segments)


def _contribution(rank: int, count: int) -> np.ndarray[Any, Any]:
    # Distinct per rank and per element, so a block landing in the wrong place or reduced twice shows.
    return (np.arange(count, dtype=np.int64) * 7 + 1) * (rank + 1) + rank * 1000


def _worker(checksum: bool) -> dict[Any, Any]:
    import torch.distributed as dist

    from allreduce.torch import TorchTransport

    _init_gloo()
    transport = TorchTransport()
    rank, world_size = transport.rank, transport.world_size
    out: dict[Any, Any] = {}
    for seq, (algorithm, segments, count) in enumerate(_cases(world_size)):
        plan = compile_plan(_schedule(algorithm, world_size, segments), rank, count)
        buffer = _contribution(rank, count)
        transport.execute(
            plan, buffer, lambda dst, inc: np.add(dst, inc, out=dst), seq=seq, timeout_s=60.0, checksum=checksum
        )
        out[(algorithm, segments, count)] = buffer
    if world_size == 3:
        out["agree"] = _dtypes_and_agree(transport, seq=len(out))
    if world_size == 2:
        out["wrong plan"] = _wrong_plan(transport)
    transport.close()
    dist.destroy_process_group()
    return out


@functools.cache
def _run(world_size: int) -> list[dict[Any, Any]]:
    return spawn(world_size, _worker, world_size == 3, group=False, timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_all_reduce_algorithm_gives_the_exact_sum(world_size: int) -> None:
    per_rank = _run(world_size)
    for algorithm, segments, count in _cases(world_size):
        expected = sum(_contribution(r, count) for r in range(world_size))
        for rank in range(world_size):
            got = per_rank[rank][(algorithm, segments, count)]
            assert np.array_equal(got, expected), f"{algorithm} segments={segments} count={count} rank {rank}"


def _dtypes_and_agree(transport: Any, seq: int) -> dict[str, Any]:
    rank, world_size = transport.rank, transport.world_size
    out: dict[str, Any] = {}
    # Descriptors of different lengths per rank, one longer than the fixed slot (a second round).
    out["short"] = transport.agree(seq, f"rank{rank}".encode(), timeout_s=30)
    out["long"] = transport.agree(seq + 1, bytes([rank]) * (50 + 90 * rank), timeout_s=30)
    out["empty"] = transport.agree(seq + 2, b"", timeout_s=30)
    import ml_dtypes  # here, not at the top: every rank of every test here imports this module (0.6-0.9 s each)

    schedule = _schedule("ring", world_size, 2)
    for dtype in (np.float32, np.float64, np.int32, np.uint8, ml_dtypes.bfloat16, np.float16):
        buffer = ((np.arange(37) % 5) + rank).astype(dtype)
        plan = compile_plan(schedule, rank, buffer.size)
        transport.execute(plan, buffer, lambda d, i: np.add(d, i, out=d), seq=seq + 3, timeout_s=30, checksum=True)
        out[np.dtype(dtype).name] = buffer.astype(np.float64)
    # recv_copy only (no reduce): a max all-reduce through the same plan with np.maximum.
    buffer = np.full(10, rank, dtype=np.int64)
    transport.execute(
        compile_plan(schedule, rank, 10),
        buffer,
        lambda d, i: np.maximum(d, i, out=d),
        seq=seq + 4,
        timeout_s=30,
        checksum=False,
    )
    out["max"] = buffer
    return out


@pytest.mark.slow
def test_agree_returns_every_ranks_descriptor_and_dtypes_travel_as_bytes() -> None:
    world_size = 3
    for out in (r["agree"] for r in _run(world_size)):
        assert out["short"] == [f"rank{r}".encode() for r in range(world_size)]
        assert out["long"] == [bytes([r]) * (50 + 90 * r) for r in range(world_size)]
        assert out["empty"] == [b""] * world_size
        expected = sum(((np.arange(37) % 5) + r) for r in range(world_size)).astype(np.float64)
        for name in ("float32", "float64", "int32", "uint8", "bfloat16", "float16"):
            assert np.array_equal(out[name], expected), name
        assert np.array_equal(out["max"], np.full(10, world_size - 1))


def _silent_peer_worker(fifo: str) -> str:
    from allreduce.runtime import CollectiveTimeoutError
    from allreduce.torch import TorchTransport

    _init_gloo()
    transport = TorchTransport()
    if transport.rank == 1:
        # Rank 1 never joins the collective and stays alive until rank 0 has seen the timeout (a Gloo timeout
        # tears the connection down, so the signal goes through a fifo, which blocks until rank 0 writes).
        with open(fifo) as f:
            return f.read()
    plan = compile_plan(_schedule("ring", 2, 1), 0, 64)
    try:
        transport.execute(plan, np.zeros(64), lambda d, i: np.add(d, i, out=d), seq=0, timeout_s=1.0, checksum=False)
    except CollectiveTimeoutError as exc:
        message = f"{exc}|peer={exc.peer}|step={exc.step}"
    else:
        message = "no error"
    try:
        transport.execute(plan, np.zeros(64), lambda d, i: np.add(d, i, out=d), seq=1, timeout_s=1.0, checksum=False)
    except RuntimeError as exc:
        message += f"|again: {exc}"
    with open(fifo, "w") as f:
        f.write("done")
    return message


@pytest.mark.slow
def test_a_silent_peer_raises_a_timeout_naming_it(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    message, silent = spawn(2, _silent_peer_worker, str(fifo), group=False, timeout_s=120)
    assert silent == "done"
    assert "timed out after 1 s waiting for rank 1" in message
    assert "|peer=1|step=0" in message
    assert "unusable after an earlier failure" in message


def _dying_peer_worker(report: str) -> None:
    from allreduce.runtime import PeerFailureError
    from allreduce.torch import TorchTransport

    _init_gloo()
    transport = TorchTransport()
    plan = compile_plan(_schedule("ring", 2, 1), transport.rank, 1 << 16)
    if transport.rank == 1:
        os._exit(3)
    # spawn stops the other ranks once one dies: stay until the failure is seen and reported.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        transport.execute(
            plan, np.zeros(1 << 16), lambda d, i: np.add(d, i, out=d), seq=0, timeout_s=60.0, checksum=False
        )
    except PeerFailureError as exc:
        message = f"{exc}|peer={exc.peer}"
    else:
        message = "no error"
    with open(report, "w") as f:
        f.write(message)


@pytest.mark.slow
def test_a_dead_peer_is_named(tmp_path: Path) -> None:
    report = tmp_path / "rank0.txt"
    with pytest.raises(RankFailedError, match="rank 1 exited with status 3"):
        spawn(2, _dying_peer_worker, str(report), group=False, timeout_s=120, grace_s=60)
    message = report.read_text()
    assert "rank 1 failed (connection closed) in collective 0 at step 0" in message
    assert message.endswith("|peer=1")


def _wrong_plan(transport: Any) -> str:
    plan = compile_plan(_schedule("ring", 2, 1), 1 - transport.rank, 8)
    try:
        transport.execute(plan, np.zeros(8), np.add, seq=0, timeout_s=5.0, checksum=False)
    except ValueError as exc:
        message = str(exc)
    plan = compile_plan(_schedule("ring", 2, 1), transport.rank, 8)
    try:
        transport.execute(plan, np.zeros(9), np.add, seq=0, timeout_s=5.0, checksum=False)
    except ValueError as exc:
        message += "|" + str(exc)
    return message


@pytest.mark.slow
def test_a_plan_for_another_rank_or_size_is_refused_before_any_data_moves() -> None:
    for rank, message in enumerate(r["wrong plan"] for r in _run(2)):
        assert f"is for rank {1 - rank} of 2, but this transport is rank {rank} of 2" in message
        assert "hold 8 elements" in message
        assert "got shape (9,)" in message


def _native_threads_after_close() -> list[str]:
    import glob

    import torch.distributed as dist

    from allreduce.torch import torch_group

    _init_gloo()
    group = torch_group(timeout_s=60)
    group.all_reduce(np.ones(100, dtype=np.float32))
    group.close()
    dist.destroy_process_group()
    # `group` is still referenced here, as in a script that keeps it: its transport must not keep Gloo alive.
    assert group.closed
    return sorted(Path(f).read_text().strip() for f in glob.glob("/proc/self/task/*/comm"))


@pytest.mark.slow
def test_a_closed_group_lets_destroy_process_group_end_gloos_threads() -> None:
    # Gloo's threads left alive into interpreter finalization abort the process when one of them takes the GIL
    # there ("terminate called without an active exception").
    for names in spawn(2, _native_threads_after_close, group=False, timeout_s=120):
        assert not [name for name in names if "gloo" in name], names
