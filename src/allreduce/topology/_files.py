"""Topology files: a YAML or JSON list of nodes and links.

Format (JSON is the same structure)::

    name: two-racks            # optional; default: the file name
    gpu_transit: false         # optional; may routes pass *through* a GPU? (true for switchless designs)
    defaults:                  # optional; for links that do not say
      bandwidth: 400Gbps       # per direction; bits (Gbps, Gb/s) or bytes (GB/s, GBps); the unit is required
      latency: 1us             # per link (s, ms, us, ns); the unit is required; without a default, 0
    nodes:                     # GPUs are numbered 0, 1, ... in the order they appear
      - {name: gpu0, kind: gpu}     # kind: gpu, nic or switch
      - {name: tor0, kind: switch}
    links:
      - {src: gpu0, dst: tor0}                                  # a cable: a link each way, the defaults
      - {src: tor0, dst: spine0, bandwidth: 800Gbps, reverse_bandwidth: 400Gbps}    # asymmetric cable
      - {src: spine0, dst: tor1, latency: 2us, reverse_latency: 1us}
      - {src: tor1, dst: gpu1, directed: true}                  # one direction only

The full description, with an example, is ``docs/topology-files.md``.

Checked when loaded, each error naming the file and line: unknown keys, unknown or repeated node names, a
link to an unknown node, a link from a node to itself, a link given twice (a cable counts for both
directions), an unreadable bandwidth or latency or one without its unit, and every ordered pair of GPUs must
have a path.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import numpy as np
import yaml

from allreduce.topology._graph import NodeKind, NodeNames, Topology
from allreduce.units import parse_bandwidth, parse_seconds

__all__ = ["load_topology"]

_KIND_NAMES = {"gpu": NodeKind.GPU, "nic": NodeKind.NIC, "switch": NodeKind.SWITCH}
_TOP_KEYS = ("name", "gpu_transit", "defaults", "nodes", "links")
_NODE_KEYS = ("name", "kind")
_LINK_KEYS = ("src", "dst", "bandwidth", "latency", "reverse_bandwidth", "reverse_latency", "directed")


class _Lined(dict[Any, Any]):
    """A mapping that remembers the (1-based) line it started on, and the line of each key."""

    line: int = 0
    key_lines: dict[Any, int]


class _LineLoader(yaml.SafeLoader):
    """SafeLoader whose mappings are :class:`_Lined` (never constructs arbitrary objects)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> _Lined:
    loader.flatten_mapping(node)
    mapping = _Lined()
    mapping.line = node.start_mark.line + 1
    mapping.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in mapping:
            raise _FileError(line, f"key {key!r} given twice (first at line {mapping.key_lines[key]})")
        mapping[key] = loader.construct_object(value_node, deep=True)
        mapping.key_lines[key] = line
    return mapping


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


class _FileError(ValueError):
    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.message = message


def _read(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read topology file: {exc.strerror or exc}") from None
    if path.lower().endswith(".json"):
        try:
            json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    try:
        # JSON is YAML too: loading it with the YAML loader gives the line of every mapping.
        return yaml.load(text, Loader=_LineLoader)
    except _FileError as exc:
        raise ValueError(f"{path}:{exc.line}: {exc.message}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"{path}{where}: not valid YAML: {problem}") from None


def _line(value: Any, default: int) -> int:
    return value.line if isinstance(value, _Lined) else default


def _check_keys(mapping: _Lined, allowed: Iterable[str], what: str, fail: Callable[[int, str], NoReturn]) -> None:
    allowed = tuple(allowed)
    for key in mapping:
        if key not in allowed:
            fail(mapping.key_lines.get(key, mapping.line), f"{what}: unknown key {key!r}; use {', '.join(allowed)}")


def _bandwidth(value: Any, what: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{what}: {value!r} is not a bandwidth")
    if isinstance(value, int | float):
        raise ValueError(f"{what}: {value!r} has no unit; write e.g. 400Gbps (bits) or 50GB/s (bytes)")
    return parse_bandwidth(str(value), what=what)


def _latency(value: Any, what: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{what}: {value!r} is not a latency")
    if isinstance(value, int | float):
        raise ValueError(f"{what}: {value!r} has no unit; write e.g. 1us, 500ns or 2ms")
    seconds = parse_seconds(str(value), what=what)
    if seconds < 0:
        raise ValueError(f"{what}: {value!r} is negative")
    return seconds


def load_topology(path: str | os.PathLike[str]) -> Topology:
    """Load and check a topology file (format in the module docstring); ValueError naming file, line and names."""
    path = os.fspath(path)
    data = _read(path)

    def fail(line: int, message: str) -> NoReturn:
        raise ValueError(f"{path}:{line}: {message}" if line else f"{path}: {message}")

    if not isinstance(data, _Lined):
        fail(1, "a topology file is a mapping with 'nodes' and 'links'")
    _check_keys(data, _TOP_KEYS, "topology", fail)
    for key in ("nodes", "links"):
        if not isinstance(data.get(key), list) or not data[key]:
            fail(data.key_lines.get(key, data.line), f"{key!r} must be a non-empty list")
    name = data.get("name", os.path.splitext(os.path.basename(path))[0])
    gpu_transit = data.get("gpu_transit", False)
    if not isinstance(gpu_transit, bool):
        fail(data.key_lines.get("gpu_transit", data.line), f"gpu_transit must be true or false, got {gpu_transit!r}")

    defaults = data.get("defaults", _Lined())
    if not isinstance(defaults, _Lined):
        fail(data.key_lines.get("defaults", data.line), "defaults must be a mapping of bandwidth and latency")
    _check_keys(defaults, ("bandwidth", "latency"), "defaults", fail)
    default_bw: float | None = None
    default_lat = 0.0
    try:
        if "bandwidth" in defaults:
            default_bw = _bandwidth(defaults["bandwidth"], "defaults: bandwidth")
        if "latency" in defaults:
            default_lat = _latency(defaults["latency"], "defaults: latency")
    except ValueError as exc:
        fail(defaults.line, str(exc))

    # Nodes.
    names: list[str] = []
    kinds: list[int] = []
    node_index: dict[str, int] = {}
    node_line: list[int] = []
    for item in data["nodes"]:
        line = _line(item, data.key_lines["nodes"])
        if not isinstance(item, _Lined):
            fail(line, f"a node is a mapping like {{name: gpu0, kind: gpu}}, got {item!r}")
        _check_keys(item, _NODE_KEYS, "node", fail)
        node_name = item.get("name")
        if not isinstance(node_name, str) or not node_name.strip() or "->" in node_name:
            fail(line, f"node name must be a non-empty string without '->', got {node_name!r}")
        kind_text = str(item.get("kind", "")).lower()
        if kind_text not in _KIND_NAMES:
            fail(line, f"node {node_name}: kind must be one of {', '.join(_KIND_NAMES)}, got {item.get('kind')!r}")
        if node_name in node_index:
            fail(line, f"node {node_name} defined twice (first at line {node_line[node_index[node_name]]})")
        node_index[node_name] = len(names)
        names.append(node_name)
        kinds.append(int(_KIND_NAMES[kind_text]))
        node_line.append(line)
    if int(NodeKind.GPU) not in kinds:
        fail(data.key_lines["nodes"], "no node of kind gpu")

    # Links.
    src: list[int] = []
    dst: list[int] = []
    bandwidth: list[float] = []
    latency: list[float] = []
    seen: dict[tuple[int, int], int] = {}
    for item in data["links"]:
        line = _line(item, data.key_lines["links"])
        if not isinstance(item, _Lined):
            fail(line, f"a link is a mapping like {{src: gpu0, dst: sw0}}, got {item!r}")
        _check_keys(item, _LINK_KEYS, "link", fail)
        ends = []
        for end in ("src", "dst"):
            if end not in item:
                fail(line, f"link without {end}")
            end_name = str(item[end])
            if end_name not in node_index:
                close = difflib.get_close_matches(end_name, names, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                fail(line, f"link {item.get('src')}->{item.get('dst')}: unknown node {end_name!r}{hint}")
            ends.append(node_index[end_name])
        a, b = ends
        label = f"{names[a]}->{names[b]}"
        if a == b:
            fail(line, f"link {label} connects a node to itself")
        directed = item.get("directed", False)
        if not isinstance(directed, bool):
            fail(line, f"link {label}: directed must be true or false, got {directed!r}")
        try:
            bw = _bandwidth(item["bandwidth"], "bandwidth") if "bandwidth" in item else default_bw
            if bw is None:
                raise ValueError("no bandwidth (give one, or a defaults: bandwidth)")
            lat = _latency(item["latency"], "latency") if "latency" in item else default_lat
            reverse_bw = (
                _bandwidth(item["reverse_bandwidth"], "reverse_bandwidth") if "reverse_bandwidth" in item else bw
            )
            reverse_lat = _latency(item["reverse_latency"], "reverse_latency") if "reverse_latency" in item else lat
        except ValueError as exc:
            fail(line, f"link {label}: {exc}")
        if directed and ("reverse_bandwidth" in item or "reverse_latency" in item):
            fail(line, f"link {label}: a directed link has no reverse_bandwidth or reverse_latency")
        pairs = [(a, b, bw, lat)] if directed else [(a, b, bw, lat), (b, a, reverse_bw, reverse_lat)]
        for s, d, w, t in pairs:
            if (s, d) in seen:
                fail(line, f"duplicate link {names[s]}->{names[d]} (already defined at line {seen[(s, d)]})")
            seen[(s, d)] = line
            src.append(s)
            dst.append(d)
            bandwidth.append(w)
            latency.append(t)

    node_kind = np.asarray(kinds, dtype=np.int8)
    topology = Topology(
        name=str(name),
        node_kind=node_kind,
        link_src=np.asarray(src, dtype=np.int64),
        link_dst=np.asarray(dst, dtype=np.int64),
        link_bandwidth_Bps=np.asarray(bandwidth, dtype=np.float64),
        link_latency_s=np.asarray(latency, dtype=np.float64),
        gpu_node=np.flatnonzero(node_kind == int(NodeKind.GPU)).astype(np.int64),
        names=NodeNames(explicit=tuple(names)),
        gpu_transit=gpu_transit,
    )
    _check_connected(topology, path, node_line)
    return topology


def _check_connected(topology: Topology, path: str, node_line: list[int]) -> None:
    """Every ordered GPU pair must have a path (through transit nodes only)."""
    from allreduce.topology._search_routing import reachability_gaps

    gap = reachability_gaps(topology)
    if gap is None:
        return
    src_gpu, dst_gpu, count = gap
    a, b = int(topology.gpu_node[src_gpu]), int(topology.gpu_node[dst_gpu])
    others = count - 1
    more = f"; {others} more GPU {'pair has' if others == 1 else 'pairs have'} no path either" if others else ""
    hint = "" if topology.gpu_transit else " (routes never pass through a GPU unless gpu_transit: true)"
    raise ValueError(
        f"{path}:{node_line[b]}: no path from {topology.node_name(a)} (line {node_line[a]}) to "
        f"{topology.node_name(b)} (line {node_line[b]}){more}{hint}"
    )
