"""Algorithms from user code: module and file specs, entry points of installed packages, ALLREDUCE_ALGORITHMS."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from allreduce.schedules import (
    AlgorithmLoadError,
    algorithms,
    get_algorithm,
    load_algorithm,
    unregister_algorithm,
)

SRC = Path(__file__).resolve().parents[2] / "src"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "algorithms"

RING_MODULE = textwrap.dedent(
    '''
    """A user's algorithms."""
    from allreduce.schedules import Program, ring_all_reduce

    NOT_A_FUNCTION = 3


    def user_ring(world_size):
        """The ring, by another name."""
        return ring_all_reduce(world_size)


    def user_wrong(world_size):
        n = world_size
        p = Program(n, num_blocks=n)
        step = p.step()
        for r in range(n):
            if n > 1:
                step.send(r, (r + 1) % n, r)
                step.recv_reduce((r + 1) % n, r, r)
        return p
    '''
)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A package ``users_algos_<n>`` with the module ``algos`` on sys.path; its algorithms unregistered after."""
    package = f"users_algos_{os.getpid()}_{abs(hash(tmp_path.name)) % 10**6}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "algos.py").write_text(RING_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(algorithms())
    yield f"{package}.algos"
    for name in set(algorithms()) - before:
        unregister_algorithm("all_reduce", name)


def test_a_module_spec_registers_the_function_under_its_name(user_module: str) -> None:
    entry = load_algorithm(f"{user_module}:user_ring")
    assert entry.name == "user_ring"
    assert entry.origin == f"{user_module}:user_ring"
    assert entry.description == "The ring, by another name."
    assert "user_ring" in algorithms()


def test_loading_the_same_spec_twice_returns_the_same_entry(user_module: str) -> None:
    assert load_algorithm(f"{user_module}:user_ring") is load_algorithm(f"{user_module}:user_ring")


def test_a_file_spec_loads_the_authored_example() -> None:
    entry = load_algorithm(f"{EXAMPLES / 'my_ring.py'}:bidirectional_ring")
    try:
        assert get_algorithm("all_reduce", "bidirectional_ring") is entry
    finally:
        unregister_algorithm("all_reduce", "bidirectional_ring")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon_here", "write it as module.path:function"),
        ("surely_not_a_module_xyz:fn", "no module named 'surely_not_a_module_xyz'"),
        ("{module}:missing", "has no attribute 'missing'"),
        ("{module}:NOT_A_FUNCTION", "NOT_A_FUNCTION is a int, not a function"),
        ("{module}:user_wrong", r"is wrong at world_size=2: .*rank \d block \d holds"),
        ("/nonexistent/dir/algos.py:fn", "no such file"),
    ],
)
def test_a_spec_that_cannot_be_loaded_is_named_in_the_error(user_module: str, spec: str, message: str) -> None:
    spec = spec.format(module=user_module)
    with pytest.raises(AlgorithmLoadError, match=message) as caught:
        load_algorithm(spec)
    assert str(caught.value).startswith(spec) or str(caught.value).startswith(f"algorithm spec {spec!r}")


def run_python(code: str, *, path: list[Path], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ALLREDUCE_ALGORITHMS")}
    environment["PYTHONPATH"] = os.pathsep.join(str(p) for p in [*path, SRC])
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environment, check=False
    )


def install_distribution(site: Path, entry_points: str, module: str = RING_MODULE) -> None:
    """What ``pip install someones-algorithms`` leaves in site-packages: the module and its dist-info."""
    (site / "someones_algorithms.py").write_text(module)
    info = site / "someones_algorithms-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: someones-algorithms\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[allreduce.algorithms]\n{entry_points}\n")


LIST_ALGORITHMS = (
    "import warnings; warnings.simplefilter('always')\n"
    "from allreduce.schedules import algorithms, get_algorithm\n"
    "print(','.join(algorithms())); print(get_algorithm('all_reduce', algorithms()[-1]).origin)"
)


@pytest.mark.slow
def test_an_installed_entry_point_appears_in_the_registry(tmp_path: Path) -> None:
    install_distribution(tmp_path, "their_ring = someones_algorithms:user_ring")
    out = run_python(LIST_ALGORITHMS, path=[tmp_path])
    assert out.returncode == 0, out.stderr
    names, origin = out.stdout.splitlines()
    assert names.split(",")[-1] == "their_ring"
    assert "ring" in names.split(",")
    assert origin == "entry point of someones-algorithms"


@pytest.mark.slow
def test_an_installed_entry_point_appears_in_explain_all(tmp_path: Path) -> None:
    install_distribution(tmp_path, "their_ring = someones_algorithms:user_ring")
    code = "import sys; from allreduce.cli._main import main; sys.exit(main(sys.argv[1:]))"
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environment["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(SRC)])
    out = subprocess.run(
        [sys.executable, "-c", code, "explain", "-n", "8", "--size", "1MiB", "--bandwidth", "1GB/s", "--latency",
         "1us", "--algorithm", "all"],
        capture_output=True, text=True, timeout=120, env=environment, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert any(
        line.split()[:1] == ["their_ring"] or line.startswith("* their_ring") for line in out.stdout.splitlines()
    )


@pytest.mark.slow
def test_a_broken_entry_point_is_reported_by_name_and_the_builtins_still_work(tmp_path: Path) -> None:
    install_distribution(tmp_path, "their_wrong = someones_algorithms:user_wrong\nghost = someones_algorithms:nope")
    out = run_python(LIST_ALGORITHMS, path=[tmp_path])
    assert out.returncode == 0, out.stderr
    names = out.stdout.splitlines()[0].split(",")
    assert "ring" in names
    assert "their_wrong" not in names
    assert "ghost" not in names
    assert "plug-in entry point their_wrong = someones_algorithms:user_wrong (distribution someones-algorithms)" in (
        out.stderr
    )
    assert "is wrong at world_size=2" in out.stderr
    assert "has no attribute 'nope'" in out.stderr


@pytest.mark.slow
def test_the_environment_variable_loads_specs_lazily_in_a_new_process(tmp_path: Path) -> None:
    (tmp_path / "env_algos.py").write_text(RING_MODULE)
    out = run_python(
        "import sys\n"
        "import allreduce.schedules as s\n"
        "assert 'env_algos' not in sys.modules, 'loaded before the first lookup'\n"
        "print(s.make_schedule('all_reduce', 'user_ring', 4).name)",
        path=[tmp_path],
        env={"ALLREDUCE_ALGORITHMS": f"env_algos:user_ring, {EXAMPLES / 'my_ring.py'}:bidirectional_ring"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "user_ring"
