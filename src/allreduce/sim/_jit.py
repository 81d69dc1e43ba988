"""Whether the event engine's compiled cores run, and how they are compiled: numba (the optional ``fast``
extra) when it is installed and the environment variable ``ALLREDUCE_SIM_KERNEL`` is not ``numpy`` (which
forces the pure numpy/Python cores, so tests can compare the two).

numba is imported when a run first needs the compiled core (:func:`ready`), not with the simulator: its import
and the loading of the cached kernel cost about 0.6 CPU-seconds, which a run on the fast engine alone never
repays. Until then :func:`available` answers from whether numba is installed.

numba's on-disk cache of a compiled function is keyed by its own file's time stamp only: a kernel whose inlined
helpers live in another module (``_kernel.py`` calling ``_kernel_levels.py``) would load the old machine code
after an edit of the helper alone. So the cache lives in a directory named by a digest of every module here that
compiles code (:func:`cache_dir`), and any edit of any of them compiles afresh; ``NUMBA_CACHE_DIR``, when set,
is the user's choice and is left alone."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["KERNEL_ENV", "available", "cache_dir", "inline", "load_numba", "njit", "prefetcher", "ready"]

# Set to "numpy" to run the pure numpy/Python cores even where numba is installed.
KERNEL_ENV = "ALLREDUCE_SIM_KERNEL"


@functools.cache
def _installed() -> bool:
    return importlib.util.find_spec("numba") is not None


@functools.cache
def load_numba() -> Any:
    """The numba module, imported on first use; None where it cannot be imported (the numpy cores run)."""
    if not _installed():
        return None
    try:
        import numba
    except ImportError:  # installed but broken (say, built for another numpy): the numpy cores run
        return None
    if not os.environ.get("NUMBA_CACHE_DIR"):  # before the first njit: numba picks the place at decoration
        config: Any = numba.config
        config.CACHE_DIR = str(cache_dir())
    return numba


_HERE = Path(__file__).resolve().parent


def _compiling_modules() -> list[Path]:
    """The simulator's modules that compile code with this one (they import it)."""
    return sorted(p for p in _HERE.glob("*.py") if p.name != "__init__.py" and "_jit import" in p.read_text())


def cache_dir(modules: Iterable[Path] | None = None) -> Path:
    """Where numba keeps the compiled kernels: ``__pycache__/numba-<digest>`` beside the sources, the digest over
    ``modules`` (default: every module here that compiles code, and this one), names and bytes."""
    digest = hashlib.sha256()
    for path in sorted({*(modules if modules is not None else _compiling_modules()), Path(__file__).resolve()}):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return _HERE / "__pycache__" / f"numba-{digest.hexdigest()[:16]}"


def available() -> bool:
    """Whether the compiled kernel runs: numba is installed and not switched off by ALLREDUCE_SIM_KERNEL (an
    installed numba that fails to import is found out by :func:`ready`, and the numpy cores run instead)."""
    return _installed() and os.environ.get(KERNEL_ENV, "").strip().lower() != "numpy"


def ready() -> bool:
    """:func:`available`, and numba imported: what a run checks before it takes the compiled kernel."""
    return available() and load_numba() is not None


def njit(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` compiled in nopython mode without numba's runtime, cached on disk; itself without numba.

    Without the runtime a compiled function cannot allocate, and it takes no references: with it, every array
    a compiled function binds (passed in, unpacked from a tuple, carried round a loop) gets an atomic increment
    and decrement of its reference count, which in the event core's per-event work cost a third of its time.
    So the caller sizes every array, and the compiled code only reads and writes them."""
    numba = load_numba()
    if numba is None:
        return function
    compiled: Callable[..., Any] = numba.njit(cache=True, _nrt=False)(function)
    return compiled


def inline(function: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`njit`, and inlined where compiled code calls it (numba's ``inline="always"``): the per-event
    helpers, so the optimiser sees them with their caller."""
    numba = load_numba()
    if numba is None:
        return function
    compiled: Callable[..., Any] = numba.njit(cache=True, _nrt=False, inline="always")(function)
    return compiled


def prefetcher() -> Callable[[Any, int], None]:
    """``prefetch(array, index)`` for compiled code: asks the processor to bring the cache line holding
    ``array[index]`` in (LLVM's ``llvm.prefetch``: a read, kept in every level), without waiting for it and without
    faulting; it changes no value, so a result is the same with it or without. Without numba, a function that does
    nothing. The event core issues it for the events a few places ahead in its lanes (sim/_kernel.py), whose
    transfers' and slots' entries lie in buffers of millions: each would otherwise be a wait for memory in turn."""
    numba = load_numba()
    if numba is None:
        return _no_prefetch
    ir: Any = importlib.import_module("llvmlite.ir")
    cgutils: Any = importlib.import_module("numba.core.cgutils")

    def prefetch(typingctx: Any, array: Any, index: Any) -> Any:
        signature = numba.types.void(array, index)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            kind = sig.args[0]
            view = context.make_array(kind)(context, builder, args[0])
            where = cgutils.get_item_pointer(context, builder, kind, view, [args[1]], wraparound=False)
            where = builder.bitcast(where, ir.IntType(8).as_pointer())
            i32 = ir.IntType(32)
            hint = ir.FunctionType(ir.VoidType(), [where.type, i32, i32, i32])
            call = cgutils.get_or_insert_function(builder.module, hint, "llvm.prefetch.p0")
            builder.call(call, [where, i32(0), i32(3), i32(1)])  # a read, kept in every cache level, of data
            return context.get_dummy_value()

        return signature, codegen

    made: Callable[[Any, int], None] = importlib.import_module("numba.extending").intrinsic(prefetch)
    return made


def _no_prefetch(array: Any, index: int) -> None:
    """What :func:`prefetcher` gives without numba."""
