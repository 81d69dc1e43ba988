"""Small all-reduces in one pass: the step-0 snapshot, the descriptor exchange and the plan's steps, without the
general loop's bookkeeping.

A mixin of :class:`~allreduce.runtime.shm.ShmTransport` (its methods resolve like the class's own).
:meth:`SmallCalls.run_small` is what the group calls for an all-reduce whose buffer goes through the eager
snapshots (:meth:`~allreduce.runtime.shm.ShmTransport.prepare`). It writes the same words in the same order as
``prepare()``, ``agree()`` and ``execute()`` on the eager path, so a peer that takes the general path for the same
collective (a torch tensor, ``eager_bytes=0``, a non-contiguous array) pairs with it. What it saves is Python: the
plan is compiled once per dtype and sequence-number parity into views of the snapshot areas, so a step is a
counter, a wait that is usually already satisfied and one ufunc call per receive; the descriptors are compared as
bytes, and read and checked one by one (:meth:`~allreduce.runtime.shm._agreement.Agreement._read_descriptor`)
only when one differs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.runtime._errors import CollectiveError
from allreduce.runtime._plan import RankPlan
from allreduce.runtime._stats import Recorder
from allreduce.runtime._transport import Call, PlanCache, ReduceInto
from allreduce.runtime.shm._agreement import Agreement
from allreduce.runtime.shm._compile import Program, Receive, compile_program
from allreduce.runtime.shm._copy import copy_into
from allreduce.runtime.shm._layout import (
    BUFFER_OFFSET_WORD,
    BUFFER_SEGMENT_WORD,
    DONE_STEP,
    IN_EAGER_SNAPSHOT,
    PROGRESS_WORD,
    READ_DONE_WORD,
    STEP_BITS,
)
from allreduce.runtime.shm._peer_data import PeerData, Remote, apply_op

__all__ = ["SmallCalls", "SmallProgram"]

_Copy = tuple[npt.NDArray[Any], int, int]
"""A step's sent range (this rank's snapshot view for it, start, stop): the view takes ``buffer[start:stop]``."""
_Recv = tuple[int, int, int, bool, npt.NDArray[Any], bool, Receive]
"""A receive: (peer, start, stop, reduce, the peer's snapshot view of the range, whole buffer?, the receive)."""
_Step = tuple[int, tuple[_Copy, ...], tuple[_Recv, ...]]
"""(step index, sent ranges to snapshot, receives)."""


class SmallProgram:
    """A plan's eager program for one dtype and parity, as views: made once, reused by every call like it."""

    __slots__ = ("own_step0", "program", "steps")

    def __init__(self, program: Program, own_step0: npt.NDArray[Any], steps: tuple[_Step, ...]) -> None:
        self.program = program
        self.own_step0 = own_step0
        self.steps = steps


class SmallCalls(Agreement, PeerData):
    """``run_small``: prepare + agree + execute of a small all-reduce in one pass (mixed into the transport)."""

    # the transport's (allreduce.runtime.Transport)
    _closed: bool
    _failure: CollectiveError | None
    plans: PlanCache
    recorder: Recorder
    check_usable: Callable[[], None]
    _record_failure: Callable[[BaseException, int], CollectiveError]
    # ShmTransport's
    _agreed_seq: int
    _prepared_seq: int
    _eager_bytes: int
    _eager_step_bound: int
    _executes_eager: int
    _small_calls: int
    _small_programs: dict[tuple[RankPlan, np.dtype[Any], int], SmallProgram]

    def small_bytes(self, seq: int) -> int:
        """The largest buffer :meth:`run_small` takes for collective ``seq`` (0: none; it needs the collective
        before to have been agreed, which proves every peer is done with the snapshot area it reuses)."""
        if self._agreed_seq != seq - 1 or self.world_size == 1:
            return 0
        return self._eager_bytes // self._eager_step_bound

    def run_small(self, call: Call, descriptor: bytes) -> list[bytes] | None:
        """All-reduce ``call.buffer`` (1-D, C-contiguous, at most :meth:`small_bytes`) by its plan: None when done;
        the descriptors when they differ (nothing was read: the group raises, or runs rank 0's plan with
        ``execute``)."""
        plan, buffer, reducer, seq, deadline, _, _ = call  # one unpacking: the hot path
        if self._closed or self._failure is not None:
            self.check_usable()
        try:
            parity = seq & 1
            small = self._small_program(plan, buffer.dtype, parity)
            views = self._views
            me = views[self.rank]
            base = seq << STEP_BITS
            # prepare(): the step-0 snapshot, then "at step 0"
            small.own_step0[...] = buffer
            me[BUFFER_SEGMENT_WORD] = IN_EAGER_SNAPSHOT
            me[BUFFER_OFFSET_WORD] = 0
            self._prepared_seq = seq
            self._publish(PROGRESS_WORD, base)
            # agree(): the descriptors, compared as bytes (read and checked one by one only if one differs)
            length_word = self._write_descriptor(seq, descriptor)
            descriptors = self._descriptors(seq, descriptor, length_word, deadline=deadline)
            self._agreed_seq = seq
            if any(d is not descriptor for d in descriptors):
                return descriptors
            self._executes_eager += 1
            self._small_calls += 1
            # execute(): the plan's steps on the snapshots
            ufunc = reducer.ufunc  # type: ignore[attr-defined]
            recorder = self.recorder
            mark = recorder.append if recorder.enabled else None
            clock = time.perf_counter_ns
            if mark is not None:
                mark(small.program.tag)
            boundary = True
            for index, copies, recvs in small.steps:
                if mark is not None and not recvs:
                    mark(clock())
                    boundary = True
                if index:
                    for snapshot, a, b in copies:
                        snapshot[...] = buffer[a:b]
                    self._publish(PROGRESS_WORD, base + index)
                target = base + index
                for peer, a, b, reduce, source, whole, rv in recvs:
                    waited = 0
                    if views[peer][PROGRESS_WORD] < target:
                        waited = self._wait(peer, PROGRESS_WORD, target, deadline=deadline, seq=seq,
                                            what="its data for this step", step=index)  # fmt: skip
                    if mark is not None:
                        if waited:
                            mark(self.wait_began)
                        elif boundary:
                            mark(clock())
                        else:
                            mark(0)
                        boundary = False
                        mark(waited)
                    if views[peer][BUFFER_SEGMENT_WORD] != IN_EAGER_SNAPSHOT:
                        self._receive_published(rv, buffer, reducer, seq=seq, step=index)
                        continue
                    mine = buffer if whole else buffer[a:b]
                    if reduce:
                        ufunc(mine, source, out=mine)
                    else:
                        mine[...] = source
                self._publish(READ_DONE_WORD, base + index + 1)
            if mark is not None:
                mark(clock())
            self._publish(PROGRESS_WORD, base + DONE_STEP)
            return None
        except (ValueError, TypeError):
            raise
        except BaseException as exc:
            self._record_failure(exc, seq)
            raise

    def _small_program(self, plan: RankPlan, dtype: np.dtype[Any], parity: int) -> SmallProgram:
        key = (plan, dtype, parity)
        small = self._small_programs.get(key)
        if small is not None:
            return small
        program = self.plans.get(("shm", plan, True), lambda: compile_program(plan, True))
        count = plan.count
        own = self._eager_area(self.rank, parity, dtype)

        def whole(rv: Receive) -> bool:
            return rv.start == 0 and rv.stop == count

        steps: list[_Step] = []
        for st in program.steps:
            at = st.index * count
            ranges = sorted({(a, b) for _, _, a, b in st.send_crcs})
            copies = tuple((own[at + a : at + b], a, b) for a, b in ranges)
            recvs = tuple(
                (rv.peer, rv.start, rv.stop, rv.reduce, self._peer_step_view(rv, parity, dtype, at), whole(rv), rv)
                for rv in st.recvs
            )
            steps.append((st.index, copies, recvs))
        if len(self._small_programs) >= 64:
            self._small_programs.clear()
        small = self._small_programs[key] = SmallProgram(program, own[:count], tuple(steps))
        return small

    def _peer_step_view(self, rv: Receive, parity: int, dtype: np.dtype[Any], at: int) -> npt.NDArray[Any]:
        """The range ``rv`` receives, in its sender's snapshot of the step that starts at element ``at``."""
        return self._eager_area(rv.peer, parity, dtype)[at + rv.start : at + rv.stop]

    def _receive_published(
        self, rv: Receive, buffer: npt.NDArray[Any], reducer: ReduceInto, *, seq: int, step: int
    ) -> None:
        """A receive from a peer that published its data elsewhere than in its snapshots (it took the general
        path with snapshots off): read where it says, like the general loop."""
        ufunc = getattr(reducer, "ufunc", None)
        source = self._peer_array(rv.peer, buffer.dtype, buffer.size, seq=seq, step=step)
        arrays = (buffer, buffer)
        for pc in rv.pieces:
            a, b = pc.start, pc.stop
            if isinstance(source, Remote):
                self._receive_remote(pc, rv, source, arrays=arrays, ufunc=ufunc, reduce_into=reducer, seq=seq,
                                     step=step)  # fmt: skip
            elif rv.reduce:
                apply_op(ufunc, reducer, buffer[a:b], source[a:b], buffer[a:b], in_place=True)
            else:
                copy_into(buffer[a:b], source[a:b])
