"""The package map of docs/design.md, enforced on the source: who may import whom, through public seams only.

Every module under ``src/allreduce`` is parsed (never imported) and each of its imports of ours, lazy ones in
functions included, is checked. A violation names the importing file and line, what it imports and the rule.
"""

from __future__ import annotations

import ast
import functools
import io
import itertools
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
ROOT_PACKAGE = "allreduce"
DESIGN_DOC = REPO / "docs" / "design.md"
# The longest module allowed: past it a file holds several concerns; split it into files a newcomer can name.
MAX_MODULE_LINES = 700

# The name the map uses for ``allreduce/__init__.py`` itself (importing ``allreduce`` runs it).
ROOT = "allreduce"
ENTRY_POINT = "__main__"
# Layers that sit above the simulator and the runtime and below the command line.
PLANNING_LAYERS = frozenset({"plan", "report", "tail", "emulate"})
BELOW_PLANNING_LAYERS = frozenset({"sim", "runtime", "schedules", "topology", "units"})


@dataclass(frozen=True)
class Import:
    """One import of ours: ``importer`` (a module) imports ``target`` (a module or ``module.name``) at a line.

    ``statement`` is what the line imports from, for messages: the module of ``from module import name``."""

    importer: str
    path: Path
    line: int
    target: str
    statement: str

    @property
    def source_package(self) -> str:
        return package_of(self.importer)

    @property
    def target_package(self) -> str:
        return package_of(self.target)

    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    def name(self) -> str:
        """What ``from statement import name`` names; empty for a plain ``import``."""
        return self.target[len(self.statement) + 1 :]


@functools.cache
def top_level_names() -> frozenset[str]:
    """The packages and modules directly under src/allreduce (``cli``, ``units``, ``__main__``, ...)."""
    base = SRC / ROOT_PACKAGE
    names = {p.name for p in base.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    names |= {p.stem for p in base.glob("*.py") if p.stem != "__init__"}
    return frozenset(names)


def package_of(module: str) -> str:
    """``allreduce.cli._demo`` -> ``cli``; ``allreduce`` and the names ``allreduce/__init__.py`` defines -> ROOT."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in top_level_names():
        return parts[1]
    return ROOT


@functools.cache
def modules() -> tuple[tuple[str, Path], ...]:
    found = []
    for path in sorted((SRC / ROOT_PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found.append((".".join(parts), path))
    return tuple(found)


def _absolute(node: ast.ImportFrom, module: str, path: Path) -> str:
    """The absolute module an ``from ... import`` names, resolving relative imports."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


@functools.cache
def imports() -> tuple[Import, ...]:
    """Every import of one of our modules or names, in every module under src/allreduce."""
    found = []
    for module, path in modules():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [(alias.name, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, module, path)
                targets = [(f"{base}.{alias.name}", base) for alias in node.names]
            else:
                continue
            found += [
                Import(module, path, node.lineno, target, statement)
                for target, statement in targets
                if target == ROOT_PACKAGE or target.startswith(ROOT_PACKAGE + ".")
            ]
    return tuple(found)


def cross_package_imports() -> list[Import]:
    return [i for i in imports() if i.source_package != i.target_package]


def fail_unless_none(offenders: list[Import], rule: str) -> None:
    """Fail naming every offending import (one line per import statement) and the rule it breaks."""
    if not offenders:
        return
    names: dict[str, list[str]] = {}
    for i in offenders:
        names.setdefault(f"{i.where()}: {i.importer} imports {i.statement}", []).append(i.name())
    lines = [f"{line} ({', '.join(n)})" if any(n) else line for line, n in names.items()]
    pytest.fail(f"{len(lines)} import(s) break the rule: {rule}\n  " + "\n  ".join(lines), pytrace=False)


# ------------------------------------------------------------------------------------------------------------
# The rules the map states in words, each its own test
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_source_tree_is_found_and_parsed() -> None:
    names = {package_of(m) for m, _ in modules()}
    assert {"schedules", "runtime", "sim", "topology", "cli"} <= names
    assert any(i.target_package == "schedules" for i in imports())


def test_schedules_imports_nothing_of_ours_but_units() -> None:
    rule = "schedules imports nothing of ours but allreduce.units (schedules are pure data and algorithms)"
    bad = [i for i in cross_package_imports() if i.source_package == "schedules" and i.target_package != "units"]
    fail_unless_none(bad, rule)


def test_units_imports_nothing_of_ours() -> None:
    rule = "units imports nothing of ours (every package may import it)"
    bad = [i for i in cross_package_imports() if i.source_package == "units"]
    fail_unless_none(bad, rule)


def test_runtime_and_sim_never_import_each_other() -> None:
    rule = "runtime and sim never import each other"
    bad = [i for i in cross_package_imports() if {i.source_package, i.target_package} == {"runtime", "sim"}]
    fail_unless_none(bad, rule)


def test_nothing_imports_cli() -> None:
    rule = "nothing imports cli (only allreduce.__main__, the python -m entry point)"
    bad = [i for i in cross_package_imports() if i.target_package == "cli" and i.source_package != ENTRY_POINT]
    fail_unless_none(bad, rule)


def test_no_package_imports_another_packages_private_module() -> None:
    rule = "no package imports another package's private module or name (export it from the package instead)"
    bad: list[Import] = []
    for i in cross_package_imports():
        inner = i.target.split(".")[2:] if i.target_package != ROOT else i.target.split(".")[1:]
        if any(part.startswith("_") and not part.startswith("__") for part in inner):
            bad.append(i)
    fail_unless_none(bad, rule)


def test_planning_layers_import_only_the_layers_below_and_each_other() -> None:
    rule = (
        "plan, report, tail and emulate may import sim, runtime (and allreduce, which re-exports it), schedules, "
        "topology, units and each other"
    )
    allowed = BELOW_PLANNING_LAYERS | PLANNING_LAYERS | {ROOT}
    bad = [
        i for i in cross_package_imports() if i.source_package in PLANNING_LAYERS and i.target_package not in allowed
    ]
    fail_unless_none(bad, rule)


def test_lower_layers_never_import_the_planning_layers() -> None:
    rule = "sim, runtime, schedules, topology and units never import plan, report, tail or emulate"
    bad = [
        i
        for i in cross_package_imports()
        if i.source_package in BELOW_PLANNING_LAYERS and i.target_package in PLANNING_LAYERS
    ]
    fail_unless_none(bad, rule)


@pytest.mark.slow
def test_torch_never_imports_train() -> None:
    rule = "torch never imports train (train may import torch: the backend is below the trainer)"
    bad = [i for i in cross_package_imports() if i.source_package == "torch" and i.target_package == "train"]
    fail_unless_none(bad, rule)


# ------------------------------------------------------------------------------------------------------------
# The whole map, as docs/design.md states it
# ------------------------------------------------------------------------------------------------------------
_MAP_ROW = re.compile(r"^\|\s*`(?P<package>[\w.]+)`\s*\|(?P<what>[^|]*)\|(?P<imports>[^|]*)\|\s*$")
EVERY_PACKAGE = "*"


@functools.cache
def documented_map() -> dict[str, frozenset[str]]:
    """Package -> the packages it may import, from the table in docs/design.md (``*``: any)."""
    allowed: dict[str, frozenset[str]] = {}
    for line in DESIGN_DOC.read_text(encoding="utf-8").splitlines():
        match = _MAP_ROW.match(line)
        if match is None:
            continue
        if "." in match["package"]:  # a row of the runtime table below the package map
            continue
        cell = match["imports"]
        names = frozenset(re.findall(r"`([\w.]+)`", cell))
        allowed[match["package"]] = frozenset({EVERY_PACKAGE}) if not names and "every" in cell else names
    return allowed


def fail_unless_mapped(missing: list[str], table: str, row: str, section: str) -> None:
    """Fail naming what has no row in a table of docs/design.md, and the row to add."""
    if missing:
        pytest.fail(
            f"{DESIGN_DOC.relative_to(REPO)}: the {table} has no row for {', '.join(missing)}; add one ({row}) "
            f"under '{section}'",
            pytrace=False,
        )


def test_the_design_doc_maps_every_package() -> None:
    missing = sorted((top_level_names() | {ROOT}) - set(documented_map()))
    fail_unless_mapped(missing, "package map", "| `name` | what it is | may import |", "Package map")


def test_every_import_follows_the_package_map() -> None:
    mapped = documented_map()
    by_package: dict[str, list[Import]] = {}
    for i in cross_package_imports():
        allowed = mapped.get(i.source_package, frozenset())
        if EVERY_PACKAGE not in allowed and i.target_package not in allowed:
            by_package.setdefault(i.source_package, []).append(i)
    rules = [
        f"the package map of docs/design.md lets {package} import {', '.join(sorted(allowed)) or 'nothing of ours'}"
        for package in sorted(by_package)
        if (allowed := mapped.get(package, frozenset())) is not None
    ]
    fail_unless_none([i for p in sorted(by_package) for i in by_package[p]], "; ".join(rules))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle of a small graph, once each, starting from its smallest node."""
    found: set[tuple[str, ...]] = set()
    for start in sorted(graph):
        stack = [[start]]
        while stack:
            trail = stack.pop()
            for nxt in sorted(graph.get(trail[-1], ())):
                if nxt == start:
                    smallest = trail.index(min(trail))
                    found.add(tuple(trail[smallest:] + trail[:smallest]))
                elif nxt not in trail:
                    stack.append([*trail, nxt])
    return [list(c) for c in sorted(found)]


def test_packages_import_each_other_without_cycles() -> None:
    graph: dict[str, set[str]] = {}
    first_import: dict[tuple[str, str], Import] = {}
    for i in cross_package_imports():
        graph.setdefault(i.source_package, set()).add(i.target_package)
        first_import.setdefault((i.source_package, i.target_package), i)
    cycles = _cycles(graph)
    offenders = [first_import[a, b] for c in cycles for a, b in itertools.pairwise([*c, c[0]])]
    fail_unless_none(
        offenders,
        "packages import each other without cycles; found " + "; ".join(" -> ".join([*c, c[0]]) for c in cycles),
    )


# ------------------------------------------------------------------------------------------------------------
# Inside runtime: subpackages in layers, as docs/design.md states them
# ------------------------------------------------------------------------------------------------------------
RUNTIME = f"{ROOT_PACKAGE}.runtime"
RUNTIME_ROOT = "runtime root"  # the modules directly under runtime/ (errors, argument checks, the Store interface)
RUNTIME_FACE = "runtime face"  # allreduce.runtime itself: its __init__.py, which imports every subpackage
_RUNTIME_ROW = re.compile(r"^\|\s*`runtime\.(?P<part>\w+)`\s*\|(?P<what>[^|]*)\|(?P<imports>[^|]*)\|\s*$")


@functools.cache
def runtime_subpackages() -> frozenset[str]:
    base = SRC / ROOT_PACKAGE / "runtime"
    return frozenset(p.name for p in base.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def runtime_part(module: str) -> str:
    """``allreduce.runtime.group._group(.Name)`` -> ``group``; ``allreduce.runtime._errors`` -> the root; names
    of ``allreduce.runtime`` itself -> its face."""
    parts = module.split(".")
    if len(parts) > 2 and parts[2] in runtime_subpackages():
        return parts[2]
    if len(parts) > 2 and (SRC / ROOT_PACKAGE / "runtime" / f"{parts[2]}.py").exists():
        return RUNTIME_ROOT
    return RUNTIME_FACE


def runtime_imports() -> list[tuple[str, str, Import]]:
    """(importing part, imported part, import) for every import between two parts of runtime."""
    found = []
    for i in imports():
        if i.source_package != "runtime" or not (i.target == RUNTIME or i.target.startswith(RUNTIME + ".")):
            continue
        source = RUNTIME_FACE if i.importer == RUNTIME else runtime_part(i.importer)
        target = runtime_part(i.target)
        if source != target:
            found.append((source, target, i))
    return found


@functools.cache
def documented_runtime_map() -> dict[str, frozenset[str]]:
    """runtime subpackage -> the subpackages it may import, from the runtime table of docs/design.md."""
    allowed: dict[str, frozenset[str]] = {}
    for line in DESIGN_DOC.read_text(encoding="utf-8").splitlines():
        match = _RUNTIME_ROW.match(line)
        if match is not None:
            allowed[match["part"]] = frozenset(re.findall(r"`runtime\.(\w+)`", match["imports"]))
    return allowed


def test_the_design_doc_maps_every_runtime_subpackage() -> None:
    missing = sorted(runtime_subpackages() - set(documented_runtime_map()))
    fail_unless_mapped(missing, "runtime table", "| `runtime.name` | what it is | may import |", "Inside runtime")


def test_runtime_subpackages_import_only_what_the_runtime_table_lets_them() -> None:
    mapped = documented_runtime_map()
    bad = [
        i
        for source, target, i in runtime_imports()
        if source in runtime_subpackages() and target != RUNTIME_ROOT and target not in mapped.get(source, ())
    ]
    fail_unless_none(
        bad,
        "a runtime subpackage imports its own modules, runtime's root modules and the subpackages its row of the "
        "runtime table in docs/design.md lists",
    )


def test_nothing_inside_runtime_imports_the_runtime_face() -> None:
    rule = "nothing inside runtime imports allreduce.runtime itself (import the defining module instead)"
    fail_unless_none([i for source, target, i in runtime_imports() if target == RUNTIME_FACE], rule)


def test_runtime_root_modules_import_no_subpackage() -> None:
    rule = "runtime's root modules (_errors, _args, _store_api) are the layer below every subpackage"
    fail_unless_none([i for source, target, i in runtime_imports() if source == RUNTIME_ROOT], rule)


def test_runtime_subpackages_import_each_other_without_cycles() -> None:
    graph: dict[str, set[str]] = {}
    first_import: dict[tuple[str, str], Import] = {}
    for source, target, i in runtime_imports():
        if source in runtime_subpackages() and target in runtime_subpackages():
            graph.setdefault(source, set()).add(target)
            first_import.setdefault((source, target), i)
    cycles = _cycles(graph)
    offenders = [first_import[a, b] for c in cycles for a, b in itertools.pairwise([*c, c[0]])]
    fail_unless_none(
        offenders,
        "runtime subpackages import each other without cycles; found "
        + "; ".join(" -> ".join([*c, c[0]]) for c in cycles),
    )


# ------------------------------------------------------------------------------------------------------------
# Public faces: a package's ``__init__.py`` and its public modules (``allreduce.schedules.timing``,
# ``allreduce.runtime.bench``) each export what one audience needs, so a name has one face
# ------------------------------------------------------------------------------------------------------------
def exported_names(path: Path) -> list[str]:
    """The strings of a module's ``__all__`` (empty when it has none), read from its source."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        names_all = any(isinstance(t, ast.Name) and t.id == "__all__" for t in getattr(node, "targets", ()))
        if isinstance(node, ast.Assign) and names_all and isinstance(node.value, ast.List | ast.Tuple):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def test_a_name_is_exported_by_one_face_of_its_package() -> None:
    faces: dict[str, dict[str, list[str]]] = {}
    for module, path in modules():
        if any(part.startswith("_") for part in module.split(".")[1:]):
            continue
        for name in exported_names(path):
            faces.setdefault(package_of(module), {}).setdefault(name, []).append(module)
    twice = [
        f"{name} ({', '.join(where)})"
        for package in sorted(faces)
        for name, where in sorted(faces[package].items())
        if len(where) > 1
    ]
    if twice:
        pytest.fail(
            f"{len(twice)} name(s) exported by two faces of one package; keep each in the face of the audience "
            "that needs it: " + ", ".join(twice),
            pytrace=False,
        )


# ------------------------------------------------------------------------------------------------------------
# Module hygiene
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_every_module_has_a_docstring() -> None:
    missing = [
        str(path.relative_to(REPO))
        for _, path in modules()
        if not ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    ]
    if missing:
        pytest.fail(
            f"{len(missing)} module(s) lack a docstring saying what they are: " + ", ".join(missing), pytrace=False
        )


def test_no_module_exceeds_the_line_limit() -> None:
    long = [
        f"{path.relative_to(REPO)} ({lines} lines)"
        for _, path in modules()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    ]
    if long:
        pytest.fail(
            f"{len(long)} module(s) exceed {MAX_MODULE_LINES} lines; split each by concern: " + ", ".join(long),
            pytrace=False,
        )


# An issue number ("issue #4", "(#12)", "gh-7") or a path outside the repository (the machine's shared notes).
_OUTSIDE_REFERENCE = re.compile(r"(?i)\bissues?\s*#?\d+|\(#\d+\)|\bgh-\d+|(?<![\w/.])shared/|/work/")


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    source = path.read_text(encoding="utf-8")
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                start = node.body[0].lineno
                found += [(start + k, line) for k, line in enumerate(doc.splitlines())]
    return found


@pytest.mark.slow
def test_no_comment_refers_to_an_issue_or_a_file_outside_the_repo() -> None:
    hits = [
        f"{path.relative_to(REPO)}:{line}: {text.strip()}"
        for _, path in modules()
        for line, text in _comments_and_docstrings(path)
        if _OUTSIDE_REFERENCE.search(text)
    ]
    if hits:
        pytest.fail(
            f"{len(hits)} comment or docstring line(s) refer to an issue number or a file outside the repo "
            "(say what the code does and why; history goes in docs/design.md):\n  " + "\n  ".join(hits),
            pytrace=False,
        )
