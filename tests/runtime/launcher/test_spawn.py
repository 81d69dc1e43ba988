"""spawn(): N real rank processes, their results, their failures, the deadline, and nothing left behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from allreduce.runtime.launcher._spawn import RankFailedError, reserve_port, spawn


def _shm_files_of(pids: list[int]) -> list[str]:
    # Data segments are named ...-<rank>-<pid namespace>x<owner pid>-<segment id>.
    return [name for name in os.listdir("/dev/shm") for pid in pids if f"x{pid}-" in name]


def _alive(pid: int) -> bool:
    """Running (a killed process whose parent has not reaped it yet is a zombie, not alive)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _pids(directory: Path) -> list[int]:
    return [int(p.read_text()) for p in directory.glob("pid-*")]


def _write_pid(directory: str, rank: int) -> None:
    Path(directory, f"pid-{rank}").write_text(str(os.getpid()))


# ------------------------------------------------------------------------------------------------------------
# Rank functions (module level: spawned interpreters import them by name)
# ------------------------------------------------------------------------------------------------------------
def _sum_of_ranks(group: Any, scale: int) -> list[int]:
    x = np.full(4, (group.rank + 1) * scale, dtype=np.int64)
    group.all_reduce(x)
    return [int(v) for v in x]


def _environment() -> dict[str, str]:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ALLREDUCE_TOKEN")
    return {k: os.environ[k] for k in keys}


def _try_to_take_the_port() -> str:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
        except OSError as exc:
            return os.strerror(exc.errno or 0)
    return "bound"


def _raise_on_rank_1_block_on_rank_0(group: Any, directory: str) -> None:
    _write_pid(directory, group.rank)
    group.barrier()  # both ranks are running before rank 1 fails
    if group.rank == 1:
        raise ValueError("rank 1's own mistake")
    signal.pause()  # until spawn stops it


def _raise_on_rank_1_collective_on_rank_0(group: Any) -> None:
    group.barrier()
    if group.rank == 1:
        raise ValueError("rank 1's own mistake")
    group.all_reduce(np.zeros(4))  # fails in turn: its peer is gone


def _hang_ignoring_sigterm(directory: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _write_pid(directory, int(os.environ["RANK"]))
    signal.pause()


def _exit_without_result() -> None:
    if os.environ["RANK"] == "1":
        os._exit(0)


def _killed_with_shared_memory(group: Any, directory: str) -> None:
    _write_pid(directory, group.rank)
    buffer = group.empty(1 << 16, np.float32)  # a data segment in /dev/shm, owned by this process
    buffer[:] = 1
    group.all_reduce(buffer)
    group.barrier()
    if group.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # no close(): its segments stay behind unless someone sweeps
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pause()


def _leave_a_child_running(directory: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    Path(directory, f"pid-{os.environ['RANK']}").write_text(str(child.pid))
    raise RuntimeError("leaving with a child still running")


# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_results_come_back_indexed_by_rank() -> None:
    assert spawn(3, _sum_of_ranks, 10) == [[60] * 4] * 3


@pytest.mark.slow
def test_group_options_reach_init() -> None:
    assert spawn(2, _sum_of_ranks, 1, init_options={"transport": "tcp"}) == [[3] * 4] * 2


@pytest.mark.slow
def test_without_a_group_the_rendezvous_environment_is_set() -> None:
    envs = spawn(2, _environment, group=False)
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    assert envs[0]["ALLREDUCE_TOKEN"] == envs[1]["ALLREDUCE_TOKEN"] != ""


@pytest.mark.slow
def test_each_job_gets_its_own_token() -> None:
    first = spawn(1, _environment, group=False)[0]["ALLREDUCE_TOKEN"]
    second = spawn(1, _environment, group=False)[0]["ALLREDUCE_TOKEN"]
    assert first != second


@pytest.mark.slow
def test_the_store_port_is_reserved_before_any_rank_starts() -> None:
    assert spawn(1, _try_to_take_the_port, group=False) == [os.strerror(98)]  # EADDRINUSE


def test_a_reserved_port_refuses_strangers_and_admits_a_reusing_server() -> None:
    with reserve_port() as reservation:
        port = reservation.getsockname()[1]
        with socket.socket() as stranger, pytest.raises(OSError, match="in use"):
            stranger.bind(("127.0.0.1", port))
        with socket.create_server(("127.0.0.1", port)) as server:  # sets SO_REUSEADDR, as the store does
            assert server.getsockname()[1] == port


@pytest.mark.slow
def test_two_spawns_at_once_both_work() -> None:
    results: dict[int, Any] = {}

    def run(scale: int) -> None:
        results[scale] = spawn(2, _sum_of_ranks, scale, init_options={"transport": "tcp"})

    threads = [threading.Thread(target=run, args=(scale,)) for scale in (1, 100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {1: [[3] * 4] * 2, 100: [[300] * 4] * 2}


@pytest.mark.slow
def test_a_rank_that_raises_is_named_and_the_others_are_stopped(tmp_path: Path) -> None:
    with pytest.raises(RankFailedError, match=r"rank 1 failed: ValueError: rank 1's own mistake") as failure:
        spawn(2, _raise_on_rank_1_block_on_rank_0, str(tmp_path), timeout_s=120)
    assert failure.value.rank == 1
    assert "Traceback" in failure.value.detail
    assert [pid for pid in _pids(tmp_path) if _alive(pid)] == []


@pytest.mark.slow
def test_the_first_cause_is_named_not_the_failures_it_caused() -> None:
    with pytest.raises(RankFailedError, match=r"rank 1 failed: ValueError: rank 1's own mistake"):
        spawn(2, _raise_on_rank_1_collective_on_rank_0, timeout_s=120)


@pytest.mark.slow
def test_a_rank_that_exits_without_a_result_is_named() -> None:
    with pytest.raises(RankFailedError, match="rank 1 exited without returning a result"):
        spawn(2, _exit_without_result, group=False, timeout_s=120)


@pytest.mark.slow
def test_ranks_that_hang_are_killed_at_the_timeout(tmp_path: Path) -> None:
    # 6 s: on a loaded host two spawned interpreters took over 3 s to start and write their pids (ml_dtypes was
    # imported then, 0.7-0.9 s of each start)
    with pytest.raises(RankFailedError, match=r"ranks 0, 1 still running after 6 s; stopped"):
        spawn(2, _hang_ignoring_sigterm, str(tmp_path), group=False, timeout_s=6, grace_s=0.5)
    pids = _pids(tmp_path)
    assert len(pids) == 2
    assert [pid for pid in pids if _alive(pid)] == []


@pytest.mark.slow
def test_a_killed_rank_leaves_no_process_and_no_shared_memory(tmp_path: Path) -> None:
    with pytest.raises(RankFailedError, match="rank 1 was killed by SIGKILL"):
        spawn(2, _killed_with_shared_memory, str(tmp_path), init_options={"transport": "shm"}, grace_s=0.5)
    pids = _pids(tmp_path)
    assert len(pids) == 2
    assert [pid for pid in pids if _alive(pid)] == []
    assert _shm_files_of(pids) == []


@pytest.mark.slow
def test_what_a_failed_rank_started_is_stopped_with_it(tmp_path: Path) -> None:
    with pytest.raises(RankFailedError, match="leaving with a child still running"):
        spawn(1, _leave_a_child_running, str(tmp_path), group=False, timeout_s=120)
    # SIGKILL is delivered asynchronously: the child is gone within moments, not at the instant spawn returns
    deadline = time.monotonic() + 30
    while [pid for pid in _pids(tmp_path) if _alive(pid)] and time.monotonic() < deadline:
        os.sched_yield()
    assert [pid for pid in _pids(tmp_path) if _alive(pid)] == []


@pytest.mark.parametrize(
    ("world_size", "options", "culprit"),
    [
        (0, {}, "world_size"),
        (True, {}, "world_size"),
        (2, {"timeout_s": 0}, "timeout_s"),
        (2, {"group": False, "init_options": {"transport": "tcp"}}, "init_options"),
    ],
)
def test_bad_arguments_are_refused_before_any_rank_starts(
    world_size: Any, options: dict[str, Any], culprit: str
) -> None:
    with pytest.raises(ValueError, match=culprit):
        spawn(world_size, _environment, **options)
