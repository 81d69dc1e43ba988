"""Inputs beyond what the machine can hold are refused up front: one line naming the argument and the cap, exit
status 2; the library raises ValueError with the same text."""

from __future__ import annotations

import re
import subprocess
import sys
import tracemalloc

import pytest

from allreduce.cli._explain import MAX_EXPLAIN_RANKS, explain
from allreduce.cli._main import main
from allreduce.cli._sim import MAX_CHUNKS, MAX_SIM_RANKS
from allreduce.schedules import CostModel
from allreduce.topology import MAX_TOPOLOGY_LINKS, MAX_TOPOLOGY_NODES, parse_topology

MODEL = CostModel(latency_s=5e-6, bandwidth_Bps=12.5e9)
EXPLAIN = ("explain", "--size", "1MiB", "--bandwidth", "100Gbps", "--latency", "5us")


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(list(args))
    err = capsys.readouterr().err
    return code, err


def _one_line_error(code: int, err: str, *culprits: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "internal error" not in err
    for culprit in culprits:
        assert culprit in lines[0], lines[0]
    return lines[0].partition("error: ")[2]


def test_explain_refuses_ranks_beyond_its_cap_with_an_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _cli(capsys, *EXPLAIN, "--ranks", "1000000000")
    message = _one_line_error(code, err, "--ranks 1000000000", f"{MAX_EXPLAIN_RANKS:,}", "would need about")
    with pytest.raises(ValueError, match="--ranks 1000000000") as info:
        explain(1_000_000_000, 1 << 20, MODEL)
    assert str(info.value) == message


@pytest.mark.parametrize("world_size", [512, 1024, 4096])
@pytest.mark.slow
def test_explain_of_every_algorithm_stays_within_100_MB(world_size: int) -> None:
    # direct and naive cost O(N^2) flows in the cost model (direct: 800 MB at 4,096 ranks, naive: 260 MB at
    # 1,024); `all` leaves them out well before that
    tracemalloc.start()
    try:
        e = explain(world_size, 1 << 20, MODEL)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 100e6
    if world_size == 4096:
        assert any(s.startswith("direct: left out above") for s in e.skipped)


def test_the_library_refuses_a_schedule_beyond_its_cap() -> None:
    from allreduce.schedules import Collective, make_schedule

    with pytest.raises(ValueError, match=r"world_size 1000000000: more than the cap of 131,072 ranks .* GiB"):
        make_schedule(Collective.ALL_REDUCE, "halving_doubling", 1_000_000_000)


def test_explain_refuses_direct_by_name_beyond_what_it_can_hold(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _cli(capsys, *EXPLAIN, "--ranks", "65536", "-a", "direct")
    _one_line_error(code, err, "direct", "65536", "would need about")


def test_sim_refuses_more_chunks_than_elements(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _cli(
        capsys, "sim", "-t", "fat-tree:k=4", "--size", "1MiB", "-a", "double_binary_tree", "--chunks", "100000000"
    )
    _one_line_error(code, err, "--chunks 100000000", "elements")


def test_sim_refuses_chunks_beyond_the_cap(capsys: pytest.CaptureFixture[str]) -> None:
    chunks = str(MAX_CHUNKS + 1)
    code, err = _cli(
        capsys, "sim", "-t", "fat-tree:k=4", "--size", "1GiB", "-a", "double_binary_tree", "--chunks", chunks
    )
    _one_line_error(code, err, f"--chunks {chunks}", f"{MAX_CHUNKS:,}")


@pytest.mark.parametrize(
    ("spec", "what"),
    [
        ("switch:99999999999", "nodes"),
        ("torus:100000x100000", "nodes"),
        ("full:100000", "links"),
        ("fat-tree:k=1000", "nodes"),
        ("rail:nodes=1000000,gpus=8", "nodes"),
        ("dragonfly:groups=5000,routers=8,hosts=1", "links"),
    ],
)
def test_topologies_beyond_the_cap_are_refused_before_building(
    capsys: pytest.CaptureFixture[str], spec: str, what: str
) -> None:
    cap = MAX_TOPOLOGY_NODES if what == "nodes" else MAX_TOPOLOGY_LINKS
    code, err = _cli(capsys, "sim", "-t", spec, "--size", "1MiB")
    message = _one_line_error(code, err, spec, f"{cap:,} {what}", "would need about")
    with pytest.raises(ValueError, match="is more than the cap") as info:
        parse_topology(spec)
    assert str(info.value) == message


@pytest.mark.slow
def test_sim_refuses_more_ranks_than_its_cap(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _cli(capsys, "sim", "-t", "torus:1024x1024", "--size", "1MiB", "-a", "ring")
    _one_line_error(code, err, "--ranks 1048576", f"{MAX_SIM_RANKS:,}", "would need about")


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "allreduce", "bench", *args], capture_output=True, text=True, timeout=240, check=False
    )


@pytest.mark.slow
def test_bench_refuses_a_size_beyond_shared_memory_and_memory() -> None:
    done = _bench("--sizes", "1TiB")
    message = _one_line_error(done.returncode, done.stderr, "--sizes", "/dev/shm", "memory")
    from allreduce.runtime.bench import BenchConfig, run_bench

    with pytest.raises(ValueError, match="--sizes") as info:
        run_bench(BenchConfig(world_size=2, sizes_bytes=(1 << 40,)))
    # the same text, up to what is free now (other processes allocate in between)
    free = re.compile(r"\(\S+ \S+ (free|available)\)")
    assert free.sub("()", str(info.value)) == free.sub("()", message)


@pytest.mark.slow
def test_bench_over_tcp_refuses_a_size_beyond_memory() -> None:
    done = _bench("--sizes", "1TiB", "--transport", "tcp")
    _one_line_error(done.returncode, done.stderr, "--sizes", "of memory")
    assert "/dev/shm" not in done.stderr


@pytest.mark.parametrize(("args", "culprit"), [(("--sizes", "0"), "--sizes"), (("--timeout", "0.0001"), "--timeout")])
@pytest.mark.slow
def test_bench_user_errors_are_not_internal_errors(args: tuple[str, ...], culprit: str) -> None:
    done = _bench(*args)
    _one_line_error(done.returncode, done.stderr, culprit)
