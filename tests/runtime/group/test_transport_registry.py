"""The transport registry: a transport written in a test (every transfer a key of the group's store: slow, but a
real transport between real processes) is registered, chosen by name through ``init()`` and runs collectives;
``auto`` and a named transport are chosen per pair of ranks from the hosts the ranks report."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

import allreduce
from allreduce.runtime import (
    Call,
    Transport,
    TransportSetup,
    register_transport,
    spawn,
    transport_names,
    unregister_transport,
)
from allreduce.runtime.group._transports import select_transport
from allreduce.schedules import block_bounds

TIMEOUT_S = 60.0


class StoreTransport(Transport):
    """Every message a key of the group's store (the k-th send from a to b in a step matches the k-th receive)."""

    name = "toy_store"

    def __init__(self, setup: TransportSetup) -> None:
        super().__init__(setup.rank, setup.world_size)
        self._store = setup.store
        self._prefix = setup.key("toy")

    def _agree(self, seq: int, descriptor: bytes, *, deadline: float, timeout_s: float) -> list[bytes]:
        # a key ending in a rank may be written by that rank only
        self._store.set(f"{self._prefix}/agree/{seq}/{self.rank}", descriptor)
        return [self._take(f"{self._prefix}/agree/{seq}/{r}", deadline) for r in range(self.world_size)]

    def _execute(self, call: Call) -> None:
        buffer = call.buffer
        for step in call.plan.steps:
            sent: dict[int, int] = {}
            for t in step.sends:  # every send reads the state at the start of the step
                k = sent[t.peer] = sent.get(t.peer, -1) + 1
                self._store.set(
                    self._key(call.seq, step.index, self.rank, t.peer, k), buffer[t.start : t.stop].tobytes()
                )
            received: dict[int, int] = {}
            for t in step.recvs:
                k = received[t.peer] = received.get(t.peer, -1) + 1
                data = self._take(self._key(call.seq, step.index, t.peer, self.rank, k), call.deadline)
                incoming = np.frombuffer(data, buffer.dtype)
                if t.reduce:
                    call.reduce_into(buffer[t.start : t.stop], incoming)
                else:
                    buffer[t.start : t.stop] = incoming

    def _key(self, seq: int, step: int, source: int, dest: int, k: int) -> str:
        return f"{self._prefix}/{seq}/{step}/{source}to{dest}n{k}"

    def _take(self, key: str, deadline: float) -> bytes:
        return self._store.get(key, timeout_s=max(deadline - time.monotonic(), 1e-3))

    def _release(self) -> None:
        pass


def _register() -> None:
    register_transport("toy_store", can_connect=lambda setup, rank, peer: True, create=StoreTransport, replace=True)


def _collectives_on_toy(world_size: int) -> dict[str, Any]:
    _register()
    with allreduce.init(transport="toy_store", timeout_s=TIMEOUT_S) as group:
        rank = group.rank
        x = np.arange(10, dtype=np.float64) + rank
        group.all_reduce(x, algorithm="ring")
        y = np.full(7, float(rank))
        group.broadcast(y, root=world_size - 1)
        z = np.ones(12, np.float32) * (rank + 1)
        mine = group.reduce_scatter(z, algorithm="ring")
        return {
            "name": group.transport_name,
            "kind": type(group.transport).__name__,
            "all_reduce": x.tolist(),
            "broadcast": y.tolist(),
            "reduce_scatter": np.asarray(mine).tolist(),
        }


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_transport_registered_in_the_test_runs_collectives_through_init(world_size: int) -> None:
    results = spawn(world_size, _collectives_on_toy, world_size, group=False, timeout_s=TIMEOUT_S * 2)
    total = sum(range(world_size))
    for rank, result in enumerate(results):
        assert (result["name"], result["kind"]) == ("toy_store", "StoreTransport")
        assert result["all_reduce"] == (world_size * np.arange(10) + total).tolist()
        assert result["broadcast"] == [float(world_size - 1)] * 7
        bounds = block_bounds(12, world_size)
        block = bounds[rank + 1] - bounds[rank]
        assert result["reduce_scatter"] == [world_size * (world_size + 1) / 2] * block


def _setup(hosts: tuple[str, ...]) -> TransportSetup:
    return TransportSetup(0, len(hosts), hosts, None, "job", "", 1.0, None, "127.0.0.1")  # type: ignore[arg-type]


def test_auto_takes_the_first_registered_transport_that_connects_every_pair() -> None:
    assert select_transport("auto", _setup(("a", "a", "a"))).name == "shm"
    assert select_transport("auto", _setup(("a", "a", "b"))).name == "tcp"


def test_a_named_transport_that_cannot_connect_a_pair_names_it() -> None:
    with pytest.raises(ValueError, match=r"shm cannot connect rank 0 and rank 2 \(every rank on one host\)"):
        select_transport("shm", _setup(("a", "a", "b")))


def test_an_unknown_transport_is_refused_with_the_registered_names() -> None:
    with pytest.raises(ValueError, match="'carrier_pigeon' is not one of auto, shm, tcp"):
        allreduce.init(0, 2, transport="carrier_pigeon")


def test_a_registered_transport_is_listed_until_unregistered() -> None:
    _register()
    try:
        assert transport_names()[-1] == "toy_store"
        with pytest.raises(ValueError, match="already registered"):
            register_transport("toy_store", can_connect=lambda setup, rank, peer: True, create=StoreTransport)
    finally:
        unregister_transport("toy_store")
    assert "toy_store" not in transport_names()
