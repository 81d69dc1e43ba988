"""Joining a group: rank and size from the environment (torchrun, mpirun, srun), the rendezvous store, the transport."""

from __future__ import annotations

import dataclasses
import datetime
import errno
import itertools
import os
import re
import socket
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

from allreduce.runtime._args import integer_arg
from allreduce.runtime._errors import CollectiveError, CollectiveTimeoutError, ProtocolError
from allreduce.runtime._liveness import lease_arg
from allreduce.runtime._store_api import KeyValueStore
from allreduce.runtime.elastic._elastic import JOIN_ENV, SHRINK_PREFIX, Lineage, joined, request_join
from allreduce.runtime.group._cost_models import default_cost_model
from allreduce.runtime.group._group import ProcessGroup
from allreduce.runtime.group._transports import AUTO, TransportSetup, select_transport, transport_names
from allreduce.runtime.tcp._socket import advertised_host
from allreduce.runtime.transport._transport import Transport
from allreduce.schedules import CostModel

__all__ = ["init"]

# --------------------------------------------------------------------------------------------------------
# init()
# --------------------------------------------------------------------------------------------------------
# Every rank calls init() the same number of times; the count keeps rendezvous keys of successive groups apart.
_INIT_CALLS = itertools.count()


def _torchrun_attempt() -> str:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _torchrun_agent_store(host: str, port: int, timeout_s: float) -> Any:
    """torchrun's own store at MASTER_ADDR:MASTER_PORT when this process is a torchrun worker, else None."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torchrun ships with torch
        return None
    # TCPStore is public API, though torch.distributed's stubs do not re-export it.
    return dist.TCPStore(  # type: ignore[attr-defined]
        host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


_RANK_ENV = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
_SIZE_ENV = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


DEFAULT_MASTER_PORT = 29500
"""torchrun's default rendezvous port, so a job set up for torch finds the store where torch would."""

MAX_TCP_PORT = 65535
"""The largest TCP port number (16 bits)."""

# The groups of this process that host or joined a store at (MASTER_ADDR, MASTER_PORT), to refuse a second init()
# on the same address while the first group is open (its store still holds the port).
_OPEN_GROUPS: dict[tuple[str, int], weakref.ref[ProcessGroup]] = {}


def _env_int(names: tuple[str, ...], what: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value != "":
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{what}: environment variable {name}={value!r} is not an integer") from None
    return None


_KIND_KEY = f"{SHRINK_PREFIX}/transport"
"""Where rank 0 publishes the transport the group chose, for processes that join it later."""


def _running_kind(store: Any, asked: str, rank: int) -> str:
    """The running group's transport, which a joiner must use (``asked`` is what it was told: auto or that)."""
    kind = bytes(store.get(_KIND_KEY)).decode()
    if kind not in transport_names():
        raise ProtocolError(f"rank {rank}: the store holds {_KIND_KEY!r} = {kind[:20]!r}, not a transport", rank=rank)
    if asked not in (AUTO, kind):
        raise ValueError(f"transport: the running group uses {kind}; rank {rank} cannot join it over {asked}")
    return kind


def _env_flag(name: str) -> bool:
    """An on/off environment variable: unset, empty or 0 is off, 1 is on; anything else is refused, naming it."""
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"environment variable {name}={value[:40]!r} must be 0 or 1")
    return value == "1"


_JOB_ID = re.compile(r"[0-9a-f]{32}")
"""What rank 0 publishes as ``allreduce/job``: ``uuid4().hex``."""
_HOST_ID = re.compile(r"[^/\s]{1,255}/[0-9a-f-]{0,36}/[0-9]{0,20}")
"""What :func:`_host_id` publishes: a hostname (at most 255 characters, no slash), the boot id, the netns inode."""
_PORT = re.compile(r"[0-9]{1,5}")
"""What rank 0 publishes in the job's own store under torchrun: the port of allreduce's store, in decimal."""
_SHOWN_VALUE_BYTES = 40  # of a malformed value, in an error message
_WRITER_LOOKUP_S = 1.0  # how long to ask the store who wrote a malformed value
_REREADS = 3  # reads of a malformed value that keeps changing while its writer is looked up


def _read_checked(store: Any, key: str, pattern: re.Pattern[str], what: str, rank: int) -> str:
    """The value of ``key`` in ``store``, which must match ``pattern``; else a ProtocolError naming the key, the
    store and, with allreduce's store, the client that wrote the value (another process writing to the job's store
    is the likely cause). A malformed value rewritten while its writer is looked up is read again."""
    from allreduce.runtime.store._store import TCPStore
    from allreduce.runtime.store._store_protocol import WRITER_PREFIX

    written_by = ""
    for _ in range(_REREADS):
        raw = bytes(store.get(key))
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            text = None
        if text is not None and pattern.fullmatch(text):
            return text
        if not isinstance(store, TCPStore):  # only ours records every write's client
            break
        try:
            writer = store.get(WRITER_PREFIX + key, timeout_s=_WRITER_LOOKUP_S).decode()
            if bytes(store.get(key, timeout_s=_WRITER_LOOKUP_S)) == raw:  # the writer of the value shown
                written_by = f" (written by {writer})"
                break
        except (CollectiveError, OSError, ValueError):
            break
    shown = repr(raw[:_SHOWN_VALUE_BYTES]) + ("..." if len(raw) > _SHOWN_VALUE_BYTES else "")
    where = (
        f"the rendezvous store at {store.host}:{store.port}"
        if hasattr(store, "host") and hasattr(store, "port")
        else f"the job's rendezvous store ({type(store).__name__})"
    )
    raise ProtocolError(
        f"rank {rank}: {where} holds {key!r} = {shown}{written_by}, which is not {what}; another process "
        "may be writing to this job's store: set ALLREDUCE_TOKEN to a secret of this job's own",
        rank=rank,
    )


def _host_id() -> str:
    """Ranks with equal ids share a machine and a network namespace: shared memory and loopback reach each other.
    (Two network namespaces on one machine, as containers have, are two hosts: 127.0.0.1 is a different
    interface in each.)"""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = ""
    return f"{socket.gethostname()}/{boot}/{netns}"


def init(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    master_addr: str | None = None,
    master_port: int | None = None,
    transport: str = "auto",
    timeout_s: float = 300.0,
    token: str | None = None,
    group_size: int | None = None,
    cost_model: CostModel | None = None,
    cross_memory: bool = True,
    rendezvous_store: KeyValueStore | None = None,
    rendezvous_key: str | None = None,
    join: bool | None = None,
    lease_s: float | None = None,
) -> ProcessGroup:
    """Join a process group. Unset arguments come from the environment: RANK / WORLD_SIZE / MASTER_ADDR /
    MASTER_PORT (torchrun), OMPI_COMM_WORLD_RANK / _SIZE (Open MPI), PMI_RANK / PMI_SIZE, SLURM_PROCID /
    SLURM_NTASKS; with none of them this process is a group of one.

    Rank 0 hosts the rendezvous store at MASTER_ADDR:MASTER_PORT (default 127.0.0.1:29500); under torchrun, whose
    own store holds that port, rank 0 hosts it on a free port and publishes it through torchrun's store.
    ``transport`` is ``"shm"`` (all ranks on this host), ``"tcp"``, or ``"auto"`` (shm when every rank reports the
    same host). Successive groups may reuse one address: a rank that left the previous group's store is told to come
    back until the next store is up.

    ``cross_memory=False`` keeps the shm transport from reading peers' buffers in place (``process_vm_readv``):
    it stages every transfer through shared memory instead. ``rendezvous_store`` is an existing store of the job
    (anything with ``set(key, value)`` and ``get(key)``, such as torch's): rank 0 then hosts allreduce's store on
    a free port and publishes it there, as under torchrun; ``rendezvous_key`` names the key it publishes under
    (every rank must pass the same; by default a key counting this process's calls of ``init()``, which agrees
    across ranks only when every rank joined the same groups before).

    ``join=True`` (default: ``ALLREDUCE_JOIN=1`` in the environment, which the launcher sets when it restarts a
    rank) joins a running group in the seat of this rank, which died and was shrunk out: this returns once the
    members have admitted it at their next ``group.grow()`` (docs/elastic.md).

    ``lease_s`` (default: ``ALLREDUCE_LEASE_S``, else 10 s; 0 turns it off): a rank the store hears nothing from
    for that long (every rank's store client sends a heartbeat five times a lease) is declared dead, as if its
    process had exited: a stopped process or a host gone from the network is found within about a lease, not at
    ``timeout_s`` (docs/reliability.md, "Silent ranks"). Rank 0's value counts: it hosts the store.
    """
    lease_s = lease_arg(lease_s)
    rank = _env_int(_RANK_ENV, "rank") if rank is None else integer_arg(rank, "rank")
    world_size = _env_int(_SIZE_ENV, "world_size") if world_size is None else integer_arg(world_size, "world_size")
    if world_size is None:
        world_size = 1 if rank in (None, 0) else None
    if world_size is None or world_size < 1:
        raise ValueError(f"world_size: cannot tell the group size (got {world_size}); set WORLD_SIZE or pass it")
    rank = 0 if rank is None else rank
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: {rank} is not in a group of {world_size}")
    if join is None:
        join = _env_flag(JOIN_ENV)
    if join and rank == 0:
        raise ValueError("join: rank 0 hosts the group's store; it cannot join a running group (join as another rank)")
    if transport != AUTO and transport not in transport_names():
        raise ValueError(f"transport: {transport!r} is not one of {', '.join((AUTO, *transport_names()))}")
    host = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = _master_port(master_port)
    token = token or os.environ.get("ALLREDUCE_TOKEN")
    if world_size == 1 and transport in (AUTO, "shm"):
        from allreduce.runtime.shm import ShmTransport

        shm = ShmTransport(0, 1, f"solo-{uuid.uuid4().hex[:12]}", timeout_s=timeout_s, cross_memory=cross_memory)
        model = cost_model or _tuned_model("shm", 1)
        return ProcessGroup(shm, transport_name="shm", timeout_s=timeout_s, cost_model=model, group_size=1)

    from allreduce.runtime.store._store import TCPStore

    agent = rendezvous_store if rendezvous_store is not None else _torchrun_agent_store(host, port, timeout_s)
    if agent is None:
        _refuse_if_open(host, port, rank)
        store = _store_at(
            host, port, rank=rank, world_size=world_size, timeout_s=timeout_s, token=token, lease_s=lease_s
        )
    else:
        # Under torchrun (or inside torch's own rendezvous), MASTER_PORT is the launcher's store: host ours on a
        # free port and tell the other ranks where, through that store.
        key = rendezvous_key or (
            f"allreduce/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{_torchrun_attempt()}/{next(_INIT_CALLS)}"
        )
        if rank == 0:
            store = TCPStore(
                host, 0, is_server=True, world_size=world_size, rank=0, timeout_s=timeout_s, token=token,
                lease_s=lease_s,
            )  # fmt: skip
            agent.set(key, str(store.port))
        else:
            agent_port = int(_read_checked(agent, key, _PORT, "a TCP port", rank))
            store = TCPStore(
                host, agent_port, is_server=False, world_size=world_size, rank=rank, timeout_s=timeout_s, token=token
            )
    try:
        if rank == 0 and not join:
            store.set("allreduce/job", uuid.uuid4().hex.encode())
        job = _read_checked(store, "allreduce/job", _JOB_ID, "a job id (32 hex digits)", rank)
        store.set(f"allreduce/host/{rank}", _host_id().encode())
        hosts = [
            _read_checked(store, f"allreduce/host/{r}", _HOST_ID, "a host id (hostname/boot id/netns)", rank)
            for r in range(world_size)
        ]
        setup = TransportSetup(
            rank, world_size, tuple(hosts), store, job, "", timeout_s, token, host, {"cross_memory": cross_memory}
        )
        if not setup.one_host:
            setup.options["advertise_host"] = advertised_host(host)
        if join:
            transport = _running_kind(store, transport, rank)
        entry = select_transport(transport, setup)
        if rank == 0:
            store.set(_KIND_KEY, entry.name.encode())  # for ranks that join later
        if group_size is None:
            group_size = hosts.count(hosts[rank])
        # a joiner's transport is the running group's, built once the members admit it
        chosen = None if join else entry.create(setup)
    except BaseException as exc:
        if isinstance(exc, Exception) and not join:  # not on Ctrl-C: then nobody waits to hear why
            store.fail(str(exc))  # (a joiner's failure is its own: the running group goes on)
        store.close()
        raise
    model = cost_model or _tuned_model(entry.name, world_size)

    def rebuild(members: Sequence[int], epoch: int, new_rank: int, view: Any) -> tuple[Transport, int, CostModel]:
        # The shrunk group of ``members`` (store ranks): the same kind of transport, under names of its own.
        shrunk = dataclasses.replace(
            setup, rank=new_rank, world_size=len(members), hosts=tuple(hosts[r] for r in members), store=view,
            name=f"{job}-e{epoch}", key_prefix=f"{SHRINK_PREFIX}/{epoch}",
        )  # fmt: skip
        peers_here = shrunk.hosts.count(hosts[rank])
        return entry.create(shrunk), peers_here, cost_model or _tuned_model(entry.name, len(members))

    if chosen is None:
        try:
            epoch, members = request_join(store, rank, timeout_s=timeout_s)
        except BaseException:
            store.close()
            raise
        parts = joined(store, Lineage(rebuild, rank, members, epoch, seats=world_size))
        group = ProcessGroup(
            parts.transport, transport_name=entry.name, timeout_s=timeout_s, cost_model=parts.cost_model,
            group_size=parts.group_size, store=parts.store, lineage=parts.lineage,
        )  # fmt: skip
    else:
        group = ProcessGroup(
            chosen, transport_name=entry.name, timeout_s=timeout_s, cost_model=model, group_size=group_size,
            store=store, lineage=Lineage(rebuild, rank, tuple(range(world_size))),
        )  # fmt: skip
    if agent is None:
        _OPEN_GROUPS[(host, port)] = weakref.ref(group)
    return group


def _master_port(master_port: object) -> int:
    """The store's port: ``master_port``, else MASTER_PORT, else the default; ``ValueError`` naming the source."""
    source = "master_port"
    if master_port is None:
        source = "MASTER_PORT"
        port = _env_int(("MASTER_PORT",), "master_port")
        if port is None:
            return DEFAULT_MASTER_PORT
    else:
        port = integer_arg(master_port, "master_port")
    if not 1 <= port <= MAX_TCP_PORT:
        raise ValueError(
            f"{source}: {port} is not a TCP port (1..{MAX_TCP_PORT}); set {source} to a free port, the same on "
            f"every rank"
        )
    return port


def _refuse_if_open(host: str, port: int, rank: int) -> None:
    """Every rank refuses a second init() on the address of its own group that is still open (its store, hosted by
    rank 0, still holds the port, and the other ranks would reach it and be taken for duplicates)."""
    ref = _OPEN_GROUPS.get((host, port))
    group = ref() if ref is not None else None
    if group is not None and not group.closed:
        raise RuntimeError(
            f"rank {rank}: init() while this process's group at {host}:{port} (MASTER_ADDR:MASTER_PORT, rank "
            f"{group.rank} of {group.world_size}) is still open: close it first (group.close(), or "
            f"`with allreduce.init() as group:`), or give the new group another MASTER_PORT, the same on every rank"
        )


def _store_at(
    host: str, port: int, *, rank: int, world_size: int, timeout_s: float, token: str | None, lease_s: float
) -> Any:
    """The store client (rank 0 also hosts the server) at MASTER_ADDR:MASTER_PORT, with errors that say which
    variable to change: the port is taken, or what answered there is not this job's store."""
    from allreduce.runtime.store._store import TCPStore

    where = f"{host}:{port} (MASTER_ADDR:MASTER_PORT)"
    try:
        return TCPStore(
            host, port, is_server=rank == 0, world_size=world_size, rank=rank, timeout_s=timeout_s, token=token,
            lease_s=lease_s,
        )  # fmt: skip
    except OSError as exc:
        if rank == 0 and exc.errno == errno.EADDRINUSE:
            raise OSError(
                exc.errno,
                f"rank 0: cannot host the rendezvous store at {where}: the port is already in use (by another "
                f"service, another job, or a group of this process that is still open). Set MASTER_PORT to a free "
                f"port, the same on every rank",
            ) from exc
        if rank == 0 and exc.errno == errno.EADDRNOTAVAIL:
            raise OSError(
                exc.errno, f"rank 0: cannot host the rendezvous store at {where}: {host} is not an address of this host"
            ) from exc
        if isinstance(exc, TimeoutError) and not isinstance(exc, CollectiveError):
            raise CollectiveTimeoutError(
                f"rank {rank}: something at {where} accepted the connection but never answered as allreduce's "
                f"rendezvous store: another service may hold MASTER_PORT (rank 0 then cannot host the store). Set "
                f"MASTER_PORT to a free port, the same on every rank",
                rank=rank,
                peer=0,
            ) from exc
        raise
    except ProtocolError as exc:
        raise type(exc)(
            f"{exc}. If no two processes share RANK={rank}, what answered at {where} is not this job's store: "
            f"another job, or a group still open in another process, holds MASTER_PORT; give each concurrent "
            f"group its own MASTER_PORT",
            rank=rank,
            peer=0,
        ) from exc


def _tuned_model(transport: str, world_size: int) -> CostModel:
    from allreduce.runtime.group._tune import load_cost_model

    return load_cost_model(transport) or default_cost_model(transport, world_size)
