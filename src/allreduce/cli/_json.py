"""JSON output of the subcommands: strict RFC 8259, so a non-finite number (the bandwidth of a zero-time run on
one rank, a ratio of zeros) is written as ``null`` instead of Python's ``NaN``/``Infinity``, which other JSON
readers reject."""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["dumps", "finite_or_none"]


def finite_or_none(value: Any) -> Any:
    """``value`` with every non-finite float, at any depth of dicts, lists and tuples, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(item) for item in value]
    return value


def dumps(value: Any) -> str:
    """Indented strict JSON of ``value``; raises ValueError if anything non-finite were left."""
    return json.dumps(finite_or_none(value), indent=2, allow_nan=False)
