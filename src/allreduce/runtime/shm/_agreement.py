"""The descriptor exchange of one collective over shared memory (``Transport.agree``).

A mixin of :class:`~allreduce.runtime.shm.ShmTransport` (its methods resolve like the class's own). Every rank
writes its descriptor into the slot of its control block chosen by the parity of the sequence number, stamps
the slot with the sequence number, and reads every peer's slot once stamped; a slot whose stamp, length or crc32
no writer could have produced is corruption, named with the word that holds it.
"""

from __future__ import annotations

import zlib

from allreduce.runtime.shm._segments import Segment
from allreduce.runtime.shm._waiting import PeerWaiting, corrupt_block_error

__all__ = ["Agreement"]


class Agreement(PeerWaiting):
    """``_agree``: the descriptor exchange (mixed into the transport, which sets the state)."""

    _ctl: list[Segment | None]
    _descriptor_words: tuple[int, int]
    _descriptor_payloads: tuple[int, int]
    _agreed_seq: int

    def _agree(self, seq: int, descriptor: bytes, *, deadline: float, timeout_s: float) -> list[bytes]:
        length_word = self._write_descriptor(seq, descriptor)
        out = self._descriptors(seq, descriptor, length_word, deadline=deadline)
        # Every peer has entered collective seq, so it has finished reading our data of seq - 1 and earlier:
        # execute(seq) may reuse the eager snapshot area of seq - 2 without waiting.
        self._agreed_seq = seq
        return out

    def _descriptors(self, seq: int, descriptor: bytes, length_word: int, *, deadline: float) -> list[bytes]:
        """Every rank's descriptor of collective ``seq``, once stamped. A peer's slot whose stamp is one its owner
        can have written and whose length word and bytes are this rank's is an equal, intact descriptor (the
        checks of :meth:`_read_descriptor` pass on it): then the list is this rank's descriptor N times. Else every
        slot is read and checked one by one, naming any corruption."""
        parity = seq & 1
        stamp_word = self._descriptor_words[parity]
        payload = self._descriptor_payloads[parity]
        end = payload + len(descriptor)
        views, ctl = self._views, self._ctl
        for p in range(self.world_size):
            if p == self.rank:
                continue
            view = views[p]
            if view[stamp_word] < seq:
                self._wait(p, stamp_word, seq, deadline=deadline, seq=seq, what="its call of this collective",
                           step=-1, floor=seq - 2 if seq >= 2 else None,
                           word_name=f"descriptors[{parity}].stamp")  # fmt: skip
            stamped = view[stamp_word]
            segment = ctl[p]
            if (
                stamped & 1 != parity
                or stamped > seq + 2
                or view[stamp_word + 1] != length_word
                or segment is None
                or segment.mm[payload:end] != descriptor
            ):
                return [
                    descriptor if q == self.rank else self._read_descriptor(q, seq, len(descriptor), deadline=deadline)
                    for q in range(self.world_size)
                ]
        return [descriptor] * self.world_size

    def _write_descriptor(self, seq: int, descriptor: bytes) -> int:
        """Publish this rank's ``descriptor`` for collective ``seq``; returns the slot's ``length`` word."""
        parity = seq & 1
        stamp_word = self._descriptor_words[parity]
        payload = self._descriptor_payloads[parity]
        own = self._ctl[self.rank]
        assert own is not None
        own.mm[payload : payload + len(descriptor)] = descriptor
        length_word = _descriptor_length_word(descriptor)
        self._views[self.rank][stamp_word + 1] = length_word
        self._publish(stamp_word, seq)
        self._agreed_seq = -1
        return length_word

    def _read_descriptor(self, p: int, seq: int, length: int, *, deadline: float) -> bytes:
        """Peer ``p``'s descriptor for collective ``seq`` (every rank's has ``length`` bytes), once stamped."""
        parity = seq & 1
        stamp_word = self._descriptor_words[parity]
        payload = self._descriptor_payloads[parity]
        segment = self._ctl[p]
        view = self._views[p]
        if view[stamp_word] < seq:
            # The slot held seq - 2 at the last agreement of this parity (stamps only grow): less is corruption.
            self._wait(p, stamp_word, seq, deadline=deadline, seq=seq, what="its call of this collective", step=-1,
                       floor=seq - 2 if seq >= 2 else None, word_name=f"descriptors[{parity}].stamp")  # fmt: skip
        assert segment is not None
        stamped, length_word = view[stamp_word], view[stamp_word + 1]
        # A slot holds the stamps of its parity only, and no peer is two collectives ahead of this one.
        if stamped & 1 != parity or stamped > seq + 2:
            raise corrupt_block_error(self.rank, p, f"descriptors[{parity}].stamp", stamped, seq=seq, step=-1)
        received_length = length_word & _DESCRIPTOR_LENGTH_MASK
        # Every rank's descriptor has the same length (a fixed layout): any other, 0 included (whose crc32 is
        # 0 too, so a zeroed word would pass the crc check below), is a word no writer produced.
        if received_length != length or length_word < 0:
            raise corrupt_block_error(self.rank, p, f"descriptors[{parity}].length", length_word, seq=seq, step=-1)
        received = segment.mm[payload : payload + length]  # a slice of an mmap is bytes
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
