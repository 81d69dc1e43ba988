"""Fixtures for the shared-memory transport's parts, tested alone: the control blocks of ranks that met in one
process (a thread per rank, each mapping the others' real /dev/shm blocks), and a rank's parts built over them."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from shm_parts import BuildFn, MeetFn, Parts

from allreduce.runtime.shm._rendezvous import ControlBlocks
from allreduce.runtime.shm._segments import SHM_DIR, shm_prefix


@pytest.fixture
def meet() -> Iterator[MeetFn]:
    """Every rank's :class:`ControlBlocks` of a fresh job (see :data:`shm_parts.MeetFn`); released after the
    test."""
    made: list[ControlBlocks] = []

    def run(world_size: int = 2, cross_memory_mode: str = "off") -> list[ControlBlocks]:
        prefix = os.path.join(SHM_DIR, shm_prefix(f"parts-{uuid.uuid4().hex[:12]}"))
        with ThreadPoolExecutor(world_size) as pool:
            futures = [
                pool.submit(ControlBlocks, prefix, rank, world_size, timeout_s=30, cross_memory_mode=cross_memory_mode)
                for rank in range(world_size)
            ]
            blocks = [f.result() for f in futures]
        made.extend(blocks)
        return blocks

    yield run
    for blocks in made:
        blocks.release()


@pytest.fixture
def build(meet: MeetFn) -> Iterator[BuildFn]:
    """One rank's :class:`shm_parts.Parts` over its blocks; released after the test, before the blocks."""
    with contextlib.ExitStack() as releases:

        def run(blocks: ControlBlocks, **options: Any) -> Parts:
            parts = Parts(blocks, **options)
            releases.callback(parts.release)
            return parts

        yield run
