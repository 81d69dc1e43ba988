"""Placement: which GPU each rank runs on."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from allreduce.topology._graph import IntArray, Topology

__all__ = ["PLACEMENTS", "place"]

PLACEMENTS: tuple[str, ...] = ("linear", "random")


def place(num_ranks: int, topology: Topology, placement: str | Sequence[int] = "linear", *, seed: int = 0) -> IntArray:
    """Rank -> GPU index.

    - ``"linear"``: rank r on GPU r (neighbouring ranks share a leaf or a node, as a scheduler packs them);
    - ``"random"``: ``num_ranks`` distinct GPUs in an order drawn from a generator seeded with ``seed``
      (as a busy cluster's scheduler scatters a job);
    - a sequence of GPU indices, one per rank (also accepted as text: ``"0,2,4,6"``), checked for its length,
      range and duplicates.
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int | np.integer) or num_ranks < 1:
        raise ValueError(f"placement: the number of ranks must be a positive integer, got {num_ranks!r}")
    n = int(num_ranks)
    if n > topology.num_gpus:
        raise ValueError(f"placement: {n} ranks do not fit on the {topology.num_gpus} GPUs of {topology.name}")
    if isinstance(placement, str):
        text = placement.strip()
        if text == "linear":
            return np.arange(n, dtype=np.int64)
        if text == "random":
            if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
                raise ValueError(f"placement: random placement needs a seed that is a whole number >= 0, got {seed!r}")
            rng = np.random.default_rng(seed)
            return np.asarray(rng.permutation(topology.num_gpus)[:n], dtype=np.int64)
        if "," not in text and not text.isdigit():
            raise ValueError(
                f"placement: unknown placement {placement!r}; use linear, random, or a list of GPU indices like 0,2,4"
            )
        try:
            values = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"placement: cannot read {placement!r} as a comma-separated list of GPU indices") from None
        return _check_list(n, topology, values)
    return _check_list(n, topology, placement)


def _check_list(n: int, topology: Topology, values: Sequence[int]) -> IntArray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"placement: expected a flat list of integer GPU indices, got {values!r:.80}")
    arr = arr.astype(np.int64)
    if arr.shape[0] != n:
        raise ValueError(f"placement: the list names {arr.shape[0]} GPUs for {n} ranks")
    bad = np.flatnonzero((arr < 0) | (arr >= topology.num_gpus))
    if bad.size:
        r = int(bad[0])
        raise ValueError(
            f"placement: rank {r} is placed on GPU {int(arr[r])}, but {topology.name} has GPUs "
            f"0..{topology.num_gpus - 1}"
        )
    order = np.argsort(arr, kind="stable")
    dup = np.flatnonzero(arr[order][1:] == arr[order][:-1])
    if dup.size:
        a, b = sorted((int(order[dup[0]]), int(order[dup[0] + 1])))
        raise ValueError(f"placement: ranks {a} and {b} are both placed on GPU {int(arr[a])}")
    return arr
