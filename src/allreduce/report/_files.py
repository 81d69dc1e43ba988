"""Reading an input file whole, with a bound on its size checked before it is parsed."""

from __future__ import annotations

from pathlib import Path

from allreduce.units import format_bytes

__all__ = ["read_at_most"]


def read_at_most(path: Path, most_bytes: int, *, why: str) -> bytes:
    """The bytes of ``path``, at most ``most_bytes`` of them read: a larger file is a ``ValueError`` naming it, the
    bound, and ``why`` (what the bound protects, what to do instead). ``OSError`` as ``open`` raises it."""
    with path.open("rb") as f:
        data = f.read(most_bytes + 1)
    if len(data) > most_bytes:
        raise ValueError(f"{path}: larger than {format_bytes(most_bytes)}, {why}")
    return data
