"""The process starter for the runtime tests' own rank processes (those not started through ``runtime.spawn``); no
tests of its own.

``RANKS.Process(target=..., args=..., kwargs=..., daemon=...)`` is multiprocessing's ``Process``, started the way
``spawn()`` starts ranks: a fork of the warm fork server (numpy and the runtime imported once, not once per
process: 0.35 CPU-s each), made what a fresh interpreter is as ``spawn()`` makes its ranks (the caller's output and
environment as they are when the process is made, its own BLAS thread count and random seed, an interpreter's exit:
non-daemon threads joined, ``atexit`` run); or a fresh interpreter where ``spawn()`` would use one
(``ALLREDUCE_START_METHOD=spawn``, or a server that cannot be made to match). The target and its arguments reach the
child as multiprocessing pickles them at ``start()``, so queues, events and barriers made by ``RANKS.Queue()``,
``RANKS.Event()``, ``RANKS.Barrier(n)`` (any attribute of the context) may be among them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from allreduce.runtime.launcher._forkserver import (
    PickledLater,
    caller_stdio,
    enter_forked_rank,
    exit_as_an_interpreter_does,
    start_method,
)


class _RankContext:
    """multiprocessing's context for the method ``spawn()`` would use now (see the module docstring)."""

    def Process(
        self,
        target: Callable[..., object],
        args: Iterable[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> Any:
        method = start_method(os.environ)
        context: Any = mp.get_context(method)
        if method == "spawn":
            return context.Process(target=target, args=tuple(args), kwargs=dict(kwargs or {}), **options)
        call = PickledLater((target, tuple(args), dict(kwargs or {})))
        return context.Process(target=_forked_main, args=(caller_stdio(), dict(os.environ), call), **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(mp.get_context(start_method(os.environ)), name)


RANKS = _RankContext()


def _forked_main(stdio: Mapping[int, int], environ: Mapping[str, str], call: bytes) -> None:
    enter_forked_rank(stdio=stdio, environ=environ)
    target, args, kwargs = pickle.loads(call)  # from the test's process, through the fork server's pipe
    try:
        target(*args, **kwargs)
    finally:
        exit_as_an_interpreter_does()
