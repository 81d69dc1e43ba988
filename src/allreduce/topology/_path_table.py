"""Explicit routing: every flow takes a path someone measured, not one a hash or a rule would pick.

A :class:`PathTable` maps an ordered (source GPU, destination GPU) pair to the directed links its traffic crosses,
in hop order. :func:`~allreduce.topology.route` accepts one in place of a routing name. What it is for: an
emulated cluster (:mod:`allreduce.emulate`) asks the kernel which next hop its ECMP hash picked for every real
connection, at every router, and the simulator then predicts that exact split instead of one of its own hashes.

Link indices are those of the topology the table was read on (the *root* topology, before any link failed); on a
topology with failed links they are translated, and a path through a failed link is an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from allreduce.topology._graph import IntArray, Routes, Topology

__all__ = ["PathTable", "table_routes"]


@dataclass(frozen=True)
class PathTable:
    """Paths by (source GPU, destination GPU): each a tuple of directed link indices in hop order."""

    paths: Mapping[tuple[int, int], tuple[int, ...]]
    name: str = "measured paths"

    def __post_init__(self) -> None:
        for (src, dst), links in self.paths.items():
            if src == dst:
                raise ValueError(f"{self.name}: a path from GPU {src} to itself")
            if not links:
                raise ValueError(f"{self.name}: GPU {src} -> GPU {dst} has an empty path")

    def check(self, topology: Topology) -> None:
        """ValueError naming the first pair whose links do not form a walk from its source to its destination."""
        base = topology.root if topology.root is not None else topology
        for (src, dst), links in self.paths.items():
            for g in (src, dst):
                if not 0 <= g < base.num_gpus:
                    raise ValueError(f"{self.name}: GPU {g} is not a GPU of {base.name} (0..{base.num_gpus - 1})")
            node = int(base.gpu_node[src])
            for link in links:
                if not 0 <= link < base.num_links:
                    raise ValueError(f"{self.name}: GPU {src} -> GPU {dst}: link {link} is not a link of {base.name}")
                if int(base.link_src[link]) != node:
                    raise ValueError(
                        f"{self.name}: GPU {src} -> GPU {dst}: {base.link_name(link)} does not leave "
                        f"{base.node_name(node)}, where the path has reached"
                    )
                node = int(base.link_dst[link])
            if node != int(base.gpu_node[dst]):
                raise ValueError(f"{self.name}: GPU {src} -> GPU {dst}: the path ends at {base.node_name(node)}")


def table_routes(topology: Topology, table: PathTable, src: IntArray, dst: IntArray) -> Routes:
    """Routes of the flows ``src[f] -> dst[f]`` (GPUs) from ``table``; a flow from a GPU to itself is empty."""
    table.check(topology)
    to_current: IntArray | None = None
    if topology.root is not None and topology.root_link is not None:
        to_current = np.full(topology.root.num_links, -1, dtype=np.int64)
        to_current[topology.root_link] = np.arange(topology.num_links, dtype=np.int64)
    counts = np.zeros(src.shape[0], dtype=np.int64)
    links: list[int] = []
    for f, (s, d) in enumerate(zip(src.tolist(), dst.tolist(), strict=True)):
        if s == d:
            continue
        path = table.paths.get((s, d))
        if path is None:
            raise ValueError(f"route: {table.name} has no path from {topology.gpu_name(s)} to {topology.gpu_name(d)}")
        if to_current is not None:
            current = [int(to_current[link]) for link in path]
            if min(current) < 0:
                raise ValueError(
                    f"{topology.name}: no path after failing {', '.join(topology.failed_links)}: "
                    f"{topology.gpu_name(s)} -> {topology.gpu_name(d)} was measured through a failed link"
                )
            path = tuple(current)
        links.extend(path)
        counts[f] = len(path)
    flow_ptr = np.zeros(src.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=flow_ptr[1:])
    link = np.asarray(links, dtype=np.int64)
    entry_flow = np.repeat(np.arange(src.shape[0], dtype=np.int64), counts)
    latency = np.bincount(entry_flow, weights=topology.link_latency_s[link], minlength=src.shape[0])
    return Routes(
        flow_ptr=flow_ptr,
        link=link,
        weight=np.ones(link.shape[0], dtype=np.float64),
        latency_s=latency.astype(np.float64),
    )
