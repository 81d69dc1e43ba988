"""One rank's parts of the shared-memory transport built over its control blocks, as the transport composes them,
for the tests that exercise a part alone (the fixtures are in this folder's conftest.py)."""

from __future__ import annotations

from collections.abc import Callable

from allreduce.runtime.shm._agreement import Agreement
from allreduce.runtime.shm._peer_data import PeerData
from allreduce.runtime.shm._rendezvous import ControlBlocks
from allreduce.runtime.shm._waiting import SpinPolicy, Waiting
from allreduce.runtime.shm._watch import PeerWatch

__all__ = ["BuildFn", "MeetFn", "Parts"]


class Parts:
    """Rank ``blocks.rank``'s watch, waiting, agreement and peer data over ``blocks``."""

    def __init__(self, blocks: ControlBlocks, *, policy: SpinPolicy | None = None, ptracer: bool = False) -> None:
        self.blocks = blocks
        self.watch = PeerWatch(blocks.rank, blocks.views, blocks.pidfds, blocks.prefix)
        self.waiting = Waiting(
            blocks.rank, blocks.views, blocks.addresses, watch=self.watch, policy=policy or SpinPolicy(0.0)
        )
        self.agreement = Agreement(blocks.rank, blocks.segments, blocks.views, self.waiting)
        self.peer_data = PeerData(blocks.rank, blocks.prefix, blocks.segments, blocks.views, blocks.peer_pids,
                                  layout=blocks.layout, ptracer=ptracer, watch=self.watch)  # fmt: skip

    def release(self) -> None:
        """What holds views into the blocks lets go of them (before the blocks are released)."""
        self.peer_data.release()
        self.waiting.release()


MeetFn = Callable[..., list[ControlBlocks]]
"""The ``meet`` fixture: ``meet(world_size=2, cross_memory_mode="off")``, every rank's control blocks of a fresh
job, met by a thread per rank of this process."""

BuildFn = Callable[..., Parts]
"""The ``build`` fixture: ``build(blocks, policy=None, ptracer=False)``, one rank's :class:`Parts`."""
