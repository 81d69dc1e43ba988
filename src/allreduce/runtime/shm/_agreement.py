"""The descriptor exchange of one collective over shared memory (``Transport.agree``).

:class:`Agreement` holds the exchange's one piece of state, the last collective agreed. Every rank writes its
descriptor into the slot of its control block chosen by the parity of the sequence number, stamps the slot with
the sequence number, and reads every peer's slot once stamped; a slot whose stamp, length or crc32 no writer could
have produced is corruption, named with the word that holds it.
"""

from __future__ import annotations

import zlib

from allreduce.runtime.shm._layout import descriptor_payload_offset, descriptor_word
from allreduce.runtime.shm._segments import Segment
from allreduce.runtime.shm._waiting import Waiting
from allreduce.runtime.shm._watch import corrupt_block_error

__all__ = ["Agreement"]


class Agreement:
    """Rank ``rank``'s descriptor exchange over every rank's control block (``segments``, and ``views`` of them as
    int64 words), publishing and waiting through ``waiting``."""

    def __init__(self, rank: int, segments: list[Segment], views: list[memoryview], waiting: Waiting) -> None:
        self.rank = rank
        self.agreed_seq = -1
        """The last collective every rank entered: every peer has finished reading this rank's data of the one
        before it (``prepare`` and the eager path may reuse its snapshot area)."""
        self.stamp_words = (descriptor_word(0), descriptor_word(1))
        """The words of this rank's block that peers wait on (a rank that gives up wakes them)."""
        self._payloads = (descriptor_payload_offset(0), descriptor_payload_offset(1))
        self._world_size = len(views)
        self._segments = segments
        self._own = segments[rank].mm
        self._views = views
        self._own_view = views[rank]
        self._waiting = waiting
        self._publish = waiting.publish

    def agree(self, seq: int, descriptor: bytes, *, deadline: float) -> list[bytes]:
        """Every rank's ``descriptor`` of collective ``seq``, by rank (see :meth:`_descriptors`)."""
        parity = seq & 1
        stamp_word = self.stamp_words[parity]
        payload = self._payloads[parity]
        self._own[payload : payload + len(descriptor)] = descriptor
        length_word = _descriptor_length_word(descriptor)
        self._own_view[stamp_word + 1] = length_word
        self._publish(stamp_word, seq)
        self.agreed_seq = -1
        out = self._descriptors(seq, descriptor, length_word, deadline=deadline)
        # Every peer has entered collective seq, so it has finished reading our data of seq - 1 and earlier:
        # execute(seq) may reuse the eager snapshot area of seq - 2 without waiting.
        self.agreed_seq = seq
        return out

    def _descriptors(self, seq: int, descriptor: bytes, length_word: int, *, deadline: float) -> list[bytes]:
        """Every rank's descriptor of collective ``seq``, once stamped. A peer's slot whose stamp is one its owner
        can have written and whose length word and bytes are this rank's is an equal, intact descriptor (the
        checks of :meth:`_read_descriptor` pass on it): then the list is this rank's descriptor N times. Else every
        slot is read and checked one by one, naming any corruption."""
        parity = seq & 1
        stamp_word = self.stamp_words[parity]
        payload = self._payloads[parity]
        end = payload + len(descriptor)
        views, segments = self._views, self._segments
        for p in range(self._world_size):
            if p == self.rank:
                continue
            view = views[p]
            if view[stamp_word] < seq:
                self._wait_for_stamp(p, seq, deadline=deadline)
            stamped = view[stamp_word]
            if (
                stamped & 1 != parity
                or stamped > seq + 2
                or view[stamp_word + 1] != length_word
                or segments[p].mm[payload:end] != descriptor
            ):
                return [
                    descriptor if q == self.rank else self._read_descriptor(q, seq, len(descriptor), deadline=deadline)
                    for q in range(self._world_size)
                ]
        return [descriptor] * self._world_size

    def _wait_for_stamp(self, p: int, seq: int, *, deadline: float) -> None:
        """Wait until peer ``p`` has stamped its slot of collective ``seq``."""
        parity = seq & 1
        # The slot held seq - 2 at the last agreement of this parity (stamps only grow): less is corruption.
        self._waiting.wait(p, self.stamp_words[parity], seq, deadline=deadline, seq=seq,
                           what="its call of this collective", step=-1, floor=seq - 2 if seq >= 2 else None,
                           word_name=f"descriptors[{parity}].stamp")  # fmt: skip

    def _read_descriptor(self, p: int, seq: int, length: int, *, deadline: float) -> bytes:
        """Peer ``p``'s descriptor for collective ``seq`` (every rank's has ``length`` bytes), once stamped."""
        parity = seq & 1
        stamp_word = self.stamp_words[parity]
        payload = self._payloads[parity]
        view = self._views[p]
        if view[stamp_word] < seq:
            self._wait_for_stamp(p, seq, deadline=deadline)
        stamped, length_word = view[stamp_word], view[stamp_word + 1]
        # A slot holds the stamps of its parity only, and no peer is two collectives ahead of this one.
        if stamped & 1 != parity or stamped > seq + 2:
            raise corrupt_block_error(self.rank, p, f"descriptors[{parity}].stamp", stamped, seq=seq, step=-1)
        received_length = length_word & _DESCRIPTOR_LENGTH_MASK
        # Every rank's descriptor has the same length (a fixed layout): any other, 0 included (whose crc32 is
        # 0 too, so a zeroed word would pass the crc check below), is a word no writer produced.
        if received_length != length or length_word < 0:
            raise corrupt_block_error(self.rank, p, f"descriptors[{parity}].length", length_word, seq=seq, step=-1)
        received = self._segments[p].mm[payload : payload + length]  # a slice of an mmap is bytes
        if _descriptor_length_word(received) != length_word:
            raise corrupt_block_error(
                self.rank, p, f"descriptors[{parity}].payload", int.from_bytes(received[:8], "little"),
                seq=seq, step=-1,
            )  # fmt: skip
        return received


_DESCRIPTOR_LENGTH_MASK = (1 << 32) - 1
"""A descriptor slot's ``length`` word holds the payload's length in its low 32 bits and its crc32 (low 31 bits) above
them, so a reader tells a corrupted slot from a peer's different call."""


def _descriptor_length_word(descriptor: bytes) -> int:
    """The ``length`` word published with ``descriptor``: its length, and its crc32 (31 bits, so the word stays a
    non-negative int64) above it."""
    return (zlib.crc32(descriptor) & 0x7FFFFFFF) << 32 | len(descriptor)
