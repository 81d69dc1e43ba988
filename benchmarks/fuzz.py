"""Fuzzing the wire parsers: the TCP frame header, the connection handshake, the store protocol.

    .venv/bin/python benchmarks/fuzz.py [--inputs 1000000] [--seed 1] [--targets frames,accept,connect,store,client]

Targets, each fed a mix of pure random bytes and structure-aware mutations of valid messages (bit flips, byte
overwrites, truncation, extension, fields set to extreme values with and without a recomputed checksum):

- ``frames``: :func:`decode_header`, in process; the only error allowed is ``ProtocolError``, and a header it
  accepts must encode back to the same bytes;
- ``accept``/``connect``: the two sides of the handshake, in process over a socketpair preloaded with the input;
  allowed errors are those the callers handle (``ProtocolError``, ``OSError``, ``EOFError``);
- ``store``: requests pipelined into a live store server (hosted in this process, reached over loopback TCP after
  a real handshake); the server must answer every well-framed request, drop a connection whose framing is
  broken, never raise, never stop serving, and stay within bounded memory (keys come from a bounded set);
- ``client``: the store client (:class:`TCPStore`) reading fuzzed responses from a fake server; allowed errors are
  the ones its API documents (``CollectiveError`` subclasses, ``ValueError``).

Prints per target: inputs, inputs/s, outcomes by class, crashes (with a reproducer: the seed and input index), the
slowest input, and the process's maximum RSS before and after. Exit status 1 if anything crashed or hung.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import random
import resource
import socket
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from allreduce.runtime import CollectiveError, ProtocolError
from allreduce.runtime.tcp import ClientHello, connect_handshake
from allreduce.runtime.tcp._frames import HEADER, HEADER_SIZE, decode_header, encode_header
from allreduce.runtime.tcp._handshake import HandshakeRetryError, accept_handshake

HANG_S = 2.0
"""An input that takes longer than this to be handled counts as a hang (every parser here answers in µs)."""

_HS_MAGIC = b"ARHS"
_GREETING = struct.Struct("!4sB8sB32s")
_HELLO = struct.Struct("!4sBBiiI32s32s")
_REPLY = struct.Struct("!4sBH32s")
_REQUEST = struct.Struct("!BIII")
_RESPONSE = struct.Struct("!BI")
_EXTREMES = (0, 1, 2**7 - 1, 2**8 - 1, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**40, 2**63 - 1, 2**64 - 1)


@dataclass
class Tally:
    """Outcomes of one target."""

    target: str
    inputs: int = 0
    seconds: float = 0.0
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    crashes: list[str] = field(default_factory=list)
    slowest_s: float = 0.0

    def record(self, outcome: str, elapsed_s: float, crash: str | None = None) -> None:
        self.inputs += 1
        self.outcomes[outcome] += 1
        self.slowest_s = max(self.slowest_s, elapsed_s)
        if elapsed_s > HANG_S:
            self.outcomes["hang"] += 1
        if crash is not None and len(self.crashes) < 20:
            self.crashes.append(crash)


MEMORY_HEADROOM_BYTES = 1 << 30
"""The fuzzing process may map this much beyond what it maps at start (threads' stacks, the store's buffers)."""


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --------------------------------------------------------------------------------------------------------
# Mutations
# --------------------------------------------------------------------------------------------------------
def mutate(data: bytes, rng: random.Random) -> bytes:
    """One to four random edits of ``data``: bit flips, byte overwrites, insertions, deletions, truncation."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(6)
        if choice == 0 and out:
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
        elif choice == 1 and out:
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif choice == 2:
            i = rng.randint(0, len(out))
            out[i:i] = rng.randbytes(rng.randint(1, 8))
        elif choice == 3 and out:
            i = rng.randrange(len(out))
            del out[i : i + rng.randint(1, 8)]
        elif choice == 4:
            del out[rng.randint(0, len(out)) :]
        else:
            out += rng.randbytes(rng.randint(1, 64))
    return bytes(out)


def random_bytes(rng: random.Random, longest: int) -> bytes:
    return rng.randbytes(rng.choice((0, 1, rng.randint(0, longest), rng.randint(0, longest))))


# --------------------------------------------------------------------------------------------------------
# frames
# --------------------------------------------------------------------------------------------------------
def frame_inputs(rng: random.Random) -> Iterator[bytes]:
    """Valid headers, mutations of them, headers with a field set to an extreme (crc recomputed or not), noise."""
    while True:
        fields = {
            "flags": rng.choice((0, 1, 2, 4, 5)),
            "sequence": rng.getrandbits(64),
            "step": rng.getrandbits(32),
            "block": rng.getrandbits(32),
            "segment": rng.getrandbits(32),
            "length": rng.choice((0, 1, 4096, rng.getrandbits(40))),
            "tag": rng.getrandbits(32),
        }
        fields["crc32"] = rng.getrandbits(32) if fields["flags"] & 1 else 0
        if fields["flags"] & 4:
            fields["length"] = rng.randint(0, 4096)
        valid = encode_header(**fields)
        kind = rng.randrange(5)
        if kind == 0:
            yield valid
        elif kind == 1:
            yield mutate(valid, rng)
        elif kind == 2:  # one field set to an extreme, header crc recomputed: reaches the checks behind the crc
            values = list(HEADER.unpack(valid))
            i = rng.randrange(len(values) - 1)
            values[i] = rng.choice((b"AR", b"\0\0", b"RA")) if i == 0 else rng.choice(_EXTREMES)
            try:
                body = struct.pack("!2sBBQIIIQII", *values[:-1])
            except struct.error:
                continue
            yield body + struct.pack("!I", zlib.crc32(body))
        elif kind == 3:
            yield random_bytes(rng, 2 * HEADER_SIZE)
        else:
            yield rng.randbytes(HEADER_SIZE)


def fuzz_frames(count: int, rng: random.Random) -> Tally:
    tally = Tally("frames")
    started = time.perf_counter()
    for index, data in zip(range(count), frame_inputs(rng), strict=False):
        t0 = time.perf_counter()
        try:
            header = decode_header(data)
        except ProtocolError:
            tally.record("ProtocolError", time.perf_counter() - t0)
            continue
        except Exception as exc:
            tally.record("crash", time.perf_counter() - t0, f"input {index} {data.hex()}: {type(exc).__name__}: {exc}")
            continue
        again = encode_header(
            sequence=header.sequence,
            step=header.step,
            block=header.block,
            segment=header.segment,
            length=header.length,
            flags=header.flags,
            crc32=header.crc32,
            tag=header.tag,
        )
        if again != bytes(data):
            tally.record("crash", 0.0, f"input {index} {data.hex()}: accepted but encodes back differently")
        else:
            tally.record("decoded", time.perf_counter() - t0)
    tally.seconds = time.perf_counter() - started
    return tally


# --------------------------------------------------------------------------------------------------------
# handshake, both sides
# --------------------------------------------------------------------------------------------------------
_TOKEN = b"fuzz-token"
_HANDSHAKE_ERRORS = (ProtocolError, OSError, EOFError)


def hello_inputs(rng: random.Random) -> Iterator[bytes]:
    while True:
        flags = rng.choice((0, 1, 3, 255))
        hello = _HELLO.pack(
            rng.choice((_HS_MAGIC, _HS_MAGIC, b"ARHT", b"\0\0\0\0")),
            rng.choice((1, 1, 0, 2, 255)),
            flags,
            rng.choice((-1, 0, 1, 3, -(2**31), 2**31 - 1)),
            rng.choice((0, 1, -1, 2**31 - 1)),
            rng.choice((2, 4, 0, 2**32 - 1)),
            rng.randbytes(32),
            rng.randbytes(32),
        )
        kind = rng.randrange(4)
        yield hello if kind == 0 else mutate(hello, rng) if kind < 3 else random_bytes(rng, 2 * _HELLO.size)


def greeting_reply_inputs(rng: random.Random) -> Iterator[bytes]:
    while True:
        greeting = _GREETING.pack(
            rng.choice((_HS_MAGIC, _HS_MAGIC, b"XXXX")),
            rng.choice((1, 1, 0, 9)),
            rng.choice((b"tcp\0\0\0\0\0", b"store\0\0\0", rng.randbytes(8))),
            rng.choice((0, 1, 0xFF)),
            rng.randbytes(32),
        )
        message = rng.randbytes(rng.choice((0, 5, 1024)))
        length = rng.choice((len(message), len(message), 0, 65535, len(message) + 1))
        reply = _REPLY.pack(_HS_MAGIC, rng.choice((0, 0, 1, 2, 3, 255)), length, rng.randbytes(32)) + message
        kind = rng.randrange(4)
        data = greeting + reply
        yield data if kind == 0 else mutate(data, rng) if kind < 3 else random_bytes(rng, 2 * len(data))


def _check_hello(hello: ClientHello) -> str | None:
    return None if hello.rank % 2 == 0 else "odd ranks are refused by this fuzz target"


def fuzz_handshake(count: int, rng: random.Random, *, side: str) -> Tally:
    """``side`` "accept": the input is what a client sends; "connect": what an endpoint sends."""
    tally = Tally(side)
    inputs = hello_inputs(rng) if side == "accept" else greeting_reply_inputs(rng)
    started = time.perf_counter()
    for index, data in zip(range(count), inputs, strict=False):
        ours, theirs = socket.socketpair()
        token = _TOKEN if index % 2 else None
        t0 = time.perf_counter()
        try:
            theirs.sendall(data)
            theirs.shutdown(socket.SHUT_WR)
            ours.settimeout(HANG_S)
            if side == "accept":
                accept_handshake(ours, b"tcp", token, _check_hello)
            else:
                connect_handshake(ours, b"tcp", token, ClientHello(rank=1, world_size=2, target=0), what="fuzz")
            tally.record("accepted", time.perf_counter() - t0)
        except _HANDSHAKE_ERRORS as exc:
            tally.record(type(exc).__name__, time.perf_counter() - t0)
        except Exception as exc:
            tally.record("crash", time.perf_counter() - t0, f"input {index} {data.hex()}: {type(exc).__name__}: {exc}")
        finally:
            ours.close()
            theirs.close()
    tally.seconds = time.perf_counter() - started
    return tally


# --------------------------------------------------------------------------------------------------------
# store server, live
# --------------------------------------------------------------------------------------------------------
_STORE_KEYS = 1000  # keys are drawn from this many, so the store's contents (and memory) stay bounded
_STORE_OPS = (1, 2, 3, 4, 5, 6, 8)  # SET GET ADD WAIT CHECK DELETE DEAD; CLOSE ends the session, tested apart


def _store_key(rng: random.Random) -> bytes:
    choice = rng.randrange(10)
    if choice == 0:
        return rng.randbytes(rng.randint(1, 12))  # often not utf-8
    if choice == 1:
        return b"k\x00" + str(rng.randrange(_STORE_KEYS)).encode()  # several keys (WAIT/CHECK syntax)
    return f"k{rng.randrange(_STORE_KEYS)}".encode()


def store_request(rng: random.Random) -> tuple[bytes, bool]:
    """A request and whether it is well framed (the server then owes an answer)."""
    op = rng.choice((*_STORE_OPS, *_STORE_OPS, 0, 9, 200, 255))
    key = _store_key(rng)
    if op == 3:
        # extreme amounts are rare: two of them overflow the counter (which once stopped the server)
        value = struct.pack(
            "!q", rng.choice((1, -1, 1000)) if rng.random() < 0.98 else rng.choice((2**63 - 1, -(2**63)))
        )
        if rng.random() < 0.2:
            value = rng.randbytes(rng.randint(0, 12))
    else:
        value = rng.randbytes(rng.choice((0, 1, 16, 200)))
    # a wait on a key nobody sets ends at its deadline: keep deadlines at 0-1 ms so the session keeps moving
    timeout_ms = rng.choice((0, 1))
    request = _REQUEST.pack(op, timeout_ms, len(key), len(value)) + key + value
    if rng.random() < 0.02:  # broken framing: the connection is dropped, and that is the end of the session
        return rng.choice((mutate(request, rng), random_bytes(rng, 64), _REQUEST.pack(1, 0, 2**32 - 1, 0))), False
    return request, True


_STORE_WORLD_SIZE = 4096  # sessions claim ranks 1, 2, ... in turn: a rank's last session has ended long before


def _store_session(port: int, rng: random.Random, batch: int, tally: Tally, index: int) -> int:
    """One connection: a real handshake as the next rank, then up to ``batch`` requests pipelined; returns how
    many were sent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=HANG_S)
    with sock:
        hello = ClientHello(rank=1 + index % (_STORE_WORLD_SIZE - 1), world_size=_STORE_WORLD_SIZE, target=0)
        connect_handshake(sock, b"store", _TOKEN, hello, what="store")
        requests = []
        framed = True
        while len(requests) < batch and framed:
            request, framed = store_request(rng)
            requests.append(request)
        well_framed = len(requests) - (0 if framed else 1)
        t0 = time.perf_counter()
        sender = threading.Thread(target=_send_quietly, args=(sock, b"".join(requests)))
        sender.start()
        answered = 0
        try:
            while answered < well_framed:
                status, length = _RESPONSE.unpack(_read(sock, _RESPONSE.size))
                _read(sock, length)
                answered += 1
                tally.record(f"status {status}", 0.0)
            if not framed:  # answered, dropped, or waiting for bytes that never come: all fine; it must live on
                tally.record("broken framing", 0.0)
        except (OSError, EOFError) as exc:
            tally.record("crash", 0.0, f"session {index}: the server dropped a well-framed session: {exc}")
        finally:
            sender.join()
        elapsed = time.perf_counter() - t0
        tally.slowest_s = max(tally.slowest_s, elapsed / max(1, len(requests)))
        return len(requests)


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(data)


def _read(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise EOFError(f"closed after {len(buf)} of {size} bytes")
        buf += chunk
    return bytes(buf)


class _CountingHandler(logging.Handler):
    """Counts the store's log records of level ERROR and above (its "server crashed" among them), and keeps the
    rest off the terminal: a fuzzer makes the store warn about every client it drops."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def fuzz_store(count: int, rng: random.Random) -> Tally:
    from allreduce.runtime.store._store import TCPStore

    tally = Tally("store")
    store_log = logging.getLogger("allreduce.store")
    handler = _CountingHandler()
    store_log.addHandler(handler)
    store_log.propagate = False

    def new_host() -> TCPStore:
        return TCPStore(
            "127.0.0.1", 0, is_server=True, world_size=_STORE_WORLD_SIZE, rank=0, timeout_s=30, token=_TOKEN
        )

    host = new_host()
    started = time.perf_counter()
    sent, session = 0, 0
    try:
        while sent < count:
            crashes = tally.outcomes["crash"]
            try:
                sent += _store_session(host.port, rng, min(2000, count - sent), tally, session)
            except HandshakeRetryError:
                # a session drew a rank that an earlier session closed: the store rightly says "retry later"
                tally.record("rank closed earlier: told to retry", 0.0)
                sent += 1
            except (ProtocolError, OSError) as exc:
                tally.record("crash", 0.0, f"session {session}: could not connect: {exc}")
                sent += 1
            session += 1
            if tally.outcomes["crash"] > crashes and not _serving(host):
                # the server is gone: count it, and start another so the remaining inputs still run
                tally.record("server died", 0.0, f"session {session - 1}: the store server stopped serving")
                host.close(wait_for_ranks_s=0)
                host = new_host()
        if not _serving(host):
            tally.record("crash", 0.0, "the server stopped answering")
    finally:
        host.close(wait_for_ranks_s=0)
        store_log.removeHandler(handler)
        store_log.propagate = True
    for message in sorted(set(handler.messages)):
        tally.record("server logged an error", 0.0, f"the store logged: {message}")
    tally.seconds = time.perf_counter() - started
    tally.inputs = sent
    return tally


def _serving(host: object) -> bool:
    """Whether the store still answers its own rank."""
    try:
        host.set("still/serving", b"yes")  # type: ignore[attr-defined]
        return bool(host.get("still/serving", timeout_s=5) == b"yes")  # type: ignore[attr-defined]
    except CollectiveError:
        return False


# --------------------------------------------------------------------------------------------------------
# store client, against a fake server
# --------------------------------------------------------------------------------------------------------
def response_inputs(rng: random.Random) -> Iterator[bytes]:
    while True:
        status = rng.choice((0, 1, 2, 3, 4, 5, 255))
        payload = rng.choice(
            (
                b"",
                b"value",
                struct.pack("!q", 7),
                b"1\nreason",
                b"x\nreason",
                b"k1\x00k2\n1,2\n3",
                b"k\nfoo,1\nbar",
                rng.randbytes(rng.randint(0, 40)),
            )
        )
        response = _RESPONSE.pack(status, len(payload)) + payload
        kind = rng.randrange(3)
        yield response if kind == 0 else mutate(response, rng) if kind == 1 else random_bytes(rng, 64)


_CLOSE_OP = 7
_CLIENT_PATIENCE_S = 0.05  # how long the fake server waits for a client to say more before closing on it


def fuzz_client(count: int, rng: random.Random) -> Tally:
    """Each input: a fresh client, one request, the fake server's fuzzed answer."""
    from allreduce.runtime.store._store import TCPStore

    tally = Tally("client")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    answers: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn, contextlib.suppress(ProtocolError, OSError, EOFError):
                conn.settimeout(HANG_S)
                accept_handshake(conn, b"store", None, lambda hello: None)
                conn.recv(1 << 16)
                conn.sendall(answers.pop())
                # A client still waiting for the rest of a short answer gets EOF after a moment; one that
                # leaves politely (CLOSE) gets its acknowledgement.
                conn.settimeout(_CLIENT_PATIENCE_S)
                while request := conn.recv(1 << 16):
                    if request[0] == _CLOSE_OP:
                        conn.sendall(_RESPONSE.pack(0, 0))

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    started = time.perf_counter()
    calls: list[Callable[[TCPStore], object]] = [
        lambda s: s.get("k", timeout_s=1),
        lambda s: s.add("k", 1),
        lambda s: s.wait(["a", "b"], timeout_s=1),
        lambda s: s.check(["a"]),
        lambda s: s.dead_ranks(),
        lambda s: s.set("k", b"v"),
    ]
    try:
        for index, data in zip(range(count), response_inputs(rng), strict=False):
            answers.append(data)
            t0 = time.perf_counter()
            store = None
            try:
                store = TCPStore("127.0.0.1", port, is_server=False, world_size=2, rank=1, timeout_s=HANG_S)
                calls[index % len(calls)](store)
                tally.record("answered", time.perf_counter() - t0)
            except (CollectiveError, ValueError) as exc:
                tally.record(type(exc).__name__, time.perf_counter() - t0)
            except Exception as exc:
                tally.record(
                    "crash", time.perf_counter() - t0, f"input {index} {data.hex()}: {type(exc).__name__}: {exc}"
                )
            finally:
                if store is not None:
                    store.close()
                while answers:  # the client gave up before reading this one (it is still counted above)
                    time.sleep(0.001)
    finally:
        stop.set()
        listener.close()
        server.join(timeout=5)
    tally.seconds = time.perf_counter() - started
    return tally


# --------------------------------------------------------------------------------------------------------
TARGETS: dict[str, Callable[[int, random.Random], Tally]] = {
    "frames": fuzz_frames,
    "accept": lambda n, rng: fuzz_handshake(n, rng, side="accept"),
    "connect": lambda n, rng: fuzz_handshake(n, rng, side="connect"),
    "store": fuzz_store,
    "client": fuzz_client,
}
SHARE = {"frames": 1.0, "accept": 0.1, "connect": 0.1, "store": 1.0, "client": 0.002}
"""Inputs per target as a share of ``--inputs``: the in-process parsers take them all; the targets that need a
socket or a connection per input, a tenth or less (they are 100-10,000x slower per input)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=1_000_000, help="inputs for the frame and store targets")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated: {', '.join(TARGETS)}")
    args = parser.parse_args(argv)
    names = args.targets.split(",")
    unknown = sorted(set(names) - set(TARGETS))
    if unknown:
        parser.error(f"--targets: unknown {', '.join(unknown)}")
    print(f"command: python benchmarks/fuzz.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"load average {os.getloadavg()[0]:.1f} (1-min) at start")
    # Bounded memory is enforced, not just reported: an input that makes a parser allocate beyond this fails with
    # MemoryError, counted as a crash, instead of taking the machine's memory.
    limit = _address_space_bytes() + MEMORY_HEADROOM_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    print(
        f"address space limited to {limit / 2**20:.0f} MiB "
        f"(what the process maps at start + {MEMORY_HEADROOM_BYTES >> 20} MiB)"
    )
    failed = False
    for name in names:
        rss_before = max_rss_mib()
        count = max(1, int(args.inputs * SHARE[name]))
        tally = TARGETS[name](count, random.Random(f"{args.seed}/{name}"))
        rate = tally.inputs / tally.seconds if tally.seconds else float("inf")
        outcomes = ", ".join(f"{k} {v}" for k, v in tally.outcomes.most_common())
        print(
            f"{name:8s} {tally.inputs:>9,d} inputs in {tally.seconds:6.1f} s ({rate:>9,.0f}/s); "
            f"slowest {tally.slowest_s * 1e3:.1f} ms; max RSS {rss_before:.0f} -> {max_rss_mib():.0f} MiB"
        )
        print(f"         outcomes: {outcomes}")
        for crash in tally.crashes:
            print(f"         CRASH (seed {args.seed}): {crash[:400]}")
        failed |= bool(tally.outcomes["crash"] or tally.outcomes["hang"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
