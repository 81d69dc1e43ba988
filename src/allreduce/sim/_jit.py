"""Whether the event engine's compiled cores run, and how they are compiled: numba (the optional ``fast``
extra) when it is installed and the environment variable ``ALLREDUCE_SIM_KERNEL`` is not ``numpy`` (which
forces the pure numpy/Python cores, so tests can compare the two)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _load_numba() -> Any:
    try:
        import numba
    except ImportError:  # the fast extra is not installed: the numpy cores run
        return None
    return numba


numba: Any = _load_numba()

__all__ = ["KERNEL_ENV", "available", "njit", "numba"]

# Set to "numpy" to run the pure numpy/Python cores even where numba is installed.
KERNEL_ENV = "ALLREDUCE_SIM_KERNEL"


def available() -> bool:
    """Whether the compiled kernel runs: numba is installed and not switched off by ALLREDUCE_SIM_KERNEL."""
    return numba is not None and os.environ.get(KERNEL_ENV, "").strip().lower() != "numpy"


def njit(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` compiled in nopython mode, cached on disk; itself without numba."""
    if numba is None:
        return function
    compiled: Callable[..., Any] = numba.njit(cache=True)(function)
    return compiled
