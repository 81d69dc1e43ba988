"""Chakra execution traces: the wire format read here, the replay's rule on hand-made traces, and on an ET the
test records itself (torch's ExecutionTraceObserver beside torch.profiler on CPU, MLCommons' converter) the same
timings as from the Kineto trace of the same step."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from allreduce.plan._chakra import execution_trace_spans
from allreduce.plan._measured import MeasuredBackward, read_profile


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _field(number: int, payload: int | bytes) -> bytes:
    if isinstance(payload, int):
        return _varint(number << 3) + _varint(payload)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _message(*fields: bytes) -> bytes:
    body = b"".join(fields)
    return _varint(len(body)) + body


def _et(*nodes: tuple[int, str, int, list[int], int]) -> bytes:
    """A Chakra ET of (id, name, type, data deps, duration in us) nodes, as et_def.proto lays them out."""
    metadata = _message(_field(1, b"0.0.4"))
    return metadata + b"".join(
        _message(
            _field(1, node_id),
            _field(2, name.encode()),
            _field(3, node_type),
            _field(5, b"".join(_varint(d) for d in deps)),
            _field(7, duration_us),
        )
        for node_id, name, node_type, deps, duration_us in nodes
    )


COMP, COLL = 4, 7


def _starts(data: bytes) -> dict[str, float]:
    return {span["name"]: span["ts"] for span in execution_trace_spans(data, "t.et")}


def test_a_node_starts_when_its_dependencies_end_and_the_stream_is_free() -> None:
    # a (10 us); b and c after a on the compute stream; an all-reduce after a beside it; d after b and the all-reduce
    trace = _et(
        (1, "a", COMP, [], 10),
        (2, "b", COMP, [1], 5),
        (3, "c", COMP, [1], 7),
        (4, "allreduce", COLL, [1], 30),
        (5, "d", COMP, [2, 4], 1),
    )
    assert _starts(trace) == {"a": 0.0, "b": 10.0, "c": 15.0, "allreduce": 10.0, "d": 40.0}


def test_a_dependency_cycle_is_refused_naming_the_file() -> None:
    trace = _et((1, "a", COMP, [2], 1), (2, "b", COMP, [1], 1))
    with pytest.raises(ValueError, match=r"t\.et: .*a dependency cycle: 2 nodes"):
        execution_trace_spans(trace, "t.et")


def test_a_truncated_trace_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cut.et"
    path.write_bytes(_et((1, "a", COMP, [], 10), (2, "b", COMP, [1], 5))[:-3])
    with pytest.raises(ValueError, match=rf"{path}: neither a Chrome trace \(JSON\) nor a Chakra .*truncated"):
        read_profile(str(path))


def test_bytes_that_are_no_trace_are_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "noise.et"
    path.write_bytes(bytes(range(7, 256)))
    with pytest.raises(ValueError, match=rf"{path}: neither a Chrome trace \(JSON\) nor a Chakra execution trace"):
        read_profile(str(path))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, MeasuredBackward, MeasuredBackward, Any]:
    """One step recorded both ways: its ET, what the ET and the Kineto trace give, and the Kineto events."""
    pytest.importorskip("torch")
    from profiler_traces import record_mlp_execution_trace

    et, kineto = record_mlp_execution_trace(tmp_path_factory.mktemp("chakra"))
    events = json.loads(kineto.read_text())["traceEvents"]
    return et, read_profile(str(et)), read_profile(str(kineto)), events


def _nodes(recorded: Any) -> int:
    return len(execution_trace_spans(recorded[0].read_bytes(), "et"))


@pytest.mark.slow
def test_an_execution_trace_gives_the_kineto_traces_gradients_and_flops(recorded: Any) -> None:
    et, from_et, from_kineto, _ = recorded
    assert from_et.tensor_params == from_kineto.tensor_params
    assert from_et.flops == from_kineto.flops
    assert from_et.source == f"profile {et.name} (Chakra ET, replayed)"


@pytest.mark.slow
def test_the_replayed_backward_is_the_kineto_traces_time_in_the_autograd_engine(recorded: Any) -> None:
    # The ET's durations are the Kineto events' (linked by record-function id), written in whole microseconds:
    # the replay's backward is the engine functions' summed time, within 1 us per node.
    _, from_et, from_kineto, events = recorded
    engine_us = sum(
        float(e["dur"])
        for e in events
        if e.get("ph") == "X" and str(e["name"]).startswith("autograd::engine::evaluate_function")
    )
    assert from_et.backward_s * 1e6 == pytest.approx(engine_us, abs=_nodes(recorded))
    assert from_et.backward_s <= from_kineto.backward_s + _nodes(recorded) * 1e-6


def _engine_functions(events: Any) -> list[tuple[float, float]]:
    """(start, duration) in us of the Kineto trace's autograd engine functions, in order."""
    return sorted(
        (float(e["ts"]), float(e["dur"]))
        for e in events
        if e.get("ph") == "X" and str(e["name"]).startswith("autograd::engine::evaluate_function")
    )


@pytest.mark.slow
def test_the_gradients_are_ready_when_the_kineto_traces_busy_time_says(recorded: Any) -> None:
    # Without idle time, a gradient is ready when the engine functions up to the one that accumulated it have run:
    # their summed time over all of theirs, from the Kineto trace, within 1 us per node of the replayed backward.
    _, from_et, _, events = recorded
    functions = _engine_functions(events)
    total_us = sum(duration for _, duration in functions)
    accumulated = sorted(float(e["ts"]) for e in events if e.get("name") == "torch::autograd::AccumulateGrad")
    busy = [sum(d for start, d in functions if start <= at) / total_us for at in accumulated]
    assert from_et.ready_fraction == pytest.approx(tuple(reversed(busy)), abs=_nodes(recorded) / total_us)


@pytest.mark.slow
def test_the_replayed_forward_is_the_kineto_traces_operators_before_backward(recorded: Any) -> None:
    # Python between the forward's operators is in the Kineto span, not in any operator's replayed time: the
    # replayed forward is the outermost operators' summed time before backward, within 1 us per node.
    _, from_et, from_kineto, events = recorded
    backward_start = _engine_functions(events)[0][0]
    operators = sorted(
        (float(e["ts"]), float(e["dur"]))
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "cpu_op" and float(e["ts"]) < backward_start
    )
    outermost_us, covered_until = 0.0, -1.0
    for start, duration in operators:
        if start >= covered_until:
            outermost_us += duration
            covered_until = start + duration
    assert from_et.forward_s * 1e6 == pytest.approx(outermost_us, abs=_nodes(recorded))
    assert from_et.forward_s <= from_kineto.forward_s + _nodes(recorded) * 1e-6


@pytest.mark.slow
def test_the_optimizer_is_its_operators_time_without_the_steps_own(recorded: Any) -> None:
    # The converter zeroes Optimizer.step's exclusive duration (its Python); its operators keep theirs.
    _, from_et, from_kineto, _ = recorded
    assert 0 < from_et.optimizer_s <= from_kineto.optimizer_s


@pytest.mark.slow
def test_a_gzipped_execution_trace_reads_as_the_plain_one(recorded: Any, tmp_path: Path) -> None:
    packed = tmp_path / "step.et.gz"
    packed.write_bytes(gzip.compress(recorded[0].read_bytes()))
    assert read_profile(str(packed)).ready_fraction == recorded[1].ready_fraction


@pytest.mark.slow
def test_a_gzipped_file_cut_short_is_refused_naming_it(recorded: Any, tmp_path: Path) -> None:
    packed = tmp_path / "cut.et.gz"
    packed.write_bytes(gzip.compress(recorded[0].read_bytes())[:-100])
    with pytest.raises(ValueError, match=r"cut\.et\.gz: a truncated gzip file"):
        read_profile(str(packed))


def test_an_execution_trace_that_begins_with_a_brace_is_still_one(tmp_path: Path) -> None:
    # a GlobalMetadata of 123 bytes: its length prefix is "{", as a JSON trace's first byte
    metadata = _message(_field(1, b"v" * 121))
    assert metadata[:1] == b"{"
    node = _et((1, "a", COMP, [], 10))[len(_message(_field(1, b"0.0.4"))) :]
    path = tmp_path / "brace.et"
    path.write_bytes(metadata + node)
    with pytest.raises(ValueError, match=r"brace\.et: no backward in the trace"):
        read_profile(str(path))
