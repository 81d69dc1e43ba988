"""numba (the compiled event core) is imported by the first run that needs it, not with the simulator: its import
and the loading of the cached kernel cost a CLI run about 0.6 CPU-seconds that the fast engine never repays."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from allreduce.sim._jit import available, cache_dir

pytestmark = pytest.mark.slow  # each starts an interpreter that imports numpy and the simulator

SIMULATE = (
    "import sys\n"
    "from allreduce.schedules import all_reduce\n"
    "from allreduce.sim import simulate\n"
    "from allreduce.topology import parse_topology\n"
    "simulate(all_reduce('double_binary_tree', 8), parse_topology('fat-tree:k=4'), size_bytes=2**20, engine={!r})\n"
    "print('numba' in sys.modules)\n"
)


def _fresh_python(code: str) -> str:
    """Run ``code`` in a new interpreter (nothing imported yet, unlike this test process); its output."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_the_simulator_and_planner_leaves_numba_unimported() -> None:
    assert _fresh_python("import sys, allreduce.sim, allreduce.plan; print('numba' in sys.modules)") == "False"


def test_a_fast_engine_run_leaves_numba_unimported() -> None:
    assert _fresh_python(SIMULATE.format("fast")) == "False"


@pytest.mark.skipif(not available(), reason="numba (the fast extra) is not installed")
def test_an_event_engine_run_imports_numba() -> None:
    assert _fresh_python(SIMULATE.format("event")) == "True"


def test_the_kernel_cache_is_named_by_every_compiling_module_so_an_edit_of_a_helper_compiles_afresh(
    tmp_path: Path,
) -> None:
    """numba keys a cached function by its own file only: an edit of an inlined helper in another module must
    change the directory the kernels are cached in."""
    kernel, helper = tmp_path / "_kernel.py", tmp_path / "_kernel_levels.py"
    kernel.write_text("from allreduce.sim._jit import njit\n")
    helper.write_text("LEVEL = 1\n")
    before = cache_dir([kernel, helper])
    assert cache_dir([kernel, helper]) == before  # the same sources, the same place
    helper.write_text("LEVEL = 2\n")
    assert cache_dir([kernel, helper]) != before
    assert before.name.startswith("numba-")


@pytest.mark.skipif(not available(), reason="numba (the fast extra) is not installed")
def test_numba_caches_the_kernels_where_cache_dir_says_unless_the_user_chose() -> None:
    code = (
        "from allreduce.sim._jit import cache_dir, load_numba\nprint(load_numba().config.CACHE_DIR == str(cache_dir()))"
    )
    assert _fresh_python(code) == "True"


@pytest.mark.skipif(not available(), reason="numba (the fast extra) is not installed")
def test_a_prefetch_asks_for_the_line_and_changes_no_value() -> None:
    """The event core's look-ahead (sim/_kernel.py) prefetches entries of strided record fields: the compiled
    code must hold the prefetch instruction, and a loop that prefetches ahead must read the same values."""
    import numpy as np

    from allreduce.sim._jit import njit, prefetcher

    prefetch = prefetcher()

    def gather(values: Any, index: Any) -> float:
        total = 0.0
        for j in range(index.size):
            if j + 4 < index.size:
                prefetch(values, index[j + 4])
            total += values[index[j]]
        return total

    compiled = njit(gather)
    record = np.zeros(1 << 12, dtype=np.dtype([("at", np.float64), ("pad", np.int64, 7)]))
    record["at"] = np.random.default_rng(0).random(record.size)
    index = np.random.default_rng(1).integers(0, record.size, 5000)
    assert compiled(record["at"], index) == sum(float(v) for v in record["at"][index])  # the same sum, in order
    assert "llvm.prefetch" in next(iter(compiled.inspect_llvm().values()))
