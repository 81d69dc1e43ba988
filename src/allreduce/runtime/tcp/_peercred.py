"""Who is at the other end of a loopback TCP connection: the user id owning its socket, and whether a given process
holds that socket.

``SO_PEERCRED`` answers this for Unix sockets only (on TCP the kernel reports pid 0, uid -1), so the other end is
looked up by its address pair: the socket whose local address is our peer's and whose remote address is ours
names the uid owning it and its inode. The kernel answers that question for one socket through ``sock_diag``
netlink (what ``ss`` uses: about 0.1 ms); where netlink is not allowed, the same row is read from
``/proc/net/tcp`` (``tcp6``), which costs a walk of the kernel's whole connection table (tens of ms on a busy
host). Both belong to this network namespace, which is what loopback reaches. A process holds the socket when one
of its ``/proc/<pid>/fd`` links reads ``socket:[inode]``; only a process of our own uid (or root) can have its
descriptors read, so a process we cannot inspect is never confirmed.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import struct
import sys
from dataclasses import dataclass

__all__ = ["PeerCredentials", "diag_lookup", "holds_socket", "loopback_peer", "proc_lookup"]

_PROC_NET: dict[int, str] = {socket.AF_INET: "/proc/net/tcp", socket.AF_INET6: "/proc/net/tcp6"}

# sock_diag netlink (linux/sock_diag.h, linux/inet_diag.h)
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_ALL_STATES = 0xFFFFFFFF
_NETLINK_TIMEOUT_S = 1.0  # the kernel answers at once; this only bounds a wedged netlink socket
_NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
_DIAG_REQ = struct.Struct("=BBBBI")  # family, protocol, extensions, pad, states
_SOCKID = struct.Struct("!HH16s16s")  # source and destination ports (big-endian), addresses (raw, zero-padded)
_SOCKID_TAIL = struct.Struct("=III")  # interface, cookie (two words)
_DIAG_MSG_HEAD = struct.Struct("=BBBB")  # family, state, timer, retransmits
_DIAG_MSG_TAIL = struct.Struct("=IIIII")  # expires, receive queue, send queue, uid, inode


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """The other end of a loopback connection: the ``uid`` owning its socket and that socket's ``inode``
    (0 while no process holds it yet, e.g. a connection still waiting in a listener's accept queue). For a Unix
    socket the kernel names the process itself (``SO_PEERCRED``): ``pid`` is set and ``inode`` is 0."""

    uid: int
    inode: int
    pid: int | None = None


_UCRED = struct.Struct("=iII")
"""``struct ucred`` (pid, uid, gid), what ``SO_PEERCRED`` answers for a Unix socket."""


def _hex_address(family: int, address: tuple[str, int]) -> str:
    """An address as ``/proc/net/tcp`` prints it: the raw address in native-order 32-bit words, the port in hex."""
    host, port = address
    raw = socket.inet_pton(family, host)
    words = "".join(f"{int.from_bytes(raw[i : i + 4], sys.byteorder):08X}" for i in range(0, len(raw), 4))
    return f"{words}:{port:04X}"


def _raw_address(family: int, host: str) -> bytes:
    return socket.inet_pton(family, host).ljust(16, b"\0")


def diag_lookup(family: int, local: tuple[str, int], remote: tuple[str, int]) -> PeerCredentials | None:
    """The socket bound to ``local`` and connected to ``remote``, asked of the kernel; None if there is none.

    Raises OSError when netlink cannot be used here."""
    body = (
        _DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 0, _ALL_STATES)
        + _SOCKID.pack(local[1], remote[1], _raw_address(family, local[0]), _raw_address(family, remote[0]))
        + _SOCKID_TAIL.pack(0, _INET_DIAG_NOCOOKIE, _INET_DIAG_NOCOOKIE)
    )
    request = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + body
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as netlink:
        netlink.settimeout(_NETLINK_TIMEOUT_S)
        netlink.sendto(request, (0, 0))
        answer = netlink.recv(1 << 16)
    _, kind, _, _, _ = _NLMSGHDR.unpack_from(answer)
    if kind == _NLMSG_ERROR:
        (code,) = struct.unpack_from("=i", answer, _NLMSGHDR.size)
        if -code == errno.ENOENT:
            return None
        raise OSError(-code, f"sock_diag: {os.strerror(-code)}")
    offset = _NLMSGHDR.size + _DIAG_MSG_HEAD.size + _SOCKID.size + _SOCKID_TAIL.size
    _, _, _, uid, inode = _DIAG_MSG_TAIL.unpack_from(answer, offset)
    return PeerCredentials(uid=uid, inode=inode)


def loopback_peer(sock: socket.socket) -> PeerCredentials | None:
    """The credentials of the other end of the connected TCP or Unix socket ``sock``; None when the peer is not on
    loopback or its socket cannot be found (it closed already)."""
    family = sock.family
    if family == socket.AF_UNIX:
        try:
            pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        except OSError:
            return None
        return PeerCredentials(uid=uid, inode=0, pid=pid) if pid > 0 else None
    if family not in _PROC_NET:
        return None
    try:
        peer = sock.getpeername()
        ours = sock.getsockname()
    except OSError:
        return None
    try:
        if not ipaddress.ip_address(str(peer[0]).partition("%")[0]).is_loopback:
            return None
    except ValueError:
        return None
    local, remote = (str(peer[0]), int(peer[1])), (str(ours[0]), int(ours[1]))
    with contextlib.suppress(OSError):
        return diag_lookup(family, local, remote)
    return proc_lookup(family, local, remote)


def proc_lookup(family: int, local: tuple[str, int], remote: tuple[str, int]) -> PeerCredentials | None:
    """As :func:`diag_lookup`, from ``/proc/net/tcp`` (slow: for when netlink is not allowed); None if there is
    none, or the table cannot be read."""
    wanted = (_hex_address(family, local), _hex_address(family, remote))
    try:
        with open(_PROC_NET[family]) as table:
            next(table, None)  # the header
            for line in table:
                fields = line.split()
                # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
                if len(fields) >= 10 and (fields[1], fields[2]) == wanted:
                    return PeerCredentials(uid=int(fields[7]), inode=int(fields[9]))
    except OSError:
        return None
    return None


def holds_socket(pid: int, inode: int) -> bool:
    """Whether process ``pid`` has the socket ``inode`` open (False if it cannot be inspected)."""
    if pid <= 0 or inode <= 0:
        return False
    target = f"socket:[{inode}]"
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return False
    for name in names:
        with contextlib.suppress(OSError):
            if os.readlink(f"{fd_dir}/{name}") == target:
                return True
    return False
