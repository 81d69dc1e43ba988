"""Whom a rank names while it waits for peers to connect, from what the store can tell it (runtime/tcp/_blame.py).

A real store on loopback: its host (rank 0) and a client (rank 1) in this process.
"""

from __future__ import annotations

import pytest

from allreduce.runtime import CollectiveError, PeerFailureError
from allreduce.runtime.store._store import TCPStore
from allreduce.runtime.tcp._blame import BlameRecords, LostPeerError


@pytest.fixture
def no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ALLREDUCE_TOKEN", raising=False)


def test_a_store_whose_host_left_names_the_host_to_a_rank_waiting_for_connections(no_env_token: None) -> None:
    host = TCPStore("127.0.0.1", 0, is_server=True, world_size=3, rank=0, timeout_s=60)
    client = TCPStore("127.0.0.1", host.port, is_server=False, world_size=3, rank=1, timeout_s=60)
    try:
        host.close(wait_for_ranks_s=0)  # the host leaves (dies or closes): its store goes with it
        with pytest.raises(CollectiveError):
            client.get("tcp/addr/2", timeout_s=1)  # how a rank finds out: one request
        blame = BlameRecords(client, "tcp", rank=1, world_size=3)
        assert blame.dead_ranks() == [0]
        with pytest.raises(PeerFailureError, match=r"rank 1: rank 0 died \(agreement for collective 0\)") as info:
            blame.raise_if_dead({2}, "agreement for collective 0")
        assert info.value.peer == 0
    finally:
        client.close()


def test_a_store_that_answers_names_nobody_while_no_rank_died(no_env_token: None) -> None:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=3, rank=0, timeout_s=60) as host:
        client = TCPStore("127.0.0.1", host.port, is_server=False, world_size=3, rank=1, timeout_s=60)
        try:
            blame = BlameRecords(client, "tcp", rank=1, world_size=3)
            assert blame.dead_ranks() == []
            blame.raise_if_dead({2}, "agreement for collective 0")  # returns: keep waiting
        finally:
            client.close()


def test_a_lost_connection_names_the_rank_the_lost_peer_gave_up_for(no_env_token: None) -> None:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=3, rank=0, timeout_s=60) as host:
        client = TCPStore("127.0.0.1", host.port, is_server=False, world_size=3, rank=1, timeout_s=60)
        gives_up = TCPStore("127.0.0.1", host.port, is_server=False, world_size=3, rank=2, timeout_s=60)
        try:
            BlameRecords(gives_up, "tcp", rank=2, world_size=3).record_abort(0)  # rank 2 gives up because of rank 0
            lost = LostPeerError("rank 1: rank 2 closed its connection at step 0", rank=1, peer=2, step=0)
            error = BlameRecords(client, "tcp", rank=1, world_size=3).lost(lost)
            assert error.peer == 0
            assert "rank 2 gave up because of rank 0" in str(error)
        finally:
            gives_up.close()
            client.close()


def test_a_lost_connection_to_a_peer_that_left_no_record_names_that_peer(no_env_token: None) -> None:
    with TCPStore("127.0.0.1", 0, is_server=True, world_size=3, rank=0, timeout_s=60) as host:
        client = TCPStore("127.0.0.1", host.port, is_server=False, world_size=3, rank=1, timeout_s=60)
        try:
            lost = LostPeerError("rank 1: rank 2 closed its connection at step 0", rank=1, peer=2, step=0)
            assert BlameRecords(client, "tcp", rank=1, world_size=3).lost(lost).peer == 2
        finally:
            client.close()
