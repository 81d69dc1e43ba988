"""Packet loss on emulated links: the firewall rules, the Gilbert–Elliott chain, and the rates really dropped.

The tests that build namespaces need root, iproute2 and iptables (skipped otherwise); each uses a name of its
own and a state directory under its tmp_path, so it never touches namespaces it did not create.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from allreduce.emulate import (
    TAIL_MIN_REPS,
    EmulationSpec,
    LossSpec,
    RunResult,
    loss_commands,
    predicted_topology,
    run,
    running,
    tail_predictions,
    tail_samples,
)
from allreduce.schedules import make_schedule
from allreduce.topology import PathTable

Z = 4.0
TWO_HOSTS = "clos:leaves=2,spines=1,hosts_per_leaf=1"

root = pytest.mark.skipif(
    os.geteuid() != 0 or any(shutil.which(tool) is None for tool in ("ip", "tc", "iptables")),
    reason="needs root, iproute2 (ip, tc) and iptables to build network namespaces that drop packets",
)


def test_a_loss_is_a_probability_or_a_gilbert_elliott_chain() -> None:
    assert LossSpec.parse("1e-3", what="--loss") == LossSpec(1e-3)
    assert LossSpec.parse("ge:p=1e-3,burst=4", what="--loss") == LossSpec(1e-3, 4.0)
    assert LossSpec(1e-3, 4.0).describe() == "ge:p=0.001,burst=4"


@pytest.mark.parametrize("text", ["ge:p=1e-3", "1.5", "0", "abc", "ge:p=0.1,burst=0.5"])
def test_a_malformed_loss_is_refused_naming_the_flag(text: str) -> None:
    with pytest.raises(ValueError, match="--loss leaf0->spine0"):
        LossSpec.parse(text, what="--loss leaf0->spine0")


@pytest.mark.parametrize(("p", "burst"), [(1e-3, 4.0), (0.05, 8.0), (0.2, 1.5)])
def test_the_chain_drops_the_asked_rate_in_bursts_of_the_asked_length(p: float, burst: float) -> None:
    # The rules' logic packet by packet: the chain may turn bad, then a packet in the bad state is dropped and
    # may turn it good.
    spec = LossSpec(p, burst)
    g, leave = spec.enter_probability(), 1 / burst
    rng = np.random.default_rng(1)
    n = 400_000
    u, v = rng.random(n), rng.random(n)
    bad, dropped = False, np.zeros(n, dtype=bool)
    for i in range(n):
        bad = bad or u[i] < g
        if bad:
            dropped[i] = True
            bad = v[i] >= leave
    r = spec.leave_probability()
    factor = (2 - g - r) / (g + r)  # (1 + lambda)/(1 - lambda) of the two-state chain, lambda = 1 - g - r
    assert abs(dropped.mean() - p) < Z * math.sqrt(p * (1 - p) * factor / n)
    starts = np.flatnonzero(dropped & ~np.concatenate([[False], dropped[:-1]]))
    # Burst lengths are geometric with mean 1/r and variance (1 - r)/r^2.
    assert abs(dropped.sum() / starts.size - 1 / r) < Z * math.sqrt((1 - r) / r**2 / starts.size)


def test_a_lossy_link_drops_at_its_far_end_and_counts_arrivals_first() -> None:
    spec = EmulationSpec(TWO_HOSTS, name="x1", loss=(("leaf0->spine0", LossSpec(1e-3)),))
    built = spec.layout()
    (link,) = spec.losses(built)
    commands = loss_commands(built, spec.losses(built))
    cable = next(c for c in built.cables if link in (c.link_ab, c.link_ba))
    far_ns, far_dev = (
        (built.namespaces[cable.b], cable.b_dev) if cable.link_ab == link else (built.namespaces[cable.a], cable.a_dev)
    )
    assert far_ns.endswith("-spine0")
    assert all(c[3] == far_ns and far_dev in c for c in commands)
    assert commands[0][-1] == f"arloss{link}:in"
    assert "DROP" in commands[1]
    assert "0.001" in commands[1]


def test_loss_all_makes_every_direction_lossy_and_a_named_link_keeps_its_own() -> None:
    spec = EmulationSpec(TWO_HOSTS, name="x1", loss_all=LossSpec(1e-4), loss=(("gpu0<->leaf0", LossSpec(1e-2, 4.0)),))
    built = spec.layout()
    losses = spec.losses(built)
    assert len(losses) == built.topology.num_links
    named = {built.topology.link_name(i): s for i, s in losses.items() if s != LossSpec(1e-4)}
    assert named == {"gpu0->leaf0": LossSpec(1e-2, 4.0), "leaf0->gpu0": LossSpec(1e-2, 4.0)}


def test_a_spec_with_loss_survives_its_state_file() -> None:
    spec = EmulationSpec(TWO_HOSTS, name="x1", loss=(("a->b", LossSpec(1e-3, 2.0)),), loss_all=LossSpec(1e-4))
    assert EmulationSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


@pytest.fixture
def name() -> Iterator[str]:
    tag = uuid.uuid4().hex[:6]
    yield tag
    listing = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True, check=True).stdout
    for entry in json.loads(listing or "[]"):
        if entry["name"].startswith(f"ar{tag}-"):  # a failed test must not leave its namespaces behind
            subprocess.run(["ip", "netns", "delete", entry["name"]], check=False)


def _realised(spec: EmulationSpec, tmp_path: Path) -> tuple[int, int, object]:
    with running(spec, state_dir=tmp_path) as built:
        devices = subprocess.run(
            ["ip", "-n", built.namespaces[built.cables[0].a], "-d", "-j", "link", "show", built.cables[0].a_dev],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert json.loads(devices)[0]["gso_max_segs"] == 1
        (row,) = run(
            built, algorithm="ring", sizes=[1 << 20], reps=TAIL_MIN_REPS, lossy_links=sorted(spec.losses(built))
        ).rows
    (entry,) = [d for d in row.dropped if d[0] == "leaf0->spine0"]
    return entry[1] + entry[2], entry[2], row


@root
@pytest.mark.slow
@pytest.mark.serial
def test_independent_loss_drops_the_asked_rate_and_the_tail_model_runs_at_it(name: str, tmp_path: Path) -> None:
    p = 0.01
    arrived, dropped, row = _realised(
        EmulationSpec(TWO_HOSTS, name=name, rate_bps=100e6, loss=(("leaf0->spine0", LossSpec(p)),)), tmp_path
    )
    assert arrived > 5000
    assert abs(dropped / arrived - p) < Z * math.sqrt(p * (1 - p) / arrived)
    assert [stack for stack, _ in row.predicted_tails] == ["linux", "rfc6298"]  # type: ignore[attr-defined]
    assert row.exact  # type: ignore[attr-defined]


def _predict_again(spec: EmulationSpec, result: RunResult) -> object:
    """The tail predictions recomputed from what a run stores (its JSON), as bench_tail_loss.py --predict-only."""
    stored = json.loads(json.dumps(result.to_json()))
    (row,) = stored["rows"]
    layout = spec.layout()
    routing = PathTable({(s, d): tuple(links) for s, d, links in row["kernel_paths"]})
    return tail_predictions(
        make_schedule("all_reduce", stored["algorithm"], len(stored["placement"])),
        predicted_topology(layout, stored["hop_latency_s"]),
        row["size_bytes"],
        rank_gpu=stored["placement"],
        routing=routing,
        dropped=[tuple(d) for d in row["dropped"]],
        burst=spec.loss_burst(layout),
    )


@root
@pytest.mark.slow
@pytest.mark.serial
def test_a_stored_run_gives_the_same_tail_predictions_offline(name: str, tmp_path: Path) -> None:
    spec = EmulationSpec(TWO_HOSTS, name=name, rate_bps=100e6, loss=(("leaf0->spine0", LossSpec(0.01)),))
    with running(spec, state_dir=tmp_path) as built:
        result = run(
            built, algorithm="ring", sizes=[1 << 20], reps=TAIL_MIN_REPS, lossy_links=sorted(spec.losses(built))
        )
    (row,) = result.rows
    assert row.kernel_paths
    assert _predict_again(spec, result) == row.predicted_tails


@root
@pytest.mark.slow
@pytest.mark.serial
def test_bursty_loss_drops_the_asked_rate(name: str, tmp_path: Path) -> None:
    spec = LossSpec(0.01, 4.0)
    arrived, dropped, _ = _realised(
        EmulationSpec(TWO_HOSTS, name=name, rate_bps=100e6, loss=(("leaf0->spine0", spec),)), tmp_path
    )
    g, r = spec.enter_probability(), spec.leave_probability()
    factor = (2 - g - r) / (g + r)
    p = spec.probability
    assert abs(dropped / arrived - p) < Z * math.sqrt(p * (1 - p) * factor / arrived)


def test_the_predictions_hold_a_burst_on_the_silent_link_as_the_firewalls_chain_does() -> None:
    # No namespaces: the prediction side alone. One link direction at 3%: independent, a stall waits for a third
    # resend (0.2 + 0.4 + 0.8 s) only when a resend (or its ACK) is lost twice running: 2e-4 of the samples at
    # 20,000 (Poisson mean 0.4 in 2,000: six or more has odds of 4e-6). In bursts of 4 the firewall's chain
    # (clocked by packets) is still bad for the resends until its 1 s limit (three times in four; the probe's,
    # after the next barrier's frame crossed the link, 0.75^2): 1% of the samples (mean 19 in 2,000: five or
    # fewer, 2e-4). Counted, not the maximum, which a single draw decides.
    layout = EmulationSpec(TWO_HOSTS, name="hold", rate_bps=100e6).layout()
    model = predicted_topology(layout, 10e-6)
    dropped = [("leaf0->spine0", 97_000, 3_000)]

    def third_resends(burst: float) -> int:
        ((_, seconds),) = tail_samples(
            make_schedule("all_reduce", "ring", 2), model, 1 << 18, rank_gpu=[0, 1], routing=None,
            dropped=dropped, burst=burst, stacks=("linux",), samples=2000,
        )  # fmt: skip
        return int(np.count_nonzero(seconds >= 1.0))

    assert third_resends(1.0) <= 5
    assert third_resends(4.0) >= 6
