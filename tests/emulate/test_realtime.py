"""Ranks at real-time priority (``emulate run --realtime``): the rank's own check of the priority it is given, and
the probe the caller asks before starting any rank."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from allreduce.emulate._rank import RT_PRIORITY_ENV, enter_realtime
from allreduce.emulate._run import RANK_RT_PRIORITY, realtime_refusal


@pytest.mark.parametrize("value", ["0", "100", "-3", "ten", "1.5"])
def test_a_priority_outside_1_to_99_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match=RT_PRIORITY_ENV):
        enter_realtime(value)


@pytest.mark.parametrize("value", [None, ""])
def test_no_priority_leaves_the_process_in_its_class(value: str | None) -> None:
    before = os.sched_getscheduler(0)
    assert enter_realtime(value) is False
    assert os.sched_getscheduler(0) == before


@pytest.mark.skipif(shutil.which("chrt") is None, reason="util-linux's chrt is not installed")
def test_the_probe_agrees_with_chrt_on_whether_this_machine_allows_it() -> None:
    refusal = realtime_refusal(RANK_RT_PRIORITY)
    chrt = subprocess.run(["chrt", "-f", str(RANK_RT_PRIORITY), "true"], capture_output=True, check=False)
    assert (refusal is None) == (chrt.returncode == 0), refusal
    if refusal is not None:
        assert refusal.strip()  # the kernel's reason, for the error that names it
