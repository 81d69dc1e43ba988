"""Builders of the usual cluster topologies.

Every builder numbers the GPUs first (node ``g`` is GPU ``g``) and records its parameters in a small *structure*
object, which :func:`~allreduce.topology.route` reads to compute paths arithmetically (up to the lowest common
tier, then down) instead of searching a graph of 10^5 nodes. Every cable becomes two directed links; no builder
makes two parallel links between the same pair of nodes (they would share one name), so capacity that real
clusters spread over several cables between one pair is one link of the summed bandwidth.

Defaults (per direction, per link):

- network links: :data:`NETWORK_BANDWIDTH_BPS` = 400 Gb/s (one NDR InfiniBand / 400 GbE port) and
  :data:`NETWORK_LATENCY_S` = 1 µs per hop (switch traversal plus cable, the order of magnitude of current
  cut-through switches);
- NVLink: :data:`NVLINK_BANDWIDTH_BPS` = 450 GB/s per GPU per direction (NVLink 4 on H100: 900 GB/s
  bidirectional), :data:`NVLINK_LATENCY_S` = 0.5 µs;
- GPU↔NIC: :data:`PCIE_BANDWIDTH_BPS` = 64 GB/s (PCIe 5.0 x16), zero latency (folded into the network hop).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from allreduce.topology._graph import IntArray, NodeGroup, NodeKind, NodeNames, Topology
from allreduce.units import format_bytes

__all__ = [
    "MAX_TOPOLOGY_LINKS",
    "MAX_TOPOLOGY_NODES",
    "NETWORK_BANDWIDTH_BPS",
    "NETWORK_LATENCY_S",
    "NVLINK_BANDWIDTH_BPS",
    "NVLINK_LATENCY_S",
    "PCIE_BANDWIDTH_BPS",
    "ClosStructure",
    "DirectStructure",
    "DragonflyStructure",
    "RailStructure",
    "TorusStructure",
    "clos",
    "dragonfly",
    "fat_tree",
    "fully_connected",
    "rail_optimized",
    "ring",
    "switch",
    "torus",
]

NETWORK_BANDWIDTH_BPS = 400e9 / 8
NETWORK_LATENCY_S = 1e-6
NVLINK_BANDWIDTH_BPS = 450e9
NVLINK_LATENCY_S = 0.5e-6
PCIE_BANDWIDTH_BPS = 64e9

MAX_TOPOLOGY_NODES = 1 << 20
"""Nodes a builder makes at most (1,048,576): four times the largest cluster the simulator is benchmarked on
(131,072 GPUs on a rail-optimized network, 282,632 nodes with their NICs and switches). Checked before anything
is allocated, so a mistyped size is refused at once instead of exhausting memory."""
MAX_TOPOLOGY_LINKS = 1 << 23
"""Directed links a builder makes at most (8,388,608): about 540 MB to build (:data:`_BUILD_BYTES_PER_LINK`),
and ten times the links of that 131,072-GPU cluster; a full mesh of 2,048 GPUs (4.2 M links) fits."""
_BUILD_BYTES_PER_LINK = 64
"""Peak bytes per directed link while building (measured with tracemalloc, 43-64 over the builders): source,
destination, bandwidth and latency at 8 bytes each, and the copies that join the parts."""
_BUILD_BYTES_PER_NODE = 16
"""Bytes per node: its kind and, for GPUs, the node index and the coordinates the builders compute."""


# ----------------------------------------------------------------------------------------------------------
# Structures: what routing needs to compute paths without a search
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClosStructure:
    """Hosts under leaves, leaves in pods, every leaf of a pod to every spine of the pod, spine ``i`` of every pod
    to the ``cores_per_plane`` cores of plane ``i`` (none in a two-tier Clos).

    Host ``x`` hangs off leaf ``x // hosts_per_leaf``; leaf ``l`` is in pod ``l // leaves_per_pod``; spine ``i`` of
    pod ``p`` is node ``spine0 + p*spines_per_pod + i``; core ``j`` of plane ``i`` is ``core0 + i*cores_per_plane + j``.
    """

    hosts_per_leaf: int
    leaves_per_pod: int
    pods: int
    spines_per_pod: int
    cores_per_plane: int
    leaf0: int
    spine0: int
    core0: int

    @classmethod
    def of(
        cls,
        hosts_per_leaf: int,
        *,
        leaves_per_pod: int = 1,
        pods: int = 1,
        spines_per_pod: int = 0,
        cores_per_plane: int = 0,
    ) -> ClosStructure:
        """The structure of these tiers, nodes numbered hosts first, then leaves, spines and cores."""
        hosts = hosts_per_leaf * leaves_per_pod * pods
        spine0 = hosts + leaves_per_pod * pods
        core0 = spine0 + spines_per_pod * pods
        return cls(hosts_per_leaf, leaves_per_pod, pods, spines_per_pod, cores_per_plane, hosts, spine0, core0)


@dataclass(frozen=True)
class RailStructure:
    """GPU ``x`` is local GPU ``x % gpus_per_node`` of node ``x // gpus_per_node``; its NIC is node ``nic0 + x``.

    Intra-node: through the node's NVSwitch ``nvswitch0 + node`` or, with ``mesh``, one NVLink per GPU pair.
    Nodes are grouped ``nodes_per_unit`` to a scalable unit; rail switch ``rail0 + unit*gpus_per_node + local``
    joins the NICs of one local GPU index in a unit; every rail switch links to every spine ``spine0 + j``.
    """

    gpus_per_node: int
    nodes_per_unit: int
    spines: int
    mesh: bool
    nic0: int
    nvswitch0: int
    rail0: int
    spine0: int


@dataclass(frozen=True)
class TorusStructure:
    """GPU ``x`` sits at the row-major coordinates of ``x`` in ``dims``, linked to its ±1 neighbours per dimension
    with wraparound (a dimension of size 2 has one cable, of size 1 none)."""

    dims: tuple[int, ...]


@dataclass(frozen=True)
class DragonflyStructure:
    """Host ``x`` hangs off router ``router0 + x // hosts_per_router``; router ``i`` of group ``g`` is node
    ``router0 + g*routers_per_group + i``. Cable ``c`` (``0 <= c < global_links``) between groups ``x`` and ``y``
    leaves ``x`` from its router ``(pos*global_links + c) mod routers_per_group``, where ``pos`` is ``y``'s place
    among the groups other than ``x`` (``y - (y > x)``)."""

    groups: int
    routers_per_group: int
    hosts_per_router: int
    global_links: int
    router0: int


@dataclass(frozen=True)
class DirectStructure:
    """Every ordered pair of GPUs has a direct link."""


# ----------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------
def _check_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or int(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_size(kind: str, nodes: int, links: int) -> None:
    """Refuse a topology beyond :data:`MAX_TOPOLOGY_NODES` or :data:`MAX_TOPOLOGY_LINKS`, before building it."""
    need = format_bytes(nodes * _BUILD_BYTES_PER_NODE + links * _BUILD_BYTES_PER_LINK)
    for count, cap, what in ((nodes, MAX_TOPOLOGY_NODES, "nodes"), (links, MAX_TOPOLOGY_LINKS, "links")):
        if count > cap:
            raise ValueError(
                f"{kind}: {count:,} {what} is more than the cap of {cap:,} {what} "
                f"(building it would need about {need} of memory)"
            )


def _check_positive(name: str, value: float) -> float:
    if not (isinstance(value, int | float | np.floating) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _check_latency(name: str, value: float) -> float:
    if not (isinstance(value, int | float | np.floating) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0 seconds, got {value!r}")
    return float(value)


def _check_link(builder: str, bandwidth_Bps: float, latency_s: float) -> tuple[float, float]:
    """A builder's link bandwidth and latency, checked; an error names the builder's argument."""
    return _check_positive(f"{builder} bandwidth_Bps", bandwidth_Bps), _check_latency(f"{builder} latency_s", latency_s)


def _gbps(bandwidth_Bps: float) -> str:
    return f"{bandwidth_Bps * 8 / 1e9:g}Gbps"


def _gBps(bandwidth_Bps: float) -> str:
    return f"{bandwidth_Bps / 1e9:g}GB/s"


def _us(latency_s: float) -> str:
    return f"{latency_s * 1e6:g}us"


class _Links:
    """Accumulates cables (two directed links) and one-way links as arrays."""

    def __init__(self) -> None:
        self._src: list[IntArray] = []
        self._dst: list[IntArray] = []
        self._bw: list[np.ndarray] = []
        self._lat: list[np.ndarray] = []

    def add(self, src: IntArray, dst: IntArray, bandwidth_Bps: float | np.ndarray, latency_s: float) -> None:
        src = np.asarray(src, dtype=np.int64).reshape(-1)
        dst = np.asarray(dst, dtype=np.int64).reshape(-1)
        self._src.append(src)
        self._dst.append(dst)
        self._bw.append(np.broadcast_to(np.asarray(bandwidth_Bps, dtype=np.float64).reshape(-1), src.shape))
        self._lat.append(np.full(src.shape, latency_s, dtype=np.float64))

    def cable(self, a: IntArray, b: IntArray, bandwidth_Bps: float | np.ndarray, latency_s: float) -> None:
        self.add(a, b, bandwidth_Bps, latency_s)
        self.add(b, a, bandwidth_Bps, latency_s)

    def build(
        self,
        name: str,
        node_kind: np.ndarray,
        num_gpus: int,
        groups: Sequence[NodeGroup],
        *,
        structure: object | None,
        gpu_transit: bool = False,
        default_routing: str = "ecmp",
    ) -> Topology:
        def cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

        return Topology(
            name=name,
            node_kind=np.asarray(node_kind, dtype=np.int8),
            link_src=cat(self._src, np.int64),
            link_dst=cat(self._dst, np.int64),
            link_bandwidth_Bps=cat(self._bw, np.float64),
            link_latency_s=cat(self._lat, np.float64),
            gpu_node=np.arange(num_gpus, dtype=np.int64),
            names=NodeNames(groups=tuple(groups)),
            gpu_transit=gpu_transit,
            default_routing=default_routing,
            structure=structure,
        )


def _kinds(*counts: tuple[NodeKind, int]) -> np.ndarray:
    return np.concatenate([np.full(n, int(kind), dtype=np.int8) for kind, n in counts])


# ----------------------------------------------------------------------------------------------------------
# Direct topologies: GPUs are the routers
# ----------------------------------------------------------------------------------------------------------
def torus(
    dims: Sequence[int],
    *,
    bandwidth_Bps: float = NETWORK_BANDWIDTH_BPS,
    latency_s: float = NETWORK_LATENCY_S,
    name: str | None = None,
) -> Topology:
    """A 1D, 2D or 3D torus of GPUs (``dims`` e.g. (8, 8, 8)), each linked to its ±1 neighbours per dimension with
    wraparound; GPUs forward traffic, and routing defaults to dimension order. Defaults: 400 Gb/s, 1 µs per link."""
    dims_t = tuple(_check_int("torus dimension", d) for d in dims)
    if not 1 <= len(dims_t) <= 3:
        raise ValueError(f"torus: need 1 to 3 dimensions, got {len(dims_t)} ({dims_t})")
    bw, lat = _check_link("torus", bandwidth_Bps, latency_s)
    n = math.prod(dims_t)
    _check_size("torus", n, sum(0 if size == 1 else n if size == 2 else 2 * n for size in dims_t))
    coords = np.stack(np.unravel_index(np.arange(n, dtype=np.int64), dims_t), axis=1)
    links = _Links()
    for axis, size in enumerate(dims_t):
        if size == 1:
            continue
        if size == 2:
            # The +1 and -1 neighbours coincide: one cable, not two parallel ones.
            lower = coords[:, axis] == 0
            nxt = coords[lower].copy()
            nxt[:, axis] = 1
            a = np.flatnonzero(lower).astype(np.int64)
            links.cable(a, np.asarray(np.ravel_multi_index(tuple(nxt.T), dims_t), dtype=np.int64), bw, lat)
            continue
        nxt = coords.copy()
        nxt[:, axis] = (nxt[:, axis] + 1) % size
        plus = np.asarray(np.ravel_multi_index(tuple(nxt.T), dims_t), dtype=np.int64)
        links.cable(np.arange(n, dtype=np.int64), plus, bw, lat)
    label = name or f"torus:{'x'.join(map(str, dims_t))},bw={_gBps(bw)},lat={_us(lat)}"
    return links.build(
        label,
        _kinds((NodeKind.GPU, n)),
        n,
        [NodeGroup(0, n, "gpu")],
        structure=TorusStructure(dims_t),
        gpu_transit=True,
        default_routing="dimension_order",
    )


def ring(
    num_gpus: int, *, bandwidth_Bps: float = NETWORK_BANDWIDTH_BPS, latency_s: float = NETWORK_LATENCY_S
) -> Topology:
    """``num_gpus`` GPUs in a bidirectional ring (GPU i linked to i±1); a 1D torus. Defaults: 400 Gb/s, 1 µs."""
    n = _check_int("ring size", num_gpus)
    return torus(
        (n,),
        bandwidth_Bps=bandwidth_Bps,
        latency_s=latency_s,
        name=f"ring:{n},bw={_gbps(bandwidth_Bps)},lat={_us(latency_s)}",
    )


def fully_connected(
    num_gpus: int, *, bandwidth_Bps: float = NETWORK_BANDWIDTH_BPS, latency_s: float = NETWORK_LATENCY_S
) -> Topology:
    """``num_gpus`` GPUs with a direct link between every pair (each its own bandwidth). Defaults: 400 Gb/s, 1 µs."""
    n = _check_int("fully_connected size", num_gpus)
    bw, lat = _check_link("fully_connected", bandwidth_Bps, latency_s)
    _check_size("full", n, n * (n - 1))
    a, b = np.triu_indices(n, k=1)
    links = _Links()
    links.cable(a.astype(np.int64), b.astype(np.int64), bw, lat)
    return links.build(
        f"full:{n},bw={_gbps(bw)},lat={_us(lat)}",
        _kinds((NodeKind.GPU, n)),
        n,
        [NodeGroup(0, n, "gpu")],
        structure=DirectStructure(),
        gpu_transit=True,
    )


# ----------------------------------------------------------------------------------------------------------
# Switched topologies
# ----------------------------------------------------------------------------------------------------------
def _clos_topology(
    name: str,
    structure: ClosStructure,
    *,
    bandwidths_Bps: tuple[float, float, float],
    latency_s: float,
    prefixes: tuple[str, str, str],
) -> Topology:
    """The Clos of ``structure``: ``bandwidths_Bps`` are the host links', the leaf uplinks' and the spine
    uplinks'; ``prefixes`` name the leaves, spines and cores."""
    st = structure
    hosts_per_leaf, leaves_per_pod, spines_per_pod, cores_per_plane = (
        st.hosts_per_leaf,
        st.leaves_per_pod,
        st.spines_per_pod,
        st.cores_per_plane,
    )
    host_bandwidth_Bps, leaf_uplink_Bps, spine_uplink_Bps = bandwidths_Bps
    leaves = leaves_per_pod * st.pods
    hosts = hosts_per_leaf * leaves
    spines = spines_per_pod * st.pods
    cores = cores_per_plane * spines_per_pod
    leaf0, spine0, core0 = st.leaf0, st.spine0, st.core0
    _check_size(
        name.partition(":")[0],
        core0 + cores,
        2 * (hosts + leaves * spines_per_pod + spines * cores_per_plane),
    )
    links = _Links()
    host = np.arange(hosts, dtype=np.int64)
    links.cable(host, leaf0 + host // hosts_per_leaf, host_bandwidth_Bps, latency_s)
    if spines_per_pod:
        leaf = np.repeat(np.arange(leaves, dtype=np.int64), spines_per_pod)
        i = np.tile(np.arange(spines_per_pod, dtype=np.int64), leaves)
        links.cable(leaf0 + leaf, spine0 + (leaf // leaves_per_pod) * spines_per_pod + i, leaf_uplink_Bps, latency_s)
    if cores_per_plane:
        spine = np.repeat(np.arange(spines, dtype=np.int64), cores_per_plane)
        j = np.tile(np.arange(cores_per_plane, dtype=np.int64), spines)
        plane = spine % spines_per_pod
        links.cable(spine0 + spine, core0 + plane * cores_per_plane + j, spine_uplink_Bps, latency_s)
    leaf_p, spine_p, core_p = prefixes
    return links.build(
        name,
        _kinds((NodeKind.GPU, hosts), (NodeKind.SWITCH, leaves + spines + cores)),
        hosts,
        [
            NodeGroup(0, hosts, "gpu"),
            NodeGroup(leaf0, leaves, leaf_p),
            NodeGroup(spine0, spines, spine_p),
            NodeGroup(core0, cores, core_p),
        ],
        structure=structure,
    )


def switch(
    num_gpus: int, *, bandwidth_Bps: float = NETWORK_BANDWIDTH_BPS, latency_s: float = NETWORK_LATENCY_S
) -> Topology:
    """``num_gpus`` GPUs on one non-blocking switch ``leaf0``. Defaults: 400 Gb/s, 1 µs per link."""
    n = _check_int("switch size", num_gpus)
    bw, lat = _check_link("switch", bandwidth_Bps, latency_s)
    return _clos_topology(
        f"switch:{n},bw={_gbps(bw)},lat={_us(lat)}",
        ClosStructure.of(n),
        bandwidths_Bps=(bw, bw, bw),
        latency_s=lat,
        prefixes=("switch", "spine", "core"),
    )


def fat_tree(k: int, *, bandwidth_Bps: float = NETWORK_BANDWIDTH_BPS, latency_s: float = NETWORK_LATENCY_S) -> Topology:
    """The three-tier k-ary fat-tree (Al-Fares et al., SIGCOMM 2008): k pods of k/2 edge and k/2 aggregation
    switches, (k/2)² cores, k³/4 hosts, every link the same bandwidth, so it is non-blocking.

    Nodes: gpu0.. (hosts), edge0.. (pod p has edges p·k/2 ..), agg0.., core0.. (core ``i·k/2 + j`` joins
    aggregation switch ``i`` of every pod). Defaults: 400 Gb/s, 1 µs per link."""
    k = _check_int("fat-tree k", k, minimum=2)
    if k % 2:
        raise ValueError(f"fat-tree k must be even, got {k}")
    bw, lat = _check_link("fat-tree", bandwidth_Bps, latency_s)
    half = k // 2
    # k pods of k/2 edges and k/2 aggregations; each aggregation switch heads a plane of k/2 cores.
    tiers = ClosStructure.of(half, leaves_per_pod=half, pods=k, spines_per_pod=half, cores_per_plane=half)
    return _clos_topology(
        f"fat-tree:k={k},bw={_gbps(bw)},lat={_us(lat)}",
        tiers,
        bandwidths_Bps=(bw, bw, bw),
        latency_s=lat,
        prefixes=("edge", "agg", "core"),
    )


def clos(
    leaves: int,
    spines: int,
    hosts_per_leaf: int,
    oversub: float = 1.0,
    cores: int | None = None,
    *,
    pods: int = 1,
    core_oversub: float = 1.0,
    bandwidth_Bps: float = NETWORK_BANDWIDTH_BPS,
    latency_s: float = NETWORK_LATENCY_S,
) -> Topology:
    """A leaf-spine Clos, two-tier, or three-tier with ``cores``.

    Two-tier (``cores=None``): every leaf links to every spine. Three-tier: leaves and spines split evenly into
    ``pods``; every leaf links to every spine of its pod; spine ``i`` of each pod links to the
    ``cores / (spines/pods)`` cores of plane ``i``.

    Host links run at ``bandwidth_Bps``. ``oversub`` is the leaf tier's ratio of host capacity to uplink
    capacity: each of a leaf's uplinks gets ``hosts_per_leaf × bandwidth_Bps / (spines_per_pod × oversub)``.
    ``core_oversub`` is the same ratio at the spine tier (a spine's leaf-facing capacity over its core-facing
    capacity). Defaults: 1:1 (non-blocking), 400 Gb/s hosts, 1 µs per link.
    """
    leaves = _check_int("clos leaves", leaves)
    spines = _check_int("clos spines", spines)
    hosts_per_leaf = _check_int("clos hosts_per_leaf", hosts_per_leaf)
    pods = _check_int("clos pods", pods)
    over = _check_positive("clos oversub", oversub)
    core_over = _check_positive("clos core_oversub", core_oversub)
    bw, lat = _check_link("clos", bandwidth_Bps, latency_s)
    if cores is None and pods != 1:
        raise ValueError(f"clos: {pods} pods need a core tier (cores=...) to join them")
    if leaves % pods or spines % pods:
        raise ValueError(f"clos: {leaves} leaves and {spines} spines must split evenly into {pods} pods")
    spines_per_pod = spines // pods
    leaves_per_pod = leaves // pods
    cores_per_plane = 0
    if cores is not None:
        cores = _check_int("clos cores", cores)
        if cores % spines_per_pod:
            raise ValueError(f"clos: {cores} cores must split evenly into {spines_per_pod} planes (spines per pod)")
        cores_per_plane = cores // spines_per_pod
    leaf_uplink = hosts_per_leaf * bw / (spines_per_pod * over)
    spine_uplink = leaves_per_pod * leaf_uplink / (max(cores_per_plane, 1) * core_over)
    label = f"clos:leaves={leaves},spines={spines},hosts_per_leaf={hosts_per_leaf},oversub={over:g}"
    if cores is not None:
        label += f",cores={cores},pods={pods},core_oversub={core_over:g}"
    label += f",bw={_gbps(bw)},lat={_us(lat)}"
    tiers = ClosStructure.of(
        hosts_per_leaf,
        leaves_per_pod=leaves_per_pod,
        pods=pods,
        spines_per_pod=spines_per_pod,
        cores_per_plane=cores_per_plane,
    )
    return _clos_topology(
        label, tiers, bandwidths_Bps=(bw, leaf_uplink, spine_uplink), latency_s=lat, prefixes=("leaf", "spine", "core")
    )


def rail_optimized(
    nodes: int,
    gpus_per_node: int = 8,
    *,
    nodes_per_unit: int | None = None,
    spines: int | None = None,
    oversub: float = 1.0,
    mesh: bool = False,
    nvlink_bandwidth_Bps: float = NVLINK_BANDWIDTH_BPS,
    nvlink_latency_s: float = NVLINK_LATENCY_S,
    nic_bandwidth_Bps: float = NETWORK_BANDWIDTH_BPS,
    pcie_bandwidth_Bps: float = PCIE_BANDWIDTH_BPS,
    latency_s: float = NETWORK_LATENCY_S,
) -> Topology:
    """A rail-optimized GPU cluster (the DGX SuperPOD layout).

    Inside a node, every GPU links to the node's NVSwitch ``nvs<node>`` at ``nvlink_bandwidth_Bps`` (or, with
    ``mesh``, to every other GPU of the node directly). Every GPU has its own NIC (``nic<gpu>``, over PCIe); the
    NIC of local GPU ``i`` of every node in a scalable unit of ``nodes_per_unit`` nodes (default: 32, as a
    SuperPOD SU, or all nodes if fewer) plugs into rail switch ``rail<unit*gpus_per_node + i>``. Every rail
    switch links to every ``spine<j>`` (default ``gpus_per_node`` spines), each uplink carrying the rail switch's
    host capacity / (spines × ``oversub``), so traffic across rails or units has a path. Traffic between GPUs
    of one node never leaves it; GPUs never forward traffic.
    """
    nodes = _check_int("rail nodes", nodes)
    g = _check_int("rail gpus_per_node", gpus_per_node)
    per_unit = _check_int("rail nodes_per_unit", nodes_per_unit if nodes_per_unit is not None else min(nodes, 32))
    num_spines = _check_int("rail spines", spines if spines is not None else g)
    over = _check_positive("rail oversub", oversub)
    nvlink_bw = _check_positive("rail nvlink_bandwidth_Bps", nvlink_bandwidth_Bps)
    nvlink_lat = _check_latency("rail nvlink_latency_s", nvlink_latency_s)
    nic_bw = _check_positive("rail nic_bandwidth_Bps", nic_bandwidth_Bps)
    pcie_bw = _check_positive("rail pcie_bandwidth_Bps", pcie_bandwidth_Bps)
    lat = _check_latency("rail latency_s", latency_s)
    if nodes % per_unit:
        raise ValueError(f"rail: {nodes} nodes do not split into units of nodes_per_unit={per_unit}")
    units = nodes // per_unit
    gpus = nodes * g
    nic0 = gpus
    nvs0 = nic0 + gpus
    num_nvs = 0 if mesh else nodes
    rail0 = nvs0 + num_nvs
    rails = units * g
    spine0 = rail0 + rails
    nvlink_cables = nodes * g * (g - 1) // 2 if mesh else gpus
    _check_size("rail", spine0 + num_spines, 2 * (nvlink_cables + 2 * gpus + rails * num_spines))
    links = _Links()
    gpu = np.arange(gpus, dtype=np.int64)
    node_of = gpu // g
    if mesh:
        a, b = np.triu_indices(g, k=1)
        base = np.arange(nodes, dtype=np.int64)[:, None] * g
        links.cable((base + a).reshape(-1), (base + b).reshape(-1), nvlink_bw, nvlink_lat)
    else:
        links.cable(gpu, nvs0 + node_of, nvlink_bw, nvlink_lat)
    links.cable(gpu, nic0 + gpu, pcie_bw, 0.0)
    links.cable(nic0 + gpu, rail0 + (node_of // per_unit) * g + gpu % g, nic_bw, lat)
    rail = np.repeat(np.arange(rails, dtype=np.int64), num_spines)
    j = np.tile(np.arange(num_spines, dtype=np.int64), rails)
    links.cable(rail0 + rail, spine0 + j, per_unit * nic_bw / (num_spines * over), lat)
    structure = RailStructure(
        gpus_per_node=g,
        nodes_per_unit=per_unit,
        spines=num_spines,
        mesh=mesh,
        nic0=nic0,
        nvswitch0=nvs0,
        rail0=rail0,
        spine0=spine0,
    )
    label = (
        f"rail:nodes={nodes},gpus={g},nvlink={_gBps(nvlink_bw)},nic={_gbps(nic_bw)},"
        f"nodes_per_unit={per_unit},spines={num_spines},oversub={over:g}{',mesh' if mesh else ''},lat={_us(lat)}"
    )
    return links.build(
        label,
        _kinds((NodeKind.GPU, gpus), (NodeKind.NIC, gpus), (NodeKind.SWITCH, num_nvs + rails + num_spines)),
        gpus,
        [
            NodeGroup(0, gpus, "gpu"),
            NodeGroup(nic0, gpus, "nic"),
            NodeGroup(nvs0, num_nvs, "nvs"),
            NodeGroup(rail0, rails, "rail"),
            NodeGroup(spine0, num_spines, "spine"),
        ],
        structure=structure,
    )


def dragonfly(
    groups: int,
    routers_per_group: int,
    hosts_per_router: int,
    *,
    global_links: int = 1,
    bandwidth_Bps: float = NETWORK_BANDWIDTH_BPS,
    local_bandwidth_Bps: float | None = None,
    global_bandwidth_Bps: float | None = None,
    latency_s: float = NETWORK_LATENCY_S,
) -> Topology:
    """A dragonfly (Kim et al., ISCA 2008): routers ``r<group>.<i>`` all-to-all within a group, and
    ``global_links`` cables between every pair of groups, spread round-robin over the routers of each group
    (cables that land on the same router pair merge into one link of the summed bandwidth).

    Host links run at ``bandwidth_Bps``; local and global links default to the same. Routed minimally in the
    dragonfly sense (local, global, local: at most one global hop, over the cables whose path is shortest; a
    route through a third group is never taken even where it has fewer hops). Defaults: 400 Gb/s, 1 µs per
    link, one global cable per group pair.
    """
    groups = _check_int("dragonfly groups", groups)
    routers = _check_int("dragonfly routers_per_group", routers_per_group)
    hpr = _check_int("dragonfly hosts_per_router", hosts_per_router)
    gl = _check_int("dragonfly global_links", global_links)
    bw = _check_positive("dragonfly bandwidth_Bps", bandwidth_Bps)
    local_bw = _check_positive("dragonfly local_bandwidth_Bps", local_bandwidth_Bps or bw)
    global_bw = _check_positive("dragonfly global_bandwidth_Bps", global_bandwidth_Bps or bw)
    lat = _check_latency("dragonfly latency_s", latency_s)
    num_routers = groups * routers
    hosts = num_routers * hpr
    r0 = hosts
    _check_size(
        "dragonfly",
        hosts + num_routers,
        2 * (hosts + groups * routers * (routers - 1) // 2 + groups * (groups - 1) // 2 * gl),
    )
    links = _Links()
    host = np.arange(hosts, dtype=np.int64)
    links.cable(host, r0 + host // hpr, bw, lat)
    a, b = np.triu_indices(routers, k=1)
    base = np.arange(groups, dtype=np.int64)[:, None] * routers
    links.cable(r0 + (base + a).reshape(-1), r0 + (base + b).reshape(-1), local_bw, lat)
    # Group x lists the other groups in increasing order; its c-th cable to the group at position o of that list
    # leaves from router (o*global_links + c) mod routers, so every router carries about the same number.
    ga, gb = np.triu_indices(groups, k=1)
    ga = np.repeat(ga.astype(np.int64), gl)
    gb = np.repeat(gb.astype(np.int64), gl)
    c = np.tile(np.arange(gl, dtype=np.int64), ga.shape[0] // gl if gl else 0)
    pos_b_in_a = gb - 1  # gb > ga, so ga's list skips ga itself before gb
    pos_a_in_b = ga
    ra = r0 + ga * routers + (pos_b_in_a * gl + c) % routers
    rb = r0 + gb * routers + (pos_a_in_b * gl + c) % routers
    if ra.size:
        key = ra * (r0 + num_routers) + rb
        uniq, counts = np.unique(key, return_counts=True)
        ua, ub = np.divmod(uniq, r0 + num_routers)
        links.cable(ua, ub, global_bw * counts.astype(np.float64), lat)
    label = f"dragonfly:groups={groups},routers={routers},hosts={hpr},global_links={gl},bw={_gbps(bw)},lat={_us(lat)}"
    return links.build(
        label,
        _kinds((NodeKind.GPU, hosts), (NodeKind.SWITCH, num_routers)),
        hosts,
        [NodeGroup(0, hosts, "gpu"), NodeGroup(r0, num_routers, "r", shape=(groups, routers))],
        structure=DragonflyStructure(groups, routers, hpr, gl, r0),
    )
