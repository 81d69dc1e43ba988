"""The transport registry: the table :func:`allreduce.init` chooses a group's transport from, and where a new one
plugs in.

After NCCL's table of transports, each asked whether it can connect two ranks: a transport registers a name,
``can_connect(setup, rank, peer)`` and ``create(setup)``. ``init(transport="auto")`` walks the table in the order
of registration (shared memory first, then TCP) and takes the first transport that can connect every pair of the
group's ranks; ``init(transport=name)`` takes that one, and raises ``ValueError`` naming a pair it cannot connect.
A group runs on one transport: every rank sees the same :class:`TransportSetup` (the hosts come from the store),
so every rank picks the same one. docs/transports.md shows how to add one.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from allreduce.runtime._store_api import Store
from allreduce.runtime.transport._transport import Transport

__all__ = [
    "AUTO",
    "TransportEntry",
    "TransportSetup",
    "register_transport",
    "select_transport",
    "transport_names",
    "unregister_transport",
]

AUTO = "auto"
"""The transport name that asks the registry to choose."""


@dataclasses.dataclass(frozen=True)
class TransportSetup:
    """What a transport is made from: the same on every rank of the group, but for ``rank``."""

    rank: int
    world_size: int
    hosts: tuple[str, ...]
    """Per rank, the host it runs on (hostname, boot id and network namespace): equal means one machine."""
    store: Store
    """The group's rendezvous store (a transport publishes its addresses there)."""
    name: str
    """A name unique to this group, the same on every rank (for files and keys of its own)."""
    key_prefix: str
    """Where in the store this group's keys go ("": the store is the group's own); see :meth:`key`."""
    timeout_s: float
    token: str | None
    """The job's shared secret, if any (a transport listening beyond loopback needs it)."""
    master_addr: str
    """The store's host: an address that reaches this machine from the others."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Transport-specific settings from ``init`` (``cross_memory`` for shm)."""

    def same_host(self, rank: int, peer: int) -> bool:
        return self.hosts[rank] == self.hosts[peer]

    def key(self, name: str) -> str:
        """The store key (or key prefix) ``name`` of this group: its transport's keys never meet another's."""
        return f"{self.key_prefix}/{name}" if self.key_prefix else name

    @property
    def one_host(self) -> bool:
        """Whether every rank runs on this rank's host."""
        return all(host == self.hosts[self.rank] for host in self.hosts)


@dataclasses.dataclass(frozen=True)
class TransportEntry:
    """A registered transport."""

    name: str
    can_connect: Callable[[TransportSetup, int, int], bool]
    """Whether this transport can move data between ``rank`` and ``peer`` of the group."""
    create: Callable[[TransportSetup], Transport]
    """This rank's transport for the group (every rank calls it, collectively)."""
    needs: str = ""
    """What ``can_connect`` asks for, in words, for the error when it cannot (``every rank on one host``)."""


_TABLE: dict[str, TransportEntry] = {}
_LOCK = threading.Lock()


def register_transport(
    name: str,
    *,
    can_connect: Callable[[TransportSetup, int, int], bool],
    create: Callable[[TransportSetup], Transport],
    needs: str = "",
    replace: bool = False,
) -> None:
    """Add a transport to the table, after those registered before (``auto`` asks them in that order); every
    rank of a job registers it before :func:`~allreduce.init`. ``replace`` lets a name be registered again."""
    if not isinstance(name, str) or not name.isidentifier() or name == AUTO:
        raise ValueError(f"transport name {name!r}: must be an identifier other than {AUTO!r}")
    if not (callable(can_connect) and callable(create)):
        raise TypeError(f"transport {name!r}: can_connect and create must be callables")
    with _LOCK:
        if name in _TABLE and not replace:
            raise ValueError(f"transport {name!r} is already registered (pass replace=True to replace it)")
        _TABLE[name] = TransportEntry(name, can_connect, create, needs)


def unregister_transport(name: str) -> None:
    """Remove a transport from the table (``KeyError`` if it is not there)."""
    with _LOCK:
        if name not in _TABLE:
            raise KeyError(f"transport {name!r} is not registered")
        del _TABLE[name]


def transport_names() -> tuple[str, ...]:
    """The registered transports, in the order ``auto`` asks them."""
    with _LOCK:
        return tuple(_TABLE)


def _unconnectable(entry: TransportEntry, setup: TransportSetup) -> tuple[int, int] | None:
    """The first pair of ranks ``entry`` cannot connect, or None."""
    for rank in range(setup.world_size):
        for peer in range(rank + 1, setup.world_size):
            if not entry.can_connect(setup, rank, peer):
                return rank, peer
    return None


def select_transport(requested: str, setup: TransportSetup) -> TransportEntry:
    """The entry to make the group's transport with: ``requested``, or for ``auto`` the first that can connect
    every pair of ranks. ``ValueError`` naming the request, or the pair and the hosts, when none fits."""
    with _LOCK:
        table = list(_TABLE.values())
    if requested == AUTO:
        for entry in table:
            if _unconnectable(entry, setup) is None:
                return entry
        raise ValueError(f"transport: no registered transport can connect every pair of ranks of hosts {setup.hosts}")
    found = [e for e in table if e.name == requested]
    if not found:
        names = ", ".join((AUTO, *(e.name for e in table)))
        raise ValueError(f"transport: {requested!r} is not one of {names}")
    entry = found[0]
    pair = _unconnectable(entry, setup)
    if pair is not None:
        rank, peer = pair
        needs = f" ({entry.needs})" if entry.needs else ""
        raise ValueError(
            f"transport: {entry.name} cannot connect rank {rank} and rank {peer}{needs}; ranks report "
            f"{sorted(set(setup.hosts))}"
        )
    return entry


# --------------------------------------------------------------------------------------------------------
# The built-in transports (imported when first made: a tcp job never loads the shm modules)
# --------------------------------------------------------------------------------------------------------
def _shm(setup: TransportSetup) -> Transport:
    from allreduce.runtime.shm import ShmTransport

    cross_memory = bool(setup.options.get("cross_memory", True))
    return ShmTransport(
        setup.rank, setup.world_size, setup.name, timeout_s=setup.timeout_s, cross_memory=cross_memory,
        store=setup.store,
    )  # fmt: skip


def _tcp(setup: TransportSetup) -> Transport:
    from allreduce.runtime.tcp import TcpTransport

    if setup.one_host:
        listen, advertise = "127.0.0.1", None
    else:  # listening beyond loopback: the TCP transport insists on the shared token
        listen, advertise = "0.0.0.0", setup.options.get("advertise_host")
    return TcpTransport(
        setup.rank, setup.world_size, setup.store, host=listen, token=setup.token, timeout_s=setup.timeout_s,
        advertise_host=advertise, prefix=setup.key("tcp"),
    )  # fmt: skip


register_transport("shm", can_connect=TransportSetup.same_host, create=_shm, needs="every rank on one host")
register_transport("tcp", can_connect=lambda setup, rank, peer: True, create=_tcp)
