"""Rank 0's stderr under a crowd of refused connections: a few described, then a count, not a line each."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from allreduce.runtime.tcp._listener import REFUSALS_SHOWN

SRC = Path(__file__).resolve().parents[3] / "src"
STRANGERS = 500

HOST = """
import sys
from allreduce.runtime.store._store import TCPStore
with TCPStore("127.0.0.1", 0, is_server=True, world_size=2, rank=0, timeout_s=120, token="job-secret") as store:
    print(store.port, flush=True)
    sys.stdin.read()  # until the test has sent its strangers
"""


@pytest.mark.slow
def test_hundreds_of_refused_connections_print_a_few_lines_and_a_count() -> None:
    host = subprocess.Popen(
        [sys.executable, "-c", HOST],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        for _ in range(STRANGERS):  # each one knocks and leaves during the handshake, as a port scan does
            socket.create_connection(("127.0.0.1", port), timeout=60).close()
        _, err = host.communicate("", timeout=120)
    finally:
        host.kill()
    lines = err.splitlines()
    described = [line for line in lines if "store refused a client from" in line]
    assert len(described) == REFUSALS_SHOWN, err
    assert len(lines) <= REFUSALS_SHOWN + 5, err  # the note that counting starts, 10 and 100 so far, the total
    total = re.search(r"refused (\d+) clients in all", err)
    assert total is not None, err
    # the store counts those it accepted before it stopped (a few may still be in the kernel's backlog then)
    assert STRANGERS // 2 <= int(total[1]) <= STRANGERS, err
