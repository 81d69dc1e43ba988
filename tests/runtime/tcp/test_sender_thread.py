"""Which tcp ranks send large steps from a thread of their own: where each has two CPUs, or as told."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from allreduce.runtime.store._store import TCPStore
from allreduce.runtime.tcp import TcpTransport
from allreduce.runtime.tcp._transport import SENDER_THREAD_ENV, sender_thread_pays

CPUS = len(os.sched_getaffinity(0))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SENDER_THREAD_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


@pytest.fixture
def store() -> Iterator[TCPStore]:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=4, rank=-1, timeout_s=30) as server:
        yield server


@pytest.mark.parametrize("ranks_here", [1, 2, 3, 64])
def test_the_thread_pays_where_each_rank_of_the_host_has_two_cpus(
    monkeypatch: pytest.MonkeyPatch, ranks_here: int
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks_here))
    assert sender_thread_pays(world_size=1024) == (2 * ranks_here <= CPUS)


def test_without_a_launcher_every_rank_of_the_group_counts_as_local() -> None:
    assert sender_thread_pays(world_size=1) == (CPUS >= 2)
    assert sender_thread_pays(world_size=CPUS) is False


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("0", False)])
def test_the_environment_decides_over_the_cores(
    store: TCPStore, monkeypatch: pytest.MonkeyPatch, value: str, expected: bool
) -> None:
    monkeypatch.setenv(SENDER_THREAD_ENV, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1" if value == "0" else str(4 * CPUS))  # the other answer
    with TcpTransport(0, 1, store, timeout_s=5) as transport:
        assert transport.sender_thread is expected


def test_the_argument_decides_over_the_environment(store: TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SENDER_THREAD_ENV, "0")
    with TcpTransport(0, 1, store, timeout_s=5, sender_thread=True) as transport:
        assert transport.sender_thread is True


def test_a_bad_setting_names_the_variable_and_the_rank(store: TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SENDER_THREAD_ENV, "yes")
    with pytest.raises(ValueError, match=r"rank 0: ALLREDUCE_TCP_SENDER_THREAD='yes': write 1 .* or 0"):
        TcpTransport(0, 1, store, timeout_s=5)
