"""dist.send / recv / isend / irecv / batch_isend_irecv on the "allreduce" backend, at world sizes 2 and 3.

One set of processes per world size runs every case and reports; each test reads one case. Every rank sends to
the next rank of the ring and receives from the previous one, so every pair of neighbours is exercised.
"""

from __future__ import annotations

from typing import Any

import pytest

import torch
from allreduce.runtime._spawn import spawn

WORLD_SIZES = [2, 3]


def _ring(rank: int, world_size: int) -> tuple[int, int]:
    return (rank + 1) % world_size, (rank - 1) % world_size


def _send_recv(rank: int, world_size: int) -> Any:
    import torch.distributed as dist

    after, before = _ring(rank, world_size)
    got = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint16):
        x = torch.zeros(5, dtype=dtype)
        if rank % 2 == 0:  # even ranks send first, odd ones receive first: no rank waits on another's send
            dist.send((torch.arange(5) + rank).to(dtype), after)
            dist.recv(x, before)
        else:
            dist.recv(x, before)
            dist.send((torch.arange(5) + rank).to(dtype), after)
        got[str(dtype)] = x.to(torch.int64).tolist()
    return got


def _isend_irecv(rank: int, world_size: int) -> Any:
    import torch.distributed as dist

    after, before = _ring(rank, world_size)
    x = torch.zeros(1 << 18)
    receive = dist.irecv(x, before, tag=4)
    send = dist.isend(torch.full((1 << 18,), float(rank)), after, tag=4)
    send.wait()
    receive.wait()
    return x.unique().tolist()


def _batch(rank: int, world_size: int) -> Any:
    import torch.distributed as dist

    after, before = _ring(rank, world_size)
    x, y = torch.zeros(3), torch.zeros(3, dtype=torch.int32)
    ops = [
        dist.P2POp(dist.irecv, x, before),  # receives listed first: the order in a batch does not matter
        dist.P2POp(dist.irecv, y, before, tag=7),
        dist.P2POp(dist.isend, torch.full((3,), float(rank)), after),
        dist.P2POp(dist.isend, torch.full((3,), rank, dtype=torch.int32), after, tag=7),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return [x.tolist(), y.tolist()]


def _any_source(rank: int, world_size: int) -> Any:
    import torch.distributed as dist

    if rank != 0:
        dist.send(torch.full((2,), float(rank)), 0, tag=2)
        return None
    got = []
    for _ in range(world_size - 1):
        x = torch.zeros(2)
        source = dist.recv(x, tag=2)
        got.append((source, x.tolist()))
    return sorted(got)


def _mismatch(rank: int, world_size: int) -> Any:
    import torch.distributed as dist

    after, before = _ring(rank, world_size)
    dist.isend(torch.ones(4), after, tag=3).wait()
    work = dist.irecv(torch.zeros(6), before, tag=3)
    try:
        work.wait()
    except dist.DistBackendError as exc:
        return str(exc)
    return "no error"


CASES = {
    "send/recv": _send_recv,
    "isend/irecv": _isend_irecv,
    "batch_isend_irecv": _batch,
    "recv from any source": _any_source,
    "mismatch": _mismatch,
}


def _worker() -> dict[str, Any]:
    import torch.distributed as dist

    import allreduce.torch  # noqa: F401

    dist.init_process_group("allreduce")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for name, case in CASES.items():
        try:
            out[name] = ("ok", case(rank, world_size))
        except Exception as exc:
            out[name] = ("raised", f"{type(exc).__name__}: {exc}")
        dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module", params=WORLD_SIZES)
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world_size: int = request.param
    return world_size, spawn(world_size, _worker, group=False, timeout_s=240, env={"OMP_NUM_THREADS": "1"})


def _outcomes(results: tuple[int, list[dict[str, Any]]], case: str) -> tuple[int, list[Any]]:
    world_size, per_rank = results
    values = []
    for rank, out in enumerate(per_rank):
        status, value = out[case]
        assert status == "ok", f"rank {rank}: {value}"
        values.append(value)
    return world_size, values


@pytest.mark.slow
def test_send_and_recv_carry_each_dtype_around_the_ring(results: tuple[int, list[dict[str, Any]]]) -> None:
    world_size, values = _outcomes(results, "send/recv")
    for rank, got in enumerate(values):
        before = (rank - 1) % world_size
        for dtype, received in got.items():
            sent = [i + before for i in range(5)]
            assert received == ([int(v != 0) for v in sent] if dtype == "torch.bool" else sent), f"rank {rank} {dtype}"


@pytest.mark.slow
def test_isend_and_irecv_deliver_a_megabyte_around_the_ring(results: tuple[int, list[dict[str, Any]]]) -> None:
    world_size, values = _outcomes(results, "isend/irecv")
    assert values == [[float((r - 1) % world_size)] for r in range(world_size)]


@pytest.mark.slow
def test_batch_isend_irecv_matches_by_tag_whatever_the_order(results: tuple[int, list[dict[str, Any]]]) -> None:
    world_size, values = _outcomes(results, "batch_isend_irecv")
    for rank, (x, y) in enumerate(values):
        before = (rank - 1) % world_size
        assert (x, y) == ([float(before)] * 3, [before] * 3)


@pytest.mark.slow
def test_recv_from_any_source_returns_the_senders_rank(results: tuple[int, list[dict[str, Any]]]) -> None:
    world_size, values = _outcomes(results, "recv from any source")
    assert values[0] == [(r, [float(r)] * 2) for r in range(1, world_size)]


@pytest.mark.slow
def test_a_receive_that_does_not_fit_raises_through_wait(results: tuple[int, list[dict[str, Any]]]) -> None:
    world_size, values = _outcomes(results, "mismatch")
    for rank, message in enumerate(values):
        before = (rank - 1) % world_size
        assert f"recv from rank {before} (tag 3): rank {before} sent 4 float32 elements" in message
        assert "this receive takes 6 float32 elements" in message
