"""Which thread may call a group's collectives: one owner at a time, handed over explicitly.

Collectives pair by call order: the k-th call on every rank is one collective. Two threads calling one group can
reach the ranks in different orders, and when their calls have the same count and dtype the descriptor check
cannot tell: the arrays of different threads are summed together. So a group belongs to one thread: the thread
that created it, until that thread hands it to another (:meth:`ThreadOwner.hand_over`). A thread that was handed
the group returns it to the thread that handed it when it finishes. Binding to the thread of the first
collective would not do: on each rank a different thread can be first, and that first pair would go unnoticed.

A group whose owner finished without handing it over (a group made in a worker thread that has ended) is not
stranded: any thread may then hand it over, to another thread or to itself (``hand_over(current_thread())``:
adopting it). Adopting is explicit for the same reason as above: were the first thread to call a collective to
adopt it, two threads could each be first on a different rank. Whichever thread adopts first owns the group; a
second one is refused like any other thread, so two threads never both call it.
"""

from __future__ import annotations

import threading

from allreduce.runtime._errors import CollectiveError

__all__ = ["ThreadOwner", "WrongThreadError"]


class WrongThreadError(CollectiveError):
    """A collective was called from a thread that does not own the group; raised before anything is consumed."""


def _name(thread: threading.Thread) -> str:
    return f"{thread.name!r} (id {thread.ident})" if thread.ident is not None else f"{thread.name!r} (not started)"


class ThreadOwner:
    """The thread that owns a group, and the chain of threads that handed it over (each gets it back in turn)."""

    __slots__ = ("_ident", "_lenders", "_lock", "_thread")

    def __init__(self) -> None:
        self._thread = threading.current_thread()
        self._ident = self._thread.ident
        self._lenders: list[threading.Thread] = []
        self._lock = threading.Lock()

    @property
    def thread(self) -> threading.Thread:
        """The owning thread now (after returning the group from owners that have finished)."""
        with self._lock:
            self._return_from_finished()
            return self._thread

    def check(self, rank: int, what: str) -> None:
        """Return if the calling thread owns the group; else :class:`WrongThreadError` naming both threads."""
        if threading.get_ident() != self._ident:
            self._check_slowly(rank, what)

    def hand_over(self, thread: threading.Thread, rank: int) -> None:
        """Give the group to ``thread`` (started or not); only the owner may, or any thread once the owner has
        finished without handing it over (then ``thread`` may be the caller: it adopts the group). The caller gets
        the group back when ``thread`` finishes."""
        if not isinstance(thread, threading.Thread):
            raise TypeError(f"hand_over: expected a threading.Thread, got {type(thread).__name__}")
        me = threading.current_thread()
        with self._lock:
            self._return_from_finished()
            if me is not self._thread and _finished(self._thread):  # the owner left it behind: the caller adopts it
                self._thread, self._ident = me, me.ident
            if me is not self._thread:
                raise WrongThreadError(
                    f"rank {rank}: hand_over was called from thread {_name(me)}, but the group belongs to thread "
                    f"{_name(self._thread)}: only the thread that owns a group can hand it over",
                    rank=rank,
                )
            if thread is me:
                return
            self._lenders.append(me)
            self._thread, self._ident = thread, thread.ident

    def _check_slowly(self, rank: int, what: str) -> None:
        me = threading.current_thread()
        with self._lock:
            self._return_from_finished()
            if me is self._thread:
                self._ident = me.ident  # the owner was handed the group before it started
                return
            owner = self._thread
            finished = _finished(owner)
        if finished:
            how = (
                ", which has finished without handing it over. To take the group over, call "
                "group.hand_over(threading.current_thread()) in the thread that is to own it, on every rank (any "
                "thread may, once the owner has finished; the first to do so owns it)"
            )
        else:
            how = (
                f". Call a group's collectives from one thread; to move the group to another thread, call "
                f"group.hand_over(thread) in {owner.name!r} first"
            )
        raise WrongThreadError(
            f"rank {rank}: {what} was called from thread {_name(me)}, but this group belongs to thread "
            f"{_name(owner)}{how}. Collectives pair by call order, and calls from two threads can reach the ranks "
            f"in different orders and silently combine different arrays; or give each thread's calls a tag= of its "
            f"own (a cross-paired call then raises MismatchError on every rank)",
            rank=rank,
        )

    def _return_from_finished(self) -> None:
        while self._lenders and _finished(self._thread):
            self._thread = self._lenders.pop()
            self._ident = self._thread.ident


def _finished(thread: threading.Thread) -> bool:
    """A started thread that is no longer alive has finished; one not started yet (ident None) has not."""
    return thread.ident is not None and not thread.is_alive()
