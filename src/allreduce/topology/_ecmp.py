"""Choosing among equal-cost next hops: D-mod-k for static tables, a per-flow hash for ECMP."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from allreduce.topology._graph import IntArray

__all__ = ["ecmp_hash", "pick_next_hop"]


def ecmp_hash(src: IntArray, dst: IntArray, seed: int, hop: int | IntArray) -> npt.NDArray[np.uint64]:
    """A deterministic 64-bit hash of (src, dst, seed, hop) per flow (splitmix64's finaliser over a mix)."""
    with np.errstate(over="ignore"):
        x = (
            np.asarray(src, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            ^ np.asarray(dst, dtype=np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
            ^ np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * np.uint64(0x165667B19E3779F9)
            ^ np.asarray(hop, dtype=np.uint64) * np.uint64(0xD6E8FEB86659FD93)
        )
        x = np.asarray(x, dtype=np.uint64)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def pick_next_hop(
    count: IntArray, src: IntArray, dst: IntArray, *, routing: str, seed: int, hop: int | IntArray
) -> IntArray:
    """Which of ``count`` equal-cost next hops each flow takes: ``dst mod count`` under ``"shortest"`` (D-mod-k),
    else the ECMP hash of (src, dst, seed, hop) mod count."""
    count = np.asarray(count, dtype=np.int64)
    if routing == "shortest":
        return np.asarray(np.mod(dst, count), dtype=np.int64)
    h = ecmp_hash(src, dst, seed, hop)
    return np.asarray(h % count.astype(np.uint64), dtype=np.int64)
