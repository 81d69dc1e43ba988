"""The torch backend without a token: refused beyond loopback before anything listens (docs/security.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

# One rank of two, on an in-memory torch store: nothing is sent anywhere (192.0.2.1 is a documentation address,
# and the refusal comes before any socket is bound or connected).
_SCRIPT = """
import torch.distributed as dist
import allreduce.torch
try:
    dist.init_process_group("allreduce", store=dist.HashStore(), rank=0, world_size=2)
except Exception as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.slow
def test_the_backend_refuses_to_listen_beyond_loopback_without_a_token() -> None:
    env = {k: v for k, v in os.environ.items() if k != "ALLREDUCE_TOKEN"}
    env["MASTER_ADDR"] = "192.0.2.1"
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120, check=False
    ).stdout
    assert "beyond loopback: set a shared token" in out
    assert "ALLREDUCE_TOKEN" in out
