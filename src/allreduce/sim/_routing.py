"""Routing and fair rates of flow patterns, cached by pattern; no-path errors named in ranks."""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, fields

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


# What a topology's routes depend on: every field but its links' bandwidths. A copy that only slows links down
# (Topology.scaled: an oversubscribed tier, a degraded link) keeps these very objects, and routes as it does.
_ROUTING_FIELDS = tuple(f.name for f in fields(Topology) if f.name != "link_bandwidth_Bps")


def _routes_alike(a: Topology, b: Topology) -> bool:
    """Whether ``a`` and ``b`` route every flow alike: they share every field but the links' bandwidths."""
    return a is b or all(getattr(a, name) is getattr(b, name) for name in _ROUTING_FIELDS)


class _SharedPatterns:
    """Patterns every router on the same topology object, placement, routing and seed shares: a planner
    simulates one schedule on one cluster many times (the Monte Carlo of each bucket size under each loss model,
    each with a noise-free run), and routing the patterns was most of each run. A topology that only slows links
    down (:func:`_routes_alike`) finds the latest pattern of the same flows on one that routes alike: the
    planner's what-ifs of an oversubscribed tier or a degraded link take its routes, and its fair rates where the
    links the pattern uses kept their bandwidths (max-min rates depend on no other). Least recently used first
    out, within :data:`_SHARED_ENTRIES` route entries; a pattern of a topology that no longer exists is never
    hit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Per key (topology object, placement, routing, seed, flows): the topology, the pattern, its alike key.
        self._patterns: OrderedDict[bytes, tuple[weakref.ref[Topology], Pattern, bytes]] = OrderedDict()
        # Per alike key (the same, but any topology that routes alike): the key of the latest such pattern.
        self._latest: dict[bytes, bytes] = {}
        self._entries = 0

    def get(
        self, key: bytes, alike: bytes, topology: Topology, src: IntArray, dst: IntArray
    ) -> tuple[Topology, Pattern] | None:
        """The pattern of these flows on ``topology``, else the latest on a topology that routes alike, with the
        topology it was made on; None if there is neither."""
        with self._lock:
            for candidate in (key, self._latest.get(alike, key)):
                hit = self._patterns.get(candidate)
                owner = None if hit is None else hit[0]()
                if hit is not None and owner is not None and _routes_alike(owner, topology):
                    pattern = hit[1]
                    if np.array_equal(pattern.src, src) and np.array_equal(pattern.dst, dst):
                        self._patterns.move_to_end(candidate)
                        return owner, pattern
        return None

    def put(self, key: bytes, alike: bytes, topology: Topology, pattern: Pattern) -> None:
        size = int(pattern.routes.link.size)
        if size > _SHARED_ENTRIES:
            return
        with self._lock:
            old = self._patterns.pop(key, None)
            if old is not None:
                self._entries -= int(old[1].routes.link.size)
            self._patterns[key] = (weakref.ref(topology), pattern, alike)
            self._latest[alike] = key
            self._entries += size
            while self._entries > _SHARED_ENTRIES:
                evicted_key, (_, evicted, evicted_alike) = self._patterns.popitem(last=False)
                self._entries -= int(evicted.routes.link.size)
                if self._latest.get(evicted_alike) == evicted_key:
                    del self._latest[evicted_alike]


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
        # The keys of this router's shared patterns: on this topology object, and on any that routes alike
        # (None: a table of paths, not shared).
        self._shared: tuple[bytes, bytes] | None = None
        if routing is None or isinstance(routing, str):
            graph = "|".join(str(id(getattr(topology, name))) for name in _ROUTING_FIELDS)
            where = f"|{routing}|{seed}|".encode() + np.ascontiguousarray(rank_gpu).tobytes()
            self._shared = (
                hashlib.blake2b(f"{id(topology)}".encode() + where, digest_size=16).digest(),
                hashlib.blake2b(graph.encode() + where, digest_size=16).digest(),
            )

    @property
    def shared_key(self) -> bytes | None:
        """What this router routes alike with every router that shares its patterns (topology object, placement,
        routing, seed): a key for results computed on them; None for a table of paths."""
        return None if self._shared is None else self._shared[0]

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
        shared = None if self._shared is None else (self._shared[0] + key, self._shared[1] + key)
        found = None if shared is None else _SHARED.get(*shared, self.topology, src, dst)
        if found is not None and found[0] is self.topology:
            pattern = found[1]
        else:
            pattern = self._solve(src, dst, found)
            if shared is not None:
                _SHARED.put(*shared, self.topology, pattern)
        self._cache[key] = pattern
        if len(self._cache) > _CACHE_PATTERNS:
            self._cache.popitem(last=False)
        return pattern

    def _solve(self, src: IntArray, dst: IntArray, alike: tuple[Topology, Pattern] | None) -> Pattern:
        """The pattern routed and its fair rates solved; with ``alike`` (a topology that routes alike and its
        pattern of these flows), its routes, and its rates where the links they use kept their bandwidths."""
        capacity = self.topology.link_bandwidth_Bps
        if alike is None:
            routes = self.route_ranks(src, dst)
        else:
            owner, known = alike
            routes = known.routes
            if np.array_equal(capacity[routes.link], owner.link_bandwidth_Bps[routes.link]):
                return Pattern(src.copy(), dst.copy(), routes, known.entry_flow, known.rate_Bps, known.bottleneck_link)
        share = max_min_rates(routes.flow_ptr, routes.link, routes.weight, capacity)
        entry_flow = routes.flow_of_entry() if alike is None else alike[1].entry_flow
        return Pattern(src.copy(), dst.copy(), routes, entry_flow, share.rate_Bps, share.bottleneck_link)

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
