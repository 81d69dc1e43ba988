"""Turn per-link waiting times into the named bottleneck list both engines report."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from allreduce.sim._result import Bottleneck
from allreduce.topology import Topology

__all__ = ["summarize_bottlenecks"]

FloatArray = npt.NDArray[np.float64]

# Bottlenecks kept by name in a result; the rest are only counted (a uniform ring waits on all N links).
KEPT_BOTTLENECKS = 16


def summarize_bottlenecks(
    topology: Topology, waited_s: FloatArray, link_bytes: FloatArray, seconds: float
) -> tuple[tuple[Bottleneck, ...], int]:
    """The links the critical path waited on, longest wait first (then busiest, then by index), and how many."""
    links = np.flatnonzero(waited_s > 0)
    if links.size == 0:
        return (), 0
    capacity = topology.link_bandwidth_Bps[links] * seconds
    util = np.divide(link_bytes[links], capacity, out=np.zeros(links.size), where=capacity > 0)
    order = np.lexsort((links, -util, -waited_s[links]))[:KEPT_BOTTLENECKS]
    kept = tuple(
        Bottleneck(
            link=int(links[i]),
            name=topology.link_name(int(links[i])),
            waited_s=float(waited_s[links[i]]),
            utilization=float(util[i]),
            bytes=float(link_bytes[links[i]]),
        )
        for i in order
    )
    return kept, int(links.size)
