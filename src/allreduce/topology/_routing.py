"""Routing: which links every flow crosses.

Routings (all over *minimal* paths — fewest hops — that never pass through a GPU unless the topology says GPUs
forward, as on a ring or a torus):

- ``"shortest"``: one deterministic path per (src, dst), chosen by the destination alone as static forwarding
  tables do (D-mod-k: at a hop with ``c`` equal-cost next hops take number ``dst mod c``); on tori it is
  dimension order;
- ``"ecmp"``: at every hop a deterministic hash of (src GPU, dst GPU, seed, hop) picks one of the equal-cost
  next hops, as a switch hashes a flow's 5-tuple, so two flows can land on one link while another idles;
- ``"spray"``: ideal packet spraying: the flow is spread evenly over *all* its minimal paths (a link gets the
  fraction of those paths that cross it);
- ``"dimension_order"`` (tori only): correct dimension 0 first, then 1, then 2, each the short way round (on a
  tie, the + direction).

Dragonflies are the exception to "fewest hops": they route local-global-local over the group pair's cables
(at most one global hop), as dragonfly switches do, even where a path through a third group has fewer hops.

Structured topologies are routed arithmetically (:mod:`._structured_routing`); file-defined topologies, and every
flow whose structured path crosses a failed link, by a search from the destination (:mod:`._search_routing`).
Both produce hop layers that :mod:`._hop_layers` assembles into CSR ``Routes``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from allreduce.topology._builders import TorusStructure
from allreduce.topology._graph import IntArray, Routes, Topology
from allreduce.topology._hop_layers import Entries, LinkIndex, assemble, resolve, select
from allreduce.topology._path_table import PathTable, table_routes
from allreduce.topology._search_routing import search_routes
from allreduce.topology._structured_routing import structured_layers

__all__ = ["ROUTINGS", "route"]

ROUTINGS: tuple[str, ...] = ("shortest", "ecmp", "spray", "dimension_order")


def _as_gpus(topology: Topology, values: npt.ArrayLike, what: str) -> IntArray:
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu":
        if arr.size and not np.all(np.asarray(arr, dtype=np.float64) == np.floor(np.asarray(arr, dtype=np.float64))):
            raise ValueError(f"route: {what} must be integer GPU indices")
        arr = arr.astype(np.int64)
    arr = np.asarray(arr, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero((arr < 0) | (arr >= topology.num_gpus))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"route: {what}[{i}] = {int(arr[i])} is not a GPU of {topology.name} (0..{topology.num_gpus - 1})"
        )
    return arr


def route(
    topology: Topology,
    src_gpu: npt.ArrayLike | Sequence[int],
    dst_gpu: npt.ArrayLike | Sequence[int],
    *,
    routing: str | PathTable | None = None,
    seed: int = 0,
) -> Routes:
    """The links each flow ``src_gpu[f] -> dst_gpu[f]`` crosses under ``routing`` (see the module docstring).

    ``routing`` may also be a :class:`~allreduce.topology.PathTable` of measured paths.
    ``routing=None`` (the default) takes the topology's default: dimension order on tori and rings, ECMP
    everywhere else. A flow from a GPU to
    itself gets an empty path with latency 0. A pair with no path raises ValueError naming both GPUs (and the
    failed links, if any).
    """
    routing = topology.default_routing if routing is None else routing
    if isinstance(routing, PathTable):
        return table_routes(
            topology, routing, _as_gpus(topology, src_gpu, "src_gpu"), _as_gpus(topology, dst_gpu, "dst_gpu")
        )
    if routing not in ROUTINGS:
        raise ValueError(f"route: unknown routing {routing!r}; choose one of {', '.join(ROUTINGS)}")
    src = _as_gpus(topology, src_gpu, "src_gpu")
    dst = _as_gpus(topology, dst_gpu, "dst_gpu")
    if src.shape != dst.shape:
        raise ValueError(f"route: {src.shape[0]} sources but {dst.shape[0]} destinations")
    base = topology.root if topology.root is not None else topology
    if routing == "dimension_order" and not isinstance(base.structure, TorusStructure):
        raise ValueError(f"route: dimension_order routing needs a torus or ring, not {topology.name}")
    num_flows = src.shape[0]
    moving = np.flatnonzero(src != dst).astype(np.int64)
    parts: list[Entries] = []
    exact: dict[int, float] = {}
    layers = structured_layers(topology, src[moving], dst[moving], moving, routing=routing, seed=seed)
    search = moving
    if layers is not None:
        entries, broken = resolve(layers, LinkIndex(topology), num_flows)
        del layers  # the node-pair arrays can be as large as the routes themselves (spraying)
        parts.append(select(entries, ~broken[entries.flow]) if broken.any() else entries)
        search = np.flatnonzero(broken).astype(np.int64)
    if search.size:
        if routing == "dimension_order":
            # Dimension order has exactly one path; around a failed link fall back to the minimal detour.
            routing = "shortest"
        found, found_exact = search_routes(topology, src[search], dst[search], search, routing=routing, seed=seed)
        parts += found
        exact.update(found_exact)
    return assemble(topology, parts, num_flows, exact)
