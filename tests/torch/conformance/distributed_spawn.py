"""torch's own distributed test suite (``torch.testing._internal.distributed.distributed_test``) as one test class
for the backend named by ``BACKEND`` at ``WORLD_SIZE`` ranks, each test in ``WORLD_SIZE`` processes torch spawns.

The adaptation of PyTorch's ``test/distributed/test_distributed_spawn.py`` that lets ``BACKEND=allreduce`` run:
importing :mod:`allreduce.torch` registers the backend, here and in every spawned rank (spawn imports this module
again to find the test class), and the backend declares in the suite's feature table what it implements (DDP and
subgroups on CPU), as a third-party backend does; the tests themselves are torch's, unchanged. ``run.py`` drives
it; ``BACKEND``, ``WORLD_SIZE`` and ``TEMP_DIR`` (holding a ``barrier`` directory) must be set before import.

With ``CONFORMANCE_SKIPS_AS=gloo`` the suite decides what to skip as for Gloo (its decorators read ``BACKEND``
when it is imported) and then runs on ``BACKEND``: how the tests reserved for Gloo by name fare on allreduce.
"""

from __future__ import annotations

import os
from typing import Any

import torch.multiprocessing
from torch.testing._internal.common_distributed import DistTestCases

import allreduce.torch  # registers the "allreduce" backend in this process and in every rank spawned from it

BACKEND = os.environ["BACKEND"]

if BACKEND == allreduce.torch.BACKEND_NAME:
    # What the backend implements for CPU tensors, in the suite's own words: "plugin" makes it count as available,
    # "ddp" and "subgroup" let the DDP and new_group tests run on it as they do on Gloo. The suite reads the table
    # in its skip decorators, when it is imported: so before the import below.
    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add(BACKEND)

SKIPS_AS = os.environ.get("CONFORMANCE_SKIPS_AS", "")
if SKIPS_AS:
    os.environ["BACKEND"] = SKIPS_AS

from torch.testing._internal.distributed import distributed_test  # noqa: E402 (after the table above)
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

if SKIPS_AS:
    # The tests and the harness read the backend from here when they run (init_process_group's backend).
    os.environ["BACKEND"] = BACKEND
    distributed_test.BACKEND = BACKEND


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc]
    """Every test of torch's ``_DistTestBase``, each in ``WORLD_SIZE`` fresh processes.

    The processes are forked from a fork server that imported this module once, where torch's harness spawns
    each (a fresh interpreter that imports it again): the import costs 4 s of CPU per rank, more than most tests
    take, and the suite is a few hundred tests. A fork server is single-threaded and has run no test, so each
    rank still starts clean; it gets the environment a spawned rank would (the test's own TEMP_DIR and
    INIT_METHOD, which the harness sets per test), and the suite's INIT_METHOD read from it, as an import would.
    """

    def setUp(self) -> None:
        super().setUp()
        context = torch.multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])
        self._start_processes(context.Process)

    def _start_processes(self, proc: Any) -> None:
        self.processes = []
        for rank in range(int(self.world_size)):
            parent_end, rank_end = torch.multiprocessing.Pipe()
            process = proc(
                target=type(self)._run_in,
                name=f"process {rank}",
                args=(dict(os.environ), rank, self._current_test_name(), self.file_name, rank_end),
            )
            process.start()
            self.pid_to_pipe[process.pid] = parent_end
            self.processes.append(process)

    @classmethod
    def _run_in(cls, environment: dict[str, str], rank: int, test_name: str, file_name: str, pipe: Any) -> None:
        os.environ.clear()
        os.environ.update(environment)
        distributed_test.INIT_METHOD = os.environ.get("INIT_METHOD", "env://")
        cls._run(rank, test_name, file_name, pipe)
