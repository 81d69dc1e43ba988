"""Checks of the arguments the runtime takes: integers (ranks, roots, sizes), integer-likes in, a clear error out;
switches given as an argument or an environment variable.

Anything with ``__index__`` is an integer (``int``, ``np.int64``, a 0-d integer tensor); ``bool`` is refused
although it is an ``int`` (``root=True`` is a bug, not rank 1), and so is ``float`` (``root=1.0``).
"""

from __future__ import annotations

import operator
import os

__all__ = ["integer_arg", "rank_arg", "switch_arg"]


def integer_arg(value: object, name: str) -> int:
    """``value`` as an ``int``; ``TypeError`` naming ``name`` for bools, floats and anything not integer-like."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an integer, got the bool {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}") from None


def rank_arg(value: object, name: str, world_size: int) -> int:
    """``value`` as a rank of a group of ``world_size``; ``ValueError`` naming ``name`` when it is out of range."""
    rank = integer_arg(value, name)
    if not 0 <= rank < world_size:
        raise ValueError(f"{name}: {rank} is not a rank of this group of {world_size} (ranks 0..{world_size - 1})")
    return rank


def switch_arg(requested: bool | None, env: str) -> bool:
    """An on/off setting: ``requested``, else the environment variable ``env`` (``0`` or ``1``; ``ValueError``
    naming it for anything else), else on."""
    if requested is not None:
        return bool(requested)
    value = os.environ.get(env, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{env}: {value!r} is not 0 or 1")
    return value != "0"
