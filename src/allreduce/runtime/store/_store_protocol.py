"""The store's wire protocol and limits: key conventions, request and response layouts, opcodes, statuses, and the
bounds both ends enforce (the server in :mod:`~allreduce.runtime.store._store_server`, the client in
:mod:`~allreduce.runtime.store._store`)."""

from __future__ import annotations

import struct
from collections.abc import Iterable

__all__ = [
    "BEAT_FRAME",
    "DEAD_PREFIX",
    "ELASTIC_PREFIX",
    "FAILED_LINGER_S",
    "GROUP_SECRET_KEY",
    "KEY_SEPARATOR",
    "LEASE_KEY",
    "MAX_ANONYMOUS_CLIENTS",
    "MAX_ANSWER_BYTES",
    "MAX_FAIL_REASON_BYTES",
    "MAX_KEY_BYTES",
    "MAX_STORED_BYTES",
    "MAX_VALUE_BYTES",
    "NO_TIMEOUT",
    "REQUEST",
    "RESERVED_PREFIX",
    "RESPONSE",
    "SERVER_STOP_S",
    "SERVICE",
    "WRITER_PREFIX",
    "Op",
    "Status",
    "check_key",
    "encode_keys",
]

RESERVED_PREFIX = "__"
"""Keys the server itself writes; clients may only read them."""
DEAD_PREFIX = "__dead__/"
ELASTIC_PREFIX = "allreduce/elastic/"  # shrunk groups' keys (runtime/elastic/_elastic.py): see _try_answer
WRITER_PREFIX = "__writer__/"
"""``__writer__/<key>``: which client last wrote ``<key>`` ("rank 1 (127.0.0.1:40112, pid 4242)"), set by the server
with every write, so a rank that reads a malformed value can name who wrote it."""
FAILED_LINGER_S = 15.0
"""When the hosting rank gives up during the rendezvous, how long its store stays up to tell ranks that have not
joined yet why (instead of their finding nothing listening and timing out)."""
GROUP_SECRET_KEY = "__group_secret__"
"""A random secret the server makes at start, readable by every admitted client: a proof of membership in this
group for connections between ranks that have no token (the TCP transport's handshake on loopback)."""
SERVICE = b"store"
LEASE_KEY = "__lease__"
"""The server's lease in seconds, as decimal text (``0``: no lease): how long a rank may go without a heartbeat
before the server declares it dead. Each client reads it once it has connected and beats several times a lease."""

REQUEST = struct.Struct("!BIII")
"""A request: op, timeout in ms (:data:`NO_TIMEOUT`: none), key length, value length; then key (utf-8), value."""
RESPONSE = struct.Struct("!BI")
"""A response: status, payload length; then the payload."""
NO_TIMEOUT = 0xFFFFFFFF
MAX_KEY_BYTES = 64 * 1024
MAX_VALUE_BYTES = 4 * 1024 * 1024
"""The largest value, in bytes. Rendezvous values are addresses and ids (tens of bytes); 4 MiB leaves room for a
user's blob while a client cannot make the hosting rank hold much."""
MAX_ANSWER_BYTES = MAX_VALUE_BYTES
"""The longest answer payload, in bytes: a value, or a timeout report cut to this size. A client refuses a longer
declared length before allocating it, so a bad server cannot make every rank allocate gigabytes."""
MAX_STORED_BYTES = 64 * 1024 * 1024
"""The most the store holds in keys and values together, in bytes: rendezvous of a group of 4,096 ranks stores
kilobytes per rank, so this only stops a client filling rank 0's memory."""
MAX_ANONYMOUS_CLIENTS = 1024
"""Anonymous connections (no rank) open at once. They come only from the hosting process or from holders of the
token, so this bounds the descriptors a buggy one can hold, well above the few helpers a job opens."""
_MAX_REQUEST_KEY_BYTES = MAX_KEY_BYTES * 64  # a WAIT or CHECK joins many keys in one request
_MAX_REQUEST_BYTES = REQUEST.size + _MAX_REQUEST_KEY_BYTES + MAX_VALUE_BYTES
KEY_SEPARATOR = "\x00"  # joins several keys in one WAIT/CHECK request; keys may not contain it
_RECV_BYTES = 1 << 16  # read per recv from a client
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1  # what an ADD's counter may hold: its answer is a signed 64-bit int
_MAX_RIVALS_LISTED = 3  # clients refused a held seat, named in its holder's death report (a bound: they may retry)
_MAX_REFUSAL_CHARS = 300  # of why a rank was refused, as a timed-out waiter is told
MAX_FAIL_REASON_BYTES = 2048  # of why a rank gave up (Op.FAIL), as the ranks waiting on it are told

SERVER_STOP_S = 10.0
"""How long stopping the server waits for its loop thread (woken at once; this bounds a loop stuck in a client)."""


class Op:
    """Request opcodes. ``BEAT`` (a heartbeat) is the one request the server never answers, and reads at any time:
    a client's heartbeat thread sends it between, or while it waits for the answer to, the other requests."""

    SET, GET, ADD, WAIT, CHECK, DELETE, CLOSE, DEAD, FAIL, BEAT = range(1, 11)


class Status:
    """Response statuses. ``EXPIRED``: the server declared this client's rank dead (no heartbeat for a lease); it is
    the last thing the server sends on that connection, whatever the client asked."""

    OK, MISSING, TIMEOUT, DEAD_RANK, ERROR, EXPIRED = range(6)


BEAT_FRAME = REQUEST.pack(Op.BEAT, NO_TIMEOUT, 4, 0) + b"beat"
"""A heartbeat as sent: 17 bytes."""


def encode_keys(keys: Iterable[str]) -> str:
    keys = list(keys)
    for key in keys:
        check_key(key)
    return KEY_SEPARATOR.join(keys)


def check_key(key: str) -> None:
    if not isinstance(key, str):
        raise TypeError(f"store keys are str, got {type(key).__name__}")
    if not key or KEY_SEPARATOR in key or len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"bad store key {key!r}: must be non-empty, without NUL, at most {MAX_KEY_BYTES} bytes")


_RANK_ZERO_KEYS = frozenset({"allreduce/job"})
"""Keys without a rank in their name that rank 0 alone publishes (the job's id)."""


def _owner_of(key: str) -> int | None:
    """By convention a key ``<prefix>/<rank>`` is set by that rank; used to name who a waiter waits for."""
    _, _, tail = key.rpartition("/")
    return int(tail) if tail.isascii() and tail.isdigit() else None  # "²" is a digit, but no int
