"""The process group over the TCP transport: every collective × algorithm × dtype × op, real processes.

Reuses the shared-memory matrix (tests/runtime/test_collectives_shm.py) with ``transport="tcp"``, so both
transports are held to the same exact references.
"""

from __future__ import annotations

import pytest
from test_collectives_shm import _matrix_worker
from test_group_harness import run_ranks


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_every_collective_algorithm_dtype_and_op_is_exact_over_tcp(world_size: int) -> None:
    results = run_ranks(world_size, _matrix_worker, "tcp")
    for rank, result in enumerate(results):
        assert isinstance(result, dict), result
        assert result["transport"] == "tcp"
        assert result["failures"] == [], f"rank {rank}: {result['failures'][:10]}"
        assert result["ran"] > 500
