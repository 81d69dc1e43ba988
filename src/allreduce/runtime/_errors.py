"""Errors raised by collectives. Every one names the culprit: the rank, the peer, the step."""

from __future__ import annotations

__all__ = [
    "ABORT_KINDS",
    "ChecksumError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "MismatchError",
    "PeerFailureError",
    "ProtocolError",
    "ShrinkError",
    "abort_kind",
    "corrupted",
    "error_class",
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


ABORT_KINDS: tuple[type[CollectiveError], ...] = (
    PeerFailureError,
    CollectiveTimeoutError,
    MismatchError,
    ChecksumError,
    ProtocolError,
    CollectiveError,
)
"""Error classes by the kind number a transport sends to its peers when it gives up (the last is the catch-all)."""


def abort_kind(error: BaseException) -> int:
    """The kind number of ``error`` (its most specific class in :data:`ABORT_KINDS`)."""
    for kind, cls in enumerate(ABORT_KINDS):
        if isinstance(error, cls):
            return kind
    return len(ABORT_KINDS) - 1


def error_class(kind: int) -> type[CollectiveError]:
    """The error class a peer's abort of ``kind`` is raised as (unknown kinds: :class:`CollectiveError`)."""
    return ABORT_KINDS[kind] if 0 <= kind < len(ABORT_KINDS) else CollectiveError


def corrupted(*, rank: int, peer: int, step: int, seq: int, what: str, got: int, expected: int) -> ChecksumError:
    """The error of a receive (``what``: which data) whose crc32 ``got`` is not the ``expected`` one its sender
    computed: the link ``peer -> rank`` corrupted it."""
    return ChecksumError(
        f"rank {rank}: {what} of collective {seq} arrived corrupted at step {step} on the link rank {peer} -> "
        f"rank {rank}: crc32 {got:#010x}, sender computed {expected:#010x}",
        rank=rank,
        peer=peer,
        step=step,
    )
