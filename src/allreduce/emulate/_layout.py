"""From a topology to the layout of an emulated cluster: namespaces, cables, addresses, shaped rates, routes.

Pure: no commands run here. One network namespace per node of the topology (a host per GPU, a router per NIC
or switch); every cable (a pair of opposite directed links) is a veth pair on a /30 of its own; every host owns
a /32 on its loopback device, which is the address its rank listens on and connects from. Routers forward
(``ip_forward``) along every shortest path, so where the topology has several (two spines) a route carries one
next hop per path and the kernel spreads flows over them by an L4 hash (ECMP). Each direction of a cable is
shaped by a token bucket on its sending end at the link's bandwidth times :attr:`Layout.scale`, so the
topology's relative speeds are kept: a 4:1 uplink stays 4:1, a link degraded to 10% stays at 10%.
"""

from __future__ import annotations

import ipaddress
import re
from collections import deque
from dataclasses import dataclass

import numpy as np

from allreduce.topology import NodeKind, Topology

__all__ = [
    "MAX_HOSTS",
    "MAX_RATE_BPS",
    "MIN_BURST_BYTES",
    "MIN_RATE_BPS",
    "WIRE_BURST_BYTES",
    "Cable",
    "Layout",
    "Route",
    "layout",
]

MAX_HOSTS = 16
"""Largest emulated cluster: every host's rank shares this machine's cores, and at the default rate of 200 Mbit/s
per link 16 hosts is what 2 cores forward without becoming the bottleneck themselves."""

MIN_BURST_BYTES = 1 << 20
"""Token-bucket burst of an emulation without loss, whose hosts send GSO super-packets of up to 64 KiB: 1 MiB, so
a Python sender that wakes up late is not throttled below the rate. A link idle for ``burst / rate`` (84 ms at
100 Mbit/s) then sends the next MiB at the veth's speed, which no switch port does: sizes whose busiest link
carries less than 10x the burst are marked as decided by it (``emulate run``)."""

WIRE_BURST_BYTES = 16 * 1024
"""Token-bucket burst of an emulation with loss (one-MSS packets, ``gso_max_segs 1``): 16 KiB, eleven full frames.
With 1 MiB, a repetition after a stall found its links' buckets full and sent its first MiB at the veth's speed:
measured (`bench_tail_loss.py --only ring-256k-1to1`, 200 repetitions a case, 2026-12-07), 9-105 of 200
repetitions of a 256 KiB ring ran faster than its links allow (31.5 ms for 384 KiB a rank at 100 Mbit/s: as
little as 8.7 ms) in 9 of 10 cases, 30 of them without loss; with 16 KiB none did, in all 10. Smaller buckets
charge the senders' gaps between steps more (loss-free median 34.9 ms at 16 KiB, 36.4 ms at 4 KiB, against 33.1 ms
predicted): 16 KiB is the largest of those tried that no repetition outran (64 KiB: 2-5 of 200 in 5 cases)."""

MIN_RATE_BPS = 1e6
MAX_RATE_BPS = 1e10
"""Rates an emulation accepts for its fastest host link (bits/s): slower links stay above the token bucket's
resolution, and faster ones would measure this machine's cores rather than the network."""

_HOST_NET = ipaddress.IPv4Network("10.251.0.0/16")  # one /32 per host
_LINK_NET = ipaddress.IPv4Network("10.252.0.0/16")  # one /30 per cable
_MAX_CABLES = _LINK_NET.num_addresses // 4
_NAME_OK = re.compile(r"^[a-z0-9]{1,8}$")


@dataclass(frozen=True)
class Cable:
    """A veth pair between nodes ``a`` and ``b``: ``a_dev`` lives in ``a``'s namespace with ``a_addr``, and so on.

    ``rate_ab_bps`` shapes traffic from a to b (bits/s, on ``a_dev``'s egress), ``rate_ba_bps`` the reverse;
    ``link_ab``/``link_ba`` are the topology's directed link indices."""

    index: int
    a: int
    b: int
    a_dev: str
    b_dev: str
    a_addr: str
    b_addr: str
    link_ab: int
    link_ba: int
    rate_ab_bps: float
    rate_ba_bps: float


@dataclass(frozen=True)
class Route:
    """In ``node``'s namespace: traffic for ``destination`` (a host /32) leaves through ``next_hops``
    (address, device) pairs — several for ECMP. ``source`` is set on a host's routes (its own /32)."""

    node: int
    destination: str
    next_hops: tuple[tuple[str, str], ...]
    source: str | None


@dataclass(frozen=True)
class Layout:
    """Everything an emulation of ``topology`` creates, named with ``name`` (see the module docstring)."""

    name: str
    topology: Topology
    rate_bps: float  # the shaped rate of the fastest link that attaches a host
    scale: float  # shaped bytes/s per topology bytes/s, on every link
    namespaces: tuple[str, ...]  # by node index
    host_address: tuple[str, ...]  # by GPU index
    cables: tuple[Cable, ...]
    routes: tuple[Route, ...]

    @property
    def num_hosts(self) -> int:
        return self.topology.num_gpus

    def host_namespace(self, gpu: int) -> str:
        return self.namespaces[int(self.topology.gpu_node[gpu])]

    def routers(self) -> tuple[int, ...]:
        """Node indices that forward (every node that is not a GPU, and GPUs where the topology routes through
        them)."""
        kinds = self.topology.node_kind
        return tuple(
            n for n in range(self.topology.num_nodes) if kinds[n] != int(NodeKind.GPU) or self.topology.gpu_transit
        )


def _cables(topology: Topology) -> list[tuple[int, int]]:
    """Pairs (link a->b, link b->a), one per cable, in the order of the first direction's index."""
    by_ends: dict[tuple[int, int], list[int]] = {}
    for i, (s, d) in enumerate(zip(topology.link_src.tolist(), topology.link_dst.tolist(), strict=True)):
        by_ends.setdefault((s, d), []).append(i)
    pairs: list[tuple[int, int]] = []
    used: set[int] = set()
    for i, (s, d) in enumerate(zip(topology.link_src.tolist(), topology.link_dst.tolist(), strict=True)):
        if i in used:
            continue
        reverse = [j for j in by_ends.get((d, s), []) if j not in used and j != i]
        if not reverse:
            raise ValueError(
                f"{topology.name}: link {topology.link_name(i)} has no reverse link; an emulated cable carries both "
                "directions"
            )
        used.update((i, reverse[0]))
        pairs.append((i, reverse[0]))
    return pairs


def _hops_to(topology: Topology, adjacency: list[list[int]], target: int, transit: np.ndarray) -> list[int]:
    """Hop count from every node to ``target`` (breadth-first; only ``transit`` nodes forward; -1: unreachable)."""
    dist = [-1] * topology.num_nodes
    dist[target] = 0
    queue = deque([target])
    while queue:
        node = queue.popleft()
        if node != target and not transit[node]:
            continue  # a host is reached, never crossed
        for nb in adjacency[node]:
            if dist[nb] < 0:
                dist[nb] = dist[node] + 1
                queue.append(nb)
    return dist


def layout(topology: Topology, *, name: str, rate_bps: float, scale_from: Topology | None = None) -> Layout:
    """The layout of an emulation of ``topology`` whose fastest host link runs at ``rate_bps`` bits/s.

    ``scale_from`` is the topology whose host links set the scale (default: ``topology``): the undegraded one, so
    that degrading a host link slows that link rather than rescaling every other. Refuses topologies with more
    than :data:`MAX_HOSTS` GPUs, links without a reverse, and GPUs some other GPU cannot reach."""
    if not _NAME_OK.match(name):
        raise ValueError(f"emulation name {name!r}: use 1 to 8 lowercase letters or digits")
    if not (np.isfinite(rate_bps) and MIN_RATE_BPS <= rate_bps <= MAX_RATE_BPS):
        raise ValueError(
            f"rate {rate_bps:g} bit/s: choose between {MIN_RATE_BPS:g} and {MAX_RATE_BPS:g} bit/s (e.g. 200Mbps); "
            "above a few hundred Mbit/s the CPU, not the shaped links, sets the pace"
        )
    hosts = topology.num_gpus
    if hosts > MAX_HOSTS:
        raise ValueError(
            f"{topology.name} has {hosts} GPUs; an emulated cluster has at most {MAX_HOSTS} hosts (every host's "
            "rank runs on this machine's cores, and beyond that the CPU, not the network, sets the pace)"
        )
    if hosts < 2:
        raise ValueError(f"{topology.name} has {hosts} GPU; an emulated cluster needs at least 2 hosts")
    gpu_nodes = {int(n) for n in topology.gpu_node}
    reference = scale_from or topology
    reference_gpus = {int(n) for n in reference.gpu_node}
    host_links = [
        i
        for i in range(reference.num_links)
        if int(reference.link_src[i]) in reference_gpus or int(reference.link_dst[i]) in reference_gpus
    ]
    fastest_host_link_Bps = float(np.max(reference.link_bandwidth_Bps[host_links]))
    scale = rate_bps / (8.0 * fastest_host_link_Bps)

    namespaces = tuple(f"ar{name}-{topology.node_name(n)}"[:64] for n in range(topology.num_nodes))
    host_address = tuple(str(_HOST_NET[g + 1]) for g in range(hosts))
    cables: list[Cable] = []
    adjacency: list[list[int]] = [[] for _ in range(topology.num_nodes)]
    for c, (ab, ba) in enumerate(_cables(topology)):
        a, b = int(topology.link_src[ab]), int(topology.link_dst[ab])
        if c >= _MAX_CABLES:
            raise ValueError(f"{topology.name}: more cables than an emulation addresses ({_MAX_CABLES})")
        subnet = ipaddress.IPv4Network((int(_LINK_NET.network_address) + 4 * c, 30))
        a_addr, b_addr = str(subnet[1]), str(subnet[2])
        cables.append(
            Cable(
                index=c,
                a=a,
                b=b,
                a_dev=f"ar{name}c{c}a",
                b_dev=f"ar{name}c{c}b",
                a_addr=a_addr,
                b_addr=b_addr,
                link_ab=ab,
                link_ba=ba,
                rate_ab_bps=8.0 * float(topology.link_bandwidth_Bps[ab]) * scale,
                rate_ba_bps=8.0 * float(topology.link_bandwidth_Bps[ba]) * scale,
            )
        )
        adjacency[a].append(b)
        adjacency[b].append(a)

    transit = np.ones(topology.num_nodes, dtype=bool)
    if not topology.gpu_transit:
        transit[list(gpu_nodes)] = False
    # (node, neighbour) -> (neighbour's address on the cable, node's device), in cable order
    via: dict[tuple[int, int], list[tuple[str, str]]] = {}
    for cable in cables:
        via.setdefault((cable.a, cable.b), []).append((cable.b_addr, cable.a_dev))
        via.setdefault((cable.b, cable.a), []).append((cable.a_addr, cable.b_dev))
    gpu_of_node = {int(node): g for g, node in enumerate(topology.gpu_node.tolist())}
    routes: list[Route] = []
    for g in range(hosts):
        target = int(topology.gpu_node[g])
        dist = _hops_to(topology, adjacency, target, transit)
        for node in range(topology.num_nodes):
            if node == target:
                continue
            if dist[node] < 0:
                if node in gpu_of_node:
                    here, there = topology.node_name(node), topology.node_name(target)
                    raise ValueError(f"{topology.name}: {there} cannot be reached from {here}")
                continue
            hops = tuple(
                hop
                for nb in adjacency[node]
                if dist[nb] == dist[node] - 1 and (transit[nb] or nb == target)
                for hop in via.get((node, nb), [])
            )
            source = host_address[gpu_of_node[node]] if node in gpu_of_node else None
            routes.append(Route(node, host_address[g], tuple(dict.fromkeys(hops)), source))
    return Layout(name, topology, rate_bps, scale, namespaces, host_address, tuple(cables), tuple(routes))
