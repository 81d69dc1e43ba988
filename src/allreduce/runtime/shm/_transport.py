"""The shared-memory transport: ranks on one host read each other's buffers directly, no socket in the data path.

One-sided execution. A receiver reduces straight out of the sender's memory into its own
(``np.add(mine, theirs, out=mine)``, one pass). Two counters per rank in its control block
(:mod:`allreduce.runtime.shm._layout`) carry all synchronisation:

- ``progress`` = (seq, t): "my buffer holds the state at the start of step t" — a receiver waits for it
  before it reads the sender's step-t blocks;
- ``read_done`` = (seq, t+1): "I have finished reading your step-t blocks" — a sender waits for it before it
  overwrites a range that a peer reads at that step or earlier.

Where a rank's data lives for one collective (its *home*, published in its control block; readers follow it):

- **eager** (small buffers): each step's sent ranges are copied into a snapshot area of the owner's control
  block, so the owner overwrites its buffer without waiting for readers; :meth:`ShmTransport.prepare` publishes
  step 0 together with the descriptor;
- **shared**: an array from :meth:`ShmTransport.allocate` (``group.empty()``) is in shared memory already;
- **adopted**: a large buffer passed again is moved, once, onto a shared segment at its own address
  (:mod:`allreduce.runtime.shm._adopt`), then read like a shared one;
- **cross-memory**: a large plain array is read by peers where it is, in the owner's private memory, with
  ``process_vm_readv(2)``, when the start-up probe found that every rank may read every other
  (:mod:`allreduce.runtime.shm._rendezvous`): openly, or under Yama ``ptrace_scope = 1`` with the ptracer
  discipline (before it publishes a step, the owner names that step's one reader its ptracer, once the previous
  one is done reading; a plan with two readers in one step stages instead);
- **staged**: otherwise through a shared staging segment, copying only what the plan needs
  (:mod:`allreduce.runtime.shm._compile`).

The transport is composed of parts, each an object with its own state, built once the ranks have met:
:class:`~allreduce.runtime.shm._rendezvous.ControlBlocks` (start-up: every rank's control block mapped, the
peers' processes, the cross-memory probe), :class:`~allreduce.runtime.shm._waiting.Waiting` (publishing this
rank's counters and waiting on peers', with a :class:`~allreduce.runtime.shm._waiting.SpinPolicy` and a
:class:`~allreduce.runtime.shm._watch.PeerWatch` for dead or aborted peers),
:class:`~allreduce.runtime.shm._agreement.Agreement` (the descriptor exchange),
:class:`~allreduce.runtime.shm._peer_data.PeerData` (reading a peer's data),
:class:`~allreduce.runtime.shm._ptracer.Ptracer` (admitting readers under Yama) and
:class:`~allreduce.runtime.shm._small.SmallCalls` (the head start and a small all-reduce in one pass: the group's
``run_small`` is its bound method). This module holds the knobs, what the group calls, where this rank's data
lives, and the step loop, which binds the parts' methods to locals once per call.
"""

from __future__ import annotations

import os
import time
import weakref
import zlib
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar

import numpy as np
import numpy.typing as npt

from allreduce.runtime._errors import CollectiveError, corrupted
from allreduce.runtime._liveness import SilenceWatch
from allreduce.runtime._store_api import Store
from allreduce.runtime.shm._adopt import SUPPORTED as ADOPTION_SUPPORTED
from allreduce.runtime.shm._adopt import Adopted, Adoptions, adopt_wanted
from allreduce.runtime.shm._agreement import Agreement
from allreduce.runtime.shm._compile import Piece, RankProgram, Receive, StepProgram, compile_program
from allreduce.runtime.shm._copy import copy_into
from allreduce.runtime.shm._huge_pages import HugePageMemo, collapse_wanted, huge_pages_likely
from allreduce.runtime.shm._layout import (
    ABORTED_WORD,
    BUFFER_OFFSET_WORD,
    BUFFER_SEGMENT_WORD,
    CLOSED_WORD,
    CRC_SLOTS_PER_PEER,
    CULPRIT_WORD,
    DONE_STEP,
    EAGER_BYTES,
    IN_EAGER_SNAPSHOT,
    IN_PRIVATE_MEMORY,
    MAX_RANKS,
    PROGRESS_WORD,
    READ_DONE_WORD,
    SEQ_WORD,
    STEP_BITS,
    STEP_WORD,
)
from allreduce.runtime.shm._linux import CROSS_MEMORY_SUPPORTED
from allreduce.runtime.shm._peer_data import PeerData, Remote, apply_op
from allreduce.runtime.shm._rendezvous import ControlBlocks
from allreduce.runtime.shm._rendezvous import cross_memory_mode as resolve_cross_memory_mode
from allreduce.runtime.shm._segments import SHM_DIR, LocalSegments, shm_prefix, sweep_stale_segments
from allreduce.runtime.shm._small import SmallCalls
from allreduce.runtime.shm._waiting import SpinPolicy, Waiting
from allreduce.runtime.shm._watch import PeerWatch
from allreduce.runtime.transport._plan import RankPlan
from allreduce.runtime.transport._transport import Call, Transport, abort_kind

__all__ = ["CROSS_MEMORY_MIN_BYTES", "ShmTransport"]

CROSS_MEMORY_MIN_BYTES = 8 << 20
"""Smallest plain array peers read in place with ``process_vm_readv``; below it staging is faster (the kernel
pins the peer's pages one by one, and only large numpy arrays are backed by huge pages)."""


def _one_reader(plan: RankPlan) -> bool:
    """Whether at most one peer reads this rank's data at every step of ``plan`` (ring, halving-doubling and
    recursive doubling: one ptracer at a time admits them all)."""
    return all(len({t.peer for t in step.sends}) <= 1 for step in plan.steps)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _weakly(method: Callable[_P, _R]) -> Callable[_P, _R | None]:
    """``method`` of an object, called while the object lives: a part given it does not keep the transport alive
    (dropped unclosed, the transport removes its files in ``__del__``, which a reference cycle would put off)."""
    ref = weakref.WeakMethod(method)

    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R | None:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    return call


def _checked_eager_bytes(size_bytes: int) -> int:
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or not 0 <= size_bytes <= EAGER_BYTES:
        raise ValueError(f"eager_bytes must be an int in [0, {EAGER_BYTES}], got {size_bytes!r}")
    return size_bytes


class ShmTransport(Transport):
    """Shared-memory transport for ``world_size`` ranks of job ``job`` on one host (see the module docstring).

    Construction is collective: every rank creates its control block and waits (up to ``timeout_s``) until
    all peers have created theirs, then the files are unlinked (nothing is left in /dev/shm if a rank dies later).

    Knobs (each rank decides alone; readers follow what the owner of the data published, so they may differ
    between ranks and may be changed between collectives through the properties of the same names):

    - ``cross_memory``: let peers read large plain arrays in place (only if the start-up probe allows it on every
      rank; ``statistics()["cross_memory_available"]`` says what it found, ``["cross_memory_ptracer"]`` whether
      reads go through the ptracer discipline). How the probe may find them is the constructor's
      ``cross_memory_mode`` (``auto``, ``open``, ``ptracer``, ``off``; default: the environment variable
      ``ALLREDUCE_SHM_CROSS_MEMORY``, else ``auto``; see :mod:`allreduce.runtime.shm._rendezvous`);
    - ``cross_memory_min_bytes``: the smallest array read that way, among those likely backed by huge pages
      (:func:`~allreduce.runtime.shm._huge_pages.huge_pages_likely`; 0: every plain array, whatever its pages);
    - ``collapse_huge_pages``: move a buffer of at least 16 MiB that is not on huge pages (a torch tensor) onto
      them the second time it is passed, so that it too is read in place from then on
      (:class:`~allreduce.runtime.shm._huge_pages.HugePageMemo`; default: the environment variable
      ``ALLREDUCE_SHM_COLLAPSE``, ``0`` or ``1``, else yes);
    - ``adopt_buffers``: the second time this rank passes the same buffer of at least 1 MiB that is a whole
      allocation (a numpy array owning its memory, a torch tensor's storage on pages of its own), move its
      pages (on the C library's heap, those inside it) onto a shared segment at the same address, so that peers
      read it in place like a ``group.empty()`` array, whatever Yama allows (:mod:`allreduce.runtime.shm._adopt`;
      default: the environment variable ``ALLREDUCE_SHM_ADOPT``, ``0`` or ``1``, else yes);
    - ``eager_bytes``: buffers whose (steps x size) fits go through snapshots (0: never; at most
      :data:`~allreduce.runtime.shm.EAGER_BYTES`).

    ``store``: the group's store, if it has one with a lease: a wait blocked on a peer then asks it now and then
    whether that peer was declared dead (a stopped process has no exit for the pidfds to show).
    """

    name = "shm"

    def __init__(
        self,
        rank: int,
        world_size: int,
        job: str,
        *,
        timeout_s: float = 300.0,
        cross_memory: bool = True,
        cross_memory_min_bytes: int = CROSS_MEMORY_MIN_BYTES,
        eager_bytes: int = EAGER_BYTES,
        cross_memory_mode: str | None = None,
        collapse_huge_pages: bool | None = None,
        adopt_buffers: bool | None = None,
        store: Store | None = None,
    ) -> None:
        super().__init__(rank, world_size)
        self._huge_pages = HugePageMemo(enabled=collapse_wanted(collapse_huge_pages))
        adopt = adopt_wanted(adopt_buffers)
        mode = resolve_cross_memory_mode(cross_memory_mode)
        if world_size > MAX_RANKS:
            raise ValueError(
                f"the shared-memory transport supports up to {MAX_RANKS} ranks on one host, got {world_size}"
            )
        self.cross_memory_min_bytes = cross_memory_min_bytes
        eager_bytes = _checked_eager_bytes(eager_bytes)
        prefix = os.path.join(SHM_DIR, shm_prefix(job))
        # the last compiled program: a training loop repeats one collective, and this skips even hashing the plan
        self._last_compiled: tuple[RankPlan, bool, RankProgram] | None = None
        self._segments = LocalSegments(prefix, rank)
        self._adoptions = Adoptions(self._segments.new_segment, enabled=adopt)
        self._corrupt_next: tuple[int, int] | None = None  # (peer, step) of inject_corruption()
        self._executes_eager = 0  # of the general path (SmallCalls counts its own)
        self._executes_shared = 0
        self._executes_adopted = 0
        self._executes_cross_memory = 0
        self._executes_staged = 0
        self._with_ends: Adopted | None = None  # this call's buffer, adopted with its two end pages private
        sweep_stale_segments(os.path.dirname(prefix))
        wanted = bool(cross_memory) and CROSS_MEMORY_SUPPORTED and mode != "off"
        try:
            blocks = ControlBlocks(
                prefix, rank, world_size, timeout_s=timeout_s, cross_memory_mode=mode if wanted else "off"
            )
        except BaseException:
            self._adoptions.release()
            self._segments.release()
            raise
        self._blocks = blocks
        self._cross_memory_available = blocks.cross_memory_available
        self._cross_memory = wanted and blocks.cross_memory_available  # available and wanted by this rank
        self._views = views = blocks.views
        self._crc = blocks.crcs
        self._peer_pids = blocks.peer_pids
        self._ptracer = blocks.ptracer
        self._watch = PeerWatch(rank, views, blocks.pidfds, prefix)
        self._waiting = Waiting(
            rank, views, blocks.addresses, watch=self._watch, policy=SpinPolicy.for_group(world_size)
        )
        self._waiting.silence = SilenceWatch.of(store, rank)
        self._publish = self._waiting.publish
        self._agreement = Agreement(rank, blocks.segments, views, self._waiting)
        self._peer_data = PeerData(
            rank, prefix, blocks.segments, views, blocks.peer_pids, layout=blocks.layout,
            ptracer=blocks.ptracer.in_force, watch=self._watch,
        )  # fmt: skip
        self._small = SmallCalls(
            rank, views, peer_data=self._peer_data, agreement=self._agreement, waiting=self._waiting,
            plans=self.plans, recorder=self.recorder, eager_bytes=eager_bytes, check_usable=_weakly(self.check_usable),
            record_failure=_weakly(self._record_failure),
        )  # fmt: skip
        # What the group calls per small collective: the part's own bound methods, no forwarding frame.
        self.run_small = self._small.run  # type: ignore[method-assign]
        self.small_bytes = self._small.small_bytes  # type: ignore[method-assign]

    # ----------------------------------------------------------------------------------------------------
    # Knobs and counters
    # ----------------------------------------------------------------------------------------------------
    @property
    def cross_memory(self) -> bool:
        """Whether this rank's large plain arrays are read by peers in place (wanted and available)."""
        return self._cross_memory

    @cross_memory.setter
    def cross_memory(self, wanted: bool) -> None:
        self._cross_memory = bool(wanted) and self._cross_memory_available

    @property
    def cross_memory_min_bytes(self) -> int:
        return self._cross_memory_min_bytes

    @cross_memory_min_bytes.setter
    def cross_memory_min_bytes(self, size_bytes: int) -> None:
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes < 0:
            raise ValueError(f"cross_memory_min_bytes must be a non-negative int, got {size_bytes!r}")
        self._cross_memory_min_bytes = size_bytes

    @property
    def adopt_buffers(self) -> bool:
        """Whether buffers used again are adopted into shared memory (buffers adopted already stay adopted)."""
        return self._adoptions.enabled

    @adopt_buffers.setter
    def adopt_buffers(self, wanted: bool) -> None:
        self._adoptions.enabled = bool(wanted) and ADOPTION_SUPPORTED

    @property
    def eager_bytes(self) -> int:
        return self._small.eager_bytes

    @eager_bytes.setter
    def eager_bytes(self, size_bytes: int) -> None:
        self._small.eager_bytes = _checked_eager_bytes(size_bytes)

    def statistics(self) -> Mapping[str, int]:
        """How many executes took each path, and whether peers may read private memory (the start-up probe)."""
        return {
            "executes_eager": self._executes_eager + self._small.calls,
            "small_calls": self._small.calls,
            "executes_shared": self._executes_shared,
            "executes_adopted": self._executes_adopted,
            "executes_cross_memory": self._executes_cross_memory,
            "executes_staged": self._executes_staged,
            "cross_memory_available": int(self._cross_memory_available),
            "cross_memory_ptracer": int(self._ptracer.in_force),
            "ptracer_switches": self._ptracer.switches,
            "huge_page_collapses": self._huge_pages.collapsed,
            "huge_page_refusals": self._huge_pages.refused,
            "buffers_adopted": self._adoptions.adopted,
            "adoption_refusals": self._adoptions.refused,
        }

    def inject_corruption(self, *, peer: int, step: int = 0) -> None:
        """Flip one byte of the next block sent to ``peer`` at ``step`` of a ``checksum=True`` collective, after
        its crc32 was computed (the receiver must raise :class:`ChecksumError` naming the link)."""
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"peer {peer!r} is not another rank of a group of {self.world_size}")
        self._corrupt_next = (peer, step)

    # ----------------------------------------------------------------------------------------------------
    # What the group calls
    # ----------------------------------------------------------------------------------------------------
    def allocate(self, size_bytes: int) -> npt.NDArray[np.uint8]:
        """A zero-filled byte array in shared memory that peers can read in place (``group.empty()``)."""
        self.check_usable()
        return self._segments.allocate(size_bytes)

    def prepare(self, seq: int, buffer: npt.NDArray[Any], *, checksum: bool) -> None:
        """Before ``agree(seq)``: publish a small ``buffer``'s step-0 state, so that the descriptor exchange and
        the first step's data cost one handoff, not two.

        The whole buffer goes into snapshot area 0 (it is the step-0 state whatever plan the ranks agree on)
        and "at step 0" is published with it. Peers read it only after they have compared the descriptors,
        so a mismatch still moves no data. Safe to overwrite the area because agree(seq - 1) proved every peer
        finished reading collective seq - 2; limited to sizes whose every possible plan fits the area.
        """
        if checksum or buffer.ndim != 1 or not buffer.flags.c_contiguous or not buffer.size:
            return
        if self._small.fits(seq, buffer):
            self._small.prepare(seq, buffer)

    def fuses(self, buffer: npt.NDArray[Any]) -> bool:
        """A staged array in a group of two: a step's sent ranges are copied into the working buffer and every
        range received is reduced straight out of the peer's into a different array (the working buffer when it
        is sent again, else the user's), one pass, never through scratch. Larger groups are left to the size
        rule: their recursive doubling receives ranges it also sends in that step into scratch first (measured
        at N=2, plain float32 arrays, recursive doubling against the ring, 2026-12-03: 0.66-0.92 of its time
        from 64 KiB to 4 MiB)."""
        return (
            self.world_size == 2
            and buffer.nbytes < self._cross_memory_min_bytes
            and self._segments.locate(buffer) is None
            and not self._adoptions.expects(buffer)
        )

    def _agree(self, seq: int, descriptor: bytes, *, deadline: float, timeout_s: float) -> list[bytes]:
        return self._agreement.agree(seq, descriptor, deadline=deadline)

    def _execute(self, call: Call) -> None:
        plan, buffer, seq, checksum = call.plan, call.buffer, call.seq, call.checksum
        steps = plan.steps[-1].index + 1
        prepared = self._small.prepared_seq == seq
        fits = steps * buffer.nbytes <= self._small.eager_bytes
        if prepared and not fits:
            bound = self._small.step_bound
            raise CollectiveError(
                f"rank {self.rank}: plan {plan.schedule_name} has {steps} steps, more than the eager path allows for "
                f"{self.world_size} ranks ({bound}); run it with eager_bytes=0",
                rank=self.rank,
            )
        # Only right after agree(seq), which proves every peer is done with the snapshot area of the same parity.
        eager = not checksum and self._agreement.agreed_seq == seq and fits
        work, private = self._choose_home(buffer, plan, eager=eager)
        with_ends = self._with_ends
        user = work if with_ends is not None else buffer  # such a buffer is worked on where peers see it
        in_shm = work is user
        last = self._last_compiled
        if last is not None and last[0] is plan and last[1] is in_shm:
            program = last[2]
        else:
            program = self.plans.get(("shm", plan, in_shm), lambda: compile_program(plan, in_shm))
            self._last_compiled = (plan, in_shm, program)
        if checksum and program.max_crc_slots > CRC_SLOTS_PER_PEER:
            raise ValueError(
                f"checksum=True supports up to {CRC_SLOTS_PER_PEER} transfers per peer per collective; this plan "
                f"has {program.max_crc_slots} (use fewer segments)"
            )
        admit = private and self._ptracer.in_force
        self._run_steps(call, program, user, work, eager=eager, prepared=prepared, admit=admit)
        self._finish(call, program, user, work, eager=eager)
        if with_ends is not None:
            with_ends.copy_ends_out(work, buffer)

    def _release(self) -> None:
        self._small.usable = False
        self._publish(CLOSED_WORD, 1)
        self._watch.unlink_dead_peers_files()
        # what holds views into the control blocks lets go of them first
        self._small.release()
        self._peer_data.release()
        self._waiting.release()
        self._blocks.release()
        self._adoptions.release()
        self._segments.release()

    def _abort(self, error: CollectiveError, seq: int) -> None:
        """Publish why this rank gave up (peers waiting on it stop at once and raise the same class)."""
        self._small.usable = False
        if not self._views:
            return
        view = self._views[self.rank]
        view[CULPRIT_WORD] = -1 if error.peer is None else error.peer
        view[SEQ_WORD] = seq
        view[STEP_WORD] = -1 if error.step is None else error.step
        self._publish(ABORTED_WORD, abort_kind(error) + 1)
        self._waiting.wake((PROGRESS_WORD, READ_DONE_WORD, *self._agreement.stamp_words))

    # ----------------------------------------------------------------------------------------------------
    # One collective
    # ----------------------------------------------------------------------------------------------------
    def _choose_home(self, buffer: npt.NDArray[Any], plan: RankPlan, *, eager: bool) -> tuple[npt.NDArray[Any], bool]:
        """Decide where peers read this rank's data and publish it; return the working buffer (``buffer`` unless
        staged, or adopted with its end pages private: then its mirror, and ``_with_ends`` its record) and whether
        that is this rank's private memory (read with ``process_vm_readv``)."""
        me = self._views[self.rank]
        work = buffer
        private = False
        self._with_ends = None
        if eager:
            segment_id, offset = IN_EAGER_SNAPSHOT, 0
            self._executes_eager += 1
        elif (located := self._segments.locate(buffer)) is not None:
            segment_id, offset = located
            self._executes_shared += 1
        elif (adopted := self._adoptions.home(buffer)) is not None:
            # A buffer used again, moved onto a shared segment at its own address: read in place like the above.
            segment_id, offset = adopted.segment_id, adopted.offset
            if adopted.edges:  # on the heap: its two end pages are copied into the file's around the call
                work = adopted.work_view(buffer)
                self._with_ends = adopted
            self._executes_adopted += 1
        elif (
            self._cross_memory
            and buffer.nbytes >= self._cross_memory_min_bytes
            and (not self._ptracer.in_force or self.plans.get(("shm-one-reader", plan), lambda: _one_reader(plan)))
            and (
                self._cross_memory_min_bytes == 0
                or huge_pages_likely(buffer)
                or self._huge_pages.in_place(buffer)  # last: it may collapse the buffer (its second use)
            )
        ):
            # Peers read the user's array where it is: no staging copy in, none out.
            segment_id, offset = IN_PRIVATE_MEMORY, int(buffer.ctypes.data)
            private = True
            self._executes_cross_memory += 1
        else:
            segment_id, staging = self._segments.staging(buffer.nbytes)
            offset = 0
            work = staging.array(buffer.dtype, plan.count)
            self._executes_staged += 1
        me[BUFFER_SEGMENT_WORD] = segment_id
        me[BUFFER_OFFSET_WORD] = offset
        return work, private

    def _run_steps(
        self,
        call: Call,
        program: RankProgram,
        user: npt.NDArray[Any],
        work: npt.NDArray[Any],
        *,
        eager: bool,
        prepared: bool,
        admit: bool,
    ) -> None:
        """Every step: make its sent ranges readable, publish "at step t", receive, publish "read step t".

        ``admit``: the ptracer discipline (this rank's private memory, under Yama): name each step's reader this
        rank's ptracer before publishing the step."""
        count, reduce_into, checksum = call.plan.count, call.reduce_into, call.checksum
        seq, deadline = call.seq, call.deadline
        dtype = user.dtype
        ufunc = getattr(reduce_into, "ufunc", None)
        arrays = (user, work)
        base = seq << STEP_BITS
        views = self._views
        waiting = self._waiting
        wait = waiting.wait
        publish = self._publish
        peer_data = self._peer_data
        eager_area = peer_data.eager_area
        peer_arrays: dict[int, npt.NDArray[Any] | Remote] = {}
        snapshot = eager_area(self.rank, seq, dtype) if eager else work
        recorder = self.recorder
        injection = self.injection
        clock = time.perf_counter_ns
        arrived = 0
        # the recorder's marks (see allreduce.runtime.stats._stats): per receive, when its wait began and how long it
        # took, both read by the wait while it waited. A receive whose data was there marks the clock (now) if it
        # is the call's first, or the first after a step without receives, else (0, 0): no boundary
        mark = recorder.append if recorder.enabled else None
        if mark is not None:
            mark(program.tag)  # the call's layout, and how many marks follow
        boundary = True
        try:
            for st in program.steps:
                if injection is not None:
                    injection.hold_step()
                if mark is not None and not st.recvs:
                    mark(clock())  # a step without receives: one mark where it starts
                    boundary = True
                # send: this step's sent ranges must be readable where this rank published them
                if st.copyins:
                    self._copy_in(st, user, work, base=base, seq=seq, deadline=deadline)
                if checksum:
                    self._sign_sends(st, work)
                if not (prepared and st.index == 0):  # prepare() published the step-0 snapshot already
                    if eager:
                        at = st.index * count
                        for _, _, a, b in st.send_crcs:
                            snapshot[at + a : at + b] = work[a:b]
                    if admit and st.readers:
                        reader = st.readers[0]
                        self._ptracer.admit(reader, self._peer_pids[reader], base + st.index + 1, wait,
                                            deadline=deadline, seq=seq, step=st.index)  # fmt: skip
                    publish(PROGRESS_WORD, base + st.index)
                # receive (and reduce): straight out of the peer's memory
                staged: dict[tuple[int, int], tuple[Piece, npt.NDArray[Any]]] = {}
                for rv in st.recvs:
                    peer = rv.peer
                    waited = 0
                    if views[peer][PROGRESS_WORD] < base + st.index:  # else there already: no call
                        waited = wait(peer, PROGRESS_WORD, base + st.index, deadline=deadline, seq=seq,
                                      what="its data for this step", step=st.index)  # fmt: skip
                    if mark is not None:
                        if waited:
                            mark(waiting.wait_began)
                        elif boundary:
                            mark(clock())  # the data was there: it arrived now
                        else:
                            mark(0)
                        boundary = False
                        mark(waited)
                    if injection is not None:
                        arrived = clock()
                    source: npt.NDArray[Any] | Remote
                    if views[peer][BUFFER_SEGMENT_WORD] == IN_EAGER_SNAPSHOT:
                        source, shift = eager_area(peer, seq, dtype), -st.index * count
                    else:
                        theirs = peer_arrays.get(peer)
                        if theirs is None:
                            theirs = peer_data.peer_array(peer, dtype, count, seq=seq, step=st.index)
                            peer_arrays[peer] = theirs
                        source, shift = theirs, 0
                    if checksum:
                        source, shift = self._verify(rv, source, shift, dtype, seq=seq, step=st.index)
                    for pc in rv.pieces:
                        a, b = pc.start, pc.stop
                        if pc.staged and not eager:
                            earlier = staged.get((a, b))
                            tmp = peer_data.receive_staged(pc, rv, source, shift, arrays=arrays, ufunc=ufunc,
                                                           reduce_into=reduce_into, seq=seq, step=st.index,
                                                           into=None if earlier is None else earlier[1])  # fmt: skip
                            staged[a, b] = (pc, tmp)
                            continue
                        for reader, value in () if eager else pc.waits:
                            if views[reader][READ_DONE_WORD] < base + value:
                                wait(reader, READ_DONE_WORD, base + value, deadline=deadline, seq=seq,
                                     what="reading data this step overwrites", step=st.index)  # fmt: skip
                        if isinstance(source, Remote):
                            peer_data.receive_remote(pc, rv, source, arrays=arrays, ufunc=ufunc,
                                                     reduce_into=reduce_into, seq=seq, step=st.index)  # fmt: skip
                        elif rv.reduce:
                            apply_op(ufunc, reduce_into, arrays[pc.src][a:b], source[a - shift : b - shift],
                                   arrays[pc.dst][a:b], in_place=pc.src == pc.dst)  # fmt: skip
                        else:
                            copy_into(arrays[pc.dst][a:b], source[a - shift : b - shift])
                    if injection is not None:
                        injection.pace(peer, (rv.stop - rv.start) * dtype.itemsize, arrived)
                publish(READ_DONE_WORD, base + st.index + 1)
                # staged receives land once the readers of this step are done with the range
                for pc, tmp in staged.values():
                    for reader, value in pc.waits:
                        wait(reader, READ_DONE_WORD, base + value, deadline=deadline, seq=seq,
                             what="reading data this step overwrites", step=st.index)  # fmt: skip
                    copy_into(arrays[pc.dst][pc.start : pc.stop], tmp)
            if mark is not None:
                mark(clock())  # the steps' end
        finally:
            peer_arrays.clear()

    def _copy_in(
        self, st: StepProgram, user: npt.NDArray[Any], work: npt.NDArray[Any], *, base: int, seq: int, deadline: float
    ) -> None:
        """Staged path: copy the ranges sent this step from the user's array into the working buffer."""
        for reader, value in st.copyin_waits:
            self._waiting.wait(reader, READ_DONE_WORD, base + value, deadline=deadline, seq=seq,
                               what="reading an earlier step", step=st.index)  # fmt: skip
        for a, b in st.copyins:
            work[a:b] = user[a:b]

    def _sign_sends(self, st: StepProgram, work: npt.NDArray[Any]) -> None:
        """checksum=True: publish the crc32 of every block sent this step (then apply an injected corruption)."""
        crc = self._crc[self.rank]
        for dst, slot, a, b in st.send_crcs:
            crc[dst * CRC_SLOTS_PER_PEER + slot] = zlib.crc32(work[a:b].view(np.uint8).data)
            if self._corrupt_next == (dst, st.index) and b > a:
                work.view(np.uint8)[a * work.dtype.itemsize] ^= 0xFF
                self._corrupt_next = None

    def _verify(
        self, rv: Receive, source: npt.NDArray[Any] | Remote, shift: int, dtype: np.dtype[Any], *, seq: int, step: int
    ) -> tuple[npt.NDArray[Any], int]:
        """checksum=True: raise :class:`ChecksumError` unless the received block matches the sender's crc32.

        Returns where to read the block from (a private copy when the peer's memory is read with
        process_vm_readv, so that what is checked is what is reduced)."""
        if isinstance(source, Remote):
            local = np.empty(rv.stop - rv.start, dtype)
            self._peer_data.fetch(source, rv.start, local, seq=seq, step=step)
            source, shift = local, rv.start
        expected = int(self._crc[rv.peer][self.rank * CRC_SLOTS_PER_PEER + rv.crc_slot])
        got = zlib.crc32(source[rv.start - shift : rv.stop - shift].view(np.uint8).data)
        if got != expected:
            what = f"elements [{rv.start}, {rv.stop})"
            raise corrupted(rank=self.rank, peer=rv.peer, step=step, seq=seq, what=what, got=got, expected=expected)
        return source, shift

    def _finish(
        self, call: Call, program: RankProgram, user: npt.NDArray[Any], work: npt.NDArray[Any], *, eager: bool
    ) -> None:
        """Wait until peers have read this rank's last data, copy staged results back, publish "done"."""
        seq, deadline = call.seq, call.deadline
        base = seq << STEP_BITS
        views = self._views
        for reader, value in () if eager else program.final_waits:
            if views[reader][READ_DONE_WORD] < base + value:
                self._waiting.wait(reader, READ_DONE_WORD, base + value, deadline=deadline, seq=seq,
                                   what="reading this rank's data", step=program.steps[-1].index)  # fmt: skip
        for a, b in program.copyouts:
            copy_into(user[a:b], work[a:b])
        self._publish(PROGRESS_WORD, base + DONE_STEP)

    def __del__(self) -> None:
        # Files in /dev/shm outlive the process: never leave ours behind, even without close().
        segments = getattr(self, "_segments", None)
        if not getattr(self, "_closed", True) and segments is not None:
            segments.unlink()
            adoptions = getattr(self, "_adoptions", None)
            if adoptions is not None:
                adoptions.unlink()
