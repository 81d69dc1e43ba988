"""The descriptor every rank publishes before a collective, and the diff that names what the ranks disagree on.

A descriptor is one declared struct (:data:`FIELDS`): the *request* (what the caller asked for: collective, dtype,
op, flags, root, element count, segments, ranks per host, algorithm name, for a :class:`Schedule` object a digest
of its streams, and the caller's ``tag``) followed by the *proposal* (the algorithm this rank would pick for
``auto``). Ranks compare the requests byte for byte; when they differ, :func:`find_mismatch` names the first
field that does, with every rank's value. All ranks then run the proposal of rank 0, so ``auto`` picks one
algorithm even when the ranks' cost models disagree.

The dtype and op tables live here because the descriptor carries their codes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from allreduce.runtime._errors import MismatchError
from allreduce.schedules import MAX_ALGORITHM_NAME_BYTES, Collective, Schedule

__all__ = [
    "BARRIER_CODE",
    "DESCRIPTOR",
    "DIGEST_BYTES",
    "DTYPES",
    "DTYPE_CODES",
    "FIELDS",
    "FLAG_CHECKSUM",
    "FLAG_DETERMINISTIC",
    "KIND_CODES",
    "MAX_TAG_BYTES",
    "NO_DIGEST",
    "NO_OP_CODE",
    "NO_TAG",
    "OPS",
    "OP_CODES",
    "REQUEST_BYTES",
    "Descriptor",
    "algorithm_name_bytes",
    "barrier_descriptor",
    "dtype_code",
    "find_mismatch",
    "proposal_of",
    "schedule_digest",
    "tag_bytes",
]

_DTYPE_ORDER = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8")


class _Dtypes(Mapping[str, "np.dtype[Any]"]):
    """The element types by name, in code order; bfloat16 (from ml_dtypes) is imported on first use.

    ml_dtypes 0.7 takes 0.7-0.9 s to import on this machine, longer than numpy and the rest of allreduce together,
    and every rank process, launcher and CLI run would pay it at ``import allreduce`` although most never touch
    bfloat16. A bfloat16 array can only exist once ml_dtypes is imported (its dtype comes from there), so
    :func:`dtype_code` registers it the first time such an array arrives; a name lookup imports it."""

    def __init__(self) -> None:
        self._known: dict[str, np.dtype[Any]] = {name: np.dtype(name) for name in _DTYPE_ORDER if name != "bfloat16"}

    def __getitem__(self, name: str) -> np.dtype[Any]:
        if name == "bfloat16" and name not in self._known:
            import ml_dtypes  # deliberately late: see the class docstring

            bf16 = np.dtype(ml_dtypes.bfloat16)
            self._known[name] = bf16
            DTYPE_CODES[bf16] = _DTYPE_ORDER.index(name)
        return self._known[name]

    def __iter__(self) -> Iterator[str]:
        return iter(_DTYPE_ORDER)

    def __len__(self) -> int:
        return len(_DTYPE_ORDER)

    def __contains__(self, name: object) -> bool:
        return name in _DTYPE_ORDER


DTYPES: Mapping[str, np.dtype[Any]] = _Dtypes()
"""The element types collectives accept, by name; a dtype's code in the descriptor is its position here."""

OPS: dict[str, np.ufunc] = {
    "sum": np.add,
    "avg": np.add,  # then divided by N
    "min": np.minimum,
    "max": np.maximum,
    "prod": np.multiply,
}
"""The reductions, by name; an op's code in the descriptor is its position here."""

DTYPE_CODES: dict[np.dtype[Any], int] = {
    np.dtype(name): code for code, name in enumerate(_DTYPE_ORDER) if name != "bfloat16"
}
"""A supported dtype's code (bfloat16's entry appears once ml_dtypes is loaded: see :func:`dtype_code`)."""


def dtype_code(dtype: np.dtype[Any]) -> int | None:
    """``dtype``'s code in the descriptor, or None when collectives do not support it."""
    code = DTYPE_CODES.get(dtype)
    if code is None and dtype.name == "bfloat16" and "ml_dtypes" in sys.modules:
        DTYPES["bfloat16"]  # registers its code
        code = DTYPE_CODES.get(dtype)
    return code


OP_CODES: dict[str, int] = {name: i for i, name in enumerate(OPS)}
KIND_CODES: dict[Collective, int] = {c: i for i, c in enumerate(Collective)}

BARRIER_CODE = 99
"""The collective code of a barrier (not a :class:`Collective`: it moves no data). Far from the collectives'
codes 0..4, so that adding a collective never collides with it."""

NO_OP_CODE = 255
"""The op code of collectives that do not reduce (all_gather, broadcast, barrier): the largest byte, never an
index into :data:`OPS`."""

FLAG_CHECKSUM = 1
FLAG_DETERMINISTIC = 2

DIGEST_BYTES = 8
"""Bytes of a :class:`Schedule` object's digest in the descriptor (64 bits: a chance mismatch is negligible)."""

NO_DIGEST = bytes(DIGEST_BYTES)
"""The digest field of a call that names a registered algorithm (every rank builds it from the registry)."""

MAX_TAG_BYTES = 32
"""Bytes of a call's ``tag=`` in the descriptor (UTF-8): room for a name such as ``"grad-bucket-1023"`` while the
whole descriptor stays far below the transports' limit."""

NO_TAG = b""
"""The tag field of an untagged call (a tag is never empty, so the two cannot be confused)."""

FIELDS: tuple[tuple[str, str], ...] = (
    ("collective", "B"),
    ("dtype", "B"),
    ("op", "B"),
    ("flags", "B"),
    ("root", "i"),
    ("count", "q"),
    ("segments", "i"),
    ("group_size", "i"),
    ("algorithm", f"{MAX_ALGORITHM_NAME_BYTES}s"),
    ("schedule", f"{DIGEST_BYTES}s"),
    ("tag", f"{MAX_TAG_BYTES}s"),
    ("proposal", f"{MAX_ALGORITHM_NAME_BYTES}s"),
)
"""The descriptor's fields in order, with their :mod:`struct` codes; every field but ``proposal`` must agree."""

DESCRIPTOR = struct.Struct("<" + "".join(code for _, code in FIELDS))
"""Packs a descriptor from the values of :data:`FIELDS`, in order."""

_REQUEST = struct.Struct("<" + "".join(code for name, code in FIELDS if name != "proposal"))
REQUEST_BYTES = _REQUEST.size
"""The compared prefix of a descriptor: the request, without the proposal."""


@dataclass(frozen=True, slots=True)
class Descriptor:
    """A descriptor decoded (for messages; the hot path packs and compares bytes)."""

    collective: int
    dtype: int
    op: int
    flags: int
    root: int
    count: int
    segments: int
    group_size: int
    algorithm: bytes
    schedule: bytes
    tag: bytes
    proposal: bytes

    @classmethod
    def unpack(cls, descriptor: bytes) -> Descriptor:
        return cls(*DESCRIPTOR.unpack_from(descriptor))


assert tuple(f.name for f in dataclasses.fields(Descriptor)) == tuple(name for name, _ in FIELDS)


def algorithm_name_bytes(name: str) -> bytes:
    """``name`` as it travels in a descriptor; a name longer than the field is refused, never cut."""
    encoded = name.encode()
    if len(encoded) > MAX_ALGORITHM_NAME_BYTES:
        raise ValueError(
            f"algorithm: name {name!r} is {len(encoded)} bytes; names travel in every call's descriptor and may "
            f"have at most {MAX_ALGORITHM_NAME_BYTES}"
        )
    return encoded


def schedule_digest(schedule: Schedule) -> bytes:
    """A digest of everything that decides what ``schedule`` moves (its shape, parameters and streams)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    header = (
        schedule.name,
        schedule.collective.value,
        schedule.world_size,
        schedule.num_blocks,
        schedule.num_steps,
        schedule.segments,
        schedule.root,
    )
    h.update(repr(header).encode())
    streams = schedule.streams
    for field in dataclasses.fields(streams):
        h.update(field.name.encode())
        h.update(np.ascontiguousarray(getattr(streams, field.name)).tobytes())
    digest = h.digest()
    # a digest is never the "registered algorithm" marker
    return digest if digest != NO_DIGEST else b"\1" + digest[1:]


def tag_bytes(tag: str | None) -> bytes:
    """``tag`` as it travels in a descriptor; one that would not travel intact is refused, never cut."""
    if tag is None:
        return NO_TAG
    if not isinstance(tag, str):
        raise TypeError(f"tag: expected a str or None, got {type(tag).__name__}")
    encoded = tag.encode()
    if not encoded or b"\0" in encoded or len(encoded) > MAX_TAG_BYTES:
        raise ValueError(
            f"tag: {tag!r} must be a non-empty string of at most {MAX_TAG_BYTES} UTF-8 bytes without NUL "
            f"(it travels in every call's descriptor)"
        )
    return encoded


def barrier_descriptor(tag: bytes = NO_TAG) -> bytes:
    return DESCRIPTOR.pack(BARRIER_CODE, 0, NO_OP_CODE, 0, 0, 0, 0, 0, b"", NO_DIGEST, tag, b"")


def proposal_of(descriptor: bytes) -> str:
    """The algorithm a rank proposed (its descriptor's last field)."""
    raw: bytes = DESCRIPTOR.unpack_from(descriptor)[-1]
    return raw.rstrip(b"\0").decode()


def find_mismatch(descriptors: list[bytes]) -> tuple[str, list[str]] | None:
    """``None`` if every rank's request is the same; else the first field that differs and each rank's value."""
    first = descriptors[0][:REQUEST_BYTES]
    if all(d[:REQUEST_BYTES] == first for d in descriptors):
        return None
    decoded = [Descriptor.unpack(d) for d in descriptors]
    for name, _ in FIELDS:
        values = [_describe(name, getattr(row, name)) for row in decoded]
        if len(set(values)) > 1:
            return name, values
    return "descriptor", [d.hex() for d in descriptors]


def check_agreement(rank: int, seq: int, descriptors: list[bytes]) -> None:
    """:class:`MismatchError` naming the first field on which the ranks' calls of collective ``seq`` differ, if
    one does (the algorithm ``auto`` picked may differ: that is not a mismatch, rank 0's pick is run)."""
    mismatch = find_mismatch(descriptors)
    if mismatch is not None:
        field, values = mismatch
        per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise MismatchError(
            f"rank {rank}: collective {seq} mismatch before any data moved: ranks called it with different {field} "
            f"({per_rank})",
            rank=rank,
        )


_KIND_NAMES = {code: c.value for c, code in KIND_CODES.items()} | {BARRIER_CODE: "barrier"}
_DTYPE_NAMES = list(DTYPES)
_OP_NAMES = list(OPS)


def _describe(field: str, value: Any) -> str:
    if field == "collective":
        return _KIND_NAMES.get(int(value), str(value))
    if field == "dtype":
        return _DTYPE_NAMES[value] if value < len(_DTYPE_NAMES) else str(value)
    if field == "op":
        return _OP_NAMES[value] if value < len(_OP_NAMES) else "none"
    if field == "flags":
        names = [n for bit, n in ((FLAG_CHECKSUM, "checksum"), (FLAG_DETERMINISTIC, "deterministic")) if value & bit]
        return "+".join(names) or "none"
    if field in ("algorithm", "proposal"):
        return bytes(value).rstrip(b"\0").decode(errors="replace")
    if field == "tag":
        return repr(bytes(value).rstrip(b"\0").decode(errors="replace")) if any(value) else "no tag"
    if field == "schedule":
        return "registered" if value == NO_DIGEST else f"digest {bytes(value).hex()}"
    return str(value)
