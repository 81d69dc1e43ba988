"""Shared test configuration, and the fixture that runs the command line as a user does."""

import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable, Generator, Iterator, Mapping

import pytest
from hypothesis import HealthCheck, settings

from allreduce.schedules import Collective, algorithms, unregister_algorithm
from cpu_seconds import cpu_s

# CI runs on 2 shared cores: no per-example deadline, a fixed number of examples, deterministic seeds.
settings.register_profile(
    "ci", deadline=None, max_examples=60, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci")


# ----------------------------------------------------------------------- the longest modules start first
# `make test` hands whole modules to 2 workers (--dist loadscope --no-loadscope-reorder), each taking the next one
# when it is free: a long module started last leaves one worker running it alone at the end. These, the longest
# (wall seconds in a run of the parallel part, `--durations=0` summed per module), start first, longest first;
# the rest follow in collection order. A module renamed or removed here fails the run rather than dropping out.
_LONGEST_FIRST = (
    "tests/train/test_elastic_training.py",
    "tests/schedules/test_generators.py",
    "tests/runtime/launcher/test_launcher_hardening.py",
    "tests/runtime/p2p/test_p2p.py",
    "tests/torch/test_torch_transport.py",
    "tests/train/test_data_parallel.py",
    "tests/cli/test_run_elastic.py",
    "tests/cli/test_demo.py",
    "tests/runtime/shm/test_shm_cross_memory_modes.py",
    "tests/torch/test_torch_ddp.py",
    "tests/runtime/tcp/test_tcp.py",
    "tests/torch/test_launchers_torch.py",
    "tests/torch/test_torch_operations.py",
    "tests/runtime/shm/test_shm_adopt.py",
    "tests/runtime/tcp/test_tcp_group.py",
    "tests/runtime/shm/test_shm_small.py",
)


# ----------------------------------------------------------------------- rewritten test modules cached
# pytest rewrites every test module's asserts as it imports it (~200 modules: seconds of CPU), and caches the result
# beside the module unless PYTHONDONTWRITEBYTECODE is set (as in many CI images and here): then each pytest process
# (make test's two workers, then its serial part) rewrites them all again. They are cached during collection
# whatever that variable says (the Makefile's `bytecode` compiles our modules for the same reason); the flag is back
# as it was before any test runs, and the processes tests start read the variable, not this flag.
_DONT_WRITE_BYTECODE = sys.dont_write_bytecode


def pytest_configure(config: pytest.Config) -> None:
    sys.dont_write_bytecode = False


def pytest_collection_finish(session: pytest.Session) -> None:
    sys.dont_write_bytecode = _DONT_WRITE_BYTECODE


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    missing = [m for m in _LONGEST_FIRST if not (root / m).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py: _LONGEST_FIRST names modules that do not exist: {missing}")
    first = {module: i for i, module in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: the rest in order


@pytest.fixture(autouse=True)
def _registry_as_it_was() -> Iterator[None]:
    """Algorithms a test registers (``-a FILE.py:function``) are removed after it, so that `all` means the same
    registry in every test of the session."""
    before = {c: set(algorithms(c)) for c in Collective}
    yield
    for collective, names in before.items():
        for name in set(algorithms(collective)) - names:
            unregister_algorithm(collective, name)


def _run_allreduce(
    *args: str, timeout_s: float = 240, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m allreduce ARGS`` in a new process (``env``: its whole environment, else this one's): its exit
    status and its output as text. A non-zero status is the test's to judge, so that it can print stderr."""
    return subprocess.run(
        [sys.executable, "-m", "allreduce", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
        check=False,
    )


@pytest.fixture(scope="session")
def run_allreduce() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Runs the command line in a new process: ``run_allreduce("train", "-n", "2", timeout_s=300)``."""
    return _run_allreduce


# ----------------------------------------------------------------------- CPU seconds per test (--cpu-durations=N)
# Wall time on 2 shared cores says more about the load than about a test; the suite's budget is CPU. Each phase's
# CPU is this process's, its reaped children's (spawned ranks, CLI runs: every child a test waits for; a child
# reaped late, by the next test that starts processes, counts there: read the modules' totals first) and its fork
# server's with the ranks forked from it (cpu_seconds.py).
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-durations", type=int, default=None, metavar="N",
        help="show the N tests that used the most CPU seconds (this process and its children), and the modules",
    )  # fmt: skip


_CPU_START = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    if item.config.getoption("--cpu-durations") is None:
        yield
        return
    item.stash[_CPU_START] = cpu_s()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, None, None]:
    outcome = yield
    if item.config.getoption("--cpu-durations") is None:
        return
    report = outcome.get_result()
    if report.when == "teardown":
        report.user_properties.append(("cpu_s", cpu_s() - item.stash[_CPU_START]))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    shown = config.getoption("--cpu-durations")
    if shown is None:
        return
    tests: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", ()):
                if key == "cpu_s":
                    tests[report.nodeid] = float(value)
    modules: dict[str, float] = defaultdict(float)
    for nodeid, cpu in tests.items():
        modules[nodeid.split("::")[0]] += cpu
    terminalreporter.section(f"CPU seconds: {sum(tests.values()):.1f} in {len(tests)} tests")
    for nodeid, cpu in sorted(tests.items(), key=lambda kv: -kv[1])[:shown]:
        terminalreporter.write_line(f"{cpu:8.2f}s  {nodeid}")
    terminalreporter.write_line("by module:")
    for module, cpu in sorted(modules.items(), key=lambda kv: -kv[1])[:shown]:
        terminalreporter.write_line(f"{cpu:8.2f}s  {module}")
