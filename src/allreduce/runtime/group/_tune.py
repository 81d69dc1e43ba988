"""Per-host α, β, γ for ``algorithm="auto"``: where ``allreduce tune`` caches them and how they are read back.

The cache is a small JSON file (``$ALLREDUCE_TUNE_FILE``, else ``~/.cache/allreduce/tune.json``) keyed by host
name and transport. A missing, unreadable or foreign file means "use the built-in defaults", never an error.
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path
from typing import Any

from allreduce.runtime.group._cost_models import default_cost_model
from allreduce.schedules import CostModel

__all__ = ["load_cost_model", "save_cost_model", "tune_file"]


def tune_file() -> Path:
    """Where the measured constants are cached."""
    explicit = os.environ.get("ALLREDUCE_TUNE_FILE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "allreduce" / "tune.json"


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_cost_model(transport: str, *, path: Path | None = None) -> CostModel | None:
    """The cached model of ``transport`` on this host, or None when there is none (or it is malformed)."""
    entry = _read(path or tune_file()).get(socket.gethostname(), {}).get(transport)
    if not isinstance(entry, dict):
        return None
    try:
        return CostModel(
            latency_s=float(entry["latency_s"]),
            bandwidth_Bps=float(entry["bandwidth_Bps"]),
            reduce_bandwidth_Bps=float(entry["reduce_bandwidth_Bps"]),
            # files written before the field existed: the transport's built-in value
            fused_bytes=float(entry.get("fused_bytes", default_cost_model(transport).fused_bytes)),
        )
    except (KeyError, TypeError, ValueError):
        return None


def save_cost_model(transport: str, model: CostModel, *, path: Path | None = None) -> Path:
    """Cache ``model`` for ``transport`` on this host; returns the file written."""
    target = path or tune_file()
    data = _read(target)
    host = data.setdefault(socket.gethostname(), {})
    host[transport] = {
        "latency_s": model.latency_s,
        "bandwidth_Bps": model.bandwidth_Bps,
        "reduce_bandwidth_Bps": model.reduce_bandwidth_Bps,
        "fused_bytes": model.fused_bytes if math.isfinite(model.fused_bytes) else "inf",
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, target)
    return target
