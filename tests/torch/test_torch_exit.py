"""A script on the "allreduce" backend that ends without destroy_process_group exits cleanly.

torch wakes a waiter on a work's future while the group's worker thread is still in torch's C++ frames; if the
script then ends, the worker would take the GIL during interpreter finalization and abort the process
("terminate called without an active exception", 1 run in 6 before the backend closed its groups at exit). The
check: an exit handler registered before the backend's (so it runs after it) finds no worker thread alive.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from allreduce.runtime.launcher._spawn import reserve_port

SCRIPT = textwrap.dedent(
    """
    import atexit, threading, time

    def check():
        alive = [t.name for t in threading.enumerate() if t.name.startswith("allreduce-rank")]
        print("worker threads alive at exit:", alive, flush=True)

    atexit.register(check)  # before the backend's handler, so it runs after it

    import torch, torch.distributed as dist
    import allreduce.torch

    dist.init_process_group("allreduce")
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(0.5)
    work = dist.all_reduce(torch.ones(4), async_op=True)
    work.get_future().wait()  # what DDP's reducer waits on: it completes inside the worker's callbacks
    """
)


@pytest.mark.slow
def test_the_backend_joins_its_workers_before_the_interpreter_finalizes() -> None:
    with reserve_port() as reservation:
        port = str(reservation.getsockname()[1])
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", SCRIPT],
                env={
                    **os.environ,
                    "RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                },
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(2)
        ]
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output
        assert "worker threads alive at exit: []" in output, output
