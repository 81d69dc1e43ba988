"""Fault kinds are classes behind one interface, registered by name: a kind a test writes runs like a built-in."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Self

import pytest

from allreduce.schedules import all_reduce
from allreduce.sim import (
    DegradedLink,
    Fault,
    Faults,
    LinkDown,
    SlowRank,
    fault_kinds,
    parse_fault,
    parse_timed_fault,
    register_fault_kind,
    simulate,
    unregister_fault_kind,
)
from allreduce.topology import Topology, switch

SIZE = float(2**24)


@dataclass(frozen=True)
class SlowNode(Fault, kind="slow_node"):
    """A toy kind: every link into or out of ``node`` runs at ``factor`` x its bandwidth (``NODE*FACTOR``)."""

    node: str
    factor: float

    @classmethod
    def parse(cls, text: str) -> Self:
        node, _, factor = text.partition("*")
        return cls(node, float(factor))

    def scaled_links(self, topology: Topology) -> Sequence[tuple[list[int], float]]:
        touching = [i for i in range(topology.num_links) if self.node in topology.link_name(i).split("->")]
        return [(touching, self.factor)]


@pytest.fixture
def slow_node() -> Iterator[type[SlowNode]]:
    register_fault_kind(SlowNode)
    yield SlowNode
    unregister_fault_kind(SlowNode.kind)


def test_a_kind_written_in_a_test_runs_a_simulation_like_its_built_in_equivalent(slow_node: type[SlowNode]) -> None:
    topology, schedule = switch(4), all_reduce("ring", 4)
    toy = parse_fault("slow_node", "gpu2*0.25")
    assert toy == slow_node("gpu2", 0.25)
    by_kind = simulate(schedule, topology, size_bytes=SIZE, faults=Faults(others=(toy,)))
    by_shorthand = simulate(schedule, topology, size_bytes=SIZE, faults=Faults(degraded=(("gpu2<->switch0", 0.25),)))
    healthy = simulate(schedule, topology, size_bytes=SIZE)
    assert by_kind.seconds == pytest.approx(by_shorthand.seconds, rel=1e-12)
    assert by_kind.seconds > 2 * healthy.seconds


def test_a_registered_kind_is_listed_with_the_static_ones(slow_node: type[SlowNode]) -> None:
    assert fault_kinds(timed=False) == ("degraded", "failed", "slow_rank", "slow_node")
    assert fault_kinds(timed=True) == ("down", "flap", "degrade")


def test_a_kind_registered_twice_is_refused(slow_node: type[SlowNode]) -> None:
    with pytest.raises(ValueError, match=r"'slow_node' is already registered \(SlowNode\)"):
        register_fault_kind(SlowNode)


def test_an_unknown_kind_is_named_with_the_kinds_there_are() -> None:
    with pytest.raises(ValueError, match=r"one of degraded, failed, slow_rank, down, flap, degrade, got 'melt'"):
        parse_fault("melt", "gpu0")


def test_a_static_kind_is_not_read_as_a_timed_one() -> None:
    with pytest.raises(ValueError, match=r"one of down, flap, degrade, got 'degraded'"):
        parse_timed_fault("degraded", "a->b=0.5")


def test_built_in_kinds_read_their_text_forms() -> None:
    assert parse_fault("degraded", "leaf0->spine1=0.1") == DegradedLink("leaf0->spine1", 0.1)
    assert parse_fault("slow_rank", "3=0.5") == SlowRank(3, 0.5)
    assert parse_fault("down", "a->b@1ms+2ms") == LinkDown("a->b", 1e-3, duration_s=2e-3)


def test_shorthand_and_objects_are_the_same_faults() -> None:
    shorthand = Faults(degraded=(("a->b", 0.5),), failed=("c->d",), slow_ranks=((1, 1e-3),))
    assert shorthand.describe() == ["a->b x0.5", "c->d failed", "rank 1 +1 ms/step"]
    delays = Faults(slow_ranks=((1, 1e-3),), others=(SlowRank(1, 2e-3),)).rank_delay_s(4)
    assert delays is not None
    assert delays.tolist() == pytest.approx([0.0, 3e-3, 0.0, 0.0])


def test_a_union_of_faults_keeps_every_kind(slow_node: type[SlowNode]) -> None:
    down, degraded = LinkDown("a->b", 0.0).as_faults(), Faults(degraded=(("c->d", 0.5),))
    union = Faults.union([down, degraded, Faults(others=(slow_node("gpu0", 0.5),))])
    assert union.describe() == ["c->d x0.5", "a->b failed", "slow_node"]
