"""The control block: one small shared segment per rank, declared once as :class:`ControlHeader`.

A rank writes only its own control block; peers map it and read it. The fixed header holds the counters
that carry all synchronisation (``progress``, ``read_done``), the abort flag and its culprit, where this rank's
data lives for the current collective, two descriptor slots for :meth:`~allreduce.runtime.Transport.agree`, and
one "asleep" word per peer. After the header come two areas whose size depends on the group
(:class:`ControlLayout`): the crc32 of every block sent to every peer (``checksum=True``) and two eager snapshot
areas (small buffers; alternating by sequence number).

Every access goes through one view of the block as 8-byte words (``memoryview.cast("q")``); the word indices
below are derived from the declared structure, never written by hand. Counters are aligned 8-byte stores, so
readers never see a torn value, and x86 TSO orders them with the data written before.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from allreduce.runtime.transport._transport import MAX_DESCRIPTOR_BYTES

__all__ = [
    "ABORTED_WORD",
    "ATTACHED_WORD",
    "BUFFER_OFFSET_WORD",
    "BUFFER_SEGMENT_WORD",
    "CLOSED_WORD",
    "CRC_SLOTS_PER_PEER",
    "CROSS_MEMORY_WORD",
    "CULPRIT_WORD",
    "DESCRIPTOR_BYTES",
    "DONE_STEP",
    "EAGER_BYTES",
    "IN_EAGER_SNAPSHOT",
    "IN_PRIVATE_MEMORY",
    "MAGIC",
    "MAGIC_WORD",
    "MAX_RANKS",
    "NOT_WAITING",
    "NO_ABORT",
    "NO_CULPRIT",
    "PAGE_BYTES",
    "PID_WORD",
    "PROBE_ADDRESS_WORD",
    "PROGRESS_WORD",
    "PTRACER_READY_WORD",
    "PTRACER_WORD",
    "READS_OPEN",
    "READS_WITH_PTRACER",
    "READ_DONE_WORD",
    "SEQ_WORD",
    "SLEEPERS_WORD",
    "STEP_BITS",
    "STEP_WORD",
    "UNSATISFIABLE",
    "WAITING_FOR_WORD",
    "ControlHeader",
    "ControlLayout",
    "DescriptorSlot",
    "descriptor_payload_offset",
    "descriptor_word",
    "stamp",
]

MAX_RANKS = 512
"""Most ranks one host's shared-memory group may have: the header keeps one "asleep" word per possible peer."""

MAGIC = 0x414C4C5245445543
"""``"ALLREDUC"``: written last when a control block is initialised; peers attach only once they see it."""

DESCRIPTOR_BYTES = MAX_DESCRIPTOR_BYTES
"""Payload of one descriptor slot: the transport interface's longest descriptor."""

CRC_SLOTS_PER_PEER = 1024
"""crc32 slots per (sender, receiver) pair and collective: the most transfers ``checksum=True`` supports."""

EAGER_BYTES = 256 << 10
"""Size of each of the two eager snapshot areas (one per sequence-number parity). A buffer goes eager when
(its plan's last step + 1) x its size fits: every step's sent data gets a place of its own."""

PAGE_BYTES = 4096
"""The eager areas start on a page of their own (the copy into them then never shares a page with counters)."""

STEP_BITS = 24
"""``progress`` and ``read_done`` hold ``seq << STEP_BITS | step``: one comparison orders collectives and steps."""

DONE_STEP = (1 << STEP_BITS) - 1
"""The step value a rank publishes in ``progress`` when it has finished a collective."""

NO_ABORT = 0
"""``aborted`` of a rank that has not given up; otherwise it holds the shared abort kind + 1."""

UNSATISFIABLE = 2
"""A target no flag ever reaches (flags are 0 or 1): waiting for it makes any departure of the peer an error."""

NOT_WAITING = -1
"""``waiting_for`` of a rank that is not blocked on a peer (a stalled rank's, whoever waits for it)."""

NO_CULPRIT = -2
"""``culprit`` of a rank that has not given up: a value no abort writes (it writes a rank, or -1 for none, before
it sets ``aborted``), so an ``aborted`` word set over it is corruption, not a rank 0 to blame."""

IN_PRIVATE_MEMORY = -1
"""``buffer_segment``: the owner's private array at address ``buffer_offset``, read with ``process_vm_readv``."""

IN_EAGER_SNAPSHOT = -2
"""``buffer_segment``: each step's sent data is a snapshot in the owner's control block (small buffers)."""


READS_OPEN = 1
"""``cross_memory`` bit: the owner read every peer's private memory with no permission of theirs (no Yama)."""

READS_WITH_PTRACER = 2
"""``cross_memory`` bit: the owner read its predecessor's private memory once that peer had named it its ptracer
(``PR_SET_PTRACER``; how ranks read each other under Yama ``ptrace_scope = 1``)."""


class DescriptorSlot(ctypes.Structure):
    """One collective's descriptor: ``stamp`` is the sequence number once ``length`` bytes of payload are valid."""

    _fields_ = (
        ("stamp", ctypes.c_int64),
        ("length", ctypes.c_int64),
        ("payload", ctypes.c_char * DESCRIPTOR_BYTES),
    )


class ControlHeader(ctypes.Structure):
    """The fixed part of a rank's control block (every field an aligned 8-byte word or an array of them)."""

    _fields_ = (
        ("magic", ctypes.c_int64),  # MAGIC once initialised
        ("pid", ctypes.c_int64),  # the owner's process id (peers watch it with a pidfd)
        ("attached", ctypes.c_int64),  # 1: the owner has mapped every peer's block
        ("progress", ctypes.c_int64),  # stamp(seq, t): my data holds the state at the start of step t
        ("read_done", ctypes.c_int64),  # stamp(seq, t + 1): I have finished reading my peers' step-t data
        ("aborted", ctypes.c_int64),  # NO_ABORT, or the shared abort kind + 1 of the error this rank gave up with
        ("culprit", ctypes.c_int64),  # the rank that error names
        ("seq", ctypes.c_int64),  # the collective it gave up in
        ("step", ctypes.c_int64),  # and the step (-1: the descriptor exchange)
        ("buffer_segment", ctypes.c_int64),  # where my data is: a data segment id, IN_PRIVATE_MEMORY, IN_EAGER_...
        ("buffer_offset", ctypes.c_int64),  # byte offset in that segment, or the private array's address
        ("closed", ctypes.c_int64),  # 1: the owner closed the transport
        ("probe_address", ctypes.c_int64),  # where the owner mapped this block (peers probe process_vm_readv there)
        ("cross_memory", ctypes.c_int64),  # READS_OPEN | READS_WITH_PTRACER: how the owner could read peers
        ("ptracer_ready", ctypes.c_int64),  # 1: the owner has named its successor its ptracer (start-up probe)
        ("ptracer", ctypes.c_int64),  # the rank the owner has named its ptracer (-1: none); readers check it
        ("waiting_for", ctypes.c_int64),  # the rank the owner is blocked waiting on, or NOT_WAITING
        ("descriptors", DescriptorSlot * 2),  # by the parity of seq
        ("sleepers", ctypes.c_int64 * MAX_RANKS),  # [r] = 1: rank r is (about to be) blocked on one of my counters
    )


_WORD_BYTES = ctypes.sizeof(ctypes.c_int64)


def _word(field: str) -> int:
    offset: int = getattr(ControlHeader, field).offset
    return offset // _WORD_BYTES


MAGIC_WORD = _word("magic")
PID_WORD = _word("pid")
ATTACHED_WORD = _word("attached")
PROGRESS_WORD = _word("progress")
READ_DONE_WORD = _word("read_done")
ABORTED_WORD = _word("aborted")
CULPRIT_WORD = _word("culprit")
SEQ_WORD = _word("seq")
STEP_WORD = _word("step")
BUFFER_SEGMENT_WORD = _word("buffer_segment")
BUFFER_OFFSET_WORD = _word("buffer_offset")
CLOSED_WORD = _word("closed")
PROBE_ADDRESS_WORD = _word("probe_address")
CROSS_MEMORY_WORD = _word("cross_memory")
PTRACER_READY_WORD = _word("ptracer_ready")
PTRACER_WORD = _word("ptracer")
SLEEPERS_WORD = _word("sleepers")
WAITING_FOR_WORD = _word("waiting_for")


def descriptor_word(parity: int) -> int:
    """Word index of descriptor slot ``parity``'s ``stamp`` (its ``length`` is the next word)."""
    return (ControlHeader.descriptors.offset + parity * ctypes.sizeof(DescriptorSlot)) // _WORD_BYTES


def descriptor_payload_offset(parity: int) -> int:
    """Byte offset of descriptor slot ``parity``'s payload."""
    return ControlHeader.descriptors.offset + parity * ctypes.sizeof(DescriptorSlot) + DescriptorSlot.payload.offset


def stamp(seq: int, step: int) -> int:
    """The counter value meaning "collective ``seq``, step ``step``"."""
    return seq << STEP_BITS | step


@dataclass(frozen=True, slots=True)
class ControlLayout:
    """Where the group-sized areas of a control block are, for ``world_size`` ranks (byte offsets)."""

    world_size: int

    @property
    def crc_offset(self) -> int:
        """uint32 crc32 values, indexed ``receiver * CRC_SLOTS_PER_PEER + k`` (the k-th transfer to it)."""
        return ctypes.sizeof(ControlHeader)

    @property
    def crc_count(self) -> int:
        return self.world_size * CRC_SLOTS_PER_PEER

    @property
    def eager_offset(self) -> int:
        """The first eager snapshot area (the second follows at ``eager_offset + EAGER_BYTES``)."""
        end = self.crc_offset + 4 * self.crc_count
        return -(-end // PAGE_BYTES) * PAGE_BYTES

    def eager_area_offset(self, seq: int) -> int:
        return self.eager_offset + (seq % 2) * EAGER_BYTES

    @property
    def size_bytes(self) -> int:
        return self.eager_offset + 2 * EAGER_BYTES
