"""Every ProcessGroup operation of the "allreduce" backend (collectives and point-to-point) against Gloo's answer
and a closed form.

One set of processes per world size runs every case on the default group (the backend) and on a Gloo group in
the same processes, and returns both; each test checks one case: the backend's result equals the closed form,
and Gloo's wherever Gloo takes the case (it refuses some dtypes and ops; the backend then still has to give the
closed form).
"""

from __future__ import annotations

import datetime
import functools
import operator
from collections.abc import Callable
from typing import Any

import pytest

import torch
from allreduce.runtime.launcher._spawn import spawn

WORLD_SIZES = [2, 3]

Case = Callable[[Any, int, int], Any]


def _value(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input: n distinct small values that exercise the op (bits for the bitwise ones)."""
    if dtype == torch.bool:
        return torch.tensor([(i + rank) % 2 == 0 or i % 3 == 0 for i in range(n)])
    base = torch.arange(n, dtype=torch.int64) * 3 + rank * 5 + 1
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        base = base + (1 << 15) * (rank % 2)  # beyond the signed range of the narrowest: order must still hold
    return base.to(dtype)


def _all_reduce(op_name: str, dtype: torch.dtype) -> Case:
    def run(group: Any, rank: int, world_size: int) -> Any:
        import torch.distributed as dist

        t = _value(rank, 7, dtype)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op_name), group=group)
        return t

    return run


def _closed_all_reduce(op_name: str, dtype: torch.dtype, world_size: int) -> torch.Tensor:
    """Element by element in Python integers (torch has no arithmetic for uint16/32/64 on CPU)."""
    columns = list(zip(*(_value(r, 7, dtype).tolist() for r in range(world_size)), strict=True))
    if dtype == torch.bool:
        folds = {"SUM": operator.or_, "MAX": operator.or_, "BOR": operator.or_, "PRODUCT": operator.and_}
        folds |= {"MIN": operator.and_, "BAND": operator.and_, "BXOR": operator.xor}
        return torch.tensor([functools.reduce(folds[op_name], c) for c in columns])
    bits = torch.iinfo(dtype).bits if not dtype.is_floating_point else 0
    folds = {"SUM": operator.add, "PRODUCT": operator.mul, "BAND": operator.and_, "MIN": min, "MAX": max}
    folds |= {"BOR": operator.or_, "BXOR": operator.xor}
    values = [functools.reduce(folds[op_name], c) for c in columns]
    if bits and not torch.iinfo(dtype).min:  # unsigned: wraps modulo 2^bits
        values = [v % (1 << bits) for v in values]
    return torch.tensor(values, dtype=dtype)


REDUCE_CASES = [
    *(("SUM", d) for d in (torch.float32, torch.int64, torch.bool, torch.uint16, torch.uint32, torch.uint64)),
    *(("MIN", d) for d in (torch.int32, torch.bool, torch.uint16, torch.uint32, torch.uint64)),
    *(("MAX", d) for d in (torch.int8, torch.bool, torch.uint32, torch.uint64)),
    ("PRODUCT", torch.int64),
    ("PRODUCT", torch.bool),
    *(("BAND", d) for d in (torch.int64, torch.uint8, torch.bool)),
    *(("BOR", d) for d in (torch.int32, torch.bool)),
    *(("BXOR", d) for d in (torch.int16, torch.int64, torch.bool)),
]


def _collectives() -> dict[str, tuple[Case, Callable[[int, int], Any]]]:
    """name -> (what each rank runs, the closed form of rank r's result at world size N)."""
    cases: dict[str, tuple[Case, Callable[[int, int], Any]]] = {}
    for op_name, dtype in REDUCE_CASES:
        cases[f"all_reduce {op_name} {dtype}"] = (
            _all_reduce(op_name, dtype),
            lambda r, n, op_name=op_name, dtype=dtype: _closed_all_reduce(op_name, dtype, n),
        )

    def broadcast_bool(group: Any, rank: int, world_size: int) -> Any:
        import torch.distributed as dist

        t = _value(rank, 5, torch.bool)
        dist.broadcast(t, src=world_size - 1, group=group)
        return t

    cases["broadcast bool"] = (broadcast_bool, lambda r, n: _value(n - 1, 5, torch.bool))

    def reduce(group: Any, rank: int, world_size: int) -> Any:
        import torch.distributed as dist

        t = _value(rank, 4, torch.int64)
        dist.reduce(t, dst=1, group=group)
        return t

    cases["reduce to rank 1"] = (
        reduce,
        lambda r, n: sum(_value(q, 4, torch.int64) for q in range(n)) if r == 1 else _value(r, 4, torch.int64),
    )

    def gather(group: Any, rank: int, world_size: int) -> Any:
        import torch.distributed as dist

        out = [torch.zeros(3, dtype=torch.int64) for _ in range(world_size)] if rank == 0 else None
        dist.gather(_value(rank, 3, torch.int64), out, dst=0, group=group)
        return torch.stack(out) if out is not None else None

    cases["gather to rank 0"] = (
        gather,
        lambda r, n: torch.stack([_value(q, 3, torch.int64) for q in range(n)]) if r == 0 else None,
    )

    def scatter(group: Any, rank: int, world_size: int) -> Any:
        import torch.distributed as dist

        out = torch.zeros(2, 2)
        chunks = [torch.full((2, 2), 10.0 * q + 1) for q in range(world_size)] if rank == world_size - 1 else None
        dist.scatter(out, chunks, src=world_size - 1, group=group)
        return out

    cases["scatter from the last rank"] = (scatter, lambda r, n: torch.full((2, 2), 10.0 * r + 1))

    def all_to_all_single(group: Any, rank: int, world_size: int) -> Any:
        import torch.distributed as dist

        local = torch.arange(world_size * 2, dtype=torch.float32) + 100 * rank
        out = torch.zeros(world_size * 2)
        dist.all_to_all_single(out, local, group=group)
        return out

    cases["all_to_all_single, even splits"] = (
        all_to_all_single,
        lambda r, n: torch.cat([torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + 100 * q for q in range(n)]),
    )

    def all_to_all_uneven(group: Any, rank: int, world_size: int) -> Any:
        import torch.distributed as dist

        # rank q sends q + d + 1 rows of 2 to rank d
        send = [rank + d + 1 for d in range(world_size)]
        recv = [q + rank + 1 for q in range(world_size)]
        local = torch.arange(sum(send) * 2, dtype=torch.int64).view(-1, 2) + 1000 * rank
        out = torch.zeros(sum(recv), 2, dtype=torch.int64)
        dist.all_to_all_single(out, local, recv, send, group=group)
        return out

    def uneven_expected(r: int, n: int) -> torch.Tensor:
        pieces = []
        for q in range(n):
            send = [q + d + 1 for d in range(n)]
            local = torch.arange(sum(send) * 2, dtype=torch.int64).view(-1, 2) + 1000 * q
            start = sum(send[:r])
            pieces.append(local[start : start + send[r]])
        return torch.cat(pieces)

    cases["all_to_all_single, uneven splits"] = (all_to_all_uneven, uneven_expected)

    def all_to_all(group: Any, rank: int, world_size: int) -> Any:
        import torch.distributed as dist

        inputs = [torch.full((d + 1,), rank * 10.0 + d) for d in range(world_size)]
        outputs = [torch.zeros(rank + 1) for _ in range(world_size)]
        dist.all_to_all(outputs, inputs, group=group)
        return torch.cat(outputs)

    cases["all_to_all"] = (all_to_all, lambda r, n: torch.cat([torch.full((r + 1,), q * 10.0 + r) for q in range(n)]))

    def complex_parts(q: int, n: int) -> list[torch.Tensor]:
        # what rank q sends each rank d: d + 1 complex numbers, moved as (real, imaginary) pairs
        return [torch.full((d + 1,), complex(q, d), dtype=torch.complex64) for d in range(n)]

    def all_to_all_complex(group: Any, rank: int, world_size: int) -> Any:
        import torch.distributed as dist

        send = [d + 1 for d in range(world_size)]
        out = torch.zeros(world_size * (rank + 1), dtype=torch.complex64)
        local = torch.cat(complex_parts(rank, world_size))
        dist.all_to_all_single(out, local, [rank + 1] * world_size, send, group=group)
        return out

    cases["all_to_all_single, complex, uneven splits"] = (
        all_to_all_complex,
        lambda r, n: torch.cat([complex_parts(q, n)[r] for q in range(n)]),
    )

    def scatter_bool(group: Any, rank: int, world_size: int) -> Any:
        import torch.distributed as dist

        out = torch.zeros(3, dtype=torch.bool)
        chunks = [torch.tensor([q % 2 == 0, True, q == 1]) for q in range(world_size)] if rank == 0 else None
        dist.scatter(out, chunks, src=0, group=group)
        return out

    cases["scatter of bool"] = (scatter_bool, lambda r, n: torch.tensor([r % 2 == 0, True, r == 1]))

    def coalesced(group: Any, rank: int, world_size: int) -> Any:
        import torch.distributed as dist

        tensors = [_value(rank, 3, torch.int64), _value(rank, 5, torch.int64)]
        with dist._coalescing_manager(group=group):
            for t in tensors:
                dist.all_reduce(t, group=group)
        return tensors

    def _coalesced_inputs(rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Of different shapes, one empty; complex ones with an imaginary part."""
        tensors = [torch.full((2, 2), rank + 1.0), torch.empty(0), torch.arange(3.0) - rank]
        return [t.to(dtype) * (1 + 2j) if dtype.is_complex else t.to(dtype) for t in tensors]

    def _as_real(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.view_as_real(t) if t.is_complex() else t for t in tensors]

    def all_gather_coalesced(dtype: torch.dtype) -> Case:
        # output lists are one per rank, each with one tensor per input (all_gather's are one per input)
        def run(group: Any, rank: int, world_size: int) -> Any:
            import torch.distributed as dist

            inputs = _coalesced_inputs(rank, dtype)
            outputs = [[torch.zeros_like(t) for t in inputs] for _ in range(world_size)]
            dist.all_gather_coalesced(outputs, inputs, group=group)
            return [_as_real(outs) for outs in outputs]

        return run

    for dtype in (torch.float32, torch.complex64):
        cases[f"all_gather_coalesced {dtype}"] = (
            all_gather_coalesced(dtype),
            lambda r, n, dtype=dtype: [_as_real(_coalesced_inputs(q, dtype)) for q in range(n)],
        )

    cases["all_reduce under _coalescing_manager"] = (
        coalesced,
        lambda r, n: [
            sum(_value(q, 3, torch.int64) for q in range(n)),
            sum(_value(q, 5, torch.int64) for q in range(n)),
        ],
    )

    def objects(group: Any, rank: int, world_size: int) -> Any:
        import torch.distributed as dist

        got = [None] * world_size if rank == 0 else None
        dist.gather_object({"rank": rank}, got, dst=0, group=group)
        return got

    def ddp_bool_buffer(group: Any, rank: int, world_size: int) -> Any:
        from torch import nn

        torch.manual_seed(rank)  # different on every rank: DDP's broadcast makes them rank 0's
        model = nn.Linear(3, 1)
        model.register_buffer("mask", torch.tensor([rank % 2 == 0, rank == 1]))
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        ddp(torch.ones(2, 3) * (rank + 1)).sum().backward()
        return [model.mask.clone(), model.weight.grad.clone()]

    def ddp_expected(r: int, n: int) -> Any:
        # d(sum(w x + b))/dw over 2 rows of (q + 1): 2 (q + 1) per element, averaged over the ranks
        return [torch.tensor([True, False]), torch.full((1, 3), float(sum(2 * (q + 1) for q in range(n))) / n)]

    cases["DDP of a model with a bool buffer"] = (ddp_bool_buffer, ddp_expected)

    cases["gather_object"] = (objects, lambda r, n: [{"rank": q} for q in range(n)] if r == 0 else None)
    return cases


def _ring(rank: int, world_size: int) -> tuple[int, int]:
    """The next and the previous rank of the ring: point-to-point cases send forward and receive from behind."""
    return (rank + 1) % world_size, (rank - 1) % world_size


def _point_to_point() -> dict[str, tuple[Case, Callable[[int, int], Any]]]:
    """name -> (what each rank runs, the closed form of rank r's result at world size N)."""
    cases: dict[str, tuple[Case, Callable[[int, int], Any]]] = {}

    def send_recv(dtype: torch.dtype) -> Case:
        def run(group: Any, rank: int, world_size: int) -> Any:
            import torch.distributed as dist

            after, before = _ring(rank, world_size)
            x = torch.zeros(5, dtype=dtype)
            if rank % 2 == 0:  # even ranks send first, odd ones receive first: no rank waits on another's send
                dist.send(_value(rank, 5, dtype), after, group=group)
                dist.recv(x, before, group=group)
            else:
                dist.recv(x, before, group=group)
                dist.send(_value(rank, 5, dtype), after, group=group)
            return x

        return run

    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint16):
        cases[f"send/recv {dtype}"] = (send_recv(dtype), lambda r, n, dtype=dtype: _value(_ring(r, n)[1], 5, dtype))

    def isend_irecv(group: Any, rank: int, world_size: int) -> Any:
        import torch.distributed as dist

        after, before = _ring(rank, world_size)
        x = torch.zeros(1 << 18)  # 1 MiB
        receive = dist.irecv(x, before, group=group, tag=4)
        dist.isend(torch.full((1 << 18,), float(rank)), after, group=group, tag=4).wait()
        receive.wait()
        return x.unique()

    cases["isend/irecv of 1 MiB"] = (isend_irecv, lambda r, n: torch.tensor([float(_ring(r, n)[1])]))

    def batch(group: Any, rank: int, world_size: int) -> Any:
        import torch.distributed as dist

        after, before = _ring(rank, world_size)
        x, y = torch.zeros(3), torch.zeros(3, dtype=torch.int32)
        ops = [
            dist.P2POp(dist.irecv, x, before, group=group),  # receives first: the order in a batch does not matter
            dist.P2POp(dist.irecv, y, before, group=group, tag=7),
            dist.P2POp(dist.isend, torch.full((3,), float(rank)), after, group=group),
            dist.P2POp(dist.isend, torch.full((3,), rank, dtype=torch.int32), after, group=group, tag=7),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return [x, y]

    cases["batch_isend_irecv with tags"] = (
        batch,
        lambda r, n: [torch.full((3,), float(_ring(r, n)[1])), torch.full((3,), _ring(r, n)[1], dtype=torch.int32)],
    )

    def any_source(group: Any, rank: int, world_size: int) -> Any:
        import torch.distributed as dist

        if rank != 0:
            dist.send(torch.full((2,), float(rank)), 0, group=group, tag=2)
            return None
        got = []
        for _ in range(world_size - 1):
            x = torch.zeros(2)
            got.append((dist.recv(x, group=group, tag=2), x.tolist()))
        return sorted(got)

    cases["recv from any source"] = (
        any_source,
        lambda r, n: [(q, [float(q)] * 2) for q in range(1, n)] if r == 0 else None,
    )
    return cases


CASES = {**_collectives(), **_point_to_point()}
# torch leaves a reduce's result on other ranks than the root unspecified: Gloo leaves partial sums there.
ROOT_ONLY = {"reduce to rank 1": 1}


def _wait_with_a_timeout(rank: int) -> Any:
    """Rank 0 waits 0.2 s for an all-reduce that the others call 1.5 s late, then waits without a limit."""
    import time

    import torch.distributed as dist

    dist.barrier()
    if rank != 0:
        time.sleep(1.5)
    t = torch.ones(4)
    work = dist.all_reduce(t, async_op=True)
    early = None
    if rank == 0:
        try:
            work.wait(timeout=datetime.timedelta(seconds=0.2))
        except dist.DistBackendError as exc:
            early = str(exc)
    work.wait()
    return {"early": early, "result": t.tolist()}


def _mismatched_receive(rank: int, world_size: int) -> str:
    """Each rank sends 4 floats to the next, which receives into 6: the error, through wait()."""
    import torch.distributed as dist

    after, before = _ring(rank, world_size)
    dist.isend(torch.ones(4), after, tag=3).wait()
    try:
        dist.irecv(torch.zeros(6), before, tag=3).wait()
    except dist.DistBackendError as exc:
        return str(exc)
    return "no error"


def _profiled_names() -> list[str]:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_reduce(torch.ones(1024))
        dist.broadcast(torch.ones(16, dtype=torch.float64), src=0)
    return [event.name for event in prof.events() if event.name.startswith("allreduce.")]


def _all_to_all_traffic(world_size: int) -> dict[str, Any]:
    """all_to_all_single of 16 KiB per part: the profiler's label, and the bytes each link carried (the group's
    stats of that one call)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_to_all_single(torch.empty(4096 * world_size), torch.ones(4096 * world_size))
    group = dist.group.WORLD.allreduce_group  # torch hands out the Python backend itself as the group
    links = {(link.src, link.dst): link.size_bytes for link in group.stats(last=1).links}
    names = [event.name for event in prof.events() if event.name.startswith("allreduce.")]
    return {"profiled": names, "links": links}


def _imported_by_a_first_call() -> list[str]:
    """The modules the first (async, 16 MiB) all_reduce imports on the caller's thread."""
    import sys

    import torch.distributed as dist

    before = set(sys.modules)
    work = dist.all_reduce(torch.ones(4 << 20), async_op=True)
    imported = sorted(set(sys.modules) - before)
    work.wait()
    return imported


def _worker() -> dict[str, Any]:
    import torch.distributed as dist

    import allreduce.torch  # noqa: F401

    dist.init_process_group("allreduce")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"imported by the first call": _imported_by_a_first_call()}
    gloo = dist.new_group(backend="gloo")
    for name, (run, _) in CASES.items():
        for backend, group in (("allreduce", None), ("gloo", gloo)):
            try:
                out[f"{backend}: {name}"] = ("ok", _portable(run(group, rank, world_size)))
            except Exception as exc:  # compared below: Gloo refuses some cases
                out[f"{backend}: {name}"] = ("raised", f"{type(exc).__name__}: {exc}")
    out["wait timeout"] = _wait_with_a_timeout(rank)
    out["mismatched receive"] = _mismatched_receive(rank, world_size)
    out["profiled"] = _profiled_names()
    out["all_to_all traffic"] = _all_to_all_traffic(dist.get_world_size())
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    try:
        dist.all_reduce(sparse)
    except ValueError as exc:
        out["sparse refused"] = str(exc)
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module", params=WORLD_SIZES)
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world_size: int = request.param
    return world_size, spawn(world_size, _worker, group=False, timeout_s=240, env={"OMP_NUM_THREADS": "1"})


def _portable(x: Any) -> Any:
    """``x`` with every tensor as (dtype, shape, values): torch cannot unpickle uint16/32/64 tensors."""
    if isinstance(x, list):
        return [_portable(item) for item in x]
    if isinstance(x, torch.Tensor):
        return (str(x.dtype), tuple(x.shape), x.tolist())
    return x


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_backend_gives_the_closed_form_and_gloos_answer(
    results: tuple[int, list[dict[str, Any]]], case: str
) -> None:
    world_size, per_rank = results
    closed_form = CASES[case][1]
    for rank, out in enumerate(per_rank):
        status, got = out[f"allreduce: {case}"]
        assert status == "ok", f"rank {rank}: {got}"
        expected = _portable(closed_form(rank, world_size))
        assert got == expected, f"rank {rank}: {got} != {expected}"
        gloo_status, gloo_got = out[f"gloo: {case}"]
        if gloo_status == "ok" and ROOT_ONLY.get(case, rank) == rank:
            assert got == gloo_got, f"rank {rank}: {got} != Gloo's {gloo_got}"


@pytest.mark.slow
def test_a_receive_that_does_not_fit_raises_through_wait(results: tuple[int, list[dict[str, Any]]]) -> None:
    world_size, per_rank = results
    for rank, out in enumerate(per_rank):
        before = _ring(rank, world_size)[1]
        assert f"recv from rank {before} (tag 3): rank {before} sent 4 float32 elements" in out["mismatched receive"]
        assert "this receive takes 6 float32 elements" in out["mismatched receive"]


@pytest.mark.slow
def test_the_first_call_imports_nothing(results: tuple[int, list[dict[str, Any]]]) -> None:
    # an import on the caller's thread, against the group's worker for the GIL, blocked it 320-400 ms
    _, per_rank = results
    for rank, out in enumerate(per_rank):
        assert out["imported by the first call"] == [], f"rank {rank}"


@pytest.mark.slow
def test_a_sparse_tensor_is_refused_naming_the_operation_and_layout(
    results: tuple[int, list[dict[str, Any]]],
) -> None:
    _, per_rank = results
    for out in per_rank:
        assert "all_reduce got a torch.sparse_coo tensor" in out["sparse refused"]


@pytest.mark.slow
def test_wait_with_a_timeout_raises_while_the_call_goes_on(results: tuple[int, list[dict[str, Any]]]) -> None:
    world_size, per_rank = results
    assert "has not finished within wait(timeout=0.2 s)" in per_rank[0]["wait timeout"]["early"]
    for out in per_rank:
        assert out["wait timeout"]["result"] == [float(world_size)] * 4


@pytest.mark.slow
def test_the_profiler_records_every_call_with_its_size_algorithm_and_ranks(
    results: tuple[int, list[dict[str, Any]]],
) -> None:
    world_size, per_rank = results
    for out in per_rank:
        all_reduce, broadcast = out["profiled"]
        assert all_reduce.startswith("allreduce.all_reduce 4096 B ")
        assert all_reduce.endswith(f" {world_size} ranks")
        assert all_reduce.split()[3] != "-", all_reduce  # the algorithm auto picked
        assert broadcast.startswith("allreduce.broadcast 128 B ")


@pytest.mark.slow
def test_all_to_all_single_runs_pairwise_and_each_link_carries_one_part(
    results: tuple[int, list[dict[str, Any]]],
) -> None:
    n, per_rank = results
    label = f"allreduce.all_to_all_single {2 * 4 * 4096 * n} B pairwise {n} ranks"
    # every ordered pair of ranks exchanges exactly one 16 KiB part (an all-gather would move every part)
    one_part_each = {(s, d): 4096 * 4 for s in range(n) for d in range(n) if s != d}
    assert [out["all_to_all traffic"] for out in per_rank] == [{"profiled": [label], "links": one_part_each}] * n
