"""The topology ↔ engine contract: a cluster as arrays of nodes and directed links, and routes as CSR arrays.

A :class:`Topology` is a directed graph. Nodes are GPUs, NICs and switches (:class:`NodeKind`); a cable is two
directed links, one per direction, each with its own bandwidth (bytes/s) and latency (s), so asymmetric links are
just two links with different numbers. GPUs are numbered ``0..num_gpus-1``; ``gpu_node[g]`` is the node of GPU
``g``. Everything is a numpy array so a 131,072-GPU cluster costs a few arrays, not 10^5 Python objects; names
("gpu12", "leaf3->spine1") are derived on demand from a compact :class:`NodeNames` scheme.

:class:`Routes` says which links each flow crosses, as CSR: flow ``f`` uses ``link[flow_ptr[f]:flow_ptr[f+1]]``
carrying the share ``weight[...]`` of its bytes on each (1.0 on a single path; spraying spreads the flow).
"""

from __future__ import annotations

import bisect
import difflib
import enum
import re
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import numpy.typing as npt

__all__ = ["FloatArray", "IntArray", "NodeGroup", "NodeKind", "NodeNames", "Routes", "Topology"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

_NAME_RE = re.compile(r"^(?P<prefix>[A-Za-z_][A-Za-z_-]*?)(?P<index>\d+(?:\.\d+)*)$")


class NodeKind(enum.IntEnum):
    """What a node is; only GPUs are endpoints of flows."""

    GPU = 0
    NIC = 1
    SWITCH = 2


@dataclass(frozen=True)
class NodeGroup:
    """Nodes ``first .. first+count-1`` are named ``prefix`` + their index within the group.

    With a ``shape`` the index is written as dotted coordinates (row-major): a dragonfly router group of shape
    (9, 4) names its nodes r0.0 … r8.3.
    """

    first: int
    count: int
    prefix: str
    shape: tuple[int, ...] = ()

    def name(self, offset: int) -> str:
        if not self.shape:
            return f"{self.prefix}{offset}"
        coords = np.unravel_index(offset, self.shape)
        return self.prefix + ".".join(str(int(c)) for c in coords)

    def parse(self, index_text: str) -> int | None:
        """The node of this group whose index reads ``index_text``, or None."""
        parts = index_text.split(".")
        if not self.shape:
            if len(parts) != 1:
                return None
            offset = int(parts[0])
        else:
            if len(parts) != len(self.shape):
                return None
            coords = [int(p) for p in parts]
            if any(not 0 <= c < s for c, s in zip(coords, self.shape, strict=True)):
                return None
            offset = int(np.ravel_multi_index(tuple(coords), self.shape))
        return self.first + offset if 0 <= offset < self.count else None

    def describe(self) -> str:
        if self.count == 0:
            return f"no {self.prefix} nodes"
        return f"{self.name(0)}..{self.name(self.count - 1)}"


@dataclass(frozen=True)
class NodeNames:
    """How node indices map to names: contiguous :class:`NodeGroup` ranges, or an explicit list (files)."""

    groups: tuple[NodeGroup, ...] = ()
    explicit: tuple[str, ...] | None = None

    def name(self, node: int) -> str:
        if self.explicit is not None:
            return self.explicit[node]
        firsts = [g.first for g in self.groups]
        i = bisect.bisect_right(firsts, node) - 1
        if i >= 0:
            group = self.groups[i]
            if node < group.first + group.count:
                return group.name(node - group.first)
        return f"node{node}"

    @cached_property
    def _explicit_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.explicit or ())}

    def find(self, name: str) -> int | None:
        if self.explicit is not None:
            return self._explicit_index.get(name)
        m = _NAME_RE.match(name)
        if not m:
            return None
        for group in self.groups:
            if group.prefix == m["prefix"]:
                node = group.parse(m["index"])
                if node is not None:
                    return node
        if m["prefix"] == "node" and "." not in m["index"]:
            # Nodes outside every group are called node<index> (see name()).
            node = int(m["index"])
            return None if self._in_group(node) else node
        return None

    def _in_group(self, node: int) -> bool:
        return any(g.first <= node < g.first + g.count for g in self.groups)

    def suggest(self, name: str) -> str:
        """A short hint about which names exist, for error messages."""
        if self.explicit is not None:
            close = difflib.get_close_matches(name, self.explicit, n=3)
            return f"did you mean {', '.join(close)}?" if close else f"the nodes are {', '.join(self.explicit[:8])}..."
        ranges = ", ".join(g.describe() for g in self.groups if g.count)
        return f"the nodes are {ranges}" if ranges else "the nodes are node0, node1, ..."


@dataclass(frozen=True, eq=False)
class Topology:
    """A cluster: nodes and directed links as arrays (see the module docstring).

    Beyond the contract fields:

    - ``names``: the naming scheme of the nodes;
    - ``gpu_transit``: whether routes may pass *through* a GPU (true where GPUs are the routers: ring, full
      mesh, torus; false where GPUs hang off switches, so no route ever borrows a GPU as a hop);
    - ``default_routing``: what :func:`~allreduce.topology.route` uses when given ``routing=None``
      ("dimension_order" on tori, "ecmp" elsewhere);
    - ``structure``: the builder's parameters, which routing uses to compute paths arithmetically instead of
      searching the graph (None for file-defined graphs);
    - ``root`` / ``root_link``: set by :meth:`without`: the topology before any link failed, and for every link
      of this one its index there. Link indices of a failed topology are the surviving links renumbered
      ``0..num_links-1`` in their original order, so ``root_link`` is increasing;
    - ``failed_links``: names of the failed links, for error messages.
    """

    name: str
    node_kind: npt.NDArray[np.int8]
    link_src: IntArray
    link_dst: IntArray
    link_bandwidth_Bps: FloatArray
    link_latency_s: FloatArray
    gpu_node: IntArray
    names: NodeNames = field(default_factory=NodeNames)
    gpu_transit: bool = False
    default_routing: str = "ecmp"
    structure: object | None = None
    root: Topology | None = None
    root_link: IntArray | None = None
    failed_links: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n_links = self.link_src.shape[0]
        for what, arr in (
            ("link_dst", self.link_dst),
            ("link_bandwidth_Bps", self.link_bandwidth_Bps),
            ("link_latency_s", self.link_latency_s),
        ):
            if arr.shape != (n_links,):
                raise ValueError(f"{self.name}: {what} has shape {arr.shape}, expected ({n_links},)")
        if n_links and (
            int(self.link_src.min()) < 0
            or int(self.link_dst.min()) < 0
            or max(int(self.link_src.max()), int(self.link_dst.max())) >= self.num_nodes
        ):
            raise ValueError(f"{self.name}: a link names a node outside 0..{self.num_nodes - 1}")
        if n_links and not bool(np.all(self.link_bandwidth_Bps > 0)):
            bad = int(np.flatnonzero(~(self.link_bandwidth_Bps > 0))[0])
            raise ValueError(f"{self.name}: link {self.link_name(bad)} has bandwidth {self.link_bandwidth_Bps[bad]}")
        if n_links and not bool(np.all(self.link_latency_s >= 0)):
            bad = int(np.flatnonzero(~(self.link_latency_s >= 0))[0])
            raise ValueError(f"{self.name}: link {self.link_name(bad)} has latency {self.link_latency_s[bad]}")

    def __repr__(self) -> str:
        failed = f", failed={len(self.failed_links)}" if self.failed_links else ""
        return f"Topology({self.name!r}, gpus={self.num_gpus}, nodes={self.num_nodes}, links={self.num_links}{failed})"

    @property
    def num_gpus(self) -> int:
        return int(self.gpu_node.shape[0])

    @property
    def num_nodes(self) -> int:
        return int(self.node_kind.shape[0])

    @property
    def num_links(self) -> int:
        return int(self.link_src.shape[0])

    # ------------------------------------------------------------------------------------------------
    # Names
    # ------------------------------------------------------------------------------------------------
    def node_name(self, node: int) -> str:
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"{self.name}: node {node} is not in 0..{self.num_nodes - 1}")
        return self.names.name(int(node))

    def gpu_name(self, gpu: int) -> str:
        return self.node_name(int(self.gpu_node[gpu]))

    def link_name(self, link: int) -> str:
        if not 0 <= link < self.num_links:
            raise ValueError(f"{self.name}: link {link} is not in 0..{self.num_links - 1}")
        return f"{self.node_name(int(self.link_src[link]))}->{self.node_name(int(self.link_dst[link]))}"

    def find_node(self, name: str) -> int:
        node = self.names.find(name.strip())
        if node is None or not 0 <= node < self.num_nodes:
            raise ValueError(f"{self.name}: no node named {name!r}; {self.names.suggest(name)}")
        return node

    @cached_property
    def _link_keys(self) -> tuple[IntArray, IntArray]:
        """Links sorted by (src, dst) as one int64 key, for name lookup."""
        keys = self.link_src * self.num_nodes + self.link_dst
        order = np.argsort(keys, kind="stable")
        return keys[order], order

    def find_link(self, name: str) -> int:
        """The index of the link named ``"a->b"``; ValueError naming the link and the links that do exist."""
        parts = name.split("->")
        if len(parts) != 2:
            raise ValueError(f"{self.name}: {name!r} is not a link name; write it as SRC->DST, e.g. leaf0->spine1")
        src = self.find_node(parts[0])
        dst = self.find_node(parts[1])
        keys, order = self._link_keys
        key = src * self.num_nodes + dst
        pos = int(np.searchsorted(keys, key))
        if pos < keys.shape[0] and int(keys[pos]) == key:
            return int(order[pos])
        out = np.flatnonzero(self.link_src == src)
        near = [self.node_name(int(self.link_dst[i])) for i in out[:6]]
        more = ", ..." if out.shape[0] > 6 else ""
        hint = f"{parts[0].strip()} links to {', '.join(near)}{more}" if near else f"{parts[0].strip()} has no links"
        failed = f" (failed: {name.strip()})" if name.strip() in self.failed_links else ""
        raise ValueError(f"{self.name}: no link {name.strip()!r}{failed}; {hint}")

    # ------------------------------------------------------------------------------------------------
    # Faults
    # ------------------------------------------------------------------------------------------------
    def _check_links(self, links: npt.ArrayLike, what: str) -> IntArray:
        arr = np.asarray(links, dtype=np.int64).reshape(-1)
        bad = arr[(arr < 0) | (arr >= self.num_links)]
        if bad.size:
            raise ValueError(f"{self.name}: {what}: link index {int(bad[0])} is not in 0..{self.num_links - 1}")
        return arr

    def scaled(self, links: npt.ArrayLike, factor: float) -> Topology:
        """A copy whose ``links`` run at ``factor`` × their bandwidth (a degraded link: 0 < factor)."""
        if not (factor > 0 and np.isfinite(factor)):
            raise ValueError(f"{self.name}: a degraded link's bandwidth factor must be > 0, got {factor}")
        arr = self._check_links(links, "scaled")
        bandwidth = self.link_bandwidth_Bps.copy()
        bandwidth[arr] *= factor
        return replace(self, link_bandwidth_Bps=bandwidth)

    def without(self, links: npt.ArrayLike) -> Topology:
        """A copy with ``links`` removed (failed). The rest are renumbered in order; ``root_link`` maps back."""
        arr = self._check_links(links, "without")
        keep = np.ones(self.num_links, dtype=np.bool_)
        keep[arr] = False
        kept = np.flatnonzero(keep).astype(np.int64)
        root = self.root if self.root is not None else self
        root_link = self.root_link[kept] if self.root_link is not None else kept
        failed = self.failed_links + tuple(self.link_name(int(i)) for i in np.unique(arr))
        return replace(
            self,
            link_src=self.link_src[kept],
            link_dst=self.link_dst[kept],
            link_bandwidth_Bps=self.link_bandwidth_Bps[kept],
            link_latency_s=self.link_latency_s[kept],
            root=root,
            root_link=root_link,
            failed_links=failed,
        )


@dataclass(frozen=True, eq=False)
class Routes:
    """The links each flow crosses, as CSR (see the module docstring).

    Links of a flow are listed in hop order (for a sprayed flow, hop layer by hop layer).
    ``latency_s[f]`` is the sum of link latencies along the path (for spraying: the longest of its paths).
    """

    flow_ptr: IntArray
    link: IntArray
    weight: FloatArray
    latency_s: FloatArray

    @property
    def num_flows(self) -> int:
        return int(self.flow_ptr.shape[0] - 1)

    def links_of(self, flow: int) -> IntArray:
        return self.link[int(self.flow_ptr[flow]) : int(self.flow_ptr[flow + 1])]

    def weights_of(self, flow: int) -> FloatArray:
        return self.weight[int(self.flow_ptr[flow]) : int(self.flow_ptr[flow + 1])]

    def flow_of_entry(self) -> IntArray:
        """For every entry of ``link``, the flow it belongs to."""
        return np.repeat(np.arange(self.num_flows, dtype=np.int64), np.diff(self.flow_ptr))

    def link_load(self, num_links: int) -> FloatArray:
        """Per link, the number of flows crossing it (fractional under spraying)."""
        return np.bincount(self.link, weights=self.weight, minlength=num_links).astype(np.float64)
