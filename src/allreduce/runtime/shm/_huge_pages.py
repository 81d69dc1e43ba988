"""Which of this rank's buffers are on huge pages, and moving a buffer used again onto them.

Reading a peer's private memory with ``process_vm_readv`` pins it page by page, which over 4 KiB pages costs more
than staging it through shared memory: the transport reads a plain array in place only where
:func:`huge_pages_likely` says it is on 2 MiB pages, or where :class:`HugePageMemo` has moved it onto them.
"""

from __future__ import annotations

import errno
import importlib
from collections import OrderedDict
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.runtime._args import switch_arg
from allreduce.runtime.shm._linux import TRANSPARENT_HUGEPAGES, collapse_to_huge_pages

__all__ = [
    "COLLAPSE_ENV",
    "COLLAPSE_MIN_BYTES",
    "NUMPY_HUGEPAGE_MIN_BYTES",
    "HugePageMemo",
    "collapse_wanted",
    "huge_pages_likely",
]

NUMPY_HUGEPAGE_MIN_BYTES = 4 << 20
"""numpy asks the kernel for huge pages (``madvise(MADV_HUGEPAGE)``) for the arrays it allocates from this size."""


def _numpy_asks_for_huge_pages() -> bool:
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):  # numpy 2, numpy 1
        try:
            ask = getattr(importlib.import_module(module), "_get_madvise_hugepage", None)
        except ImportError:
            continue
        if ask is not None:
            return bool(ask())
    return False


_NUMPY_HUGE_PAGES = _numpy_asks_for_huge_pages()


def huge_pages_likely(buffer: npt.NDArray[Any]) -> bool:
    """Whether ``buffer`` is most likely backed by 2 MiB pages: the kernel gives them to every large region, or it
    gives them on request and the memory is a large array numpy allocated (numpy asks; torch's allocator does not).

    Reading a peer's memory with ``process_vm_readv`` pins it page by page: over 4 KiB pages that costs more than
    staging the buffer through shared memory (64 MiB, N = 2: 12-14.5 ms of CPU per call in place against 9.4 ms
    staged, and 5.3-6.2 ms in place over huge pages), so only buffers this returns True for are read in place."""
    if TRANSPARENT_HUGEPAGES == "always":
        return True
    if TRANSPARENT_HUGEPAGES != "madvise" or not _NUMPY_HUGE_PAGES:
        return False
    owner = buffer
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    return owner.base is None and owner.nbytes >= NUMPY_HUGEPAGE_MIN_BYTES


COLLAPSE_MIN_BYTES = 16 << 20
"""The smallest buffer :class:`HugePageMemo` collapses: at least 3/4 of it then lies in whole 2 MiB pages, however
it is aligned (the partial huge pages at its two ends stay on 4 KiB pages)."""

COLLAPSE_ENV = "ALLREDUCE_SHM_COLLAPSE"
"""``0`` turns :class:`HugePageMemo` off (the transport's ``collapse_huge_pages`` keyword wins over it)."""

_MEMO_CAPACITY = 64
"""Distinct buffers a rank remembers (oldest forgotten first): more than a training loop's gradient buckets."""

_SEEN, _COLLAPSED, _REFUSED = 0, 1, 2


def collapse_wanted(requested: bool | None) -> bool:
    """Whether to collapse buffers used again: ``requested``, else :data:`COLLAPSE_ENV` (``0`` or ``1``; ValueError
    naming it for anything else), else yes."""
    return switch_arg(requested, COLLAPSE_ENV)


class HugePageMemo:
    """Buffers that are used again are moved onto huge pages, so that peers read them in place.

    Reading a peer's private memory pins it page by page, which over 4 KiB pages costs more than staging (see
    :func:`huge_pages_likely`). Plain arrays numpy allocates are on huge pages already; torch's CPU tensors and
    memory from other allocators are not. A training loop all-reduces the same buffers step after step, so the
    second time a rank passes a buffer of at least :data:`COLLAPSE_MIN_BYTES` (same address and size) it asks the
    kernel to collapse the buffer's whole huge pages (``MADV_COLLAPSE``, Linux 6.1: a one-off copy inside the
    kernel, contents unchanged), and from then on that buffer is read in place. A buffer seen once is staged as
    before, so a loop that allocates a fresh buffer per call never pays for a collapse.

    A refusal (an older kernel, no huge page to be had) is remembered: that buffer stays staged, and on EINVAL or
    ENOSYS (the kernel has no ``MADV_COLLAPSE``) no buffer is tried again. If a collapsed buffer is freed and a new
    one lands at the same address with the same size, it is read in place over whatever pages it has: slower
    than staging, never wrong."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled and TRANSPARENT_HUGEPAGES != "never"  # the administrator said no huge pages
        self.collapsed = 0
        """Buffers collapsed."""
        self.refused = 0
        """Collapses the kernel refused."""
        self.last_errno = 0
        self._seen: OrderedDict[tuple[int, int], int] = OrderedDict()

    def in_place(self, buffer: npt.NDArray[Any]) -> bool:
        """Whether peers may read ``buffer`` in place as on huge pages (collapsing it now if this is its second
        use); False for a buffer this memo does not (or cannot) move onto huge pages."""
        if not self.enabled or buffer.nbytes < COLLAPSE_MIN_BYTES:
            return False
        key = (int(buffer.ctypes.data), buffer.nbytes)
        state = self._seen.get(key)
        if state is None:
            self._seen[key] = _SEEN
            if len(self._seen) > _MEMO_CAPACITY:
                self._seen.popitem(last=False)
            return False
        self._seen.move_to_end(key)
        if state == _SEEN:
            done, err = collapse_to_huge_pages(*key)
            state = _COLLAPSED if done else _REFUSED
            self._seen[key] = state
            if done:
                self.collapsed += 1
            else:
                self.refused += 1
                self.last_errno = err
                if err in (errno.EINVAL, errno.ENOSYS):
                    self.enabled = False
        return state == _COLLAPSED
