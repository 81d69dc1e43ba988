"""Emulated clusters for real: namespaces, shaped veth cables, routes, the runtime across them, and teardown.

Needs root and iproute2 (skipped otherwise). Every test uses a name of its own and a state directory under its
tmp_path, so it never sees, let alone touches, namespaces it did not create.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from allreduce.emulate import (
    TAIL_MIN_REPS,
    Connection,
    EmulationError,
    EmulationSpec,
    Layout,
    build,
    kernel_paths,
    remove,
    run,
    running,
)

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
        reason="needs root and iproute2 (ip, tc) to build network namespaces",
    ),
]
# Serial (run alone, after the parallel part): the tests that run collectives on the module's cluster or measure a
# shaped link's drops. Building, refusing, removing and signalling clusters time nothing: they run beside others.
serial = pytest.mark.serial

CLOS4 = "clos:leaves=2,spines=2,hosts_per_leaf=2"


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {entry["name"] for entry in json.loads(out or "[]")}


def _ours(name: str) -> set[str]:
    return {ns for ns in _namespaces() if ns.startswith(f"ar{name}-")}


@pytest.fixture
def name() -> Iterator[str]:
    tag = uuid.uuid4().hex[:6]
    yield tag
    for ns in _ours(tag):  # a failed test must not leave its namespaces behind
        subprocess.run(["ip", "netns", "delete", ns], check=False)


@pytest.mark.slow
def test_build_creates_one_namespace_per_node_and_remove_deletes_them_all(name: str, tmp_path: Path) -> None:
    built = build(EmulationSpec(CLOS4, name=name), state_dir=tmp_path)
    assert _ours(name) == set(built.namespaces)
    removed = remove(name, state_dir=tmp_path)
    assert set(removed) == set(built.namespaces)
    assert _ours(name) == set()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_every_shaped_direction_has_a_token_bucket_at_its_rate(name: str, tmp_path: Path) -> None:
    with running(EmulationSpec(CLOS4, name=name, rate_bps=100e6), state_dir=tmp_path) as built:
        cable = built.cables[0]
        out = subprocess.run(
            ["tc", "-n", built.namespaces[cable.a], "-j", "qdisc", "show", "dev", cable.a_dev],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        (qdisc,) = [q for q in json.loads(out) if q["kind"] == "tbf"]
        assert qdisc["options"]["rate"] * 8 == pytest.approx(cable.rate_ab_bps, rel=0.01)


@pytest.mark.slow
def test_a_name_already_in_use_is_refused_before_anything_is_created(name: str, tmp_path: Path) -> None:
    with running(EmulationSpec(CLOS4, name=name), state_dir=tmp_path) as built:
        with pytest.raises(EmulationError, match="exists already"):
            build(EmulationSpec(CLOS4, name=name), state_dir=tmp_path)
        assert _ours(name) == set(built.namespaces)


def test_a_namespace_of_the_same_name_is_refused_before_anything_is_created(name: str, tmp_path: Path) -> None:
    spec = EmulationSpec(CLOS4, name=name)
    victim = spec.layout().namespaces[-1]
    subprocess.run(["ip", "netns", "add", victim], check=True)
    try:
        with pytest.raises(EmulationError, match="exist already"):
            build(spec, state_dir=tmp_path)
        assert _ours(name) == {victim}  # not ours to remove: it was there before
        assert list(tmp_path.iterdir()) == []
    finally:
        subprocess.run(["ip", "netns", "delete", victim], check=False)


def test_remove_refuses_a_state_file_that_lists_foreign_namespaces(tmp_path: Path) -> None:
    (tmp_path / "x1.json").write_text(json.dumps({"spec": EmulationSpec(CLOS4, name="x1").to_json(),
                                                  "namespaces": ["someone-elses"]}))  # fmt: skip
    with pytest.raises(EmulationError, match="not touching them"):
        remove("x1", state_dir=tmp_path)


def _wait_for_state(path: Path, proc: subprocess.Popen[bytes]) -> None:
    """Until the state file lists at least two namespaces (the build is under way), or the process ended."""
    while proc.poll() is None:
        try:
            if len(json.loads(path.read_text())["namespaces"]) >= 2:
                return
        except (OSError, ValueError, KeyError):
            pass
        os.sched_yield()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_up_leaves_nothing(name: str, tmp_path: Path, sig: signal.Signals) -> None:
    env = dict(os.environ, ALLREDUCE_EMULATE_STATE_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "allreduce", "emulate", "run", "--topology",
           "clos:leaves=4,spines=2,hosts_per_leaf=4", "--name", name, "--sizes", "1MiB"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for_state(tmp_path / f"{name}.json", proc)
    proc.send_signal(sig)
    proc.communicate(timeout=120)
    assert _ours(name) == set()
    assert list(tmp_path.glob("*.json")) == []


@pytest.mark.slow
def test_after_sigkill_of_up_down_removes_the_rest(name: str, tmp_path: Path) -> None:
    env = dict(os.environ, ALLREDUCE_EMULATE_STATE_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "allreduce", "emulate", "up", "--topology", "clos:leaves=4,spines=2,hosts_per_leaf=4",
           "--name", name]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for_state(tmp_path / f"{name}.json", proc)
    proc.kill()
    proc.communicate(timeout=60)
    down = subprocess.run([sys.executable, "-m", "allreduce", "emulate", "down", "--name", name], env=env,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert down.returncode == 0, down.stderr
    assert _ours(name) == set()


@pytest.fixture(scope="module")
def four_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Layout]:
    tag = uuid.uuid4().hex[:6]
    with running(EmulationSpec(CLOS4, name=tag), state_dir=tmp_path_factory.mktemp("state")) as built:
        yield built


@serial
@pytest.mark.slow
def test_a_ring_across_four_hosts_is_exact_and_predicted(four_hosts: Layout) -> None:
    result = run(four_hosts, algorithm="ring", sizes=[1 << 20], reps=2)
    (row,) = result.rows
    assert row.exact
    assert len(row.seconds) == 2
    assert row.predicted_s > 0
    # the counters saw the data: a ring sends 2(N-1)/N of the buffer out of every host
    assert row.busiest_link_bytes >= 2 * 3 / 4 * (1 << 20)


@serial
@pytest.mark.slow
def test_the_prediction_routes_every_flow_where_the_kernel_sent_it(four_hosts: Layout) -> None:
    # Interleaved: every ring neighbour is across the spines, where the kernel's 5-tuple hash picks the path.
    result = run(four_hosts, algorithm="ring", sizes=[1 << 20], reps=1, placement=[0, 2, 1, 3])
    (row,) = result.rows
    assert row.paths == "kernel"


@serial
@pytest.mark.slow
def test_kernel_paths_walk_a_connection_both_ways_across_a_spine(four_hosts: Layout) -> None:
    connection = Connection(0, four_hosts.host_address[0], 40000, four_hosts.host_address[2], 50000)
    table = kernel_paths(four_hosts, [connection], ignore_ports=frozenset())
    topology = four_hosts.topology
    there = [topology.link_name(link) for link in table.paths[(0, 2)]]
    back = [topology.link_name(link) for link in table.paths[(2, 0)]]
    assert len(there) == len(back) == 4
    assert "spine" in there[1]
    assert "spine" in back[1]


@serial
def test_kernel_paths_skip_the_store_port(four_hosts: Layout) -> None:
    connection = Connection(0, four_hosts.host_address[0], 40000, four_hosts.host_address[2], 29500)
    assert kernel_paths(four_hosts, [connection], ignore_ports=frozenset({29500})).paths == {}


@serial
@pytest.mark.slow
def test_a_shallow_queue_drops_packets_and_the_tail_model_runs_at_the_measured_rate(name: str, tmp_path: Path) -> None:
    spec = EmulationSpec(CLOS4, name=name, queue=(("leaf0->spine0", 30_000), ("leaf0->spine1", 30_000)))
    with running(spec, state_dir=tmp_path) as built:
        (row,) = run(built, algorithm="ring", sizes=[256 << 10], reps=TAIL_MIN_REPS, placement=[0, 2, 1, 3]).rows
    assert row.exact
    assert row.dropped
    assert row.predicted_tail_s is not None


@serial
@pytest.mark.slow
def test_halving_doubling_across_four_hosts_is_exact(four_hosts: Layout) -> None:
    result = run(four_hosts, algorithm="halving_doubling", sizes=[256 << 10], reps=1)
    assert result.rows[0].exact


@serial
def test_an_unknown_algorithm_is_refused_before_any_rank_starts(four_hosts: Layout) -> None:
    with pytest.raises(ValueError, match="no_such_algorithm"):
        run(four_hosts, algorithm="no_such_algorithm", sizes=[4096], reps=1)


def _is_rank(pid: str) -> bool:
    try:
        return b"allreduce.emulate._rank" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _connected(pid: str) -> bool:
    """Whether ``pid``'s network namespace (a host's: the rank is alone there) has two established TCP connections:
    the rank's to the store, and one of its collectives' (the run is under way: a death now is a peer's, not a
    rank that never joined, which the others would wait out at init)."""
    try:
        table = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return sum(line.split()[3] == "01" for line in table) >= 2  # 01: TCP_ESTABLISHED


@serial
@pytest.mark.slow
def test_a_rank_killed_mid_run_is_named_and_the_run_ends(four_hosts: Layout) -> None:
    outcome: list[BaseException] = []

    def measure() -> None:
        try:
            run(four_hosts, algorithm="ring", sizes=[32 << 20], reps=20, timeout_s=10)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=measure)
    thread.start()
    victim_ns = four_hosts.host_namespace(1)
    pids: list[str] = []
    while thread.is_alive() and not pids:
        out = subprocess.run(["ip", "netns", "pids", victim_ns], capture_output=True, text=True, check=False)
        pids = [pid for pid in out.stdout.split() if _is_rank(pid)]
    while thread.is_alive() and not all(map(_connected, pids)):
        time.sleep(0.01)
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)
    thread.join(timeout=200)
    assert not thread.is_alive()
    assert outcome
    assert isinstance(outcome[0], EmulationError)
    assert "rank" in str(outcome[0])


@serial
def test_a_congestion_control_the_kernel_lacks_is_refused_before_any_rank_starts(four_hosts: Layout) -> None:
    with pytest.raises(ValueError, match="'no-such-cc' cannot be set here"):
        run(four_hosts, algorithm="ring", sizes=[4096], reps=1, congestion="no-such-cc")


@serial
@pytest.mark.slow
def test_a_run_says_which_congestion_control_its_ranks_used(four_hosts: Layout) -> None:
    result = run(four_hosts, algorithm="ring", sizes=[64 << 10], reps=1, congestion="reno")
    assert result.congestion == "reno"
    assert result.rows[0].exact


@serial
@pytest.mark.slow
def test_a_size_the_token_bucket_burst_decides_is_marked_and_a_large_one_is_not(four_hosts: Layout) -> None:
    result = run(four_hosts, algorithm="ring", sizes=[256 << 10, 16 << 20], reps=1)
    small, large = result.rows
    assert small.burst_bound  # a ring of 4 at 256 KiB moves 384 KiB per link: less than the 1 MiB burst
    assert not large.burst_bound  # 24 MiB per link: the burst is 4% of it


@pytest.mark.slow
def test_the_cli_notes_a_row_the_burst_decides(name: str, tmp_path: Path) -> None:
    env = dict(os.environ, ALLREDUCE_EMULATE_STATE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "allreduce", "emulate", "run", "--topology", CLOS4, "--name", name,
                           "--sizes", "256KiB", "--reps", "1"], env=env, capture_output=True, text=True, timeout=300,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.strip().startswith("256 KiB"))
    assert "*" in row
    assert "token-bucket burst (1 MiB)" in done.stdout


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _rank_pids(layout: Layout) -> list[int]:
    pids = []
    for gpu in range(layout.num_hosts):
        out = subprocess.run(["ip", "netns", "pids", layout.host_namespace(gpu)], capture_output=True, text=True,
                             check=False).stdout  # fmt: skip
        pids += [int(pid) for pid in out.split() if _is_rank(pid)]
    return pids


def _assert_ranks_end(pids: list[int]) -> None:
    """The ranks are gone within 30 s (they lived for minutes, holding the namespaces, until their collectives
    timed out); any still running are killed, so a failure leaves nothing either."""
    try:
        _until(lambda: not any(map(_alive, pids)), f"ranks {pids} outlived `emulate run`", timeout_s=30)
    finally:
        for pid in filter(_alive, pids):
            os.kill(pid, signal.SIGKILL)


def _until(condition: object, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(what)
        time.sleep(0.05)


def _signal_a_run(layout: Layout, options: list[str], env: dict[str, str], sig: signal.Signals) -> list[int]:
    """Start `emulate run` with ``options``, signal its own pid (nothing else) once all its ranks run, and return
    the ranks' pids once it has exited."""
    cmd = [sys.executable, "-m", "allreduce", "emulate", "run", *options, "--sizes", "32MiB", "--reps", "50"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _until(lambda: len(_rank_pids(layout)) == layout.num_hosts or proc.poll() is not None, "no ranks started")
        pids = _rank_pids(layout)
        assert len(pids) == layout.num_hosts, proc.communicate()
        os.kill(proc.pid, sig)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_the_ranks_die_with_emulate_run_on_an_existing_cluster(name: str, tmp_path: Path, sig: signal.Signals) -> None:
    env = dict(os.environ, ALLREDUCE_EMULATE_STATE_DIR=str(tmp_path))
    with running(EmulationSpec(CLOS4, name=name), state_dir=tmp_path) as built:
        _assert_ranks_end(_signal_a_run(built, ["--name", name], env, sig))


@pytest.mark.slow
def test_sigterm_to_emulate_run_with_its_own_cluster_leaves_no_rank_and_no_namespace(name: str, tmp_path: Path) -> None:
    env = dict(os.environ, ALLREDUCE_EMULATE_STATE_DIR=str(tmp_path))
    layout = EmulationSpec(CLOS4, name=name).layout()
    _assert_ranks_end(_signal_a_run(layout, ["--topology", CLOS4, "--name", name], env, signal.SIGTERM))
    assert _ours(name) == set()
    assert list(tmp_path.glob("*.json")) == []


@serial
@pytest.mark.slow
def test_realtime_ranks_run_at_sched_fifo_and_stay_exact(four_hosts: Layout) -> None:
    # run() raises unless every rank reports that it ran in the real-time class
    result = run(four_hosts, algorithm="ring", sizes=[64 << 10], reps=2, realtime=True)
    assert result.realtime
    assert all(row.exact for row in result.rows)
