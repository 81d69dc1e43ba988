"""Errors raised by collectives. Every one names the culprit: the rank, the peer, the step."""

from __future__ import annotations

__all__ = [
    "ChecksumError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "MismatchError",
    "PeerFailureError",
    "ProtocolError",
    "ShrinkError",
]


class CollectiveError(RuntimeError):
    """A collective could not complete. ``rank`` is the rank raising; ``peer`` and ``step`` when known."""

    def __init__(self, message: str, *, rank: int | None = None, peer: int | None = None, step: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.step = step


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """The collective did not finish in time; the message names the peer(s) waited for and the step."""


class PeerFailureError(CollectiveError):
    """A peer process died or closed its connection mid-collective; ``peer`` is that rank."""


class ShrinkError(CollectiveError):
    """The survivors of a failure could not form a smaller group (:meth:`ProcessGroup.shrink`); every survivor
    raises it with the reason."""


class MismatchError(CollectiveError):
    """Ranks called different collectives (op, size, dtype, algorithm or root); raised before any data moves."""


class ChecksumError(CollectiveError):
    """Data arrived corrupted (crc32 mismatch); ``peer`` -> ``rank`` is the link that corrupted it."""


class ProtocolError(CollectiveError):
    """A frame could not be decoded, or came from a peer that did not authenticate."""
