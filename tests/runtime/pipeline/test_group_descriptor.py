"""The descriptor: one declared struct, compared byte for byte, diffed field by field into a message."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from allreduce.runtime.pipeline._descriptor import (
    BARRIER_CODE,
    DESCRIPTOR,
    DTYPE_CODES,
    DTYPES,
    FIELDS,
    KIND_CODES,
    NO_DIGEST,
    NO_OP_CODE,
    NO_TAG,
    OPS,
    REQUEST_BYTES,
    algorithm_name_bytes,
    barrier_descriptor,
    find_mismatch,
    proposal_of,
    schedule_digest,
)
from allreduce.runtime.transport._transport import MAX_DESCRIPTOR_BYTES
from allreduce.schedules import MAX_ALGORITHM_NAME_BYTES, Collective, ring_all_reduce

BASE = {
    "collective": KIND_CODES[Collective.ALL_REDUCE],
    "dtype": 2,
    "op": 0,
    "flags": 0,
    "root": 0,
    "count": 100,
    "segments": 1,
    "group_size": 4,
    "algorithm": b"auto",
    "schedule": NO_DIGEST,
    "tag": NO_TAG,
    "proposal": b"ring",
}


def _pack(**changes: object) -> bytes:
    values = BASE | changes
    return DESCRIPTOR.pack(*(values[name] for name, _ in FIELDS))


def test_a_descriptor_fits_what_every_transport_carries() -> None:
    assert DESCRIPTOR.size <= MAX_DESCRIPTOR_BYTES


def test_the_proposal_is_the_only_field_outside_the_compared_request() -> None:
    assert DESCRIPTOR.size - MAX_ALGORITHM_NAME_BYTES == REQUEST_BYTES
    assert FIELDS[-1][0] == "proposal"


def test_equal_requests_with_different_proposals_agree() -> None:
    assert find_mismatch([_pack(), _pack(proposal=b"direct")]) is None


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("collective", KIND_CODES[Collective.BROADCAST], "broadcast"),
        ("dtype", 3, "float64"),
        ("op", 3, "max"),
        ("flags", 1, "checksum"),
        ("root", 2, "2"),
        ("count", 101, "101"),
        ("segments", 4, "4"),
        ("group_size", 2, "2"),
        ("algorithm", b"direct", "direct"),
        ("schedule", b"\x01" * 8, "digest 0101010101010101"),
        ("tag", b"bucket-3", "'bucket-3'"),
    ],
)
def test_a_differing_field_is_named_with_each_ranks_value(field: str, value: object, shown: str) -> None:
    mismatch = find_mismatch([_pack(), _pack(), _pack(**{field: value})])
    assert mismatch is not None
    name, values = mismatch
    assert name == field
    assert values[2] == shown
    assert values[0] == values[1] != shown


def test_a_barrier_against_a_collective_names_both() -> None:
    mismatch = find_mismatch([barrier_descriptor(), _pack()])
    assert mismatch == ("collective", ["barrier", "all_reduce"])


def test_a_barrier_has_no_op() -> None:
    values = DESCRIPTOR.unpack(barrier_descriptor())
    assert values[0] == BARRIER_CODE
    assert values[2] == NO_OP_CODE
    assert BARRIER_CODE not in KIND_CODES.values()
    assert len(OPS) <= NO_OP_CODE


def test_the_proposal_reads_back() -> None:
    assert proposal_of(_pack(proposal=b"halving_doubling")) == "halving_doubling"


def test_every_dtype_and_op_has_a_code_that_fits_a_byte() -> None:
    assert len(DTYPES) < 256
    assert len(OPS) < NO_OP_CODE


def test_a_name_longer_than_the_field_is_refused_not_cut() -> None:
    name = "n" * (MAX_ALGORITHM_NAME_BYTES + 1)
    with pytest.raises(ValueError, match=f"'{name}' is 25 bytes"):
        algorithm_name_bytes(name)


def test_a_name_of_the_field_length_is_kept_whole() -> None:
    name = "n" * MAX_ALGORITHM_NAME_BYTES
    assert algorithm_name_bytes(name) == name.encode()


def test_equal_schedules_have_equal_digests() -> None:
    assert schedule_digest(ring_all_reduce(4)) == schedule_digest(ring_all_reduce(4))


@pytest.mark.parametrize(
    "other",
    [
        ring_all_reduce(5),
        ring_all_reduce(4).with_segments(2),
        dataclasses.replace(ring_all_reduce(4), name="renamed"),
        dataclasses.replace(ring_all_reduce(4), streams=ring_all_reduce(4).streams.replace(reduce=False)),
    ],
    ids=["world_size", "segments", "name", "streams"],
)
def test_a_schedule_that_moves_data_differently_has_another_digest(other: object) -> None:
    assert schedule_digest(other) != schedule_digest(ring_all_reduce(4))  # type: ignore[arg-type]


def test_a_digest_is_never_the_registered_marker() -> None:
    assert schedule_digest(ring_all_reduce(2)) != NO_DIGEST


def _fresh_python(code: str) -> str:
    """Run ``code`` in a new interpreter (nothing imported yet, unlike this test process) and return its output."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_allreduce_leaves_ml_dtypes_unimported() -> None:
    # ml_dtypes 0.7 alone took 0.7-0.9 s to import: every rank, launcher and CLI run paid it for bfloat16
    out = _fresh_python("import sys, allreduce, allreduce.runtime, allreduce.train; print('ml_dtypes' in sys.modules)")
    assert out.strip() == "False"


def test_a_bfloat16_array_made_after_import_is_reduced_with_its_fixed_code() -> None:
    out = _fresh_python(
        "import numpy as np, allreduce\n"
        "from allreduce.runtime.pipeline._descriptor import DTYPE_CODES\n"
        "import ml_dtypes\n"
        "group = allreduce.init(0, 1)\n"
        "x = np.arange(6).astype(ml_dtypes.bfloat16)\n"
        "group.all_reduce(x)\n"
        "print(x.astype(np.float32).tolist(), DTYPE_CODES[x.dtype])\n"
    )
    assert out.split("]")[0] + "]" == "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]"
    assert int(out.split("]")[1]) == list(DTYPES).index("bfloat16")


def test_the_dtype_table_keeps_bfloat16_at_code_1_before_and_after_it_is_loaded() -> None:
    assert list(DTYPES)[1] == "bfloat16"
    assert DTYPES["bfloat16"].name == "bfloat16"
    assert DTYPE_CODES[DTYPES["bfloat16"]] == 1
