"""The registry of collective algorithms: collective → name → generator, the one list every consumer reads.

The runtime, the cost model, ``explain``, the simulator, ``bench``, ``tune``, training and the torch backend look
algorithm names up here and nowhere else. Built-in generators are registered when this package is imported;
users add their own with :func:`register_algorithm`.

A generator is a plain function ``build(world_size, **parameters) -> Schedule``. It declares which of the
standard parameters it takes (:data:`PARAMETERS`); :func:`make_schedule` passes exactly those, so one call shape
serves every algorithm.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from allreduce.schedules._algorithms import (
    binary_tree_broadcast,
    binary_tree_reduce,
    binomial_broadcast,
    binomial_reduce,
    direct_all_gather,
    direct_all_reduce,
    direct_reduce_scatter,
    double_binary_tree_all_reduce,
    halving_doubling_all_reduce,
    hierarchical_all_reduce,
    recursive_doubling_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from allreduce.schedules._schedule import Collective, Schedule

__all__ = [
    "MAX_ALGORITHM_NAME_BYTES",
    "PARAMETERS",
    "Algorithm",
    "algorithms",
    "get_algorithm",
    "make_schedule",
    "register_algorithm",
    "unregister_algorithm",
]

PARAMETERS: frozenset[str] = frozenset({"root", "chunks", "group_size"})
"""The parameters a generator may declare besides ``world_size``: the root rank (broadcast, reduce), the number of
pipelined chunks (trees), and the ranks per host (hierarchical)."""

MAX_ALGORITHM_NAME_BYTES = 24
"""An algorithm's name travels in every call's descriptor, in this many bytes of UTF-8 at most."""

Generator = Callable[..., Schedule]


@dataclass(frozen=True)
class Algorithm:
    """One registered algorithm: ``build(world_size, **{p: value for p in parameters})`` gives its schedule."""

    collective: Collective
    name: str
    build: Generator
    parameters: frozenset[str]
    description: str = ""
    origin: str = "built-in"
    """Where it came from: ``built-in``, ``python`` (register_algorithm), a ``module:function`` spec, or
    ``entry point <distribution>``."""


_REGISTRY: dict[Collective, dict[str, Algorithm]] = {c: {} for c in Collective}


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or not name.isidentifier():
        raise ValueError(f"algorithm name {name!r} must be a Python identifier (letters, digits, underscores)")
    if name == "auto":
        raise ValueError("algorithm name 'auto' is reserved (it means: let the cost model choose)")
    if len(name.encode()) > MAX_ALGORITHM_NAME_BYTES:
        raise ValueError(
            f"algorithm name {name!r} is {len(name.encode())} bytes; names travel in every call's descriptor "
            f"and may have at most {MAX_ALGORITHM_NAME_BYTES}"
        )


def register_algorithm(
    collective: Collective | str,
    name: str,
    build: Generator,
    *,
    parameters: Iterable[str] | None = None,
    description: str = "",
    origin: str = "python",
    replace: bool = False,
) -> Algorithm:
    """Add ``build`` as ``name`` for ``collective`` and return its entry.

    ``parameters`` are the standard parameters ``build`` takes (default: those of its signature that are in
    :data:`PARAMETERS`). A name already registered is refused unless ``replace=True``.
    """
    coll = Collective(collective)
    _check_name(name)
    if not callable(build):
        raise TypeError(f"algorithm {name!r}: build must be callable, got {type(build).__name__}")
    if parameters is None:
        try:
            declared = set(inspect.signature(build).parameters)
        except (TypeError, ValueError):
            declared = set()
        params = frozenset(declared & PARAMETERS)
    else:
        params = frozenset(parameters)
        unknown = params - PARAMETERS
        if unknown:
            raise ValueError(
                f"algorithm {name!r}: unknown parameter(s) {', '.join(sorted(unknown))}; "
                f"a generator may take {', '.join(sorted(PARAMETERS))}"
            )
    table = _REGISTRY[coll]
    if name in table and not replace:
        raise ValueError(
            f"a {coll.value} algorithm named {name!r} is already registered ({table[name].origin}); "
            "pass replace=True to replace it"
        )
    entry = Algorithm(coll, name, build, params, description, origin)
    table[name] = entry
    return entry


def unregister_algorithm(collective: Collective | str, name: str) -> None:
    """Remove a registered algorithm (tests and plug-ins that reload)."""
    coll = Collective(collective)
    if _REGISTRY[coll].pop(name, None) is None:
        raise KeyError(f"no {coll.value} algorithm named {name!r} is registered")


def algorithms(collective: Collective | str = Collective.ALL_REDUCE) -> tuple[str, ...]:
    """The names registered for ``collective``, built-ins first, then in registration order."""
    return tuple(_REGISTRY[Collective(collective)])


def get_algorithm(collective: Collective | str, name: str) -> Algorithm:
    """The registered entry, or ``ValueError`` listing the names there are."""
    coll = Collective(collective)
    try:
        return _REGISTRY[coll][name]
    except (KeyError, TypeError):
        names = ", ".join(_REGISTRY[coll]) or "none"
        raise ValueError(f"unknown {coll.value} algorithm {name!r}; choose one of {names}") from None


def make_schedule(
    collective: Collective | str,
    name: str,
    world_size: int,
    *,
    root: int = 0,
    chunks: int = 8,
    group_size: int | None = None,
    segments: int = 1,
) -> Schedule:
    """The schedule of the registered algorithm ``name`` for ``collective`` on ``world_size`` ranks.

    Each generator receives only the parameters it declares; ``segments`` cuts every transfer into that many
    pipelined pieces (any algorithm). Not cached: callers that repeat a call (the process group) keep their own
    cache.
    """
    entry = get_algorithm(collective, name)
    kwargs: dict[str, int] = {}
    if "root" in entry.parameters:
        kwargs["root"] = root
    if "chunks" in entry.parameters:
        kwargs["chunks"] = chunks
    if "group_size" in entry.parameters:
        if group_size is None:
            raise ValueError(f"{entry.collective.value} algorithm {name!r} needs group_size (ranks per host)")
        kwargs["group_size"] = group_size
    schedule = entry.build(world_size, **kwargs)
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"{entry.collective.value} algorithm {name!r} ({entry.origin}) returned {type(schedule).__name__}, "
            "not a Schedule"
        )
    return schedule.with_segments(segments) if segments != 1 else schedule


def _register_builtins() -> None:
    all_reduce = Collective.ALL_REDUCE
    for name, build, description in (
        ("ring", ring_all_reduce, "ring reduce-scatter then ring all-gather: 2(N-1) steps, bandwidth-optimal"),
        ("halving_doubling", halving_doubling_all_reduce, "Rabenseifner: recursive halving, then doubling"),
        ("recursive_doubling", recursive_doubling_all_reduce, "log2 N exchanges of the whole buffer"),
        ("double_binary_tree", double_binary_tree_all_reduce, "NCCL's two complementary pipelined trees"),
        ("direct", direct_all_reduce, "pairwise reduce-scatter and all-gather, one peer per step"),
        ("hierarchical", hierarchical_all_reduce, "ring inside each host, an all-reduce across hosts, ring back"),
    ):
        register_algorithm(all_reduce, name, build, description=description, origin="built-in")
    for coll, ring, direct in (
        (Collective.REDUCE_SCATTER, ring_reduce_scatter, direct_reduce_scatter),
        (Collective.ALL_GATHER, ring_all_gather, direct_all_gather),
    ):
        register_algorithm(coll, "ring", ring, description="N-1 steps around a ring", origin="built-in")
        register_algorithm(coll, "direct", direct, description="one peer per step", origin="built-in")
    register_algorithm(Collective.BROADCAST, "binomial", binomial_broadcast, origin="built-in")
    register_algorithm(Collective.BROADCAST, "binary_tree", binary_tree_broadcast, origin="built-in")
    register_algorithm(Collective.REDUCE, "binomial", binomial_reduce, origin="built-in")
    register_algorithm(Collective.REDUCE, "binary_tree", binary_tree_reduce, origin="built-in")


_register_builtins()
