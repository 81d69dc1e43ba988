"""Reading a peer's data alone: a :class:`PeerData` over the control blocks of two ranks that met in one process
(a thread each), the peer's data put where its owner would put it: its snapshot area, a shared segment, its
private memory."""

from __future__ import annotations

import numpy as np
import pytest
from shm_parts import BuildFn, MeetFn

from allreduce.runtime import PeerFailureError, ProtocolError
from allreduce.runtime.shm._compile import IN_USER, Piece, Receive
from allreduce.runtime.shm._layout import BUFFER_OFFSET_WORD, BUFFER_SEGMENT_WORD, IN_PRIVATE_MEMORY, PTRACER_WORD
from allreduce.runtime.shm._linux import CROSS_MEMORY_SUPPORTED
from allreduce.runtime.shm._peer_data import CROSS_MEMORY_CHUNK_BYTES, PeerData, Remote
from allreduce.runtime.shm._rendezvous import ControlBlocks
from allreduce.runtime.shm._segments import LocalSegments

F32 = np.dtype(np.float32)


def _add_into(dst: np.ndarray, incoming: np.ndarray) -> None:  # type: ignore[type-arg]
    np.add(dst, incoming, out=dst)


@pytest.fixture
def pair(meet: MeetFn, build: BuildFn) -> tuple[list[ControlBlocks], list[PeerData]]:
    blocks = meet(2, "open")
    return blocks, [build(b).peer_data for b in blocks]


Pair = tuple[list[ControlBlocks], list[PeerData]]


def _publish_home(blocks: ControlBlocks, segment_id: int, offset: int) -> None:
    """Where rank ``blocks.rank`` says its data is, as its transport publishes it."""
    own = blocks.views[blocks.rank]
    own[BUFFER_SEGMENT_WORD] = segment_id
    own[BUFFER_OFFSET_WORD] = offset


def test_a_peers_snapshot_area_is_read_where_the_peer_wrote_it(pair: Pair) -> None:
    _, (zero, one) = pair
    one.eager_area(1, 7, F32)[:4] = [1, 2, 3, 4]
    assert zero.eager_area(1, 7, F32)[:4].tolist() == [1, 2, 3, 4]
    assert zero.eager_area(1, 8, F32)[:4].tolist() == [0, 0, 0, 0]  # the other parity's area


def test_a_peers_shared_segment_is_read_in_place(pair: Pair) -> None:
    blocks, (zero, _) = pair
    segments = LocalSegments(blocks[1].prefix, 1)
    try:
        data = segments.allocate(1024).view(np.float32)
        data[:] = np.arange(256)
        located = segments.locate(data[16:])
        assert located is not None
        _publish_home(blocks[1], *located)
        theirs = zero.peer_array(1, F32, 240, seq=0, step=0)
        assert isinstance(theirs, np.ndarray)
        assert theirs.tolist() == list(range(16, 256))
        data[20] = -1  # the same memory, not a copy
        assert theirs[4] == -1
        del theirs
    finally:
        segments.release()


def test_an_offset_past_the_peers_segment_is_named_as_corruption(pair: Pair) -> None:
    blocks, (zero, _) = pair
    segments = LocalSegments(blocks[1].prefix, 1)
    try:
        segments.allocate(1 << 16)
        _publish_home(blocks[1], 1, 8)  # 16 KiB of float32 from byte 8 do not fit in its 64 KiB
        with pytest.raises(ProtocolError, match=r"rank 1's control block is corrupt \(word buffer_offset = 8\)"):
            zero.peer_array(1, F32, 1 << 14, seq=3, step=1)
    finally:
        segments.release()


def test_a_segment_its_owner_released_is_named_as_the_peer_gone(pair: Pair) -> None:
    blocks, (zero, _) = pair
    _publish_home(blocks[1], 5, 0)  # a segment no file backs (any more)
    with pytest.raises(PeerFailureError, match="rank 1 released its shared memory during collective 2") as caught:
        zero.peer_array(1, F32, 16, seq=2, step=0)
    assert (caught.value.peer, caught.value.step) == (1, 0)


@pytest.mark.skipif(not CROSS_MEMORY_SUPPORTED, reason="no process_vm_readv")
def test_a_peers_private_array_is_fetched_from_its_address(pair: Pair) -> None:
    blocks, (zero, _) = pair
    private = np.arange(100, dtype=np.float32)
    _publish_home(blocks[1], IN_PRIVATE_MEMORY, int(private.ctypes.data))
    remote = zero.peer_array(1, F32, 100, seq=0, step=0)
    assert isinstance(remote, Remote)
    out = np.empty(10, np.float32)
    zero.fetch(remote, 40, out, seq=0, step=0)
    assert out.tolist() == list(range(40, 50))


@pytest.mark.skipif(not CROSS_MEMORY_SUPPORTED, reason="no process_vm_readv")
def test_a_reduce_out_of_private_memory_goes_through_scratch_pieces(pair: Pair) -> None:
    blocks, (zero, _) = pair
    count = CROSS_MEMORY_CHUNK_BYTES // 4 * 2 + 5  # two whole scratch pieces and a bit
    theirs = np.arange(count, dtype=np.float32)
    _publish_home(blocks[1], IN_PRIVATE_MEMORY, int(theirs.ctypes.data))
    remote = zero.peer_array(1, F32, count, seq=0, step=0)
    assert isinstance(remote, Remote)
    mine = np.ones(count, np.float32)
    receive = Receive(1, 0, count, reduce=True, crc_slot=0, pieces=(Piece(0, count, IN_USER, IN_USER, False, ()),))
    zero.receive_remote(receive.pieces[0], receive, remote, arrays=(mine, mine), ufunc=np.add,
                        reduce_into=_add_into, seq=0, step=0)  # fmt: skip
    assert np.array_equal(mine, theirs + 1)


@pytest.mark.skipif(not CROSS_MEMORY_SUPPORTED, reason="no process_vm_readv")
def test_under_the_ptracer_discipline_a_reader_the_owner_did_not_name_is_refused(pair: Pair, build: BuildFn) -> None:
    blocks, _ = pair
    reader = build(blocks[0], ptracer=True).peer_data
    private = np.arange(8, dtype=np.float32)
    _publish_home(blocks[1], IN_PRIVATE_MEMORY, int(private.ctypes.data))
    remote = reader.peer_array(1, F32, 8, seq=0, step=0)
    assert isinstance(remote, Remote)
    out = np.empty(8, np.float32)
    with pytest.raises(ProtocolError, match="rank 1 had not named this rank its ptracer"):
        reader.fetch(remote, 0, out, seq=0, step=0)
    blocks[1].views[1][PTRACER_WORD] = 0  # rank 1 names rank 0
    reader.fetch(remote, 0, out, seq=0, step=0)
    assert out.tolist() == private.tolist()
