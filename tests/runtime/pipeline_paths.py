"""Which path of the group's pipeline a call took, counted by the interpreter's profiler (no timing, no mocks). No
tests of its own."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType


def general_path_entries(call: Callable[[], object]) -> int:
    """How many times ``call()`` entered the general path (``Pipeline.collective``), not the plain-call entry."""
    entries = 0

    def count(frame: FrameType, event: str, _: object) -> None:
        nonlocal entries
        if event == "call" and frame.f_code.co_name == "collective" and "_pipeline" in frame.f_code.co_filename:
            entries += 1

    sys.setprofile(count)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entries
