"""Socket helpers shared by the TCP transport and the store: tuning, exact reads, bounded sends, drain-and-close,
and the key that says whether two processes can reach each other over a Unix socket."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import select
import socket
import time

__all__ = [
    "DRAIN_LINGER_S",
    "IO_CHUNK_BYTES",
    "LOOPBACK_SNDBUF_BYTES",
    "POLL_ERR",
    "POLL_IN",
    "UNIX_SHARED_CORES_SNDBUF_BYTES",
    "UNIX_SNDBUF_BYTES",
    "advertised_host",
    "connect_tcp",
    "drain_and_close",
    "family_of",
    "host_key",
    "is_loopback",
    "read_exact",
    "send_until",
    "tune",
    "wait_readable",
]

IO_CHUNK_BYTES = 1 << 20
"""At most this much per send/recv call: keeps an event loop alternating between its peers."""

LOOPBACK_SNDBUF_BYTES = 256 << 10
"""The send buffer of a loopback connection (see :func:`tune`)."""

UNIX_SNDBUF_BYTES = 512 << 10
"""The send buffer of a Unix-socket connection when each rank of the host has a core (see :func:`tune`)."""

UNIX_SHARED_CORES_SNDBUF_BYTES = 2 << 20
"""The send buffer of a Unix-socket connection when the host's ranks outnumber its cores (see :func:`tune`)."""

DRAIN_LINGER_S = 5.0
"""How long a rank that gave up keeps reading (and discarding) from its peers before closing: long enough for a
peer blocked sending to it to reach its ABORT frame instead of a reset, short enough not to keep a dead group."""

_DRAIN_SINK_BYTES = 1 << 16  # discarded per recv while draining

POLL_IN = select.POLLIN | select.POLLPRI
POLL_ERR = select.POLLERR | select.POLLHUP | select.POLLNVAL


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` keeps the port on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def family_of(host: str) -> socket.AddressFamily:
    """The address family for listening on or connecting to ``host`` (IPv6 when it has a colon)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def host_key() -> str:
    """Equal for two processes exactly when they share a kernel and a network namespace, i.e. when one reaches the
    other's abstract Unix socket (abstract names are scoped to the network namespace; two namespaces on one
    machine, as containers or an emulated topology have, are two hosts)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""  # not Linux, or /proc hidden: never claim to share a host
    return f"{socket.gethostname()}/{boot}/{netns}"


def congestion_control(name: str) -> bytes:
    """``name`` checked as a TCP congestion control this process may set on its sockets (``TCP_CONGESTION``);
    ValueError naming the ones this kernel has if it may not."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError as exc:
        try:
            with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
                available = f.read().split()
        except OSError:
            available = []
        raise ValueError(
            f"TCP congestion control {name!r} cannot be set here ({exc.strerror or exc}); this kernel has "
            f"{', '.join(available) or 'none listed'} (one not in net.ipv4.tcp_allowed_congestion_control needs "
            "CAP_NET_ADMIN)"
        ) from exc
    finally:
        probe.close()
    return name.encode()


def connect_tcp(host: str, port: int, *, timeout_s: float, congestion: bytes | None = None) -> socket.socket:
    """``socket.create_connection``, with the congestion control ``congestion`` chosen before the handshake.

    A connection's congestion control is initialised once, when it is established (``tcp_init_transfer``), and
    one set later keeps what that first one's ``init`` did: BBR, the default on some kernels, asks for the
    kernel's own pacing (``SK_PACING_NEEDED``), which then stays with a CUBIC set after it, so CUBIC set on an
    established socket is CUBIC paced as no stock host paces it. The accepting side chooses it on its listening
    socket (:func:`allreduce.runtime.tcp._listener.listening_socket`), whose connections inherit it."""
    last: OSError | None = None
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            if congestion is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion)
            sock.settimeout(timeout_s)
            sock.connect(address)
        except OSError as exc:
            sock.close()
            last = exc
            continue
        return sock
    raise last if last is not None else OSError(f"no address for {host!r}")


def tune(sock: socket.socket, *, congestion: bytes | None = None, shared_cores: bool = False) -> None:
    """Make a freshly authenticated data connection non-blocking, without Nagle, with a loopback-sized buffer
    (a Unix socket: non-blocking, no Nagle to turn off, a buffer sized for whether ``shared_cores``: the host's
    ranks outnumber its cores); ``congestion``: the TCP congestion control to use instead of the kernel's default
    (checked by :func:`congestion_control`). The kernel caps every buffer asked for at ``net.core.wmem_max``."""
    if sock.family == socket.AF_UNIX:
        # The kernel's default (about 208 KiB) cost a fifth more CPU per all-reduce than 512 KiB (measured in
        # docs/design.md, "The TCP transport"): a Unix sender may write again only once most of it drained. With
        # more ranks than cores every drained buffer is a switch to another rank: 2 MiB moved 6% more at N=8
        # and 4-8% at N=4 on 2 cores, and 3-5% less at N=2, where each rank has a core and 512 KiB stays in L2.
        size = UNIX_SHARED_CORES_SNDBUF_BYTES if shared_cores else UNIX_SNDBUF_BYTES
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        sock.setblocking(False)
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if congestion is not None:  # chosen before the handshake (connect_tcp, listening_socket): then a no-op
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion)
    try:
        peer_host = sock.getpeername()[0]
    except OSError:  # the peer is already gone: the first read or write will name it
        peer_host = ""
    if is_loopback(peer_host):
        # Over loopback the bytes in flight are copied twice by the CPU (into the socket, out of it): a small
        # send buffer keeps them in cache between the two copies (measured in docs/design.md, "The TCP
        # transport"). Across a real network the buffer must cover the bandwidth-delay product, so there the
        # kernel's autotuning stays.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOOPBACK_SNDBUF_BYTES)
    sock.setblocking(False)


def read_exact(sock: socket.socket, size: int, *, deadline: float | None = None) -> bytes:
    """Exactly ``size`` bytes from ``sock``.

    Raises EOFError if the peer closes first. A blocking socket waits as its own timeout says (``TimeoutError``);
    a non-blocking one waits until ``deadline`` (``time.monotonic()``; required then), then ``TimeoutError``."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        try:
            n = sock.recv_into(view[got:])
        except (BlockingIOError, InterruptedError):
            if deadline is None or time.monotonic() >= deadline:
                raise TimeoutError(f"read {got} of {size} bytes before the deadline") from None
            wait_readable([sock], deadline)
            continue
        if n == 0:
            raise EOFError(f"connection closed after {got} of {size} bytes")
        got += n
    return bytes(buf)


def wait_readable(socks: list[socket.socket], deadline: float) -> list[socket.socket]:
    """The sockets of ``socks`` readable before ``deadline`` (poll: file descriptors may exceed 1024)."""
    poller = select.poll()
    by_fd = {}
    for sock in socks:
        with contextlib.suppress(OSError, ValueError):
            poller.register(sock, POLL_IN)
            by_fd[sock.fileno()] = sock
    events = poller.poll(max(deadline - time.monotonic(), 0.0) * 1000.0)
    return [by_fd[fd] for fd, _ in events if fd in by_fd]


def send_until(sock: socket.socket, data: bytes | memoryview, deadline: float) -> None:
    """Send all of ``data`` before ``deadline`` on a non-blocking socket, else raise TimeoutError."""
    view = memoryview(data).cast("B")
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    while view:
        try:
            view = view[sock.send(view[:IO_CHUNK_BYTES]) :]
        except (BlockingIOError, InterruptedError):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("peer not reading") from None
            poller.poll(remaining * 1000.0)


def drain_and_close(socks: list[socket.socket], linger_s: float = DRAIN_LINGER_S) -> None:
    """Read and discard from ``socks`` until each peer closes or ``linger_s`` passes, then close them all."""
    deadline = time.monotonic() + linger_s
    open_socks = list(socks)
    sink = bytearray(_DRAIN_SINK_BYTES)
    for sock in open_socks:
        with contextlib.suppress(OSError):
            sock.setblocking(False)
    while open_socks and time.monotonic() < deadline:
        for sock in wait_readable(open_socks, deadline):
            try:
                n = sock.recv_into(sink)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                n = 0
            if n == 0:
                open_socks.remove(sock)
                sock.close()
    for sock in open_socks:
        sock.close()


def advertised_host(master_addr: str) -> str:
    """The address peers should use to reach this host: the interface that routes to the master."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()
