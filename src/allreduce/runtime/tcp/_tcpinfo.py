"""What the kernel measured sending on a TCP connection: bytes the peer acknowledged, and the time the connection
spent limited by the network (``getsockopt(TCP_INFO)``).

A receiver cannot time a link: the data of a collective step often arrives while the receiving rank is busy
sending, and a shaped link's token bucket lets a step's bytes through at line rate until it is empty, so the slow
part shows as a wait before the first byte, which a rank that waits for a late upstream peer shows too. The sender's
kernel knows better: it counts the bytes the peer acknowledged (``tcpi_bytes_acked``, RFC 4898's
``tcpEStatsAppHCThruOctetsAcked``) and, since Linux 4.10, how long the connection had data in flight
(``tcpi_busy_time``) split by what limited it (``tcp_chrono``: the network, the receiver's window
``tcpi_rwnd_limited``, the sender's buffer ``tcpi_sndbuf_limited``). Bytes over the time the network limited the
connection is the link's rate as this connection saw it, whatever the ranks were doing meanwhile. A sender short of
CPU does not inflate it: the kernel counts a connection sndbuf-limited only once everything the writer gave it is
sent, the congestion window is not full and the writer waits for space (``tcp_cwnd_validate``), and a late writer
leaves the connection idle (not counted) or busy (counted); on an emulated Clos (8 ranks, a cable at a tenth or a
twentieth or none) no connection counted a microsecond sndbuf-limited in 8,200 readings over 17 runs at load 9-18,
most of them beside eight busy loops.

The kernel keeps those times in jiffies (4 ms at HZ=250): a short busy period counts as 0 or a jiffy, unbiased on
average, so rates are read over windows of many calls (re-planning's), never per step. The offsets are those of
``struct tcp_info`` in ``include/uapi/linux/tcp.h``; the kernel only appends to it, and a kernel too old to fill the
fields returns a shorter struct (then: no counters).
"""

from __future__ import annotations

import socket
import struct

__all__ = ["JIFFY_S", "pace_sending", "sent_and_busy"]

_BYTES_ACKED = struct.Struct("<Q")
_BYTES_ACKED_AT = 120  # after the u8 flags, 24 u32 fields, pacing_rate and max_pacing_rate
_CHRONO = struct.Struct("<3Q")  # tcpi_busy_time, tcpi_rwnd_limited, tcpi_sndbuf_limited (µs)
_CHRONO_AT = 168  # after bytes_received, segs_out/in, notsent_bytes, min_rtt, data_segs_in/out, delivery_rate
_INFO_BYTES = _CHRONO_AT + _CHRONO.size

_SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # include/uapi/asm-generic/socket.h
_MAX_PACING_BPS = 2**32 - 1  # the option's 32-bit form

JIFFY_S = 0.004
"""The resolution of the kernel's busy times at HZ=250 (a kernel with a higher HZ only makes them finer)."""


def sent_and_busy(sock: socket.socket) -> tuple[int, float] | None:
    """(bytes the peer acknowledged, seconds the network limited sending) of a TCP connection, both counted since it
    opened; None for a socket that is not TCP (a Unix socket of a same-host group) or a kernel without the fields."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _INFO_BYTES)
    except OSError:
        return None
    if len(raw) < _INFO_BYTES:
        return None
    (acked,) = _BYTES_ACKED.unpack_from(raw, _BYTES_ACKED_AT)
    busy_us, rwnd_us, sndbuf_us = _CHRONO.unpack_from(raw, _CHRONO_AT)
    return int(acked), max(busy_us - rwnd_us - sndbuf_us, 0) / 1e6


def pace_sending(sock: socket.socket, rate_Bps: float) -> None:
    """Make the kernel pace ``sock``'s sending at ``rate_Bps`` bytes per second (``SO_MAX_PACING_RATE``; TCP paces
    itself without the fq qdisc since Linux 4.13): a slow link as the network would make it, data queued in the
    kernel and counted as network-limited time, not a sender that holds its data back. ValueError for a socket that
    is not TCP or a rate outside 1 B/s..4 GiB/s."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        raise ValueError("only a TCP connection can be paced by the kernel (this one is a Unix socket)")
    if not 1 <= rate_Bps <= _MAX_PACING_BPS:
        raise ValueError(f"pacing rate {rate_Bps} B/s is outside 1..{_MAX_PACING_BPS} B/s")
    sock.setsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE, int(rate_Bps))
