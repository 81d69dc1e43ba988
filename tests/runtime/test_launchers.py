"""Scripts run unchanged under torchrun (whose own store holds MASTER_PORT) and under `allreduce run`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import sys

    import numpy as np
    import allreduce

    for call in range(2):  # two groups in a row: their rendezvous must not collide
        with allreduce.init() as group:
            x = np.arange(6, dtype=np.int64) * (group.rank + 1) + call
            group.all_reduce(x)
            # one write per line: both ranks share the launcher's pipe (writes under PIPE_BUF are atomic)
            sys.stdout.write(f"result {call} rank {group.rank} of {group.world_size}: {x.tolist()}\\n")
            sys.stdout.flush()
    """
)


def _expected(call: int, world_size: int) -> list[int]:
    return [i * sum(range(1, world_size + 1)) + call * world_size for i in range(6)]


def _check(stdout: str, world_size: int) -> None:
    for call in range(2):
        lines = [line for line in stdout.splitlines() if f"result {call} rank" in line]
        assert len(lines) == world_size, stdout
        for line in lines:
            assert line.endswith(str(_expected(call, world_size))), line


def test_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    _check(out.stdout, 2)


def test_allreduce_run(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "allreduce", "run", "-n", "3", "--", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    _check(out.stdout, 3)
