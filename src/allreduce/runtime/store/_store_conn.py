"""The store server's state of one client connection (:class:`Conn`) and of one pending wait (:class:`Waiter`)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

__all__ = ["Conn", "Waiter"]


@dataclass(eq=False)
class Conn:
    sock: socket.socket
    address: str
    rank: int | None = None
    pid: int | None = None  # verified by the handshake without a token; unknown with one
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    closing: bool = False  # the client said CLOSE: its disconnect is not a death
    gave_up: bool = False  # the client said FAIL (a rank whose init failed)
    waiting: Waiter | None = None
    last_heard: float = field(default_factory=time.monotonic)  # when the server last read a byte from it
    expired: bool = False  # a rank declared dead for its silence: read no more, answer nothing but EXPIRED
    # Clients refused because this one held their rank's seat, as "a client from <address>"; touched under the
    # server's lock (by handshake threads). Then this one may not be the real rank: the report of its end says so.
    rivals: list[str] = field(default_factory=list)

    @property
    def who(self) -> str:
        name = f"rank {self.rank}" if self.rank is not None else "an anonymous client"
        return f"{name} ({self.address})"

    @property
    def writer(self) -> str:
        """How a write of this client is attributed (``__writer__/<key>``)."""
        name = f"rank {self.rank}" if self.rank is not None else "an anonymous client"
        return f"{name} ({self.origin})"

    @property
    def origin(self) -> str:
        return f"{self.address} (pid {self.pid})" if self.pid is not None else self.address


@dataclass(eq=False)
class Waiter:
    conn: Conn
    keys: list[str]
    deadline: float | None
    want_value: bool  # GET answers with the value, WAIT with an empty OK
