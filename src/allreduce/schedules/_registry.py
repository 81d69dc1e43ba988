"""The registry of collective algorithms: collective → name → generator, the one list every consumer reads.

The runtime, the cost model, ``explain``, the simulator, ``bench``, ``tune``, training and the torch backend look
algorithm names up here and nowhere else. Built-in generators are registered when this package is imported;
users add their own with :func:`register_algorithm`.

A generator is a plain function ``build(world_size, **parameters)`` that returns a :class:`Schedule` or an
authored :class:`Program` (compiled on the way out). It declares which of the standard parameters it takes
(:data:`PARAMETERS`); :func:`make_schedule` passes exactly those, so one call shape serves every algorithm.

Registration verifies: the generator's schedules for :data:`VERIFY_WORLD_SIZES` (and representative parameters)
are replayed by the verifier, and a wrong algorithm is refused with its message, which names the rank, step and
block. Each entry carries its limits (:attr:`Algorithm.max_ranks`, :attr:`Algorithm.quadratic`,
:attr:`Algorithm.needs_group_size`), so no consumer special-cases a name. Plug-ins (entry points,
``ALLREDUCE_ALGORITHMS``) are loaded on the first lookup by the loader :mod:`allreduce.schedules._plugins` hands to
:func:`add_loader`: this module never imports user code, nor the module that does.
"""

from __future__ import annotations

import dataclasses
import inspect
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from allreduce.schedules import _algorithms as built_in
from allreduce.schedules import _personalized as personalized
from allreduce.schedules._author import Program
from allreduce.schedules._schedule import Collective, Schedule
from allreduce.schedules._verify import ScheduleError, verify

__all__ = [
    "MAX_ALGORITHM_NAME_BYTES",
    "MAX_SCHEDULE_RANKS",
    "PARAMETERS",
    "VERIFY_WORLD_SIZES",
    "Algorithm",
    "add_loader",
    "algorithms",
    "all_reduce",
    "declared_parameters",
    "get_algorithm",
    "make_schedule",
    "register_algorithm",
    "unregister_algorithm",
]

PARAMETERS: frozenset[str] = frozenset({"root", "chunks", "group_size"})
"""The parameters a generator may declare besides ``world_size``: the root rank (broadcast, reduce, gather,
scatter), the number of
pipelined chunks (trees), and the ranks per host (hierarchical)."""

MAX_ALGORITHM_NAME_BYTES = 24
"""An algorithm's name travels in every call's descriptor, in this many bytes of UTF-8 at most."""

MAX_SCHEDULE_RANKS = 1 << 17
"""The most ranks :func:`make_schedule` builds a schedule for (131,072, the largest cluster the project models).
The built-in streams grow as O(N log N): halving_doubling, the largest, takes 7.2 GB at 2^20 ranks."""
_SCHEDULE_BYTES_PER_RANK = 7 << 10
"""Peak bytes per rank of building halving_doubling at 2^20 ranks (tracemalloc), for the estimate in the
refusal."""

VERIFY_WORLD_SIZES: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16)
"""World sizes a new algorithm is verified on: every size up to 9 catches off-by-one and odd/even mistakes,
16 a larger power of two; small enough that registering takes milliseconds."""

Generator = Callable[..., Schedule | Program]


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
    automatic: bool = False
    """Whether ``algorithm="auto"`` may choose it. Only for algorithms whose result is bitwise identical on every
    rank (each element reduced once, in one order, then copied), so that replicas of a model never drift apart:
    every built-in but ``naive``, whose ranks each sum the N contributions in an order of their own."""
    max_ranks: int | None = None
    """The most ranks it builds a schedule for (None: up to :data:`MAX_SCHEDULE_RANKS`); :func:`make_schedule`
    refuses more with a message naming the algorithm."""
    quadratic: bool = False
    """Whether every rank exchanges with every other (N(N-1) transfers), so that modelling it costs O(N^2): tools
    that try every algorithm (``--algorithm all``, the planner) leave it out of large groups unless it is named."""

    @property
    def needs_group_size(self) -> bool:
        """Whether it takes ``group_size`` (ranks per host), so a caller must find a size that divides the group."""
        return "group_size" in self.parameters


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


def declared_parameters(build: Callable[..., object]) -> frozenset[str]:
    """The standard parameters (:data:`PARAMETERS`) that ``build``'s signature names."""
    try:
        return frozenset(set(inspect.signature(build).parameters) & PARAMETERS)
    except (TypeError, ValueError):
        return frozenset()


def register_algorithm(
    collective: Collective | str,
    name: str,
    build: Generator,
    *,
    parameters: Iterable[str] | None = None,
    description: str = "",
    origin: str = "python",
    replace: bool = False,
    verify_on: Iterable[int] | None = VERIFY_WORLD_SIZES,
    automatic: bool = False,
    max_ranks: int | None = None,
    quadratic: bool = False,
) -> Algorithm:
    """Add ``build`` as ``name`` for ``collective`` and return its entry.

    ``parameters`` are the standard parameters ``build`` takes (default: those of its signature that are in
    :data:`PARAMETERS`). A name already registered is refused unless ``replace=True``. The algorithm is verified
    on the world sizes ``verify_on`` (None: not at all, for generators with tests of their own) and refused with
    a :class:`ScheduleError` naming the world size, parameters, rank, step and block when it is wrong. A
    generator may decline a world size it does not support by raising ``ValueError``; it must accept one.
    ``automatic=True`` lets ``algorithm="auto"`` choose it (see :attr:`Algorithm.automatic`: only for algorithms
    whose result is identical on every rank); otherwise it runs when named. ``max_ranks`` and ``quadratic``
    are its limits (see :class:`Algorithm`).
    """
    coll = Collective(collective)
    _check_name(name)
    if not callable(build):
        raise TypeError(f"algorithm {name!r}: build must be callable, got {type(build).__name__}")
    if parameters is None:
        params = declared_parameters(build)
    else:
        params = frozenset(parameters)
        unknown = params - PARAMETERS
        if unknown:
            raise ValueError(
                f"algorithm {name!r}: unknown parameter(s) {', '.join(sorted(unknown))}; "
                f"a generator may take {', '.join(sorted(PARAMETERS))}"
            )
    if max_ranks is not None and (isinstance(max_ranks, bool) or not isinstance(max_ranks, int) or max_ranks < 1):
        raise ValueError(f"algorithm {name!r}: max_ranks must be an int >= 1 or None, got {max_ranks!r}")
    table = _REGISTRY[coll]
    if name in table and not replace:
        raise ValueError(
            f"a {coll.value} algorithm named {name!r} is already registered ({table[name].origin}); "
            "pass replace=True to replace it"
        )
    entry = Algorithm(coll, name, build, params, description, origin, automatic, max_ranks, quadratic)
    if verify_on is not None:
        _verify_algorithm(entry, tuple(verify_on))
    table[name] = entry
    return entry


def _trial_parameters(entry: Algorithm, world_size: int) -> list[dict[str, int]]:
    """Representative values of the parameters ``entry`` declares, for a group of ``world_size``."""
    trials: list[dict[str, int]] = [{}]
    if "root" in entry.parameters:
        trials = [{**t, "root": r} for t in trials for r in sorted({0, world_size - 1})]
    if "chunks" in entry.parameters:
        trials = [{**t, "chunks": c} for t in trials for c in (1, 3)]
    if "group_size" in entry.parameters:
        sizes = sorted({g for g in (1, 2, world_size) if world_size % g == 0})
        trials = [{**t, "group_size": g} for t in trials for g in sizes]
    return trials


def _verify_algorithm(entry: Algorithm, world_sizes: tuple[int, ...]) -> None:
    label = f"{entry.collective.value} algorithm {entry.name!r} ({entry.origin})"
    accepted = 0
    declined: list[str] = []
    for n in world_sizes:
        for kwargs in _trial_parameters(entry, n):
            where = f"world_size={n}" + "".join(f", {k}={v}" for k, v in kwargs.items())
            try:
                built = entry.build(n, **kwargs)
            except ScheduleError as exc:
                raise ScheduleError(f"{label} is wrong at {where}: {exc}") from None
            except ValueError as exc:
                declined.append(f"{where}: {exc}")
                continue
            except Exception as exc:
                if entry.origin == "built-in":  # a bug of ours
                    raise
                raise _failed(entry, where, exc) from exc
            try:
                schedule = _as_schedule(entry, built)
                if schedule.world_size != n:
                    raise ScheduleError(f"it built a schedule for {schedule.world_size} ranks")
                if schedule.collective is not entry.collective:
                    raise ScheduleError(f"it built a {schedule.collective.value} schedule")
                verify(schedule)
            except (ScheduleError, TypeError) as exc:
                raise ScheduleError(f"{label} is wrong at {where}: {exc}") from None
            accepted += 1
    if world_sizes and not accepted:
        raise ScheduleError(f"{label} declined every world size it was verified on: {declined[0]}")


def _failed(entry: Algorithm, where: str, exc: Exception) -> ScheduleError:
    """What a user's generator that raised something other than ``ValueError`` (which declines a world size)
    becomes: an error naming the algorithm, the world size and the line that raised, not an internal error."""
    frames = traceback.extract_tb(exc.__traceback__)
    code = getattr(entry.build, "__code__", None)
    own = [f for f in frames if code is not None and f.filename == code.co_filename]  # the user's file's last line
    at = (own or frames)[-1:]
    line = f" at {at[0].filename}:{at[0].lineno}" if at else ""
    return ScheduleError(
        f"{entry.collective.value} algorithm {entry.name!r} ({entry.origin}) failed at {where}: "
        f"{type(exc).__name__}{line}" + (f": {exc}" if str(exc) else "")
    )


def _as_schedule(entry: Algorithm, built: object) -> Schedule:
    """The generator's result as a schedule named after the entry (a :class:`Program` is compiled)."""
    if isinstance(built, Program):
        return built.compile(name=entry.name)
    if not isinstance(built, Schedule):
        raise TypeError(
            f"{entry.collective.value} algorithm {entry.name!r} ({entry.origin}) returned {type(built).__name__}, "
            "not a Schedule or a Program"
        )
    return built if built.name == entry.name else dataclasses.replace(built, name=entry.name)


def unregister_algorithm(collective: Collective | str, name: str) -> None:
    """Remove a registered algorithm (tests and plug-ins that reload)."""
    coll = Collective(collective)
    if _REGISTRY[coll].pop(name, None) is None:
        raise KeyError(f"no {coll.value} algorithm named {name!r} is registered")


def algorithms(collective: Collective | str = Collective.ALL_REDUCE, *, automatic: bool = False) -> tuple[str, ...]:
    """The names registered for ``collective``, built-ins first, then in registration order (plug-ins
    included: the first lookup loads them); with ``automatic=True`` only those ``algorithm="auto"`` may choose."""
    _run_loaders()
    table = _REGISTRY[Collective(collective)]
    return tuple(name for name, entry in table.items() if entry.automatic or not automatic)


def get_algorithm(collective: Collective | str, name: str) -> Algorithm:
    """The registered entry, or ``ValueError`` listing the names there are."""
    coll = Collective(collective)
    if name not in _REGISTRY[coll]:
        _run_loaders()
    try:
        return _REGISTRY[coll][name]
    except (KeyError, TypeError):
        names = ", ".join(_REGISTRY[coll]) or "none"
        what = coll.value.replace("_", "-")
        raise ValueError(f"unknown {what} algorithm {name!r}; choose one of {names}") from None


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
    if entry.max_ranks is not None and world_size > entry.max_ranks:
        raise ValueError(
            f"world_size {world_size}: {entry.collective.value} algorithm {name!r} is built for at most "
            f"{entry.max_ranks:,} ranks"
        )
    if world_size > MAX_SCHEDULE_RANKS:
        need = world_size * _SCHEDULE_BYTES_PER_RANK
        raise ValueError(
            f"world_size {world_size}: more than the cap of {MAX_SCHEDULE_RANKS:,} ranks a schedule is built for "
            f"(the largest built-in schedule would need about {need / 2**30:.4g} GiB of memory)"
        )
    kwargs: dict[str, int] = {}
    if "root" in entry.parameters:
        kwargs["root"] = root
    if "chunks" in entry.parameters:
        kwargs["chunks"] = chunks
    if entry.needs_group_size:
        if group_size is None:
            raise ValueError(f"{entry.collective.value} algorithm {name!r} needs group_size (ranks per host)")
        kwargs["group_size"] = group_size
    try:
        built = entry.build(world_size, **kwargs)
    except ValueError:
        raise
    except Exception as exc:
        if entry.origin == "built-in":  # a bug of ours
            raise
        raise _failed(entry, f"world_size={world_size}", exc) from exc
    schedule = _as_schedule(entry, built)
    return schedule.with_segments(segments) if segments != 1 else schedule


def all_reduce(
    algorithm: str,
    world_size: int,
    *,
    group_size: int | None = None,
    chunks: int = 8,
    segments: int = 1,
) -> Schedule:
    """The all-reduce schedule of the registered algorithm ``algorithm`` (:func:`make_schedule` for all-reduce)."""
    return make_schedule(
        Collective.ALL_REDUCE, algorithm, world_size, chunks=chunks, group_size=group_size, segments=segments
    )


_loaders: list[Callable[[], None]] = []


def add_loader(load: Callable[[], None]) -> None:
    """Run ``load`` once, before the next lookup (:func:`algorithms`, :func:`get_algorithm` of a name not yet
    registered): how plug-ins reach the registry without it importing the code that loads them."""
    _loaders.append(load)


def _run_loaders() -> None:
    while _loaders:
        _loaders.pop(0)()  # taken off first: a loader that looks names up must not run itself again


def _register_builtins() -> None:
    # Built-ins are verified exhaustively by their own tests, so registration skips it (and stays instant).
    for name, build, description in (
        ("ring", built_in.ring_all_reduce, "ring reduce-scatter then ring all-gather: 2(N-1) steps, bandwidth-optimal"),
        ("halving_doubling", built_in.halving_doubling_all_reduce, "Rabenseifner: recursive halving, then doubling"),
        ("recursive_doubling", built_in.recursive_doubling_all_reduce, "log2 N exchanges of the whole buffer"),
        ("double_binary_tree", built_in.double_binary_tree_all_reduce, "NCCL's two complementary pipelined trees"),
        ("direct", built_in.direct_all_reduce, "pairwise reduce-scatter and all-gather, one peer per step"),
        (
            "hierarchical",
            built_in.hierarchical_all_reduce,
            "ring inside each host, an all-reduce across hosts, ring back",
        ),
        ("naive", built_in.naive_all_reduce, "the strawman: every rank sends its whole buffer to every other rank"),
    ):
        register_algorithm(
            Collective.ALL_REDUCE,
            name,
            build,
            description=description,
            origin="built-in",
            verify_on=None,
            automatic=name != "naive",
            max_ranks=built_in.NAIVE_MAX_RANKS if name == "naive" else None,
            quadratic=name in {"direct", "naive"},
        )
    for coll, ring, direct in (
        (Collective.REDUCE_SCATTER, built_in.ring_reduce_scatter, built_in.direct_reduce_scatter),
        (Collective.ALL_GATHER, built_in.ring_all_gather, built_in.direct_all_gather),
    ):
        for name, build, description in (
            ("ring", ring, "N-1 steps around a ring"),
            ("direct", direct, "one peer per step"),
        ):
            register_algorithm(
                coll,
                name,
                build,
                description=description,
                origin="built-in",
                verify_on=None,
                automatic=True,
                quadratic=name == "direct",
            )
    for coll, name, build in (
        (Collective.BROADCAST, "binomial", built_in.binomial_broadcast),
        (Collective.BROADCAST, "binary_tree", built_in.binary_tree_broadcast),
        (Collective.REDUCE, "binomial", built_in.binomial_reduce),
        (Collective.REDUCE, "binary_tree", built_in.binary_tree_reduce),
    ):
        register_algorithm(coll, name, build, origin="built-in", verify_on=None, automatic=True)
    for coll, name, build, description in (
        (Collective.GATHER, "binomial", personalized.binomial_gather, "subtrees handed in: ceil(log2 N) steps"),
        (Collective.GATHER, "direct", personalized.direct_gather, "every rank sends to the root in one step"),
        (Collective.SCATTER, "binomial", personalized.binomial_scatter, "subtrees handed out: ceil(log2 N) steps"),
        (Collective.SCATTER, "direct", personalized.direct_scatter, "the root sends every rank its block"),
    ):
        register_algorithm(coll, name, build, description=description, origin="built-in", verify_on=None,
                           automatic=True, quadratic=False)  # fmt: skip
    register_algorithm(
        Collective.ALL_TO_ALL,
        "pairwise",
        personalized.pairwise_all_to_all,
        description="N-1 steps: at step k send to rank+k, receive from rank-k",
        origin="built-in",
        verify_on=None,
        automatic=True,
        quadratic=True,
    )
    register_algorithm(
        Collective.ALL_TO_ALL,
        "direct",
        personalized.direct_all_to_all,
        description="one step: every rank sends every other rank its block at once",
        origin="built-in",
        verify_on=None,
        quadratic=True,
    )
    # Named only, as direct above: the α–β model ranks both ahead of pairwise (fewer steps, and direct no more
    # bytes), but it sees neither incast nor that the runtime sends each block Bruck forwards as a transfer of its
    # own (it saves steps, not messages); measured on 4 ranks, direct was no faster than pairwise over shm.
    register_algorithm(
        Collective.ALL_TO_ALL,
        "bruck",
        personalized.bruck_all_to_all,
        description="ceil(log2 N) steps, blocks forwarded through ranks 2^k apart: for small messages",
        origin="built-in",
        verify_on=None,
        max_ranks=personalized.BRUCK_MAX_RANKS,
        quadratic=True,
    )


_register_builtins()
