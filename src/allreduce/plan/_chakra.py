"""Chakra execution traces (MLCommons' ``et_def.proto``), read without protobuf and replayed into a step's spans.

A Chakra ET is a sequence of length-prefixed protobuf messages (each a varint byte count, then the message): one
``GlobalMetadata``, then ``Node`` messages. This module decodes the protobuf wire format for the fields it needs
(a node's id, name, type, control and data dependencies, duration and input shapes) and skips every other field,
so reading needs no package beyond the standard library.

The PyTorch converter (``chakra_converter PyTorch``) writes each operator's *exclusive* duration (its own time,
not its callees'), chains the operators of a thread in call order through data dependencies, leaves every start
time at 0, keeps a parent only when it was converted before its child (rarely) and zeroes ``Optimizer.step``'s
own time. So the times come from a replay:

- each node starts when every node it depends on (data and control) has ended; compute nodes run one at a time
  on one stream, the next being the ready node that can start first (ties: the lower id); a communication node
  (``COMM_SEND``/``RECV``/``COLL``) runs beside the stream. A trace whose nodes carry start times is replayed the
  same way: the dependencies, not the recorded starts, decide.
- With no call tree in the trace, a phase spans from its first node to the next phase's first node: the phases
  are the autograd engine's functions (``autograd::engine::evaluate_function``), ``Optimizer.step#`` and
  ``Optimizer.zero_grad#``; a ``ProfilerStep#`` spans to the next one. Each gradient is ready when the engine's
  function that accumulated it ends (``torch::autograd::AccumulateGrad`` ends with it).

The replay has no idle time: host time outside every operator (Python between two operators) was charged to the
enclosing operator's exclusive duration, which the replay runs before that operator's callees. The result is the
spans a Chrome trace would hold (name, start, duration, input shapes), for the reader of profiles to take the
same timings from.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["execution_trace_spans"]

_COMMUNICATION_TYPES = frozenset({5, 6, 7})  # COMM_SEND_NODE, COMM_RECV_NODE, COMM_COLL_NODE
_RECORDER_PREFIX = "[pytorch|profiler|execution_"  # the observer's process and thread markers: not operators
_PHASE_PREFIXES = ("autograd::engine::evaluate_function", "Optimizer.step#", "Optimizer.zero_grad#")
_STEP_PREFIX = "ProfilerStep#"
_ACCUMULATE = "torch::autograd::AccumulateGrad"


class _MalformedError(ValueError):
    """The bytes break the wire format or the graph (the message says where)."""


@dataclass
class _Node:
    id: int = 0
    name: str = ""
    type: int = 0
    deps: list[int] = field(default_factory=list)
    duration_us: int = 0
    input_shapes: str = ""


def _varint(data: bytes, offset: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if offset >= len(data):
            raise _MalformedError(f"a varint runs past the end (byte {offset})")
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, offset
        shift += 7
        if shift >= 70:
            raise _MalformedError(f"a varint longer than 10 bytes at byte {offset}")


def _fields(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of each field of the message in ``data[start:end]``: value an int for
    varints and fixed widths, the (start, end) of its bytes for length-delimited fields."""
    offset = start
    while offset < end:
        key = data[offset]  # a one-byte key (field numbers below 16) is the common case: no call for it
        if key < 0x80:
            offset += 1
        else:
            key, offset = _varint(data, offset)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, offset = _varint(data, offset)
            yield number, wire, value
        elif wire == 2:
            length = data[offset] if offset < end else 0x80
            if length < 0x80:
                offset += 1
            else:
                length, offset = _varint(data, offset)
            if offset + length > end:
                raise _MalformedError(f"field {number} of {length} bytes runs past its message (byte {offset})")
            yield number, wire, (offset, offset + length)
            offset += length
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if offset + width > end:
                raise _MalformedError(f"field {number} runs past its message (byte {offset})")
            yield number, wire, int.from_bytes(data[offset : offset + width], "little")
            offset += width
        else:
            raise _MalformedError(f"field {number} has wire type {wire}, which proto3 does not write (byte {offset})")
    if offset != end:
        raise _MalformedError(f"a field runs past its message (byte {offset})")


def _uint64s(data: bytes, wire: int, value: Any) -> list[int]:
    """A repeated uint64: packed (the proto3 default) or one element."""
    if wire == 0:
        return [value]
    start, end = value
    out = []
    while start < end:
        item, start = _varint(data, start)
        out.append(item)
    return out


def _text(data: bytes, wire: int, value: Any, what: str) -> str:
    if wire != 2:
        raise _MalformedError(f"{what} is not a string")
    start, end = value
    try:
        return data[start:end].decode("utf-8")
    except UnicodeDecodeError:
        raise _MalformedError(f"{what} is not UTF-8 (byte {start})") from None


def _node(data: bytes, start: int, end: int) -> _Node:
    node = _Node()
    for number, wire, value in _fields(data, start, end):
        if number == 1 and wire == 0:
            node.id = value
        elif number == 2:
            node.name = _text(data, wire, value, "a node's name")
        elif number == 3 and wire == 0:
            node.type = value
        elif number in (4, 5):
            node.deps.extend(_uint64s(data, wire, value))
        elif number == 7 and wire == 0:
            node.duration_us = value
        elif number == 8 and wire == 2:
            for io_number, io_wire, io_value in _fields(data, *value):
                if io_number == 2:
                    node.input_shapes = _text(data, io_wire, io_value, f"node {node.id}'s input shapes")
    return node


def _messages(data: bytes) -> list[tuple[int, int]]:
    """The (start, end) of each length-prefixed message."""
    spans, offset = [], 0
    while offset < len(data):
        length, body = _varint(data, offset)
        if body + length > len(data):
            left = len(data) - body
            raise _MalformedError(f"truncated: a message of {length:,} bytes from byte {body:,}, {left:,} left")
        spans.append((body, body + length))
        offset = body + length
    return spans


def _decode(data: bytes) -> list[_Node]:
    messages = _messages(data)
    if not messages:
        raise _MalformedError("no messages")
    metadata = list(_fields(data, *messages[0]))
    if any(wire != 2 for _, wire, _ in metadata):
        raise _MalformedError("the first message is not the trace's GlobalMetadata")
    return [_node(data, *span) for span in messages[1:]]


@dataclass(frozen=True)
class _Replayed:
    name: str
    start_us: float
    end_us: float
    input_shapes: str


def _replay(nodes: list[_Node]) -> list[_Replayed]:
    """Start and end of each node, in the order the replay started them (see the module's rule)."""
    by_id: dict[int, _Node] = {}
    for node in nodes:
        if node.id in by_id:
            raise _MalformedError(f"two nodes have id {node.id}")
        by_id[node.id] = node
    # A dependency on a node the trace does not hold is already met: the converter drops nodes nothing depends on.
    waiting = {node.id: {d for d in node.deps if d in by_id and d != node.id} for node in nodes}
    dependents: dict[int, list[int]] = {}
    for node_id, deps in waiting.items():
        for dep in deps:
            dependents.setdefault(dep, []).append(node_id)
    ready_at = dict.fromkeys(by_id, 0.0)
    ready = [(0.0, node_id) for node_id, deps in waiting.items() if not deps]
    heapq.heapify(ready)
    stream_free_us = 0.0
    out = []
    while ready:
        at, node_id = heapq.heappop(ready)
        node = by_id[node_id]
        if node.type in _COMMUNICATION_TYPES:
            start = at
        else:
            start = max(at, stream_free_us)
            stream_free_us = start + node.duration_us
        end = start + node.duration_us
        out.append(_Replayed(node.name, start, end, node.input_shapes))
        for dependent in dependents.get(node_id, ()):
            ready_at[dependent] = max(ready_at[dependent], end)
            waiting[dependent].discard(node_id)
            if not waiting[dependent]:
                heapq.heappush(ready, (ready_at[dependent], dependent))
    if len(out) != len(by_id):
        stuck = sorted(node_id for node_id, deps in waiting.items() if deps)
        raise _MalformedError(f"a dependency cycle: {len(stuck)} nodes never become ready (node {stuck[0]} among them)")
    return out


def _shapes(text: str, parsed: dict[str, Any]) -> Any:
    """The input shapes as the converter writes them (a Python list's text, which for shapes is JSON); ``parsed``
    keeps each text's, as most operators repeat a few shapes."""
    shapes = parsed.get(text)
    if shapes is None:
        try:
            shapes = json.loads(text) if text else []
        except ValueError:
            shapes = []  # a non-shape input (a scalar list the text cannot hold as JSON): no shape to count
        parsed[text] = shapes
    return shapes


def _phase_ends(replayed: list[_Replayed]) -> list[float]:
    """Each node's span end: a phase's or a step's until the next one starts, any other node's its own."""
    ends = [r.end_us for r in replayed]
    trace_end = max(ends, default=0.0)
    next_phase = next_step = trace_end
    for index in range(len(replayed) - 1, -1, -1):
        name = replayed[index].name
        if name.startswith(_STEP_PREFIX):
            ends[index] = next_step
            next_step = replayed[index].start_us
        elif name.startswith(_PHASE_PREFIXES):
            ends[index] = max(ends[index], next_phase)
            next_phase = replayed[index].start_us
    return ends


def execution_trace_spans(data: bytes, path: str) -> list[dict[str, Any]]:
    """The replayed step of a Chakra ET as Chrome trace spans (``ph``, ``name``, ``ts`` and ``dur`` in
    microseconds, ``args['Input Dims']``). Errors name the file and what is wrong."""
    try:
        replayed = _replay(_decode(data))
    except _MalformedError as exc:
        raise ValueError(f"{path}: neither a Chrome trace (JSON) nor a Chakra execution trace: {exc}") from None
    ends = _phase_ends(replayed)
    spans, engine_end = [], 0.0
    parsed: dict[str, Any] = {}
    for r, end in zip(replayed, ends, strict=True):
        if r.name.startswith(_RECORDER_PREFIX):
            continue
        if r.name.startswith(_PHASE_PREFIXES[0]):
            engine_end = end
        # A gradient is final when the engine's function that accumulated it returns.
        span_end = max(end, engine_end) if r.name == _ACCUMULATE else end
        spans.append(
            {
                "ph": "X",
                "name": r.name,
                "ts": r.start_us,
                "dur": span_end - r.start_us,
                "args": {"Input Dims": _shapes(r.input_shapes, parsed)},
            }
        )
    return spans
