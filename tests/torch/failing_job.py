"""One rank of a 2-rank job on the "allreduce" backend in which something goes wrong, for test_torch_failures.py.

    python failing_job.py OUT_DIR FAULT MODE
    python failing_job.py --zygote      (forks ranks of such jobs on request: :func:`zygote`)

FAULT, what rank 1 does just before its second call (under DDP: between the second step's forward and
backward): ``kill`` (SIGKILL itself), ``stall`` (wait past the collective timeout: until rank 0 has given up and
written what it raised, at most :data:`STALL_S`), ``mismatch`` (an all-reduce of 7 elements, which pairs with
another call of rank 0), ``stop`` (SIGSTOP itself, under a collective timeout of :data:`STOP_TIMEOUT_S`: the
store's lease, ``ALLREDUCE_LEASE_S``, must find it; the test kills it).
MODE: ``collective`` (``dist.all_reduce``), ``async`` (``dist.broadcast(async_op=True)`` then ``work.wait()``),
``ddp`` (DDP on the backend: the second training step's backward), ``hook`` (DDP on Gloo with
``allreduce.torch.comm_hook`` on an "allreduce" group).

Rank and rendezvous come from the environment (by hand or torchrun). Each rank writes OUT_DIR/rank-R.json: what
its second call raised (class names along the MRO, message, the error's peer) or that it returned, then exits 0.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist

import allreduce.torch
import torch
from torch import nn

TIMEOUT_S = 2.0
STALL_S = 60.0
"""The longest a stall waits for rank 0 to give up (it gives up after TIMEOUT_S)."""
STOP_TIMEOUT_S = 120.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _fault(rank: int, fault: str, group: Any, out_dir: Path) -> None:
    """What rank 1 does just before its second call (DDP: between forward and backward)."""
    if rank != 1:
        return
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "stall":
        given_up, deadline = out_dir / "rank-0.json", time.monotonic() + STALL_S
        while not given_up.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    elif fault == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault == "mismatch":
        dist.all_reduce(torch.ones(7), group=group)  # pairs with rank 0's next call on that group, another one


def _second_call(mode: str, ddp: nn.Module | None, rank: int, fault: str, group: Any = None, *, out_dir: Path) -> None:
    if ddp is not None:
        # The fault strikes between forward and backward, so that backward's bucket all-reduces (DDP's reducer,
        # in C++) are the calls that must fail.
        loss = ddp(torch.ones(4, 8)).sum()
        _fault(rank, fault, group, out_dir)
        loss.backward()
        return
    _fault(rank, fault, group, out_dir)
    if mode == "async":
        dist.broadcast(torch.ones(64), src=0, async_op=True).wait()
    else:
        dist.all_reduce(torch.ones(64))


def main(out_dir: Path, fault: str, mode: str) -> None:
    timeout_s = STOP_TIMEOUT_S if fault == "stop" else TIMEOUT_S
    dist.init_process_group("allreduce", timeout=datetime.timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    # Ranks start seconds apart on loaded cores: meet on a Gloo group (a long timeout) before the short-timeout
    # group's first call.
    gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=120))
    dist.barrier(group=gloo)
    ddp: nn.Module | None = None
    hook_group = None
    if mode == "ddp":
        ddp = nn.parallel.DistributedDataParallel(_model())
    elif mode == "hook":
        hook_group = dist.new_group(backend="allreduce", timeout=datetime.timedelta(seconds=TIMEOUT_S))
        ddp = nn.parallel.DistributedDataParallel(_model(), process_group=gloo)
        ddp.register_comm_hook(hook_group, allreduce.torch.comm_hook)
    # one good step: every rank is connected and past its first collectives
    _second_call(mode, ddp, rank, "none", out_dir=out_dir)
    started = time.monotonic()
    result: dict[str, Any]
    try:
        _second_call(mode, ddp, rank, fault, hook_group, out_dir=out_dir)
    except Exception as exc:
        result = {
            "raised": [cls.__name__ for cls in type(exc).__mro__],
            "message": str(exc),
            "peer": getattr(exc, "peer", None),
        }
    else:
        result = {"raised": None}
    result["seconds"] = time.monotonic() - started
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------------ the fork server
# `python failing_job.py --zygote`: imports torch and the backend once (1.9 CPU-s a process), then forks each rank the
# test asks for (a JSON line on stdin: args, environment, output and exit-status files), printing its pid. A forked
# rank is made what a hand-started one is: a session of its own, its output to a file, the test's environment for
# it (RANK, WORLD_SIZE, MASTER_*: nothing is read from them before init_process_group), an interpreter's exit
# (threads joined, atexit run). The server reaps its ranks, writing each one's exit status as
# subprocess.Popen.returncode has it, and kills those left when the test closes its stdin.
ZYGOTE_REAP_S = 0.02


def _forked_rank(request: dict[str, Any]) -> None:
    import faulthandler
    import traceback

    from allreduce.runtime.launcher._forkserver import exit_as_an_interpreter_does

    os.setsid()
    out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    faulthandler.enable()  # PYTHONFAULTHANDLER=1, as the hand-started ranks have it
    code = 0
    try:
        main(Path(request["args"][0]), request["args"][1], request["args"][2])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        exit_as_an_interpreter_does()  # non-daemon threads joined, atexit run
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def zygote() -> NoReturn:
    import selectors

    assert len(os.listdir("/proc/self/task")) == 1, "a thread started on import: forking would not be safe"
    exits: dict[int, str] = {}
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin, selectors.EVENT_READ)
    while True:
        ready = selector.select(ZYGOTE_REAP_S)
        while exits:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            path = exits.pop(pid)
            with open(path + ".tmp", "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".tmp", path)
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:  # the test has gone: so do the ranks
            for pid in exits:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            os._exit(0)  # nothing to finalize: tearing torch's modules down costs a second
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            selector.close()
            _forked_rank(request)
        exits[pid] = request["exit"]
        print(pid, flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        zygote()
    else:
        main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
