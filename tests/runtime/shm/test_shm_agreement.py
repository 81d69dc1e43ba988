"""The descriptor exchange alone: an :class:`Agreement` per rank over the control blocks of ranks that met in one
process (a thread each), no transport around them."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from shm_parts import BuildFn, MeetFn, Parts

from allreduce.runtime import CollectiveTimeoutError, ProtocolError
from allreduce.runtime.shm._layout import descriptor_word


@pytest.fixture
def ranks(meet: MeetFn, build: BuildFn) -> list[Parts]:
    return [build(b) for b in meet(3)]


@pytest.fixture
def pair(meet: MeetFn, build: BuildFn) -> list[Parts]:
    return [build(b) for b in meet(2)]


def _agree_all(ranks: list[Parts], seq: int, descriptors: list[bytes]) -> list[list[bytes]]:
    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = [
            pool.submit(r.agreement.agree, seq, d, deadline=time.monotonic() + 30)
            for r, d in zip(ranks, descriptors, strict=True)
        ]
        return [f.result() for f in futures]


def test_equal_descriptors_come_back_once_per_rank(ranks: list[Parts]) -> None:
    assert _agree_all(ranks, 0, [b"same call"] * 3) == [[b"same call"] * 3] * 3


def test_different_descriptors_come_back_by_rank_on_every_rank(ranks: list[Parts]) -> None:
    sent = [b"call A", b"call B", b"call A"]
    assert _agree_all(ranks, 0, sent) == [sent] * 3


def test_an_agreement_records_the_collective_every_rank_entered(ranks: list[Parts]) -> None:
    assert [r.agreement.agreed_seq for r in ranks] == [-1] * 3
    for seq in range(4):  # both slots, twice each
        assert _agree_all(ranks, seq, [bytes([seq]) * 8] * 3) == [[bytes([seq]) * 8] * 3] * 3
    assert [r.agreement.agreed_seq for r in ranks] == [3] * 3


def test_a_rank_that_never_comes_is_waited_for_until_the_deadline(ranks: list[Parts]) -> None:
    with pytest.raises(CollectiveTimeoutError, match="at the descriptor exchange waiting for rank 1") as caught:
        ranks[0].agreement.agree(0, b"alone", deadline=time.monotonic() + 0.05)
    assert caught.value.peer == 1
    assert ranks[0].agreement.agreed_seq == -1


# In these two, the test writes rank 1's block as nothing but corruption could, and rank 0 agrees.
def test_a_stamp_of_the_other_parity_is_named_as_corruption_of_its_owners_block(pair: list[Parts]) -> None:
    pair[1].blocks.views[1][descriptor_word(1)] = 1 << 40
    with pytest.raises(
        ProtocolError, match=r"rank 1's control block is corrupt \(word descriptors\[1\].stamp"
    ) as caught:
        pair[0].agreement.agree(1, b"d", deadline=time.monotonic() + 30)
    assert caught.value.peer == 1


def test_a_length_word_no_writer_produced_is_named_as_corruption(pair: list[Parts]) -> None:
    slot = descriptor_word(0)
    pair[1].blocks.views[1][slot + 1] = 0  # the length and crc32 of an empty payload, which no rank sends
    pair[1].blocks.views[1][slot] = 0
    with pytest.raises(ProtocolError, match=r"rank 1's control block is corrupt \(word descriptors\[0\].length = 0\)"):
        pair[0].agreement.agree(0, b"d", deadline=time.monotonic() + 30)
