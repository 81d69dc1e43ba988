"""Planning a schedule imports nothing new: the runtime plans its first collective on the caller's thread while
its worker thread runs another, and a first-time import there (numpy.ma, through np.unique) held the GIL for
hundreds of milliseconds on a loaded machine."""

from __future__ import annotations

import subprocess
import sys


def test_deriving_phases_does_not_import_numpy_ma() -> None:
    code = (
        "import sys\n"
        "from allreduce.schedules import double_binary_tree_all_reduce, ring_all_reduce\n"
        "for s in (ring_all_reduce(8), double_binary_tree_all_reduce(8)):\n"
        "    list(s.phases())\n"
        "print('numpy.ma' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
