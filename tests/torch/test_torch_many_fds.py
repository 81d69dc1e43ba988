"""The torch backend in processes whose descriptors are numbered past 1,024: many open files, many subgroups.

Through torch, a rank that could not watch its peers' pidfds once returned a wrong sum with no error (about 75
torch subgroups reach that descriptor count). Each test waits on a late peer, which is when the pidfds are read.
"""

from __future__ import annotations

import os
import resource
import time

import pytest

pytest.importorskip("torch")

from allreduce.runtime.launcher._spawn import spawn

LATE_S = 0.15  # longer than the transport's spin and yield: the waiting rank sleeps on a futex and checks its peers


def _open_many(count: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = count + 1024
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else hard, hard))
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(count)]
    assert max(fds) >= 1024


def _sums_with_open_files(open_files: int, rounds: int) -> list[float]:
    import torch.distributed as dist

    import allreduce.torch  # noqa: F401  (registers the backend)
    import torch

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _open_many(open_files)
    dist.init_process_group("allreduce", rank=rank, world_size=world_size)
    sums = []
    for _ in range(rounds):
        if rank == world_size - 1:
            time.sleep(LATE_S)
        x = torch.full((1024,), float(rank + 1))
        dist.all_reduce(x)
        sums.append(float(x[0]))
    dist.destroy_process_group()
    return sums


def _sums_on_subgroups(count: int) -> list[float]:
    import torch.distributed as dist

    import allreduce.torch  # noqa: F401  (registers the backend)
    import torch

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("allreduce", rank=rank, world_size=world_size)
    groups = [dist.new_group(list(range(world_size)), backend="allreduce") for _ in range(count)]
    highest = max(int(name) for name in os.listdir("/proc/self/fd"))
    sums = []
    for i, group in enumerate(groups):
        if rank == world_size - 1 and i % 25 == 0:
            time.sleep(LATE_S)
        x = torch.full((64,), float(rank + 1 + i))
        dist.all_reduce(x, group=group)
        sums.append(float(x[0]))
    dist.destroy_process_group()
    return [float(highest >= 1024), *sums]


@pytest.mark.slow
def test_all_reduce_with_4000_open_files_is_exact() -> None:
    results = spawn(2, _sums_with_open_files, 4000, 3, group=False, timeout_s=200, env={"OMP_NUM_THREADS": "1"})
    assert results == [[3.0, 3.0, 3.0]] * 2


@pytest.mark.slow
def test_all_reduce_on_each_of_100_subgroups_is_exact() -> None:
    count = 100
    # Recording off: this test is about descriptors (the recorders' memory is another matter).
    results = spawn(
        2,
        _sums_on_subgroups,
        count,
        group=False,
        timeout_s=400,
        env={"OMP_NUM_THREADS": "1", "ALLREDUCE_STATS": "0"},
    )
    want = [float(2 * i + 3) for i in range(count)]
    # rank 0 (the one that waits: rank 1 is late) hosts the groups' stores too, and so has the most descriptors
    assert results[0][0] == 1.0, "rank 0 never reached a descriptor numbered 1024: the test tests nothing"
    assert [r[1:] for r in results] == [want, want]
