"""The reaper's process-group probe: it finds a live group, and leaves no directory handle open behind it."""

from __future__ import annotations

import gc
import os
import warnings

from allreduce.runtime.launcher._reaper import running_in_groups


def test_a_live_group_is_found_and_the_proc_listing_is_closed() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        assert running_in_groups({os.getpgrp()})  # this process: the listing stops early
        gc.collect()  # an iterator left open warns when collected


def test_a_group_without_processes_is_not_found() -> None:
    assert not running_in_groups({2**31 - 7})
