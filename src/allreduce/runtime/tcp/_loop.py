"""The event loop of one step: every socket of the step driven with non-blocking calls and ``poll``.

:func:`exchange` sends the step's frames (or hands them to the rank's :class:`Sender` thread) while it receives
the step's frames into their destinations, applies staged receives once the sends reading their range have left,
and sleeps in ``poll`` only when no socket can move. Whatever goes wrong raises naming the peer: a broken
connection, a peer that sends nothing before the deadline, a peer that does not read what this rank sends.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from allreduce.runtime._errors import CollectiveTimeoutError
from allreduce.runtime._liveness import CHECK_AFTER_S, SilenceWatch
from allreduce.runtime.tcp._blame import LostPeerError
from allreduce.runtime.tcp._frames import InFrame, OutFrame
from allreduce.runtime.tcp._pair import Pair, apply_staged, check_idle
from allreduce.runtime.tcp._socket import POLL_ERR, POLL_IN
from allreduce.runtime.transport._transport import ReduceInto

__all__ = ["SENDER_POLL_S", "SENDER_STOP_S", "Sender", "exchange", "pace_step"]

SENDER_POLL_S = 0.05
"""How often a thread blocked in ``poll`` while the sender thread runs wakes to look for the other's failure or
cancellation: bounds how late an error crosses between the two threads, at 20 wake-ups a second."""

SENDER_STOP_S = 5.0
"""How long cancelling or stopping waits for the sender thread (it notices within :data:`SENDER_POLL_S`)."""

_IDLE_POLL_S = 1.0  # the longest a lone loop sleeps in poll before looking at the deadline again
_SENDER_LAST_POLL_S = 1.0  # past the deadline, the sender thread still gets this long to raise its own timeout

Sends = list[tuple[int, OutFrame]]


def exchange(
    rank: int,
    pairs: Mapping[int, Pair],
    seq: int,
    *,
    tag: int,
    sends: Sends,
    recvs: list[tuple[int, InFrame]],
    deadline: float,
    timeout_s: float,
    reduce_into: ReduceInto,
    step: int | None,
    label: str,
    sender: Sender | None,
    arrivals: dict[int, int] | None = None,
    last_bytes: bool = False,
    watch_idle: bool = False,
    silence: SilenceWatch | None = None,
) -> None:
    """Send and receive one step's frames concurrently; apply staged receives; raise naming the culprit.

    With ``sender``, that thread sends while this one receives, reduces and applies staged receives. With
    ``arrivals`` (the recorder's, or an injected pacing's), a receiving peer whose first bytes this rank had to
    wait for gets, under ``peer``, when the ``poll`` that found them readable returned: the clock is read only
    after a wait, so a step whose data was there reads none (``peer`` absent: the data was there from the step's
    start, or arrived while this rank was busy sending). With ``last_bytes`` too, each peer's last byte's arrival
    goes in under ``~peer`` (a clock read per peer; without it the step's end stands for it: one receiving peer).
    With ``watch_idle`` (a collective's data steps), the peers this step receives nothing from are watched for an
    ABORT frame while this rank sleeps: see :func:`~allreduce.runtime.tcp._pair.check_idle`. With ``silence``, a
    step that has slept :data:`~allreduce.runtime._liveness.CHECK_AFTER_S` asks the store now and then whether a
    peer it waits for was declared dead (a silent peer: stopped, or its host gone), and raises naming it."""
    send_q: dict[int, list[OutFrame]] = {}
    for peer, out in sends:
        send_q.setdefault(peer, []).append(out)
    recv_q: dict[int, list[InFrame]] = {}
    for peer, inc in recvs:
        recv_q.setdefault(peer, []).append(inc)
    send_pos = dict.fromkeys(send_q, 0)
    recv_pos = dict.fromkeys(recv_q, 0)
    staged = [inc for _, inc in recvs if inc.staged]
    all_out = [out for _, out in sends] if staged else []
    poller: select.poll | None = None  # made the first time nothing can move (small steps rarely get there)
    # Peers this step receives nothing from (more: whose receives are done) are watched too while this rank sleeps:
    # one that gave up sends an ABORT frame and closes, which this rank would otherwise see only at its timeout
    # (a peer it has finished sending to, waiting on another that never sends). ``quiet``: those with a later
    # step's frame waiting, read in its step. Made when first needed: a step whose data was there never sleeps.
    quiet: set[int] | None = None
    first_pending = arrivals is not None  # a receiving peer may still have sent no byte: look at each wake-up
    registered: dict[int, int] = {}
    fd_peer: dict[int, int] = {}
    ask_store_at = -1.0  # when a step still waiting asks the store about silent peers (set at its first sleep)
    if sender is not None:
        sender.post(sends, pairs, seq=seq, label=label, deadline=deadline, timeout_s=timeout_s)
        send_pos = {}
    while send_pos or recv_pos:
        if sender is not None and sender.error() is not None:
            sender.wait(0.0)
        progress = pump_sends(pairs, send_q, send_pos, seq, label)
        for peer in list(recv_pos):
            pair = pairs[peer]
            queue_in = recv_q[peer]
            i = recv_pos[peer]
            n_in = len(queue_in)
            while i < n_in:
                inc = queue_in[i]
                moved = pair.receive(inc, seq, tag=tag, reduce_into=reduce_into, label=label)
                progress = progress or moved
                if inc.got < inc.length or inc.length < 0:
                    break
                i += 1
            if i == n_in:
                del recv_pos[peer]
                if last_bytes and arrivals is not None:
                    arrivals[~peer] = time.perf_counter_ns()
            else:
                recv_pos[peer] = i
        if staged:
            progress = apply_staged(staged, all_out, reduce_into) or progress
        if progress or not (send_pos or recv_pos):
            continue
        # Nothing moved: sleep in poll until a socket can, or the deadline.
        wanted: dict[int, int] = {}
        for peer in send_pos:
            wanted[pairs[peer].sock.fileno()] = select.POLLOUT
            fd_peer[pairs[peer].sock.fileno()] = peer
        for peer in recv_pos:
            fd = pairs[peer].sock.fileno()
            wanted[fd] = wanted.get(fd, 0) | POLL_IN
            fd_peer[fd] = peer
        if watch_idle:
            if quiet is None:
                quiet = set()
            for peer, pair in pairs.items():
                if peer not in recv_pos and peer not in quiet:
                    fd = pair.sock.fileno()
                    wanted[fd] = wanted.get(fd, 0) | POLL_IN
                    fd_peer[fd] = peer
        if poller is None:
            poller = select.poll()
        for fd, events in wanted.items():
            if registered.get(fd) != events:
                poller.register(fd, events)
                registered[fd] = events
        for fd in [fd for fd in registered if fd not in wanted]:
            poller.unregister(fd)
            del registered[fd]
        now = time.monotonic()
        remaining = deadline - now
        if remaining <= 0:
            _raise_timeout(
                rank, seq, label=label, timeout_s=timeout_s, recv_pos=recv_pos, send_pos=send_pos, recv_q=recv_q
            )
        if silence is not None:
            if ask_store_at < 0:
                ask_store_at = now + CHECK_AFTER_S
            elif now >= ask_store_at:
                silence.check(recv_pos.keys() | send_pos.keys(), now, seq=seq, what=label, step=step)
        # With the sender thread running, wake now and then to pick up its failure.
        wait_s = min(remaining, SENDER_POLL_S if sender is not None else _IDLE_POLL_S)
        ready = poller.poll(wait_s * 1000.0)
        if first_pending and arrivals is not None:
            # After a wait (so off the path of a step whose data was there): a readable peer that has sent no byte
            # of the step yet gets the clock, read once; later wake-ups look again while such a peer is left.
            first_pending = False
            woke = 0
            for fd, revents in ready:
                if revents & POLL_IN:
                    peer = fd_peer[fd]
                    if recv_pos.get(peer) == 0 and peer not in arrivals and recv_q[peer][0].header_got == 0:
                        woke = woke or time.perf_counter_ns()
                        arrivals[peer] = woke
            for peer, i in recv_pos.items():
                if i == 0 and peer not in arrivals and recv_q[peer][0].header_got == 0:
                    first_pending = True
                    break
        for fd, revents in ready:
            peer = fd_peer[fd]
            idle = quiet is not None and peer not in recv_pos and peer not in quiet
            if idle and revents & POLL_IN and not check_idle(pairs[peer], seq):
                assert quiet is not None
                quiet.add(peer)
            if revents & POLL_ERR and not revents & (POLL_IN | select.POLLOUT):
                raise _broken(rank, peer, label=label, seq=seq, step=step)
    if sender is not None:
        # The sender raises its own timeout at the deadline; the margin only covers its last poll.
        sender.wait(max(deadline - time.monotonic(), 0.0) + _SENDER_LAST_POLL_S)
        if sender.busy:
            raise CollectiveTimeoutError(
                f"rank {rank}: collective {seq} timed out at {label}: the sender thread did not finish",
                rank=rank,
            )
    if staged:
        apply_staged(staged, all_out, reduce_into)


def pump_sends(
    pairs: Mapping[int, Pair],
    send_q: dict[int, list[OutFrame]],
    send_pos: dict[int, int],
    seq: int,
    label: str,
) -> bool:
    """Push every peer's queued frames (from ``send_pos[peer]`` on, in order) as far as its socket takes them;
    drop the peers whose queue is done. Whether any byte moved."""
    progress = False
    for peer in list(send_pos):
        pair = pairs[peer]
        queue = send_q[peer]
        i = send_pos[peer]
        while i < len(queue):
            progress = pair.send(queue[i], seq, label) or progress
            if not queue[i].done:
                break
            i += 1
        if i == len(queue):
            del send_pos[peer]
        else:
            send_pos[peer] = i
    return progress


def send_all(
    rank: int,
    pairs: Mapping[int, Pair],
    sends: Sends,
    *,
    seq: int,
    label: str,
    deadline: float,
    timeout_s: float,
    cancelled: Callable[[], bool],
) -> None:
    """Send every frame of ``sends`` (in order per peer), polling for room; runs in the sender thread."""
    send_q: dict[int, list[OutFrame]] = {}
    for peer, out in sends:
        send_q.setdefault(peer, []).append(out)
    send_pos = dict.fromkeys(send_q, 0)
    conns = {peer: pairs[peer] for peer in send_q}
    poller = select.poll()
    registered: set[int] = set()
    while send_pos and not cancelled():
        progress = pump_sends(conns, send_q, send_pos, seq, label)
        if progress or not send_pos:
            continue
        fd_peer = {conns[peer].sock.fileno(): peer for peer in send_pos}
        for fd in fd_peer.keys() - registered:
            poller.register(fd, select.POLLOUT)
        for fd in registered - fd_peer.keys():
            poller.unregister(fd)
        registered = set(fd_peer)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            blocked = sorted(send_pos)
            raise CollectiveTimeoutError(
                f"rank {rank}: collective {seq} timed out after {timeout_s:g} s at {label}: rank(s) "
                f"{', '.join(map(str, blocked))} not receiving what this rank sends",
                rank=rank,
                peer=blocked[0],
            )
        for fd, revents in poller.poll(min(remaining, SENDER_POLL_S) * 1000.0):
            if revents & POLL_ERR and not revents & select.POLLOUT:
                raise _broken(rank, fd_peer[fd], label=label, seq=seq, step=None)


def _broken(rank: int, peer: int, *, label: str, seq: int, step: int | None) -> LostPeerError:
    """The error for a connection the poller reports broken (hang-up or error, nothing left to read or write)."""
    return LostPeerError(
        f"rank {rank}: the connection to rank {peer} broke at {label} of collective {seq} "
        f"(rank {peer} died or aborted)",
        rank=rank,
        peer=peer,
        step=step,
    )


def _raise_timeout(
    rank: int,
    seq: int,
    *,
    label: str,
    timeout_s: float,
    recv_pos: dict[int, int],
    send_pos: dict[int, int],
    recv_q: dict[int, list[InFrame]],
) -> None:
    waiting = sorted(recv_pos)
    blocked = sorted(send_pos)
    parts = []
    if waiting:
        details = ", ".join(
            f"rank {p} (block {recv_q[p][recv_pos[p]].block}, segment {recv_q[p][recv_pos[p]].segment})"
            for p in waiting
        )
        parts.append(f"waiting for data from {details}")
    if blocked:
        parts.append(f"rank(s) {', '.join(map(str, blocked))} not receiving what this rank sends")
    raise CollectiveTimeoutError(
        f"rank {rank}: collective {seq} timed out after {timeout_s:g} s at {label}: {'; '.join(parts)}",
        rank=rank,
        peer=(waiting or blocked)[0],
    )


class Sender:
    """The rank's sender thread: sends one step's frames while the calling thread receives and reduces.

    Socket calls and numpy release the GIL, so with sends in their own thread a rank copies out while it copies
    in and reduces, whenever a core is free (measured in docs/design.md, "The TCP transport").
    ``post`` hands over a step, ``wait`` returns when it is sent (or raises what the thread raised); the
    calling thread never touches the sockets' send side while a job runs.
    """

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._cond = threading.Condition()
        self._job: tuple[Sends, Mapping[int, Pair], int, str, float, float] | None = None
        self._busy = False
        self._error: BaseException | None = None
        self._cancelled = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"allreduce-tcp-send-{rank}", daemon=True)
        self._thread.start()

    def post(
        self,
        sends: Sends,
        pairs: Mapping[int, Pair],
        *,
        seq: int,
        label: str,
        deadline: float,
        timeout_s: float,
    ) -> None:
        with self._cond:
            self._job = (sends, pairs, seq, label, deadline, timeout_s)
            self._busy = True
            self._error = None
            self._cond.notify_all()

    @property
    def busy(self) -> bool:
        return self._busy

    def error(self) -> BaseException | None:
        return self._error

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the posted step; raise the thread's error if it failed."""
        with self._cond:
            self._cond.wait_for(lambda: not self._busy, timeout_s)
            if self._error is not None:
                raise self._error

    def cancel(self) -> None:
        """Make a running job give up within :data:`SENDER_POLL_S` and wait for it (the caller then owns the
        sockets)."""
        with self._cond:
            self._cancelled = True
            self._cond.wait_for(lambda: not self._busy, SENDER_STOP_S)
            self._cancelled = False

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cancelled = True
            self._cond.notify_all()
        self._thread.join(timeout=SENDER_STOP_S)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None or self._stopped)
                if self._stopped:
                    return
                job, self._job = self._job, None
            assert job is not None
            sends, pairs, seq, label, deadline, timeout_s = job
            try:
                send_all(
                    self._rank,
                    pairs,
                    sends,
                    seq=seq,
                    label=label,
                    deadline=deadline,
                    timeout_s=timeout_s,
                    cancelled=lambda: self._cancelled,
                )
            except BaseException as exc:  # handed to the calling thread by wait()
                self._error = exc
            with self._cond:
                self._busy = False
                self._cond.notify_all()


def pace_step(injection: Any, step: Any, arrivals: dict[int, int], step_start: int) -> None:
    """Pace the injected slow links of ``step`` (a prepared step, run with ``last_bytes``): each paced peer's data
    takes its size at the paced rate from its first byte (``arrivals[peer]``, else the step's start), and its last
    byte (``arrivals[~peer]``) moves to when the pacing let it through."""
    for peer in step.recv_peers:
        if injection.paces(peer) and ~peer in arrivals:
            last = arrivals[~peer]
            size_bytes = sum(r.byte_stop - r.byte_start for r in step.recvs if r.peer == peer)
            injection.pace(peer, size_bytes, arrivals.get(peer, step_start))
            arrivals[~peer] = max(last, time.perf_counter_ns())
