"""A peer's mapped segments: real /dev/shm files, kept by recency, bounded in count and in bytes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest

from allreduce.runtime.shm._segments import SHM_DIR, PeerSegments, Segment


@pytest.fixture
def make_segment() -> Iterator[Callable[[int], Segment]]:
    paths: list[str] = []

    def make(size_bytes: int) -> Segment:
        path = os.path.join(SHM_DIR, f"allreduce-test-{uuid.uuid4().hex}")
        paths.append(path)
        return Segment(path, size_bytes, create=True)

    yield make
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)


def test_past_the_entry_limit_the_least_recently_used_segment_is_closed(make_segment: Callable[[int], Segment]) -> None:
    cache = PeerSegments(capacity=3, capacity_bytes=1 << 40, kept=1)
    segments = [make_segment(4096) for _ in range(4)]
    for i, segment in enumerate(segments[:3]):
        cache.add(i, segment)
    assert cache.get(0) is segments[0]  # 0 is now the most recent; 1 the least
    cache.add(3, segments[3])
    assert cache.get(1) is None
    assert segments[1].mm.closed
    assert [cache.get(i) is not None for i in (0, 2, 3)] == [True, True, True]


def test_past_the_byte_limit_segments_beyond_the_kept_ones_are_closed(make_segment: Callable[[int], Segment]) -> None:
    cache = PeerSegments(capacity=64, capacity_bytes=3 * 65536, kept=2)
    segments = [make_segment(65536) for _ in range(4)]
    for i, segment in enumerate(segments):
        cache.add(i, segment)
    assert len(cache) == 3
    assert cache.nbytes == 3 * 65536
    assert segments[0].mm.closed
    big = make_segment(1 << 20)
    cache.add(9, big)  # alone over the budget: the kept most recent ones stay
    assert len(cache) == 2
    assert cache.get(9) is big
    assert cache.get(3) is segments[3]
    assert cache.nbytes == (1 << 20) + 65536


def test_adding_an_id_again_closes_the_mapping_it_replaces(make_segment: Callable[[int], Segment]) -> None:
    cache = PeerSegments()
    first, second = make_segment(4096), make_segment(8192)
    cache.add(5, first)
    cache.add(5, second)
    assert first.mm.closed
    assert len(cache) == 1
    assert cache.nbytes == 8192
