"""Cluster topologies, placement and routing: the graph the simulator runs schedules on.

``Topology`` and ``Routes`` (in ``_graph``) are the contract with :mod:`allreduce.sim`: build a topology
(:func:`fat_tree`, :func:`clos`, :func:`rail_optimized`, :func:`torus`, :func:`dragonfly`, :func:`switch`,
:func:`ring`, :func:`fully_connected`, a spec string via :func:`parse_topology`, or a YAML/JSON file via
:func:`load_topology`), map ranks to GPUs with :func:`place`, and get the links of every flow with :func:`route`.
"""

from allreduce.topology._builders import (
    MAX_TOPOLOGY_LINKS,
    MAX_TOPOLOGY_NODES,
    NETWORK_BANDWIDTH_BPS,
    NETWORK_LATENCY_S,
    NVLINK_BANDWIDTH_BPS,
    NVLINK_LATENCY_S,
    PCIE_BANDWIDTH_BPS,
    ClosStructure,
    DirectStructure,
    RailStructure,
    TorusStructure,
    clos,
    dragonfly,
    fat_tree,
    fully_connected,
    rail_optimized,
    ring,
    switch,
    torus,
)
from allreduce.topology._ecmp import ecmp_hash
from allreduce.topology._files import load_topology
from allreduce.topology._graph import FloatArray, IntArray, NodeGroup, NodeKind, NodeNames, Routes, Topology
from allreduce.topology._path_table import PathTable
from allreduce.topology._placement import PLACEMENTS, place
from allreduce.topology._routing import ROUTINGS, route
from allreduce.topology._search_routing import reachability_gaps
from allreduce.topology._spec import TOPOLOGY_KINDS, parse_topology

__all__ = [
    "MAX_TOPOLOGY_LINKS",
    "MAX_TOPOLOGY_NODES",
    "NETWORK_BANDWIDTH_BPS",
    "NETWORK_LATENCY_S",
    "NVLINK_BANDWIDTH_BPS",
    "NVLINK_LATENCY_S",
    "PCIE_BANDWIDTH_BPS",
    "PLACEMENTS",
    "ROUTINGS",
    "TOPOLOGY_KINDS",
    "ClosStructure",
    "DirectStructure",
    "FloatArray",
    "IntArray",
    "NodeGroup",
    "NodeKind",
    "NodeNames",
    "PathTable",
    "RailStructure",
    "Routes",
    "Topology",
    "TorusStructure",
    "clos",
    "dragonfly",
    "ecmp_hash",
    "fat_tree",
    "fully_connected",
    "load_topology",
    "parse_topology",
    "place",
    "rail_optimized",
    "reachability_gaps",
    "ring",
    "route",
    "switch",
    "torus",
]
