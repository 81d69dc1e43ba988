"""Argument types shared by the subcommands."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from allreduce.cli._main import CLIError
from allreduce.schedules import ENVIRONMENT_VARIABLE, Collective, algorithms, get_algorithm, load_algorithm
from allreduce.units import parse_bytes

if TYPE_CHECKING:
    from allreduce.topology import Topology

__all__ = [
    "AlgorithmSelection",
    "add_algorithm_argument",
    "algorithm_for_ranks",
    "algorithm_selection",
    "non_negative_int",
    "positive_bytes",
    "positive_int",
    "world_size_on",
]


def _int_at_least(name: str, minimum: int) -> Callable[[str], int]:
    """An argparse type for a whole number >= ``minimum``; errors name the option (``name``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {value}")
        return value

    return parse


def positive_int(name: str) -> Callable[[str], int]:
    """A whole number >= 1."""
    return _int_at_least(name, 1)


def non_negative_int(name: str) -> Callable[[str], int]:
    """A whole number >= 0."""
    return _int_at_least(name, 0)


def positive_bytes(text: str, *, flag: str) -> int:
    """A size given to ``flag`` (64MiB, 1GiB), which must be more than 0 bytes."""
    size = parse_bytes(text, what=flag)
    if size <= 0:
        raise CLIError(f"{flag} must be greater than 0 bytes, got {text!r}")
    return size


def world_size_on(topology: Topology, ranks: int | None) -> int:
    """The ranks ``--ranks`` asked for on ``topology`` (all its GPUs when not given): at most one per GPU."""
    world_size = ranks if ranks is not None else topology.num_gpus
    if world_size > topology.num_gpus:
        raise CLIError(f"--ranks {world_size}: {topology.name} has only {topology.num_gpus} GPUs")
    return world_size


@dataclass(frozen=True)
class AlgorithmSelection:
    """What ``--algorithm`` named: registered algorithm names (of all-reduce unless re-read with
    :meth:`for_collective`), and whether the user listed them."""

    names: tuple[str, ...]
    explicit: bool
    """False for ``all``: then consumers may leave out an algorithm that does not fit the run, with a note."""
    error: str | None = None
    """Why the value could not be resolved. Kept rather than raised so that the subcommand reports it as its
    one-line error (argparse would print its usage first); :meth:`checked` raises it."""
    text: str = "all"
    flag: str = "--algorithm"

    def checked(self) -> AlgorithmSelection:
        """This selection, or :class:`CLIError` with the reason it could not be resolved."""
        if self.error is not None:
            raise CLIError(self.error)
        return self

    def for_collective(self, collective: Collective) -> AlgorithmSelection:
        """The same words read as names of ``collective``'s algorithms (``--collective``)."""
        return self if collective is Collective.ALL_REDUCE else select_algorithms(self.text, self.flag, collective)


def select_algorithms(text: str, flag: str, collective: Collective = Collective.ALL_REDUCE) -> AlgorithmSelection:
    """``text`` of ``flag`` as a selection of ``collective``'s algorithms: comma-separated registered names,
    ``all``, and ``module:function`` or ``file.py:function`` specs, which are loaded (imported, verified,
    registered) and stand for their name."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        return AlgorithmSelection((), explicit=True, error=f"{flag} is empty; name an algorithm or all")
    names: list[str] = []
    for item in items:
        try:
            if ":" in item:
                names.append(load_algorithm(item).name)
            elif item != "all":
                names.append(get_algorithm(collective, item).name)
        except ValueError as exc:
            return AlgorithmSelection((), explicit=True, error=f"{flag}: {exc}", text=text, flag=flag)
    if "all" in items:
        return AlgorithmSelection(algorithms(collective), explicit=False, text=text, flag=flag)
    return AlgorithmSelection(tuple(dict.fromkeys(names)), explicit=True, text=text, flag=flag)


def algorithm_selection(flag: str) -> Callable[[str], AlgorithmSelection]:
    """An argparse type for ``--algorithm`` (see :func:`select_algorithms`), read as all-reduce algorithms."""

    def parse(text: str) -> AlgorithmSelection:
        return select_algorithms(text, flag)

    return parse


def algorithm_for_ranks(flag: str, text: str) -> str:
    """The algorithm name that ranks started by this command should use for ``flag text``.

    ``auto`` and registered names stand for themselves. A ``module:function`` or ``file.py:function`` spec is
    loaded (imported, verified, registered) here, so a wrong one is refused before any rank starts, and added to
    the environment variable the ranks inherit (``allreduce.schedules.ENVIRONMENT_VARIABLE``), so that each of
    them registers it too (a file path is made absolute first: ranks may run elsewhere)."""
    if text == "auto":
        return text
    try:
        if ":" not in text:
            return get_algorithm(Collective.ALL_REDUCE, text).name
        module_text, _, function = text.rpartition(":")
        if module_text.endswith(".py") or os.sep in module_text:
            text = f"{os.path.abspath(module_text)}:{function}"
        name = load_algorithm(text).name
    except ValueError as exc:
        raise CLIError(f"{flag}: {exc}") from None
    specs = [s for s in os.environ.get(ENVIRONMENT_VARIABLE, "").split(",") if s]
    if text not in specs:
        os.environ[ENVIRONMENT_VARIABLE] = ",".join([*specs, text])
    return name


def add_algorithm_argument(parser: argparse.ArgumentParser, *, default: str = "all") -> None:
    """``--algorithm/-a`` as explain, sim and tail take it (an :class:`AlgorithmSelection`)."""
    parser.add_argument(
        "--algorithm",
        "-a",
        default=default,
        type=algorithm_selection("--algorithm"),
        help="registered names, module:function or file.py:function specs of your own (loaded, verified and "
        f"registered), comma-separated, or all (default: {default})",
    )


def add_collective_argument(parser: argparse.ArgumentParser) -> None:
    """``--collective`` as explain and sim take it: which collective's algorithms ``--algorithm`` names."""
    parser.add_argument(
        "--collective",
        "-c",
        default=Collective.ALL_REDUCE.value,
        choices=[c.value for c in Collective],
        help="the collective whose algorithms to model (default: all_reduce)",
    )


def add_mitigate_argument(parser: argparse.ArgumentParser, *, what: str) -> None:
    """``--mitigate`` of ``sim`` and ``tail``: ``what`` (the time, the tail) of the ring re-planned around slow links
    beside the ring as placed (sim/_mitigate.py)."""
    parser.add_argument(
        "--mitigate",
        action="store_true",
        help=f"also {what} of the ring re-planned around slow links, ordered from the rates its links would show "
        "as the runtime's ALLREDUCE_REPLAN orders it, beside the ring as placed; a slow rank is said to be beyond it",
    )
