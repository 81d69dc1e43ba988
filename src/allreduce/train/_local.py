"""Running one function on N local ranks: fresh processes with the usual rendezvous environment.

Each rank is a new interpreter (``spawn``: no state forked from the caller, as on a real cluster) whose
environment carries ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` (loopback) and ``MASTER_PORT`` — the
conventions torch.distributed's ``env://`` rendezvous and allreduce's own ``init()`` read. The function's return
value comes back to the caller over a local pipe from a process the caller started; nothing crosses a network.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["RankFailedError", "free_port", "run_local"]

R = TypeVar("R")

# After one rank fails, the others usually block on it; they get this long to notice and report before they are
# terminated, so the error the caller sees is the first cause, not a cascade of timeouts.
_GRACE_S = 5.0


class RankFailedError(RuntimeError):
    """A rank raised or died; ``rank`` is the first one that did, ``detail`` its traceback when it raised."""

    def __init__(self, message: str, *, rank: int, detail: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.detail = detail


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (the rendezvous binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _child(
    rank: int,
    env: Mapping[str, str],
    target: Callable[..., Any],
    args: Sequence[Any],
    results: mp.Queue[tuple[int, bool, Any]],
) -> None:
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        value = target(*args)
    except BaseException as exc:
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    # Plain pickle to bytes: multiprocessing's own pickler would pass torch tensors as handles to this process's
    # shared memory, which vanish when it exits before the parent reads them.
    results.put((rank, True, pickle.dumps(value)))


def run_local(
    world_size: int,
    target: Callable[..., R],
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> list[R]:
    """Run ``target(*args)`` on ``world_size`` fresh local processes; return their results indexed by rank.

    ``target`` must be importable by name (a module-level function). Raises :class:`RankFailedError` naming the
    first rank that raised or died, or the ranks still running after ``timeout_s``; every process is gone when
    this returns.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    ctx = mp.get_context("spawn")
    results: mp.Queue[tuple[int, bool, Any]] = ctx.Queue()
    cores = os.cpu_count() or 1
    child_env = {
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        # N ranks share the machine's cores: one intra-op thread pool per core, not per rank.
        "OMP_NUM_THREADS": str(max(1, cores // world_size)),
        # Gloo picks its interface from the host name, which may not be loopback; rendezvous stays local.
        "GLOO_SOCKET_IFNAME": "lo",
        **(env or {}),
    }
    procs = [
        ctx.Process(target=_child, args=(rank, child_env, target, args, results), name=f"allreduce-rank-{rank}")
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    failure: RankFailedError | None = None
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size and failure is None:
            try:
                rank, ok, value = results.get(timeout=0.1)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode is not None]
                if dead:
                    # It may have reported just before dying: drain once more before blaming it.
                    with contextlib.suppress(queue.Empty):
                        rank, ok, value = results.get(timeout=1.0)
                        if ok:
                            values[rank] = pickle.loads(value)
                            continue
                        failure = _failed(rank, value)
                        break
                    code = procs[dead[0]].exitcode
                    how = "exited without returning a result" if code == 0 else f"died with exit code {code}"
                    failure = RankFailedError(f"rank {dead[0]} {how}", rank=dead[0])
                elif time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in values]
                    failure = RankFailedError(
                        f"ranks {missing} still running after {timeout_s:g} s; terminated", rank=missing[0]
                    )
                continue
            if ok:
                values[rank] = pickle.loads(value)  # bytes from a child this function started, not the network
            else:
                failure = _failed(rank, value)
    finally:
        stop = time.monotonic() + (_GRACE_S if failure is not None else 30.0)
        for p in procs:
            p.join(max(0.0, stop - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    if failure is not None:
        raise failure
    return [values[r] for r in range(world_size)]


def _failed(rank: int, detail: str) -> RankFailedError:
    first_line = detail.splitlines()[0] if detail else "unknown error"
    return RankFailedError(f"rank {rank} failed: {first_line}", rank=rank, detail=detail)
