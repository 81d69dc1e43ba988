"""The "allreduce" torch.distributed backend and the DDP comm hook under three launchers: torchrun, `allreduce run`,
and RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set by hand.

One 2-rank job per launcher (``launched_ddp_job.py``, unchanged between launchers) runs collectives, DDP on the
backend and DDP with the comm hook; the tests share its results and compare them with a reference computed here,
bitwise. Every job runs under a deadline: past it, every process it started (torchrun's workers are in sessions of
their own) is killed and the test fails with the job's output, so a hang is a failure, never a stuck suite.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import torch
from allreduce.runtime.launcher._spawn import reserve_port

WORLD_SIZE = 2
# A job's deadline: torch start-up costs seconds per process on two shared cores; a hang costs the whole deadline.
JOB_DEADLINE_S = 200.0
# How long a job stopped at its deadline gets to print its stacks and exit before SIGKILL (and then to be reaped).
REAP_S = 10.0
JOB = Path(__file__).with_name("launched_ddp_job.py")


def _load_job() -> ModuleType:
    spec = importlib.util.spec_from_file_location("launched_ddp_job", JOB)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


job = _load_job()


# ------------------------------------------------------------------------------------------------------------
# Running a job under a deadline
# ------------------------------------------------------------------------------------------------------------
def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # Fields after the command name (which may hold spaces and parentheses): state, ppid, ...
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def _descendants(pid: int) -> list[int]:
    children = _children()
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _job_processes(procs: list[subprocess.Popen[str]]) -> list[int]:
    """The job's processes and everything they started; only of processes not yet reaped, whose pids are theirs."""
    return [pid for proc in procs if proc.poll() is None for pid in (proc.pid, *_descendants(proc.pid))]


def _dump_stacks(procs: list[subprocess.Popen[str]]) -> None:
    """SIGABRT every process of the job: with PYTHONFAULTHANDLER set, each prints where it is stuck, and dies."""
    for pid in _job_processes(procs):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)


def _kill_tree(procs: list[subprocess.Popen[str]]) -> None:
    """SIGKILL every process the job started, and each one's process group (never the test's own)."""
    own_group = os.getpgrp()
    for pid in _job_processes(procs):
        try:
            group = os.getpgid(pid)
            if group != own_group:
                os.killpg(group, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass(frozen=True)
class JobResult:
    returncodes: list[int]
    output: str
    per_rank: list[dict[str, Any]]


def _run(commands: list[tuple[list[str], dict[str, str]]], out_dir: Path) -> JobResult:
    procs = [
        subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, so a stop reaches everything it started
        )
        for command, env in commands
    ]
    deadline = time.monotonic() + JOB_DEADLINE_S
    outputs: list[str] = []
    try:
        for proc in procs:
            remaining_s = max(deadline - time.monotonic(), 0.1)
            outputs.append(proc.communicate(timeout=remaining_s)[0])
    except subprocess.TimeoutExpired:
        _dump_stacks(procs)
        tails = []
        for proc in procs:
            try:
                tails.append(proc.communicate(timeout=REAP_S)[0][-5000:])
            except subprocess.TimeoutExpired:
                _kill_tree(procs)
                tails.append(proc.communicate(timeout=REAP_S)[0][-5000:])
        pytest.fail(
            f"the job did not finish within {JOB_DEADLINE_S:g} s (stopped); where it was stuck:\n" + "\n".join(tails)
        )
    finally:
        # A job that finished may still have left processes behind: none may outlive the test.
        _kill_tree(procs)
    output = "\n".join(outputs)
    returncodes = [proc.returncode for proc in procs]
    files = [out_dir / f"rank-{rank}.pt" for rank in range(WORLD_SIZE)]
    per_rank = [torch.load(f, weights_only=True) for f in files if f.exists()]
    return JobResult(returncodes, output, per_rank)


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # One thread per rank, as torchrun sets it: the reference computed here uses one thread too.
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a rank stopped at the deadline prints its stack
    return env


def _torchrun(script: Path, args: list[str]) -> JobResult:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD_SIZE), str(script)]
    return _run([([*command, *args], _base_env())], Path(args[0]))


def _allreduce_run(script: Path, args: list[str], world_size: int = WORLD_SIZE) -> JobResult:
    command = [sys.executable, "-m", "allreduce", "run", "-n", str(world_size), "--", sys.executable, str(script)]
    return _run([([*command, *args], _base_env())], Path(args[0]))


def _by_hand(script: Path, args: list[str]) -> JobResult:
    with reserve_port() as reservation:  # held while the ranks run, so no one else takes the port
        port = reservation.getsockname()[1]
        variables = {"WORLD_SIZE": str(WORLD_SIZE), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        return _run(
            [
                ([sys.executable, str(script), *args], {**_base_env(), **variables, "RANK": str(rank)})
                for rank in range(WORLD_SIZE)
            ],
            Path(args[0]),
        )


LAUNCHERS = {"torchrun": _torchrun, "allreduce run": _allreduce_run, "by hand": _by_hand}


@pytest.fixture(scope="module", params=list(LAUNCHERS))
def launched(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    out_dir = tmp_path_factory.mktemp("job")
    result = LAUNCHERS[request.param](JOB, [str(out_dir)])
    assert result.returncodes == [0] * len(result.returncodes), result.output[-5000:]
    assert len(result.per_rank) == WORLD_SIZE, result.output[-5000:]
    return result


# ------------------------------------------------------------------------------------------------------------
# The reference, computed here
# ------------------------------------------------------------------------------------------------------------
def reference_training(world_size: int) -> dict[str, torch.Tensor]:
    """Rank 0's model trained on each rank's shard, gradients averaged as the group does: sum over ranks, then
    divide by the number of ranks (with two ranks, a + b = b + a and halving is exact, so any order agrees)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = job.make_model(job.MODEL_SEED)
        optimizer = job.optimizer_for(model)
        x, y = job.dataset(world_size)
        params = list(model.parameters())
        for step in range(job.STEPS):
            per_rank = []
            for rank in range(world_size):
                model.zero_grad()
                window = job.shard(step, rank, world_size)
                torch.nn.functional.cross_entropy(model(x[window]), y[window]).backward()
                per_rank.append([p.grad.clone() for p in params])
            for i, p in enumerate(params):
                total = per_rank[0][i].clone()
                for grads in per_rank[1:]:
                    total += grads[i]
                p.grad = total / world_size
            optimizer.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------------------
# The tests
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_every_rank_joins_the_allreduce_backend(launched: JobResult) -> None:
    assert [(out["rank"], out["world_size"], out["backend"]) for out in launched.per_rank] == [
        (rank, WORLD_SIZE, "allreduce") for rank in range(WORLD_SIZE)
    ]


@pytest.mark.slow
def test_all_reduce_and_broadcast_are_exact(launched: JobResult) -> None:
    expected_sum = torch.arange(6, dtype=torch.int64) * sum(range(1, WORLD_SIZE + 1))
    expected_broadcast = torch.full((3,), float(WORLD_SIZE - 1))
    for out in launched.per_rank:
        assert torch.equal(out["all_reduce"], expected_sum), out["rank"]
        assert torch.equal(out["broadcast"], expected_broadcast), out["rank"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ddp on the backend", "ddp with the comm hook"])
def test_ddp_training_equals_the_reference_bitwise(launched: JobResult, case: str) -> None:
    expected = reference_training(WORLD_SIZE)
    for out in launched.per_rank:
        got = out[case]
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(got[name], value), f"rank {out['rank']}: {case}: {name} differs from the reference"


@pytest.mark.slow
def test_the_comm_hook_accepts_a_torch_group_on_the_allreduce_backend(launched: JobResult) -> None:
    assert all(out["hook group type"] == "_AllreduceBackend" for out in launched.per_rank)


@pytest.mark.slow
def test_torch_calls_the_backend_and_the_hook_from_the_main_thread_only(launched: JobResult) -> None:
    for out in launched.per_rank:
        calls = [(what, where) for what, where in out["threads"] if what != "comm_hook future completed"]
        assert {what for what, _ in calls} >= {"backend.allreduce", "backend.broadcast", "comm_hook"}
        assert {where for _, where in calls} == {"main"}, f"rank {out['rank']}: {calls}"


SUBGROUPS = textwrap.dedent(
    """
    import datetime
    import sys

    import torch
    import torch.distributed as dist

    import allreduce.torch

    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("allreduce", timeout=timeout)
    rank = dist.get_rank()
    # Only ranks 0 and 1 build this group's backend: rank 2 joins one group fewer than they do.
    pair = dist.new_group([0, 1], backend="allreduce", timeout=timeout)
    if rank < 2:
        x = torch.tensor([rank + 1], dtype=torch.int64)
        dist.all_reduce(x, group=pair)
        sys.stdout.write(f"pair rank {rank}: {x.item()}\\n")
    everyone = dist.new_group(backend="allreduce", timeout=timeout)
    y = torch.tensor([rank + 1], dtype=torch.int64)
    dist.all_reduce(y, group=everyone)
    sys.stdout.write(f"everyone rank {rank}: {y.item()}\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_a_group_after_a_subgroup_some_ranks_are_not_in_joins(tmp_path: Path) -> None:
    script = tmp_path / "subgroups.py"
    script.write_text(SUBGROUPS)
    result = _allreduce_run(script, [str(tmp_path)], world_size=3)
    assert result.returncodes == [0], result.output[-5000:]
    lines = sorted(line for line in result.output.splitlines() if " rank " in line)
    assert lines == [
        "[rank 0] everyone rank 0: 6",
        "[rank 0] pair rank 0: 3",
        "[rank 1] everyone rank 1: 6",
        "[rank 1] pair rank 1: 3",
        "[rank 2] everyone rank 2: 6",
    ]


INIT_AFTER_SUBGROUP = textwrap.dedent(
    """
    import datetime
    import sys

    import torch
    import torch.distributed as dist

    import allreduce
    import allreduce.torch

    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("allreduce", timeout=timeout)
    rank = dist.get_rank()
    pair = dist.new_group([0, 1], backend="allreduce", timeout=timeout)
    with allreduce.init(timeout_s=30) as group:
        x = torch.tensor([rank + 1], dtype=torch.int64)
        group.all_reduce(x)
        sys.stdout.write(f"init rank {rank}: {x.item()}\\n")
        sys.stdout.flush()
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_under_torchrun_an_init_after_a_subgroup_some_ranks_are_not_in_joins(tmp_path: Path) -> None:
    script = tmp_path / "init_after_subgroup.py"
    script.write_text(INIT_AFTER_SUBGROUP)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", str(script)]
    result = _run([(command, _base_env())], tmp_path)
    assert result.returncodes == [0], result.output[-5000:]
    assert sorted(line for line in result.output.splitlines() if "init rank" in line) == [
        f"init rank {rank}: 6" for rank in range(3)
    ]
