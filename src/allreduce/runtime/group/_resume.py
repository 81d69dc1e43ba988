"""Going on after a death: a loop of all-reduces that one raised in resumes on the survivors, by the rule of
docs/elastic.md (shrink; when the death split the survivors by one call, the ranks behind take that call's result
from the first rank ahead; then every survivor runs the call the ranks ahead failed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from allreduce.runtime.group._group import ProcessGroup

__all__ = ["shrink_and_resume"]


def shrink_and_resume(
    group: ProcessGroup,
    x: Any,
    fill: Callable[[Any, bool], object],
    *,
    kept: Any | None,
    op: str = "sum",
    algorithm: str = "auto",
) -> ProcessGroup:
    """Every survivor calls this in its ``except CollectiveError`` of a loop of all-reduces on ``x``: the group
    shrinks to the survivors (``group.shrink()``; this one is closed). When the death split them by one call
    (``ahead_ranks``), the ranks behind receive that call's result into ``kept`` from ``ahead_ranks[0]`` (a
    broadcast on the new group), where the ranks ahead keep it: the call left it in ``x``, which the loop has since
    filled with the next call's input, so a loop that needs it keeps a copy. ``kept=None``, for a loop that repeats
    one step and never reads the split call's result: ``x`` is broadcast instead (the group takes no other first
    collective after a split), and what the ranks behind receive is whatever the first rank ahead's ``x`` holds.

    Then ``fill(x, took)`` writes the input of the call every survivor runs next: with ``took`` True (this rank
    was behind and has just taken the result of the call it raised in) the call after that one; otherwise the call
    this rank raised in (the ranks ahead raised in the call after the split one; without a split every survivor
    raised in the same call). They all-reduce it (``op``, ``algorithm``). Returns the new group, with that call's
    result in ``x``. Raises :class:`~allreduce.runtime.ShrinkError` as ``shrink()`` does, and a collective's errors
    when another rank fails meanwhile."""
    group = group.shrink()
    took = False
    if group.ahead_ranks:
        group.broadcast(x if kept is None else kept, root=group.ahead_ranks[0])
        took = group.rank not in group.ahead_ranks
    fill(x, took)
    group.all_reduce(x, op=op, algorithm=algorithm)
    return group
