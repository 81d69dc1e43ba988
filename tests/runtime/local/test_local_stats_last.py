"""group.stats(last=K) sizes its summary for the calls a recorder keeps, however large K is."""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np

from allreduce.runtime import GroupStats, ProcessGroup


def _stats(group: ProcessGroup, last: int) -> GroupStats:
    group.recording = True
    x = np.zeros(1024, np.float32)
    for _ in range(3):
        group.all_reduce(x, algorithm="ring")
    return group.stats(last=last)


def test_a_last_beyond_what_is_kept_allocates_only_what_is_kept(ranks: Any, on_ranks: Any) -> None:
    groups = ranks(2)
    tracemalloc.start()
    try:
        # 10**7 rows of durations and waits: 0.5 GB per rank before the clamp (10**9 asked for 29.8 GiB)
        results = on_ranks(groups, lambda g: _stats(g, 10**7))
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 100e6
    assert results[0].calls == 3
    assert results[0] == results[1]
