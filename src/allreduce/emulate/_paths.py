"""The path every real connection took through an emulated cluster, asked of the kernel hop by hop.

Where a topology has several equal-cost paths (two spines), each router's kernel hashes a connection's addresses
and ports (``fib_multipath_hash_policy=1``) onto one next hop. The hash and its per-namespace key are the
kernel's, so no simulator can reproduce it; but ``ip route get DST from SRC iif DEV ipproto tcp sport P dport Q``
asks the very lookup a packet of that connection would get, ECMP choice included. Walking it from the sending
host to the receiving one, through the namespace on the far end of each chosen device, gives the exact links a
connection's data crossed, and a :class:`~allreduce.topology.PathTable` of them lets the simulator predict the
split the kernel made rather than one of its own hashes.

A connection carries data both ways, and each direction is hashed on its own (the reverse direction's tuple is
the mirror image), so every connection is walked both ways. Each rank reports its own connections; one report of
a connection is enough (a read of ``/proc/net/tcp`` can miss a line while the table changes).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

from allreduce.emulate._layout import Layout
from allreduce.emulate._netns import COMMAND_TIMEOUT_S, EmulationError
from allreduce.topology import PathTable

__all__ = ["Connection", "kernel_paths"]


@dataclass(frozen=True)
class Connection:
    """One established TCP connection as seen from the GPU host ``gpu`` that reported it."""

    gpu: int
    local_address: str
    local_port: int
    remote_address: str
    remote_port: int


def _devices(layout: Layout) -> dict[tuple[int, str], tuple[int, int, str]]:
    """(node, device) -> (directed link leaving through it, node at the far end, device there)."""
    out: dict[tuple[int, str], tuple[int, int, str]] = {}
    for cable in layout.cables:
        out[(cable.a, cable.a_dev)] = (cable.link_ab, cable.b, cable.b_dev)
        out[(cable.b, cable.b_dev)] = (cable.link_ba, cable.a, cable.a_dev)
    return out


def _next_device(namespace: str, connection: Connection, incoming: str | None) -> str:
    command = ["ip", "-n", namespace, "-j", "route", "get", connection.remote_address,
               "from", connection.local_address]  # fmt: skip
    if incoming is not None:
        command += ["iif", incoming]
    command += ["ipproto", "tcp", "sport", str(connection.local_port), "dport", str(connection.remote_port)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise EmulationError(f"{' '.join(command)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    answer = json.loads(done.stdout)
    if not answer or "dev" not in answer[0]:
        raise EmulationError(f"{' '.join(command)}: no device in the kernel's answer {done.stdout.strip()!r}")
    return str(answer[0]["dev"])


def _walk(layout: Layout, devices: dict[tuple[int, str], tuple[int, int, str]], connection: Connection,
          destination_gpu: int) -> tuple[int, ...]:  # fmt: skip
    topology = layout.topology
    node, target = int(topology.gpu_node[connection.gpu]), int(topology.gpu_node[destination_gpu])
    incoming: str | None = None
    links: list[int] = []
    while node != target:
        if len(links) > topology.num_nodes:
            raise EmulationError(f"{connection}: the kernel's next hops loop ({links})")
        device = _next_device(layout.namespaces[node], connection, incoming)
        hop = devices.get((node, device))
        if hop is None:
            raise EmulationError(
                f"{connection}: {layout.namespaces[node]} forwards through {device}, which is not a cable of the "
                "emulation"
            )
        link, node, incoming = hop
        links.append(link)
    return tuple(links)


def kernel_paths(layout: Layout, connections: Iterable[Connection], *, ignore_ports: frozenset[int]) -> PathTable:
    """The links each (GPU, GPU) pair's data crossed, from the kernel's own route lookups.

    Connections to or from a port in ``ignore_ports`` (the rendezvous store) and to addresses that are not
    emulated hosts are skipped. A pair whose connections took different paths (several connections between two
    hosts, hashed apart) is an :class:`EmulationError`: one path per pair is what the table can say.
    """
    gpu_of = {address: g for g, address in enumerate(layout.host_address)}
    devices = _devices(layout)
    directions: set[Connection] = set()
    for c in connections:
        remote = gpu_of.get(c.remote_address)
        if remote is None or gpu_of.get(c.local_address) != c.gpu or {c.local_port, c.remote_port} & ignore_ports:
            continue
        directions.add(c)
        directions.add(Connection(remote, c.remote_address, c.remote_port, c.local_address, c.local_port))
    paths: dict[tuple[int, int], tuple[int, ...]] = {}
    for direction in sorted(directions, key=lambda d: (d.gpu, d.local_port, d.remote_address, d.remote_port)):
        destination = gpu_of[direction.remote_address]
        path = _walk(layout, devices, direction, destination)
        key = (direction.gpu, destination)
        if paths.get(key, path) != path:
            raise EmulationError(
                f"GPU {key[0]} -> GPU {key[1]}: two connections took different paths "
                f"({[layout.topology.link_name(link) for link in path]} and "
                f"{[layout.topology.link_name(link) for link in paths[key]]})"
            )
        paths[key] = path
    return PathTable(paths, name="the kernel's paths")
