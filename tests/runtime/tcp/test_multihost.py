"""Two "hosts" on one machine: each rank in its own network namespace, joined by a veth pair.

Nothing is on loopback here: rank 0 hosts the store on 10.77.x.1, rank 1 reaches it from another namespace, and
the TCP transport listens beyond loopback, so the shared token is required. Needs root and iproute2 (`ip netns`);
skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytestmark = pytest.mark.slow  # two namespaces and four rank processes per test

RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import allreduce
    from allreduce.runtime import CollectiveError

    try:
        group = allreduce.init(transport=sys.argv[1], timeout_s=float(sys.argv[2]))
    except (CollectiveError, ValueError) as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
        sys.exit(0)
    n = 1_000_003  # a prime count: uneven blocks
    x = np.arange(n, dtype=np.int64) * (group.rank + 1)
    try:
        group.all_reduce(x, algorithm="ring")
        y = np.full(7, group.rank + 1, dtype=np.int32)
        group.all_reduce(y, op="max", algorithm="halving_doubling")
    except CollectiveError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
        sys.exit(0)
    expected = np.arange(n, dtype=np.int64) * sum(r + 1 for r in range(group.world_size))
    print(json.dumps({
        "transport": group.transport_name,
        "exact": bool(np.array_equal(x, expected)),
        "max": y.tolist(),
    }))
    group.close()
    """
)


@dataclass(frozen=True)
class Hosts:
    namespaces: tuple[str, str]
    addresses: tuple[str, str]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = uuid.uuid4().hex[:6]
    a, b = f"ar{tag}a", f"ar{tag}b"
    subnet = 10 + int(tag[:2], 16) % 200  # 10.77.<subnet>.0/24, so parallel runs do not collide
    addresses = (f"10.77.{subnet}.1", f"10.77.{subnet}.2")
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b")
        for ns, dev, addr in ((a, f"v{tag}a", addresses[0]), (b, f"v{tag}b", addresses[1])):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        stderr = getattr(exc, "stderr", b"") or b""
        pytest.skip(f"cannot create network namespaces here: {stderr.decode().strip()}")
    try:
        yield Hosts((a, b), addresses)
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def _run_pair(
    hosts: Hosts,
    *,
    transport: str = "auto",
    tokens: tuple[str | None, str | None] = ("s3cret", "s3cret"),
    timeout_s: float = 30.0,
) -> list[dict[str, object]]:
    port = 20000 + int(uuid.uuid4().hex[:4], 16) % 20000
    procs = []
    for rank, ns in enumerate(hosts.namespaces):
        env = {
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": os.pathsep.join(sys.path),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": hosts.addresses[0],
            "MASTER_PORT": str(port),
        }
        token = tokens[rank]
        if token is not None:
            env["ALLREDUCE_TOKEN"] = token
        procs.append(
            subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-c", RANK_SCRIPT, transport, str(timeout_s)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert lines, f"no result on stdout; stderr:\n{err}"
        results.append(json.loads(lines[-1]))
    return results


def test_all_reduce_between_two_network_namespaces_is_exact(hosts: Hosts) -> None:
    # Different network namespaces are different hosts to the group: auto picks TCP, over the veth pair.
    results = _run_pair(hosts)
    for r in results:
        assert r == {"transport": "tcp", "exact": True, "max": [2] * 7}, r


def test_a_wrong_token_is_refused_across_hosts(hosts: Hosts) -> None:
    results = _run_pair(hosts, tokens=("s3cret", "guess"), timeout_s=5.0)
    # The store refuses rank 1's handshake and says why; rank 0 gives up waiting for rank 1, names it and says why
    # it never joined.
    assert results[1]["error"] == "ProtocolError", results[1]
    assert "wrong token" in str(results[1]["message"]), results[1]
    assert results[0]["error"] == "CollectiveTimeoutError", results[0]
    assert "rank 1 tried to connect and was refused (wrong token; from 10.77." in str(results[0]["message"]), results[0]
    assert "never connected" not in str(results[0]["message"]), results[0]


def test_no_token_beyond_loopback_is_an_error_not_an_open_port(hosts: Hosts) -> None:
    results = _run_pair(hosts, tokens=(None, None), timeout_s=5.0)
    # Rank 0 refuses to listen on 10.77.x.1 without a token; rank 1 then finds no store there, and says where
    # it looked.
    assert results[0].get("error") == "ValueError", results[0]
    assert "token" in str(results[0]["message"]), results[0]
    assert results[1].get("error"), results[1]
    assert hosts.addresses[0] in str(results[1]["message"]), results[1]


def test_forced_tcp_between_namespaces_does_not_use_loopback(hosts: Hosts) -> None:
    # Loopback is per network namespace: a rank that advertised 127.0.0.1 could not be reached.
    results = _run_pair(hosts, transport="tcp")
    for r in results:
        assert r == {"transport": "tcp", "exact": True, "max": [2] * 7}, r
