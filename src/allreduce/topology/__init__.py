"""Cluster topologies, placement and routing: the graph the simulator runs schedules on.

``Topology`` and ``Routes`` (in ``_graph``) are the contract with :mod:`allreduce.sim`.
"""

from allreduce.topology._graph import FloatArray, IntArray, NodeGroup, NodeKind, NodeNames, Routes, Topology

__all__ = [
    "FloatArray",
    "IntArray",
    "NodeGroup",
    "NodeKind",
    "NodeNames",
    "Routes",
    "Topology",
]
