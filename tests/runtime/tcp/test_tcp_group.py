"""The process group over the TCP transport: every collective × algorithm × dtype × op, real processes.

One set of processes per world size (a module-scoped fixture) runs the matrix of collective_matrix; one test per
collective and algorithm reads what each rank got wrong.
"""

from __future__ import annotations

from typing import Any

import pytest
from collective_matrix import WORLD_SIZES, assert_exact, assert_ran, case_id, cases, run_matrix

import allreduce
from allreduce.runtime.launcher._spawn import spawn


def _matrix_rank(group: allreduce.ProcessGroup) -> dict[str, Any]:
    return run_matrix(group)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"world{n}")
def tcp_matrix(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return spawn(request.param, _matrix_rank, init_options={"transport": "tcp", "timeout_s": 120}, timeout_s=240)


@pytest.mark.slow
def test_the_matrix_ran_over_tcp(tcp_matrix: list[dict[str, Any]]) -> None:
    assert_ran(tcp_matrix, "tcp")


@pytest.mark.slow
@pytest.mark.parametrize("case", cases(), ids=case_id)
def test_every_dtype_and_op_is_exact_over_tcp(tcp_matrix: list[dict[str, Any]], case: tuple[str, str]) -> None:
    assert_exact(tcp_matrix, case)
