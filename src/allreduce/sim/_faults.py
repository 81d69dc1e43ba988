"""Faults injected into a simulation: degraded links, failed links, slow ranks.

Links are named as the topology names them (``leaf3->spine1``, one direction of a cable); ``leaf3<->spine1``
names both directions, which is what a bad cable or a flapping transceiver does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from allreduce.topology import Topology

__all__ = ["Faults", "apply_faults", "resolve_links"]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Faults:
    """``degraded``: (link, bandwidth factor) pairs; ``failed``: links removed (traffic is rerouted);
    ``slow_ranks``: (rank, seconds) pairs, the delay added to each step in which that rank transfers."""

    degraded: tuple[tuple[str, float], ...] = ()
    failed: tuple[str, ...] = ()
    slow_ranks: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for link, factor in self.degraded:
            if not (math.isfinite(factor) and factor > 0):
                raise ValueError(
                    f"degraded link {link}: the bandwidth factor must be a finite number > 0, got {factor}"
                )
        for rank, seconds in self.slow_ranks:
            if not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"slow rank {rank}: the delay must be a finite number of seconds >= 0, got {seconds}")

    def __bool__(self) -> bool:
        return bool(self.degraded or self.failed or self.slow_ranks)

    def rank_delay_s(self, world_size: int) -> FloatArray | None:
        """Per-rank delay per step (None when no rank is slow); a rank named twice gets the sum."""
        if not self.slow_ranks:
            return None
        delay = np.zeros(world_size, dtype=np.float64)
        for rank, seconds in self.slow_ranks:
            if not 0 <= rank < world_size:
                raise ValueError(f"slow rank {rank} is not a rank of a group of {world_size}")
            delay[rank] += seconds
        return delay


def resolve_links(topology: Topology, name: str) -> list[int]:
    """The link indices ``name`` stands for: ``a->b`` is one link, ``a<->b`` both directions."""
    if "<->" in name:
        left, _, right = name.partition("<->")
        return [topology.find_link(f"{left}->{right}"), topology.find_link(f"{right}->{left}")]
    return [topology.find_link(name)]


def apply_faults(topology: Topology, faults: Faults) -> Topology:
    """The topology with degraded links slowed down and failed links removed (indices then renumber, see
    :meth:`Topology.without`). Link names are resolved on ``topology`` before anything is removed."""
    result = topology
    for name, factor in faults.degraded:
        result = result.scaled(resolve_links(topology, name), factor)
    if faults.failed:
        failed = sorted({link for name in faults.failed for link in resolve_links(topology, name)})
        result = result.without(np.asarray(failed, dtype=np.int64))
    return result
