"""The state a rank that joins a running data-parallel job needs besides the model: the optimizer's and the
loop's (which step it is), broadcast from rank 0 without pickling anything.

Rank 0 describes its optimizer state (per parameter: each entry's name, and for a tensor its shape and dtype, for a
number its value) and the loop's ``extra`` as JSON, bounded in size; every rank reads the description, gives its
optimizer the same entries (a joiner's optimizer has none before its first step) and receives each tensor by
broadcast. Members of the group hold the same state already; they take part so that the broadcasts match.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

import torch
from torch import nn

__all__ = ["MAX_STATE_DESCRIPTION_BYTES", "sync_state"]

MAX_STATE_DESCRIPTION_BYTES = 16 << 20
"""The most JSON a state description may take (a few hundred bytes per parameter)."""


def _describe(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], extra: dict[str, Any]) -> bytes:
    state = []
    for p in params:
        entries: dict[str, dict[str, Any]] = {}
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                entries[key] = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
            elif isinstance(value, int | float | bool):
                entries[key] = {"value": value}
            else:
                raise TypeError(f"optimizer state {key!r} is a {type(value).__name__}: only tensors and numbers sync")
        state.append(entries)
    return json.dumps({"state": state, "extra": extra}).encode()


def _broadcast_bytes(group: Any, data: bytes) -> bytes:
    """Rank 0's ``data`` on every rank (other ranks pass anything)."""
    size = np.array([len(data)], dtype=np.int64)
    group.broadcast(size, 0)
    n = int(size[0])
    if not 0 <= n <= MAX_STATE_DESCRIPTION_BYTES:
        raise ValueError(f"rank {group.rank}: rank 0's state description is {n} bytes (at most "
                         f"{MAX_STATE_DESCRIPTION_BYTES})")  # fmt: skip
    buffer = np.zeros(n, dtype=np.uint8)
    if group.rank == 0:
        buffer[:] = np.frombuffer(data, dtype=np.uint8)
    group.broadcast(buffer, 0)
    return buffer.tobytes()


def sync_state(
    group: Any, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Give every rank rank 0's optimizer state and return rank 0's ``extra`` (JSON-serialisable: the step, the
    epoch): called by every rank of a group that ``grow()`` just made, after ``model.regroup(group, joined=True)``
    on the members and ``DataParallel(module, group)`` on the joiners."""
    params = [p for p in model.parameters() if p.requires_grad]
    mine = _describe(optimizer, params, extra or {}) if group.rank == 0 else b""
    try:
        described = json.loads(_broadcast_bytes(group, mine))
        state, theirs = described["state"], described["extra"]
        if len(state) != len(params):
            raise ValueError(f"rank 0 has state for {len(state)} parameters, this rank's model has {len(params)}")
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"rank {group.rank}: rank 0's state description is malformed: {exc}") from None
    for p, entries in zip(params, state, strict=True):
        slot = optimizer.state[p]
        for key, entry in entries.items():  # in rank 0's order, which the optimizer may rely on
            if "value" in entry:
                slot[key] = entry["value"]
                continue
            dtype = getattr(torch, str(entry["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"rank {group.rank}: rank 0's state names dtype {str(entry['dtype'])[:20]!r}")
            if not isinstance(slot.get(key), torch.Tensor) or list(slot[key].shape) != entry["shape"]:
                slot[key] = torch.zeros(entry["shape"], dtype=dtype)
            group.broadcast(slot[key].data, 0)
    return dict(theirs)
