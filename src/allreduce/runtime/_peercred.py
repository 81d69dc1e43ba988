"""Who is at the other end of a loopback TCP connection: the user id owning its socket, and whether a given process
holds that socket.

``SO_PEERCRED`` answers this for Unix sockets only (on TCP the kernel reports pid 0, uid -1), so the other end is
found in ``/proc/net/tcp`` (``tcp6``): the row whose local address is our peer's and whose remote address is ours
names the uid owning that socket and its inode; a process holds the socket when one of its ``/proc/<pid>/fd``
links reads ``socket:[inode]``. Both tables belong to this network namespace, which is what loopback reaches.
Only a process of our own uid (or root) can have its descriptors read, so a process we cannot inspect is never
confirmed.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
from dataclasses import dataclass

__all__ = ["PeerCredentials", "holds_socket", "loopback_peer"]

_PROC_NET = {socket.AF_INET: "/proc/net/tcp", socket.AF_INET6: "/proc/net/tcp6"}


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """The other end of a loopback connection: the ``uid`` owning its socket and that socket's ``inode``
    (0 while no process holds it yet, e.g. a connection still waiting in a listener's accept queue)."""

    uid: int
    inode: int


def _hex_address(family: int, address: tuple[str, int] | tuple[str, int, int, int]) -> str:
    """An address as ``/proc/net/tcp`` prints it: the raw address in native-order 32-bit words, the port in hex."""
    host, port = str(address[0]), int(address[1])
    raw = socket.inet_pton(family, host)
    words = "".join(f"{int.from_bytes(raw[i : i + 4], sys.byteorder):08X}" for i in range(0, len(raw), 4))
    return f"{words}:{port:04X}"


def loopback_peer(sock: socket.socket) -> PeerCredentials | None:
    """The credentials of the other end of the connected TCP socket ``sock``; None when the peer is not on
    loopback or its socket cannot be found (it closed already)."""
    family = sock.family
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
    wanted = (_hex_address(family, peer), _hex_address(family, ours))
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
