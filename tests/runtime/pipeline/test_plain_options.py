"""An all-reduce given options at their defaults (``segments=1``, ``timeout_s=None``, ...) takes the plain path as a
bare ``all_reduce(x)`` does (a benchmark passing ``segments=1`` measured 2.5-3x slower calls when it did not)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from pipeline_paths import general_path_entries

import allreduce
from allreduce.runtime.group._group import _defaults_only


@pytest.fixture
def group() -> Iterator[allreduce.ProcessGroup]:
    with allreduce.init(0, 1, transport="shm") as g:
        yield g


def _general_path_calls(group: allreduce.ProcessGroup, **options: Any) -> int:
    """How many times ``all_reduce(x, **options)`` entered the general path (``Pipeline.collective``)."""
    x = np.ones(1024, np.float32)
    group.all_reduce(x)  # the plain path's preparation happens once, outside the count
    return general_path_entries(lambda: group.all_reduce(x, **options))


def test_options_at_their_defaults_take_the_plain_path(group: allreduce.ProcessGroup) -> None:
    options = {"segments": 1, "timeout_s": None, "checksum": False, "deterministic": False, "tag": None}
    assert _general_path_calls(group, **options) == 0


def test_an_option_that_is_not_its_default_takes_the_general_path(group: allreduce.ProcessGroup) -> None:
    assert _general_path_calls(group, checksum=True) == 1


@pytest.mark.parametrize(
    ("options", "plain"),
    [
        ({}, True),
        ({"segments": 1, "tag": None}, True),
        ({"segments": 2}, False),
        ({"segments": True}, False),  # a bool is not the int 1: the general path checks it
        ({"timeout_s": 5.0}, False),
        ({"deterministic": 0}, False),
    ],
)
def test_which_options_count_as_defaults(options: dict[str, object], plain: bool) -> None:
    assert _defaults_only(options) is plain
