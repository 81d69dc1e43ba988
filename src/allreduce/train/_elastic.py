"""The state a rank that joins a running data-parallel job needs besides the model: the optimizer's and the
loop's (which step it is), broadcast from rank 0 without pickling anything; after a shrink that split the survivors
by one call, the same from the first rank ahead, which finished the step the others failed.

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

__all__ = ["MAX_STATE_DESCRIPTION_BYTES", "state_source", "sync_state"]

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


def _broadcast_bytes(group: Any, data: bytes, root: int) -> bytes:
    """The root's ``data`` on every rank (other ranks pass anything)."""
    size = np.array([len(data)], dtype=np.int64)
    group.broadcast(size, root)
    n = int(size[0])
    if not 0 <= n <= MAX_STATE_DESCRIPTION_BYTES:
        raise ValueError(f"rank {group.rank}: rank {root}'s state description is {n} bytes (at most "
                         f"{MAX_STATE_DESCRIPTION_BYTES})")  # fmt: skip
    buffer = np.zeros(n, dtype=np.uint8)
    if group.rank == root:
        buffer[:] = np.frombuffer(data, dtype=np.uint8)
    group.broadcast(buffer, root)
    return buffer.tobytes()


def state_source(group: Any) -> int:
    """The rank whose state the others take: the first of ``group.ahead_ranks`` after a shrink that split the
    survivors by one call (they completed the call the others raised in), else rank 0."""
    ahead = getattr(group, "ahead_ranks", ())
    return int(ahead[0]) if ahead else 0


def sync_state(
    group: Any, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Give every rank the optimizer state of :func:`state_source` (rank 0, or the first rank ahead after a split
    shrink) and return its ``extra`` (JSON-serialisable: the step, the epoch): called by every rank of a group that
    ``grow()`` just made, after ``model.regroup(group, joined=True)`` on the members and ``DataParallel(module,
    group)`` on the joiners, or of one that ``shrink()`` made with ``ahead_ranks``, after ``model.regroup(group)``."""
    source = state_source(group)
    params = [p for p in model.parameters() if p.requires_grad]
    mine = _describe(optimizer, params, extra or {}) if group.rank == source else b""
    try:
        described = json.loads(_broadcast_bytes(group, mine, source))
        state, theirs = described["state"], described["extra"]
        if len(state) != len(params):
            raise ValueError(f"rank {source} has state for {len(state)} parameters, this rank's has {len(params)}")
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"rank {group.rank}: rank {source}'s state description is malformed: {exc}") from None
    for p, entries in zip(params, state, strict=True):
        slot = optimizer.state[p]
        for key, entry in entries.items():  # in rank 0's order, which the optimizer may rely on
            if "value" in entry:
                slot[key] = entry["value"]
                continue
            dtype = getattr(torch, str(entry["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"rank {group.rank}: rank {source}'s state names dtype {str(entry['dtype'])[:20]!r}")
            if not isinstance(slot.get(key), torch.Tensor) or list(slot[key].shape) != entry["shape"]:
                slot[key] = torch.zeros(entry["shape"], dtype=dtype)
            group.broadcast(slot[key].data, source)
    return dict(theirs)
