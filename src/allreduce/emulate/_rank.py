"""One rank of an emulated run: ``python -m allreduce.emulate._rank SPEC_JSON`` inside a host's namespace.

Joins the group from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ALLREDUCE_TOKEN) over TCP,
and for every size: one untimed warm-up, then ``reps`` timed all-reduces, each after a barrier, each result
checked exactly (integer-valued float32 data, so every summation order gives the same bits). Prints one JSON
line: this rank's seconds per repetition and size, whether every result was exact, and the TCP connections it
had open at the end (local and remote address and port, from this namespace's ``/proc/net/tcp``), so the caller
can ask the kernel which path each connection's packets took.

With ``ALLREDUCE_EMULATE_RT_PRIORITY`` set (``emulate run --realtime``), the rank first moves itself to the
real-time class (``SCHED_FIFO`` at that priority), before any thread starts, so every thread it starts inherits it,
and says so in its report (``realtime``).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time

import numpy as np

_ESTABLISHED = "01"  # the state column of /proc/net/tcp

RT_PRIORITY_ENV = "ALLREDUCE_EMULATE_RT_PRIORITY"
"""The SCHED_FIFO priority a rank moves itself to before it starts (unset: it stays in the normal class)."""


def enter_realtime(value: str | None) -> bool:
    """Move this process to ``SCHED_FIFO`` at priority ``value`` (1-99) if given; True if it now runs there.
    Raises ValueError for a priority that is not an integer in 1..99, OSError if the kernel refuses."""
    if not value:
        return False
    try:
        priority = int(value)
    except ValueError:
        raise ValueError(f"{RT_PRIORITY_ENV}={value!r}: not an integer priority (1-99)") from None
    if not 1 <= priority <= 99:
        raise ValueError(f"{RT_PRIORITY_ENV}={value!r}: SCHED_FIFO priorities are 1-99")
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    return True


def _address(hex_address: str) -> tuple[str, int]:
    """``0100007F:1F90`` (the kernel's little-endian IPv4 and big-endian port in hex) -> ("127.0.0.1", 8080)."""
    address, port = hex_address.split(":")
    return socket.inet_ntoa(struct.pack("<I", int(address, 16))), int(port, 16)


def established_connections() -> list[tuple[str, int, str, int]]:
    """(local address, local port, remote address, remote port) of every established IPv4 TCP connection in this
    network namespace."""
    out = []
    with open("/proc/net/tcp", encoding="ascii") as table:
        next(table)
        for line in table:
            fields = line.split()
            if fields[3] == _ESTABLISHED:
                out.append((*_address(fields[1]), *_address(fields[2])))
    return out


def main(spec_json: str) -> int:
    try:
        realtime = enter_realtime(os.environ.get(RT_PRIORITY_ENV))
    except (ValueError, OSError) as exc:
        print(f"cannot run at real-time priority: {exc}", file=sys.stderr)
        return 2
    import allreduce

    spec = json.loads(spec_json)
    group = allreduce.init(transport="tcp", timeout_s=float(spec["timeout_s"]))
    try:
        n, rank = group.world_size, group.rank
        times: dict[str, list[float]] = {}
        exact = True
        for size_bytes in spec["sizes"]:
            count = max(int(size_bytes) // 4, 1)
            # rank r contributes (r + 1) * (i mod 251): sums stay below 2^24, exact in float32
            base = (np.arange(count, dtype=np.int64) % 251).astype(np.float32)
            expected = base * (n * (n + 1) // 2)
            row = []
            for rep in range(int(spec["reps"]) + 1):
                x = base * (rank + 1)
                group.barrier()
                started = time.perf_counter()
                group.all_reduce(x, algorithm=spec["algorithm"])
                elapsed = time.perf_counter() - started
                exact = exact and bool(np.array_equal(x, expected))
                if rep:  # the first is a warm-up: connections, plans, page faults
                    row.append(elapsed)
            times[str(size_bytes)] = row
        group.barrier()  # every connection of the collectives is open on every rank
        report = {"rank": rank, "times_s": times, "exact": exact, "connections": established_connections(),
                  "realtime": realtime}  # fmt: skip
        print(json.dumps(report), flush=True)
    finally:
        group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
