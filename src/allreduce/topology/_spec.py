"""Topology spec strings: ``KIND:ARG,KEY=VALUE,...`` or the path of a YAML/JSON topology file.

=============  ====================================================================================================
kind           parameters (bandwidths take units such as 400Gbps or 50GB/s, latencies 1us or 500ns)
=============  ====================================================================================================
``fat-tree``   ``k`` (or the first argument), ``bw``, ``lat``
``clos``       ``leaves``, ``spines``, ``hosts_per_leaf`` (``hosts``), ``oversub``, ``cores``, ``pods``,
               ``core_oversub``, ``bw``, ``lat``
``rail``       ``nodes``, ``gpus`` (per node), ``nvlink``, ``nvlink_lat``, ``nic``, ``pcie``, ``nodes_per_unit``,
               ``spines``, ``oversub``, ``mesh`` (flag: NVLink full mesh instead of an NVSwitch), ``lat``
``torus``      dimensions as the first argument (``8x8x8``) or ``dims=``, ``bw``, ``lat``
``dragonfly``  ``groups``, ``routers``, ``hosts``, ``global_links``, ``bw``, ``local_bw``, ``global_bw``, ``lat``
``switch``     GPU count (first argument or ``n``), ``bw``, ``lat``
``ring``       GPU count, ``bw``, ``lat``
``full``       GPU count, ``bw``, ``lat``
=============  ====================================================================================================

Examples: ``fat-tree:k=16,bw=400Gbps,lat=1us``, ``clos:leaves=32,spines=16,hosts_per_leaf=16,oversub=4``,
``rail:nodes=128,gpus=8,nvlink=900GB/s,nic=400Gbps``, ``torus:8x8x8,bw=100GB/s``,
``dragonfly:groups=9,routers=4,hosts=2``, ``switch:64``, ``ring:8``, ``full:8``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from allreduce.topology._builders import clos, dragonfly, fat_tree, fully_connected, rail_optimized, ring, switch, torus
from allreduce.topology._files import load_topology
from allreduce.topology._graph import Topology
from allreduce.units import parse_bandwidth, parse_seconds

__all__ = ["TOPOLOGY_KINDS", "parse_topology"]

_FILE_SUFFIXES = (".yaml", ".yml", ".json")


def _int(kind: str, key: str) -> Callable[[str], int]:
    def read(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"topology {kind}: {key}={text!r} is not an integer") from None

    return read


def _float(kind: str, key: str) -> Callable[[str], float]:
    def read(text: str) -> float:
        # Ratios may be written as 4 or as 4:1.
        num, colon, den = text.partition(":")
        try:
            return float(num) / (float(den) if colon else 1.0)
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"topology {kind}: {key}={text!r} is not a number or a ratio like 4:1") from None

    return read


def _bw(kind: str, key: str) -> Callable[[str], float]:
    return lambda text: parse_bandwidth(text, what=f"topology {kind}: {key}")


def _lat(kind: str, key: str) -> Callable[[str], float]:
    return lambda text: parse_seconds(text, what=f"topology {kind}: {key}")


def _flag(kind: str, key: str) -> Callable[[str], bool]:
    def read(text: str) -> bool:
        value = text.strip().lower()
        if value in ("", "1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"topology {kind}: {key}={text!r} is not a yes/no flag")

    return read


def _dims(kind: str, key: str) -> Callable[[str], tuple[int, ...]]:
    def read(text: str) -> tuple[int, ...]:
        try:
            return tuple(int(part) for part in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"topology {kind}: {key}={text!r} is not dimensions like 8x8x8") from None

    return read


# kind -> (builder, positional parameter, {spec key: (builder keyword, reader factory)})
_Param = tuple[str, Callable[[str, str], Callable[[str], Any]]]
_KINDS: dict[str, tuple[Callable[..., Topology], str | None, dict[str, _Param]]] = {
    "fat-tree": (fat_tree, "k", {"k": ("k", _int), "bw": ("bandwidth_Bps", _bw), "lat": ("latency_s", _lat)}),
    "clos": (
        clos,
        None,
        {
            "leaves": ("leaves", _int),
            "spines": ("spines", _int),
            "hosts_per_leaf": ("hosts_per_leaf", _int),
            "hosts": ("hosts_per_leaf", _int),
            "oversub": ("oversub", _float),
            "cores": ("cores", _int),
            "pods": ("pods", _int),
            "core_oversub": ("core_oversub", _float),
            "bw": ("bandwidth_Bps", _bw),
            "lat": ("latency_s", _lat),
        },
    ),
    "rail": (
        rail_optimized,
        None,
        {
            "nodes": ("nodes", _int),
            "gpus": ("gpus_per_node", _int),
            "gpus_per_node": ("gpus_per_node", _int),
            "nvlink": ("nvlink_bandwidth_Bps", _bw),
            "nvlink_lat": ("nvlink_latency_s", _lat),
            "nic": ("nic_bandwidth_Bps", _bw),
            "pcie": ("pcie_bandwidth_Bps", _bw),
            "nodes_per_unit": ("nodes_per_unit", _int),
            "spines": ("spines", _int),
            "oversub": ("oversub", _float),
            "mesh": ("mesh", _flag),
            "lat": ("latency_s", _lat),
        },
    ),
    "torus": (torus, "dims", {"dims": ("dims", _dims), "bw": ("bandwidth_Bps", _bw), "lat": ("latency_s", _lat)}),
    "dragonfly": (
        dragonfly,
        None,
        {
            "groups": ("groups", _int),
            "routers": ("routers_per_group", _int),
            "hosts": ("hosts_per_router", _int),
            "global_links": ("global_links", _int),
            "bw": ("bandwidth_Bps", _bw),
            "local_bw": ("local_bandwidth_Bps", _bw),
            "global_bw": ("global_bandwidth_Bps", _bw),
            "lat": ("latency_s", _lat),
        },
    ),
    "switch": (switch, "n", {"n": ("num_gpus", _int), "bw": ("bandwidth_Bps", _bw), "lat": ("latency_s", _lat)}),
    "ring": (ring, "n", {"n": ("num_gpus", _int), "bw": ("bandwidth_Bps", _bw), "lat": ("latency_s", _lat)}),
    "full": (
        fully_connected,
        "n",
        {"n": ("num_gpus", _int), "bw": ("bandwidth_Bps", _bw), "lat": ("latency_s", _lat)},
    ),
}
_ALIASES = {
    "fat_tree": "fat-tree",
    "fattree": "fat-tree",
    "leaf-spine": "clos",
    "rail-optimized": "rail",
    "rail_optimized": "rail",
    "fully-connected": "full",
    "fully_connected": "full",
    "mesh": "full",
}
TOPOLOGY_KINDS: tuple[str, ...] = tuple(_KINDS)


def parse_topology(spec: str) -> Topology:
    """The topology a spec string or a ``.yaml``/``.yml``/``.json`` file describes (see the module docstring).

    Errors are ValueError with one line naming the problem (for files: the file and line)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"topology: expected a spec like fat-tree:k=16 or a .yaml/.json file, got {spec!r}")
    text = spec.strip()
    if text.lower().endswith(_FILE_SUFFIXES) or (":" not in text and os.path.isfile(text)):
        return load_topology(text)
    kind_text, _, args_text = text.partition(":")
    kind = _ALIASES.get(kind_text.strip().lower(), kind_text.strip().lower())
    if kind not in _KINDS:
        raise ValueError(
            f"topology: unknown kind {kind_text.strip()!r} in {text!r}; use one of {', '.join(_KINDS)} "
            "or a .yaml/.json file"
        )
    builder, positional, params = _KINDS[kind]
    kwargs: dict[str, Any] = {}
    for position, item in enumerate(part.strip() for part in args_text.split(",")):
        if not item:
            continue
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if not eq:
            if key in params and params[key][1] is _flag:
                value = ""
            elif position == 0 and positional is not None:
                key, value = positional, item
            else:
                raise ValueError(f"topology {kind}: {item!r} is not KEY=VALUE; parameters are {', '.join(params)}")
        if key not in params:
            raise ValueError(f"topology {kind}: unknown parameter {key!r}; parameters are {', '.join(params)}")
        keyword, reader = params[key]
        if keyword in kwargs:
            raise ValueError(f"topology {kind}: {key} is given twice in {text!r}")
        kwargs[keyword] = reader(kind, key)(value.strip())
    try:
        return builder(**kwargs)
    except TypeError as exc:
        # A required parameter is missing: name it in the spec's own words.
        missing = [k for k, (kw, _) in params.items() if f"'{kw}'" in str(exc) and kw not in kwargs]
        hint = f"missing {missing[0]}" if missing else str(exc)
        raise ValueError(f"topology {kind}: {hint} in {text!r}") from None
    except ValueError as exc:
        raise ValueError(f"topology {text!r}: {exc}") from None
