"""``allreduce emulate up --loss``: a malformed loss or an unknown link is refused in one line, nothing built."""

from __future__ import annotations

import os
import shutil

import pytest

from allreduce.cli import main

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="emulate up checks for root and iproute2 before it reads the loss",
)

TOPOLOGY = "clos:leaves=2,spines=1,hosts_per_leaf=1"


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--loss", "leaf0->spine0=2"], "--loss leaf0->spine0 '2'"),
        (["--loss", "leaf0->spine0=ge:p=1e-3"], "ge:p=P,burst=B"),
        (["--loss", "1e-3"], "write it as LINK=P"),
        (["--loss-all", "ge:p=0.1,burst=0"], "--loss-all"),
        (["--loss", "nosuch->link=1e-3"], "--loss nosuch->link: "),
        (["--loss-all", "1e-3", "--burst", "1000"], "--burst 1000: with one-MSS packets the burst must be 3,028"),
        (["--burst", "64KiB"], "--burst 65536: with GSO packets of up to 64 KiB (no --loss)"),
        (["--burst", "lots"], "--burst"),
    ],
)
def test_a_bad_loss_is_refused_before_anything_is_built(
    capsys: pytest.CaptureFixture[str], flags: list[str], says: str
) -> None:
    code = main(["emulate", "up", "--topology", TOPOLOGY, "--name", "lossx", *flags])
    err = capsys.readouterr().err
    assert code == 2
    assert says in err
    assert "Traceback" not in err
