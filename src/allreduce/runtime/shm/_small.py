"""Small all-reduces through the eager snapshots: the head start of ``prepare()``, and the whole call in one pass
(the step-0 snapshot, the descriptor exchange and the plan's steps, without the general loop's bookkeeping).

:class:`SmallCalls` owns the snapshot policy (``eager_bytes``, the step bound), the collective whose step 0 it
published, and the compiled small programs. :meth:`SmallCalls.run` is the transport's ``run_small``, what the
group calls for an all-reduce whose buffer goes through the eager snapshots. It writes the same words in the same
order as ``prepare()``, ``agree()`` and ``execute()`` on the eager path, so a peer that takes the general path for
the same collective (a torch tensor, ``eager_bytes=0``, a non-contiguous array) pairs with it. What it saves is
Python: the plan is compiled once per dtype and sequence-number parity into views of the snapshot areas, so a step
is a counter, a wait that is usually already satisfied and one ufunc call per receive; the descriptors are compared
as bytes, and read and checked one by one (:class:`~allreduce.runtime.shm._agreement.Agreement`) only when one
differs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.runtime.shm._agreement import Agreement
from allreduce.runtime.shm._compile import RankProgram, Receive, compile_program
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
from allreduce.runtime.shm._waiting import Waiting
from allreduce.runtime.stats._stats import Recorder
from allreduce.runtime.transport._plan import RankPlan
from allreduce.runtime.transport._transport import Call, PlanCache, ReduceInto

__all__ = ["EAGER_STEPS_PER_RANK", "EAGER_STEPS_SLACK", "SmallCalls", "SmallProgram", "eager_step_bound"]

EAGER_STEPS_PER_RANK = 2
EAGER_STEPS_SLACK = 8
"""``prepare()`` publishes a small buffer before the ranks agree on a plan, so it must bound the steps of any plan:
``EAGER_STEPS_PER_RANK * N + EAGER_STEPS_SLACK`` (a ring takes 2(N - 1) steps; trees and doubling fewer)."""

SMALL_PROGRAMS_KEPT = 64
"""Compiled small programs a rank keeps (plans x dtypes x parities) before it forgets them all and starts over."""


def eager_step_bound(world_size: int) -> int:
    """The most steps a plan may have for a buffer that ``prepare()`` published (see :data:`EAGER_STEPS_SLACK`)."""
    return EAGER_STEPS_PER_RANK * world_size + EAGER_STEPS_SLACK


_Copy = tuple[npt.NDArray[Any], int, int]
"""A step's sent range (this rank's snapshot view for it, start, stop): the view takes ``buffer[start:stop]``."""
_Recv = tuple[int, int, int, bool, npt.NDArray[Any], bool, Receive]
"""A receive: (peer, start, stop, reduce, the peer's snapshot view of the range, whole buffer?, the receive)."""
_Step = tuple[int, tuple[_Copy, ...], tuple[_Recv, ...]]
"""(step index, sent ranges to snapshot, receives)."""


class SmallProgram:
    """A plan's eager program for one dtype and parity, as views: made once, reused by every call like it."""

    __slots__ = ("own_step0", "program", "steps")

    def __init__(self, program: RankProgram, own_step0: npt.NDArray[Any], steps: tuple[_Step, ...]) -> None:
        self.program = program
        self.own_step0 = own_step0
        self.steps = steps


class SmallCalls:
    """Rank ``rank``'s small all-reduces over ``views`` (every rank's control block as int64 words): the step-0
    head start and the one-pass call, reading peers through ``peer_data``, agreeing through ``agreement``,
    publishing and waiting through ``waiting``; compiled plans are cached in the group's ``plans``, and each call's
    receives recorded into ``recorder`` while it is enabled.

    ``eager_bytes``: buffers whose (steps x size) fits go through the snapshots (0: never). The transport's own
    ``check_usable`` and ``record_failure`` are called when it was closed or failed (it clears :attr:`usable`)
    and when a call fails."""

    def __init__(
        self,
        rank: int,
        views: list[memoryview],
        *,
        peer_data: PeerData,
        agreement: Agreement,
        waiting: Waiting,
        plans: PlanCache,
        recorder: Recorder,
        eager_bytes: int,
        check_usable: Callable[[], None],
        record_failure: Callable[[BaseException, int], object],
    ) -> None:
        self.rank = rank
        self.world_size = len(views)
        self.eager_bytes = eager_bytes
        self.step_bound = eager_step_bound(self.world_size)
        self.usable = True
        """False once the transport is closed or failed: then a call asks its ``check_usable``, which raises."""
        self.prepared_seq = -1
        """The collective whose step-0 snapshot this rank published before the descriptors were agreed."""
        self.calls = 0
        """Calls run in one pass (:meth:`run`)."""
        self._views = views
        self._own = views[rank]
        self._peer_data = peer_data
        self._agreement = agreement
        self._waiting = waiting
        self._publish = waiting.publish
        self._plans = plans
        self._recorder = recorder
        self._check_usable = check_usable
        self._record_failure = record_failure
        self._programs: dict[tuple[RankPlan, np.dtype[Any], int], SmallProgram] = {}

    def release(self) -> None:
        """Forget the compiled programs (views of the control blocks, dropped before they are unmapped)."""
        self._programs.clear()

    def fits(self, seq: int, buffer: npt.NDArray[Any]) -> bool:
        """Whether ``buffer``'s step 0 may be published for collective ``seq`` before the ranks agree on a plan:
        whatever plan they agree on fits the snapshot area, and agree(seq - 1) proved every peer finished reading
        the area of its parity (collective seq - 2)."""
        return self._agreement.agreed_seq == seq - 1 and buffer.nbytes * self.step_bound <= self.eager_bytes

    def prepare(self, seq: int, buffer: npt.NDArray[Any]) -> None:
        """Publish ``buffer`` (1-D, C-contiguous, non-empty, :meth:`fits`) as the step-0 state of collective
        ``seq``, and "at step 0" with it."""
        if not self.usable:
            self._check_usable()
        area = self._peer_data.eager_area(self.rank, seq, buffer.dtype)
        area[: buffer.size] = buffer
        me = self._own
        me[BUFFER_SEGMENT_WORD] = IN_EAGER_SNAPSHOT
        me[BUFFER_OFFSET_WORD] = 0
        self.prepared_seq = seq
        self._publish(PROGRESS_WORD, seq << STEP_BITS)

    def small_bytes(self, seq: int) -> int:
        """The largest buffer :meth:`run` takes for collective ``seq`` (0: none; it needs the collective before to
        have been agreed, which proves every peer is done with the snapshot area it reuses)."""
        if self._agreement.agreed_seq != seq - 1 or self.world_size == 1:
            return 0
        return self.eager_bytes // self.step_bound

    def run(self, call: Call, descriptor: bytes) -> list[bytes] | None:
        """All-reduce ``call.buffer`` (1-D, C-contiguous, at most :meth:`small_bytes`) by its plan: None when done;
        the descriptors when they differ (nothing was read: the group raises, or runs rank 0's plan with
        ``execute``)."""
        plan, buffer, reducer, seq, deadline, _, _ = call  # one unpacking: the hot path
        if not self.usable:
            self._check_usable()
        try:
            parity = seq & 1
            small = self._program(plan, buffer.dtype, parity)
            views = self._views
            me = self._own
            publish = self._publish
            base = seq << STEP_BITS
            # prepare(): the step-0 snapshot, then "at step 0"
            small.own_step0[...] = buffer
            me[BUFFER_SEGMENT_WORD] = IN_EAGER_SNAPSHOT
            me[BUFFER_OFFSET_WORD] = 0
            self.prepared_seq = seq
            publish(PROGRESS_WORD, base)
            # agree(): the descriptors, compared as bytes (read and checked one by one only if one differs)
            descriptors = self._agreement.agree(seq, descriptor, deadline=deadline)
            if any(d is not descriptor for d in descriptors):
                return descriptors
            self.calls += 1
            # execute(): the plan's steps on the snapshots
            ufunc = reducer.ufunc  # type: ignore[attr-defined]
            waiting = self._waiting
            recorder = self._recorder
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
                    publish(PROGRESS_WORD, base + index)
                target = base + index
                for peer, a, b, reduce, source, whole, rv in recvs:
                    waited = 0
                    if views[peer][PROGRESS_WORD] < target:
                        waited = waiting.wait(peer, PROGRESS_WORD, target, deadline=deadline, seq=seq,
                                              what="its data for this step", step=index)  # fmt: skip
                    if mark is not None:
                        if waited:
                            mark(waiting.wait_began)
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
                publish(READ_DONE_WORD, base + index + 1)
            if mark is not None:
                mark(clock())
            publish(PROGRESS_WORD, base + DONE_STEP)
            return None
        except (ValueError, TypeError):
            raise
        except BaseException as exc:
            self._record_failure(exc, seq)
            raise

    def _program(self, plan: RankPlan, dtype: np.dtype[Any], parity: int) -> SmallProgram:
        key = (plan, dtype, parity)
        small = self._programs.get(key)
        if small is not None:
            return small
        program = self._plans.get(("shm", plan, True), lambda: compile_program(plan, True))
        count = plan.count
        eager_area = self._peer_data.eager_area
        own = eager_area(self.rank, parity, dtype)

        def whole(rv: Receive) -> bool:
            return rv.start == 0 and rv.stop == count

        def sent(rv: Receive, at: int) -> npt.NDArray[Any]:
            """The range ``rv`` receives, in its sender's snapshot of the step that starts at element ``at``."""
            return eager_area(rv.peer, parity, dtype)[at + rv.start : at + rv.stop]

        steps: list[_Step] = []
        for st in program.steps:
            at = st.index * count
            ranges = sorted({(a, b) for _, _, a, b in st.send_crcs})
            copies = tuple((own[at + a : at + b], a, b) for a, b in ranges)
            recvs = tuple((rv.peer, rv.start, rv.stop, rv.reduce, sent(rv, at), whole(rv), rv) for rv in st.recvs)
            steps.append((st.index, copies, recvs))
        if len(self._programs) >= SMALL_PROGRAMS_KEPT:
            self._programs.clear()
        small = self._programs[key] = SmallProgram(program, own[:count], tuple(steps))
        return small

    def _receive_published(
        self, rv: Receive, buffer: npt.NDArray[Any], reducer: ReduceInto, *, seq: int, step: int
    ) -> None:
        """A receive from a peer that published its data elsewhere than in its snapshots (it took the general
        path with snapshots off): read where it says, like the general loop."""
        ufunc = getattr(reducer, "ufunc", None)
        peer_data = self._peer_data
        source = peer_data.peer_array(rv.peer, buffer.dtype, buffer.size, seq=seq, step=step)
        arrays = (buffer, buffer)
        for pc in rv.pieces:
            a, b = pc.start, pc.stop
            if isinstance(source, Remote):
                peer_data.receive_remote(pc, rv, source, arrays=arrays, ufunc=ufunc, reduce_into=reducer, seq=seq,
                                         step=step)  # fmt: skip
            elif rv.reduce:
                apply_op(ufunc, reducer, buffer[a:b], source[a:b], buffer[a:b], in_place=True)
            else:
                copy_into(buffer[a:b], source[a:b])
