"""Run torch's distributed test suite on Gloo and on the allreduce backend, and hold allreduce to what Gloo passes.

    run.py refresh [--world-sizes 2 3] [--jobs 2]   # every test, both backends: rewrites gloo_passes.json, reports
    run.py check   [--world-sizes 2 3] [--jobs 2]   # allreduce on gloo_passes.json; fails on a failure not listed
    run.py run --backend B --world-size N [TEST ...]  # some tests, one backend (the edit loop)

Each (backend, world size) runs in ``--jobs`` worker processes that take tests from one list as they free up
(each claims a test by creating a file named after it), so one slow test does not hold up a shard; every test
starts its ranks afresh (torch's harness; distributed_spawn.py forks them). Results go to ``--out`` as JSON
lines, one per test: outcome (passed, failed, skipped, crashed), seconds, and the skip reason or the end of the
traceback.

``gloo_passes.json`` (committed) is the set of tests Gloo passes on this CPU machine, per world size: the whole
set, as ``refresh`` found it, never a selection. ``expected_failures.yaml`` (committed, written by hand) names
every test of that set that allreduce cannot pass and why; ``check`` fails on any other test of the set that does
not pass on allreduce, and on a listed test that gets otherwise than listed (the list is kept exact). The tests
the suite reserves for named backends run again with ``--skips-as gloo`` (see distributed_spawn.py), and what
they get there is checked as well.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GLOO_PASSES = HERE / "gloo_passes.json"
EXPECTED_FAILURES = HERE / "expected_failures.yaml"
WORLD_SIZES = (2, 3)
TEST_TIMEOUT_S = 240
"""torch's harness stops a test's ranks after this (its own default is 300 s); the slowest test here took 32 s at
load 25 (the first of a worker, which starts the fork server)."""
TAIL_LINES = 12


# ------------------------------------------------------------------------------------------------------------
# The worker: one backend, one world size, tests claimed one at a time
# ------------------------------------------------------------------------------------------------------------
class _Recorder(unittest.TestResult):
    """A unittest result that writes one JSON line per test as it ends."""

    def __init__(self, sink: Any) -> None:
        super().__init__()
        self._sink = sink
        self._started = 0.0

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self._started = time.monotonic()

    def _write(self, test: unittest.TestCase, outcome: str, detail: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        seconds = round(time.monotonic() - self._started, 2)
        self._sink.write(json.dumps({"test": name, "outcome": outcome, "seconds": seconds, "detail": detail}) + "\n")
        self._sink.flush()

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._write(test, "passed")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._write(test, "failed", _tail(self.failures[-1][1]))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._write(test, "failed", _tail(self.errors[-1][1]))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._write(test, "skipped", reason)


def _tail(text: str) -> str:
    """The lines of a traceback that say what went wrong: the ranks' own exceptions come last."""
    lines = [line for line in text.splitlines() if line.strip()]
    # torch's harness ends each traceback with how to run the test alone: not the news.
    news = [line for line in lines if not line.startswith(_REPRO_LINES)]
    return "\n".join(news[-TAIL_LINES:])


_REPRO_LINES = ("To execute this test", "    python distributed_spawn.py", "This message can be suppressed")


def _claim(claims: Path, name: str) -> bool:
    try:
        os.close(os.open(claims / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def work(names: list[str], claims: Path, results: Path) -> None:
    """Run each of ``names`` no other worker has claimed (``BACKEND``, ``WORLD_SIZE`` and ``TEMP_DIR`` set)."""
    sys.path.insert(0, str(HERE))
    from distributed_spawn import TestDistBackendWithSpawn

    with results.open("a") as sink:
        recorder = _Recorder(sink)
        for name in names:
            if _claim(claims, name):
                TestDistBackendWithSpawn(name).run(recorder)


def all_tests() -> list[str]:
    """Every test of torch's suite, as unittest orders them (needs ``BACKEND`` etc. set: run in a worker)."""
    sys.path.insert(0, str(HERE))
    from distributed_spawn import TestDistBackendWithSpawn

    return list(unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn))


# ------------------------------------------------------------------------------------------------------------
# The driver: workers per (backend, world size), their results merged
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    test: str
    outcome: str
    seconds: float
    detail: str


def _environment(backend: str, world_size: int, temp_dir: Path, skips_as: str = "") -> dict[str, str]:
    (temp_dir / "barrier").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env |= {"BACKEND": backend, "WORLD_SIZE": str(world_size), "TEMP_DIR": str(temp_dir)}
    env["CONFORMANCE_SKIPS_AS"] = skips_as
    env["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(TEST_TIMEOUT_S)
    # The fork server imports the suite by name before it forks a rank, and finds it only through PYTHONPATH
    # (Python 3.11 does not hand it the parent's sys.path): else every rank imports it again (4 s of CPU each).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def list_tests(out: Path) -> list[str]:
    """Every test name, from a worker (importing the suite needs its environment)."""
    env = _environment("gloo", 2, out / "list")
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import run; print('\\n'.join(run.all_tests()))"
    found = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return found.stdout.split()


def run_suite(
    backend: str, world_size: int, names: list[str], *, jobs: int, out: Path, skips_as: str = ""
) -> list[Outcome]:
    """Run ``names`` on ``backend`` at ``world_size`` ranks in ``jobs`` workers (skipping what the suite skips
    for ``skips_as``, when given); a test whose worker died is recorded as crashed, and a new worker goes on
    with the rest."""
    tag = f"{backend}-ws{world_size}" + (f"-skips-as-{skips_as}" if skips_as else "")
    run_dir = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=out))
    claims = run_dir / "claims"
    claims.mkdir()
    results = out / f"{tag}.jsonl"
    results.unlink(missing_ok=True)
    names_file = run_dir / "names"
    names_file.write_text("\n".join(names))
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import run; from pathlib import Path; "
        f"run.work(Path({str(names_file)!r}).read_text().split(), Path({str(claims)!r}), Path({str(results)!r}))"
    )
    started = time.monotonic()
    workers: dict[int, subprocess.Popen[bytes]] = {}
    spawned = 0

    def start() -> None:
        nonlocal spawned
        log = (out / f"{tag}.worker{spawned}.log").open("wb")
        env = _environment(backend, world_size, run_dir / f"temp{spawned}", skips_as)
        workers[spawned] = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log, stderr=log)
        spawned += 1

    for _ in range(min(jobs, len(names))):
        start()
    while workers:
        time.sleep(0.5)
        for key, proc in list(workers.items()):
            if proc.poll() is None:
                continue
            del workers[key]
            if proc.returncode == 0:
                continue
            if not _record_crashed(claims, results, proc.returncode):
                # It died before any test (an import failed): another would too.
                for other in workers.values():
                    other.kill()
                log = out / f"{tag}.worker{key}.log"
                raise RuntimeError(
                    f"{tag}: a worker exited with {proc.returncode} outside any test; {log}:\n"
                    + _tail(log.read_text(errors="replace"))
                )
            if len(list(claims.iterdir())) < len(names):
                start()
    outcomes = _read(results)
    elapsed = time.monotonic() - started
    counts = Counter(o.outcome for o in outcomes)
    print(f"{tag}: {dict(sorted(counts.items()))} in {elapsed:.0f} s ({jobs} workers, load {_load()})", flush=True)
    return outcomes


def _record_crashed(claims: Path, results: Path, returncode: int) -> int:
    """Tests claimed but never recorded belonged to a worker that died (a rank's crash took the harness down):
    recorded as crashed; how many."""
    recorded = {o.test for o in _read(results)}
    crashed = [claim.name for claim in sorted(claims.iterdir()) if claim.name not in recorded]
    with results.open("a") as sink:
        for name in crashed:
            detail = f"the worker running it exited with {returncode}"
            sink.write(json.dumps({"test": name, "outcome": "crashed", "seconds": 0, "detail": detail}) + "\n")
    return len(crashed)


def _read(results: Path) -> list[Outcome]:
    if not results.exists():
        return []
    return [Outcome(**json.loads(line)) for line in results.read_text().splitlines() if line.strip()]


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


# ------------------------------------------------------------------------------------------------------------
# The committed lists
# ------------------------------------------------------------------------------------------------------------
def gloo_passes() -> dict[int, list[str]]:
    data = json.loads(GLOO_PASSES.read_text())
    return {int(ws): names for ws, names in data["passes"].items()}


@dataclass(frozen=True)
class Expected:
    """A test Gloo passes that allreduce cannot: what it gets (``failed`` or ``skipped``: the suite reserves it
    for other backends by name), why, and, for a skipped one, what it gets when run with the names lifted."""

    outcome: str
    reason: str
    lifted: str = ""
    world_sizes: tuple[int, ...] = WORLD_SIZES


def expected_failures() -> dict[str, Expected]:
    """expected_failures.yaml: ``{test: {outcome, reason, lifted?, world_sizes?}}``."""
    import yaml

    data = yaml.safe_load(EXPECTED_FAILURES.read_text()) or {}
    return {
        name: Expected(**{k: tuple(v) if k == "world_sizes" else v for k, v in entry.items()})
        for name, entry in data.items()
    }


def refresh(world_sizes: list[int], jobs: int, out: Path) -> int:
    names = list_tests(out)
    print(f"{len(names)} tests in torch {_torch_version()}'s distributed_test.py", flush=True)
    passes: dict[str, list[str]] = {}
    summary: dict[str, Any] = {}
    for world_size in world_sizes:
        gloo = run_suite("gloo", world_size, names, jobs=jobs, out=out)
        passed = sorted(o.test for o in gloo if o.outcome == "passed")
        passes[str(world_size)] = passed
        mine = run_suite("allreduce", world_size, names, jobs=jobs, out=out)
        summary[str(world_size)] = {
            "gloo": dict(Counter(o.outcome for o in gloo)),
            "allreduce": dict(Counter(o.outcome for o in mine)),
            "allreduce_not_passing_gloo_passes": {
                o.test: o.outcome for o in mine if o.test in set(passed) and o.outcome != "passed"
            },
        }
    record = {
        "torch": _torch_version(),
        "made": datetime.date.today().isoformat(),
        "made_by": "tests/torch/conformance/run.py refresh",
        "passes": passes,
    }
    GLOO_PASSES.write_text(json.dumps(record, indent=1) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


def compare(world_size: int, passes: list[str], got: dict[str, Outcome], lifted: dict[str, Outcome]) -> list[str]:
    """What differs from the committed expectations at ``world_size``: one line per test."""
    expected = {name: e for name, e in expected_failures().items() if world_size in e.world_sizes}
    problems = []
    for name in passes:
        outcome = got[name].outcome if name in got else "no result"
        want = expected.get(name)
        if want is None and outcome != "passed":
            detail = got[name].detail if name in got else ""
            problems.append(f"ws {world_size} {name}: {outcome}, not in {EXPECTED_FAILURES.name}\n{detail}")
        elif want is not None and outcome != want.outcome:
            problems.append(f"ws {world_size} {name}: {outcome}, where {EXPECTED_FAILURES.name} says {want.outcome}")
        elif want is not None and want.lifted:
            outcome = lifted[name].outcome if name in lifted else "no result"
            if outcome != want.lifted:
                detail = lifted[name].detail if name in lifted else ""
                problems.append(f"ws {world_size} {name}: {outcome} with the names lifted, not {want.lifted}\n{detail}")
    return problems


def check(world_sizes: list[int], jobs: int, out: Path) -> int:
    """allreduce on every test Gloo passes, then the listed skipped ones with the suite's names lifted; 1 when
    anything differs from expected_failures.yaml."""
    passes = gloo_passes()
    problems: list[str] = []
    totals: Counter[str] = Counter()
    for world_size in world_sizes:
        got = {o.test: o for o in run_suite("allreduce", world_size, passes[world_size], jobs=jobs, out=out)}
        to_lift = [
            name
            for name, e in expected_failures().items()
            if e.lifted and world_size in e.world_sizes and name in passes[world_size]
        ]
        lifted = {o.test: o for o in run_suite("allreduce", world_size, to_lift, jobs=jobs, out=out, skips_as="gloo")}
        problems += compare(world_size, passes[world_size], got, lifted)
        counts = Counter(o.outcome for o in got.values())
        lifted_counts = Counter(o.outcome for o in lifted.values())
        print(
            f"ws {world_size}: of {len(passes[world_size])} tests Gloo passes, allreduce {dict(counts)}; "
            f"the skipped ones with the names lifted {dict(lifted_counts)}"
        )
        totals["passed"] += counts["passed"]
        totals["expected"] += len(got) - counts["passed"]
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"({totals['expected']} listed in {EXPECTED_FAILURES.name} did not pass, as listed)")
    # The plain closing line CI reads: what passed, and what differed from the expectations.
    print(f"conformance: {totals['passed']} passed, {len(problems)} failed")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["refresh", "check", "run"])
    parser.add_argument("tests", nargs="*", help="run: the tests (default: all)")
    parser.add_argument("--backend", default="allreduce", help="run: the backend")
    parser.add_argument("--world-size", type=int, default=2, help="run: the world size")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    parser.add_argument("--skips-as", default="", help="run: skip what the suite skips for this backend")
    parser.add_argument("--jobs", type=int, default=2, help="workers per backend and world size")
    parser.add_argument("--out", type=Path, default=None, help="where results and logs go (default: a temp dir)")
    args = parser.parse_intermixed_args(argv)
    if args.jobs < 1 or any(ws < 2 for ws in args.world_sizes) or args.world_size < 2:
        parser.error("--jobs must be >= 1 and world sizes >= 2")
    try:
        import expecttest  # noqa: F401 (torch's test harness imports it)
    except ImportError:
        parser.error("torch's test harness needs the expecttest package (pip install expecttest; the test extra)")
    out = args.out or Path(tempfile.mkdtemp(prefix="conformance-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"results in {out}; load {_load()}", flush=True)
    started = time.monotonic()
    try:
        if args.mode == "refresh":
            return refresh(args.world_sizes, args.jobs, out)
        if args.mode == "check":
            return check(args.world_sizes, args.jobs, out)
        names = args.tests or list_tests(out)
        outcomes = run_suite(args.backend, args.world_size, names, jobs=args.jobs, out=out, skips_as=args.skips_as)
        for o in outcomes:
            if o.outcome != "passed":
                print(f"{o.test}: {o.outcome} ({o.seconds} s)\n  " + o.detail.replace("\n", "\n  "))
        return 0 if all(o.outcome not in {"failed", "crashed"} for o in outcomes) else 1
    finally:
        with contextlib.suppress(OSError):
            print(f"wall {time.monotonic() - started:.0f} s; load {_load()}")


if __name__ == "__main__":
    sys.exit(main())
