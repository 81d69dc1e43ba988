"""Routing and fair rates of flow patterns, cached by pattern; no-path errors named in ranks."""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from allreduce.sim._fair import max_min_rates
from allreduce.topology import PathTable, Routes, Topology, route

__all__ = ["Pattern", "Router"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

# Patterns kept: ring-like schedules reuse one or two; schedules whose peers move every step (direct) reuse
# none, and must not accumulate O(steps x N) cached arrays.
_CACHE_PATTERNS = 8
# How many unreachable pairs an error message lists.
_NAMED_PAIRS = 3
# Route entries (a flow's links) that the patterns shared between routers keep in all: about 60 MB.
_SHARED_ENTRIES = 2**21


@dataclass(frozen=True, eq=False)
class Pattern:
    """A set of concurrent flows (rank ``src[f]`` to rank ``dst[f]``), routed, with their max-min fair rates."""

    src: IntArray
    dst: IntArray
    routes: Routes
    entry_flow: IntArray  # flow of each routes.link entry
    rate_Bps: FloatArray
    bottleneck_link: IntArray

    def transfer_seconds(self, nbytes: FloatArray) -> FloatArray:
        """Bytes at the fair rate; zero for flows that cross no link (same GPU) or carry nothing."""
        with np.errstate(divide="ignore", invalid="ignore"):
            seconds = np.where(nbytes > 0, nbytes / self.rate_Bps, 0.0)
        return np.asarray(seconds, dtype=np.float64)

    def link_bytes(self, nbytes: FloatArray, num_links: int) -> FloatArray:
        """Bytes each link carries when every flow sends ``nbytes``."""
        return np.bincount(
            self.routes.link, weights=self.routes.weight * nbytes[self.entry_flow], minlength=num_links
        ).astype(np.float64)


class _SharedPatterns:
    """Patterns every router on the same topology object, placement, routing and seed shares: a planner
    simulates one schedule on one cluster many times (the Monte Carlo of each bucket size under each loss model,
    each with a noise-free run), and routing the patterns was most of each run. Least recently used first out,
    within :data:`_SHARED_ENTRIES` route entries; a pattern of a topology that no longer exists is never hit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._patterns: OrderedDict[bytes, tuple[weakref.ref[Topology], Pattern]] = OrderedDict()
        self._entries = 0

    def get(self, key: bytes, topology: Topology, src: IntArray, dst: IntArray) -> Pattern | None:
        with self._lock:
            hit = self._patterns.get(key)
            if hit is None or hit[0]() is not topology:
                return None
            self._patterns.move_to_end(key)
        pattern = hit[1]
        return pattern if np.array_equal(pattern.src, src) and np.array_equal(pattern.dst, dst) else None

    def put(self, key: bytes, topology: Topology, pattern: Pattern) -> None:
        size = int(pattern.routes.link.size)
        if size > _SHARED_ENTRIES:
            return
        with self._lock:
            old = self._patterns.pop(key, None)
            if old is not None:
                self._entries -= int(old[1].routes.link.size)
            self._patterns[key] = (weakref.ref(topology), pattern)
            self._entries += size
            while self._entries > _SHARED_ENTRIES:
                _, (_, evicted) = self._patterns.popitem(last=False)
                self._entries -= int(evicted.routes.link.size)


_SHARED = _SharedPatterns()


class Router:
    """Routes rank-to-rank flows on one topology and placement; remembers recent patterns, and shares them
    with every router of the same topology object, placement, routing (by name) and seed."""

    def __init__(self, topology: Topology, rank_gpu: IntArray, routing: str | PathTable | None, seed: int) -> None:
        self.topology = topology
        self.rank_gpu = rank_gpu
        self.routing = routing
        self.seed = seed
        self._cache: OrderedDict[bytes, Pattern] = OrderedDict()
        # The key of this router's shared patterns (None: a table of paths, not shared).
        self._shared: bytes | None = None
        if routing is None or isinstance(routing, str):
            where = f"{id(topology)}|{routing}|{seed}|".encode() + np.ascontiguousarray(rank_gpu).tobytes()
            self._shared = hashlib.blake2b(where, digest_size=16).digest()

    def route_ranks(self, src: IntArray, dst: IntArray) -> Routes:
        """Routes of the flows src[f] -> dst[f] (ranks); ValueError naming ranks that cannot reach each other."""
        try:
            return self._route(src, dst)
        except ValueError as exc:
            pairs = self._unreachable(src, dst)
            if not pairs:
                raise
            named = ", ".join(
                f"rank {a} ({self.topology.gpu_name(int(self.rank_gpu[a]))}) -> "
                f"rank {b} ({self.topology.gpu_name(int(self.rank_gpu[b]))})"
                for a, b in pairs
            )
            failed = self.topology.failed_links
            after = f" after failing {', '.join(failed)}" if failed else ""
            raise ValueError(f"{self.topology.name}: no path{after}: {named} can no longer reach each other") from exc

    def pattern(self, src: IntArray, dst: IntArray) -> Pattern:
        key = hashlib.blake2b(src.tobytes() + b"|" + dst.tobytes(), digest_size=16).digest()
        hit = self._cache.get(key)
        if hit is not None and np.array_equal(hit.src, src) and np.array_equal(hit.dst, dst):
            self._cache.move_to_end(key)
            return hit
        shared = None if self._shared is None else self._shared + key
        pattern = None if shared is None else _SHARED.get(shared, self.topology, src, dst)
        if pattern is None:
            routes = self.route_ranks(src, dst)
            share = max_min_rates(routes.flow_ptr, routes.link, routes.weight, self.topology.link_bandwidth_Bps)
            pattern = Pattern(
                src=src.copy(),
                dst=dst.copy(),
                routes=routes,
                entry_flow=routes.flow_of_entry(),
                rate_Bps=share.rate_Bps,
                bottleneck_link=share.bottleneck_link,
            )
            if shared is not None:
                _SHARED.put(shared, self.topology, pattern)
        self._cache[key] = pattern
        if len(self._cache) > _CACHE_PATTERNS:
            self._cache.popitem(last=False)
        return pattern

    def _route(self, src: IntArray, dst: IntArray) -> Routes:
        return route(self.topology, self.rank_gpu[src], self.rank_gpu[dst], routing=self.routing, seed=self.seed)

    def _unreachable(self, src: IntArray, dst: IntArray) -> list[tuple[int, int]]:
        """A few (src, dst) rank pairs without a path, found by bisecting the flows: O(k log F) routing calls."""
        found: list[tuple[int, int]] = []
        pending = [(0, int(src.size))]
        while pending and len(found) < _NAMED_PAIRS:
            lo, hi = pending.pop()
            try:
                self._route(src[lo:hi], dst[lo:hi])
            except ValueError:
                if hi - lo == 1:
                    found.append((int(src[lo]), int(dst[lo])))
                else:
                    mid = (lo + hi) // 2
                    pending.extend([(mid, hi), (lo, mid)])
        return found
