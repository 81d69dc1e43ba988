"""Algorithms from user code: the one place ``allreduce.schedules`` imports code it does not ship.

An algorithm is named by a *spec*, ``module.path:function`` (importable: on ``sys.path``/``PYTHONPATH``) or
``path/to/file.py:function``. The function is a generator, ``(world_size, **parameters)`` returning a
``Schedule`` or an authored ``Program``; it is registered under the function's name for the collective its
result computes, and verified on the way in. Three routes lead here:

- :func:`load_algorithm` (and ``--algorithm SPEC`` on the command line);
- installed distributions that declare entry points in the group ``allreduce.algorithms``
  (``my_ring = someones_algorithms.rings:my_ring``; the entry point's name is the algorithm's name);
- the environment variable ``ALLREDUCE_ALGORITHMS``, comma-separated specs, which is how ranks started by a
  launcher see the algorithm their parent was given.

The last two are loaded by :func:`load_plugins`, once per process, on the first registry lookup (this module
hands it to the registry's :func:`add_loader` when it is imported, as the package is). A plug-in that
fails to load is reported (a :class:`PluginWarning` naming it, and :func:`plugin_errors`) and skipped: the
built-ins and the other plug-ins still work.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

from allreduce.schedules._author import Program
from allreduce.schedules._registry import (
    VERIFY_WORLD_SIZES,
    Algorithm,
    _trial_parameters,
    add_loader,
    declared_parameters,
    get_algorithm,
    register_algorithm,
)
from allreduce.schedules._schedule import Collective, Schedule
from allreduce.schedules._verify import ScheduleError

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENVIRONMENT_VARIABLE",
    "AlgorithmLoadError",
    "PluginWarning",
    "load_algorithm",
    "load_plugins",
    "plugin_errors",
]

ENTRY_POINT_GROUP = "allreduce.algorithms"
ENVIRONMENT_VARIABLE = "ALLREDUCE_ALGORITHMS"

_errors: list[str] = []


class AlgorithmLoadError(ValueError):
    """An algorithm spec that cannot be loaded; the message starts with the spec."""


class PluginWarning(UserWarning):
    """A plug-in (entry point or ``ALLREDUCE_ALGORITHMS`` spec) was skipped; the message names it and why."""


def _import(spec: str, module_text: str) -> ModuleType:
    if module_text.endswith(".py") or os.sep in module_text:
        path = Path(module_text).resolve()
        if not path.is_file():
            raise AlgorithmLoadError(f"{spec}: no such file {module_text!r}")
        module_name = f"allreduce_algorithm_file_{path.stem}_{abs(hash(str(path))):x}"
        if module_name in sys.modules:
            return sys.modules[module_name]
        file_spec = importlib.util.spec_from_file_location(module_name, path)
        if file_spec is None or file_spec.loader is None:
            raise AlgorithmLoadError(f"{spec}: {module_text!r} cannot be imported as a Python file")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[module_name] = module
        try:
            file_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[module_name]
            raise AlgorithmLoadError(f"{spec}: running {module_text} raised {type(exc).__name__}: {exc}") from exc
        return module
    try:
        return importlib.import_module(module_text)
    except ModuleNotFoundError as exc:
        raise AlgorithmLoadError(
            f"{spec}: no module named {exc.name or module_text!r} (is it installed, or on PYTHONPATH?)"
        ) from None
    except Exception as exc:
        raise AlgorithmLoadError(f"{spec}: importing {module_text} raised {type(exc).__name__}: {exc}") from exc


def _collective_of(spec: str, name: str, build: object) -> Collective:
    """What the generator computes: the collective of the first schedule it builds for a small group."""
    assert callable(build)
    entry = Algorithm(Collective.ALL_REDUCE, name, build, declared_parameters(build))
    first_error = ""
    for n in VERIFY_WORLD_SIZES:
        for kwargs in _trial_parameters(entry, n):
            try:
                built = build(n, **kwargs)
            except ScheduleError as exc:
                raise AlgorithmLoadError(f"{spec}: {exc}") from None
            except ValueError as exc:
                first_error = first_error or f"world_size={n}: {exc}"
                continue
            except Exception as exc:
                raise AlgorithmLoadError(f"{spec}: {name}({n}) raised {type(exc).__name__}: {exc}") from exc
            if isinstance(built, Schedule | Program):
                return built.collective
            raise AlgorithmLoadError(f"{spec}: {name}({n}) returned {type(built).__name__}, not a Schedule or Program")
    raise AlgorithmLoadError(f"{spec}: {name} declined every world size it was tried on ({first_error})")


def load_algorithm(spec: str, *, name: str | None = None, origin: str | None = None) -> Algorithm:
    """Import the generator named by ``spec`` (``module:function`` or ``file.py:function``) and register it.

    It is registered as ``name`` (default: the function's name in the spec) for the collective its schedules
    compute, after verification. Loading the same spec again returns the entry already registered. Every error
    is an :class:`AlgorithmLoadError` whose message starts with the spec.
    """
    module_text, sep, attribute = spec.strip().rpartition(":")
    if not sep or not module_text or not attribute:
        raise AlgorithmLoadError(
            f"algorithm spec {spec!r}: write it as module.path:function or path/to/file.py:function"
        )
    name = attribute if name is None else name
    origin = spec if origin is None else origin
    module = _import(spec, module_text)
    try:
        build = getattr(module, attribute)
    except AttributeError:
        raise AlgorithmLoadError(f"{spec}: module {module_text} has no attribute {attribute!r}") from None
    if not callable(build):
        raise AlgorithmLoadError(
            f"{spec}: {attribute} is a {type(build).__name__}, not a function (world_size, ...) -> Schedule | Program"
        )
    collective = _collective_of(spec, name, build)
    try:
        existing = get_algorithm(collective, name)
    except ValueError:
        existing = None
    if existing is not None and existing.build is build:
        return existing
    doc = (getattr(build, "__doc__", None) or "").strip()
    try:
        return register_algorithm(
            collective, name, build, description=doc.splitlines()[0] if doc else "", origin=origin
        )
    except (ValueError, TypeError) as exc:
        raise AlgorithmLoadError(f"{spec}: {exc}") from None


def _report(what: str, exc: Exception) -> None:
    message = f"allreduce: algorithm plug-in {what} was not loaded: {exc}"
    _errors.append(message)
    warnings.warn(message, PluginWarning, stacklevel=3)


def load_plugins() -> None:
    """Register every entry point of :data:`ENTRY_POINT_GROUP` and every spec in :data:`ENVIRONMENT_VARIABLE`.

    A plug-in that fails is reported and skipped (a broken plug-in never breaks the built-ins)."""
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(entry_point, "dist", None)
        where = f"entry point {entry_point.name} = {entry_point.value}" + (
            f" (distribution {dist.name})" if dist is not None else ""
        )
        origin = f"entry point of {dist.name}" if dist is not None else f"entry point {entry_point.value}"
        try:
            load_algorithm(entry_point.value, name=entry_point.name, origin=origin)
        except Exception as exc:  # a plug-in may fail in any way; it must not take the registry down
            _report(where, exc)
    for spec in os.environ.get(ENVIRONMENT_VARIABLE, "").split(","):
        if spec.strip():
            try:
                load_algorithm(spec.strip())
            except Exception as exc:  # as above
                _report(f"{spec.strip()!r} (from {ENVIRONMENT_VARIABLE})", exc)


def plugin_errors() -> tuple[str, ...]:
    """One line per plug-in that failed to load in this process."""
    return tuple(_errors)


add_loader(load_plugins)
