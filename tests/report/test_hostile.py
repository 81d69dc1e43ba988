"""Result files are input from anywhere: every field is checked before it is rendered, and every text that reaches
the page is escaped. Hostile files are refused naming the field, or drawn inert; Chromium checks nothing runs."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from allreduce.report import load_documents, render_report, write_report

# Each payload, if it ran, would log PWNED to the console and mark the body.
RUN = "console.error('PWNED');document.body.setAttribute('data-pwned','1')"
PAYLOADS = (
    f"<script>{RUN}</script>",
    f'<img src=x onerror="{RUN}">',
    f'"><svg onload="{RUN}">',
    f"</text></svg><script>{RUN}</script>",
    f'\'><iframe srcdoc="<script>parent.{RUN}</script>">',
)


def sim_document() -> dict[str, Any]:
    """``allreduce sim --json``'s shape."""
    return {
        "topology": "fat-tree:k=4",
        "ranks": 16,
        "size_bytes": 2**20,
        "algorithms": [
            {"name": "ring", "seconds": 2.2e-4, "busbw_GBps": 8.9, "engine": "fast"},
            {"name": "halving_doubling", "seconds": 1.4e-4, "busbw_GBps": 13.7, "engine": "event"},
        ],
        "best": "halving_doubling",
        "bottlenecks": [{"link": "agg4->core1", "utilization": 0.66, "waited_s": 6.3e-5}],
        "skipped": [],
    }


def bench_document() -> dict[str, Any]:
    rows = [
        {"transport": "shm", "algorithm": "ring", "world_size": 4, "size_bytes": s, "time_s": s / 5e9, "busbw_Bps": 7e9}
        for s in (4096, 2**20)
    ]
    return {"kind": "bench", "rows": rows}


def sweep_document() -> dict[str, Any]:
    ok = {"case_id": "a1", "gpus": 8, "topology": "switch:8", "algorithm": "ring", "step_s": 0.02, "error": ""}
    failed = {"case_id": "b2", "gpus": 64, "topology": "switch:8", "algorithm": "ring", "step_s": "", "error": "x"}
    return {"kind": "sweep", "rows": [ok, {**ok, "case_id": "a2", "gpus": 16}, failed]}


@pytest.fixture
def documents(
    plan_document: dict[str, Any], measured_plan_document: dict[str, Any], tail_document: dict[str, Any]
) -> list[dict[str, Any]]:
    return [plan_document, measured_plan_document, tail_document, sim_document(), bench_document(), sweep_document()]


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _leaves(item, (*path, i))
    else:
        yield path, value


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    out = copy.deepcopy(doc)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


def _shown(path: tuple[Any, ...]) -> str:
    text = ""
    for key in path:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else str(key))
    return text


def _hostile_texts(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with every string (but its kind, and empty cells) replaced by one of the payloads in turn."""
    out = copy.deepcopy(doc)
    strings = [p for p, v in _leaves(doc) if isinstance(v, str) and v and p != ("kind",)]
    for i, path in enumerate(strings):
        out = _set(out, path, PAYLOADS[i % len(PAYLOADS)])
    return out


def _used_numbers(doc: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The paths of the numbers the report reads (what load_documents keeps of ``doc``)."""
    return [p for p, v in _leaves(doc) if isinstance(v, int | float) and not isinstance(v, bool)]


def test_a_script_in_place_of_any_number_is_refused_naming_the_file_and_field(
    documents: list[dict[str, Any]], tmp_path: Path
) -> None:
    checked = 0
    for index, doc in enumerate(documents):
        kept = load_documents([_write(tmp_path / f"ok{index}.json", doc)])[0]
        for path in _used_numbers(kept):
            bad = _write(tmp_path / "bad.json", _set(doc, path, PAYLOADS[0]))
            with pytest.raises(ValueError, match=re.escape(f"{bad}: not a valid")) as info:
                load_documents([bad])
            assert _shown(path) in str(info.value)
            checked += 1
    assert checked > 60  # every number of five kinds of result


def _write(path: Path, doc: Any) -> Path:
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(
    ("field", "value"),
    [("ranks", -1), ("ranks", 1.5), ("ranks", True), ("samples", 0), ("seed", "1; DROP"), ("size_bytes", 1e400)],
)
def test_a_number_out_of_range_is_refused(tail_document: dict[str, Any], field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"result 0: not a valid tail result: {field}: expected"):
        render_report([{**tail_document, field: value}])


def test_every_text_of_a_hostile_file_reaches_the_page_escaped(documents: list[dict[str, Any]]) -> None:
    page = render_report([_hostile_texts(doc) for doc in documents])
    assert "PWNED" in page  # the texts are there, as text
    for tag in ("<script", "<img", "<iframe", "<svg onload", 'onerror="', 'onload="'):
        assert tag not in page.replace('<svg xmlns="http://www.w3.org/2000/svg"', "")


BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
HEADLESS = ["--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0"]
BROWSER_TIMEOUT_S = 120


def _dump_dom(page: Path) -> subprocess.CompletedProcess[str]:
    """A headless browser's DOM of ``page`` once it has loaded (stdout) and its console (stderr); the test is
    skipped where no browser is installed."""
    browser = next(filter(None, map(shutil.which, BROWSERS)), None)
    if browser is None:
        pytest.skip(f"no headless browser: none of {', '.join(BROWSERS)} is on PATH (.ci/run installs chromium)")
    return subprocess.run(
        [browser, *HEADLESS, "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=BROWSER_TIMEOUT_S,
        check=False,
    )


@pytest.mark.slow
def test_chromium_runs_nothing_from_a_hostile_file(documents: list[dict[str, Any]], tmp_path: Path) -> None:
    page = write_report(tmp_path / "hostile.html", [_hostile_texts(doc) for doc in documents])
    done = _dump_dom(page)
    assert done.returncode == 0, done.stderr[-500:]
    assert "PWNED" in done.stdout  # the page loaded, the payloads in it as text
    assert re.search(r"<body[^>]*data-pwned", done.stdout) is None
    assert [line for line in done.stderr.splitlines() if ":CONSOLE" in line and "PWNED" in line] == []
    assert "<iframe" not in done.stdout


@pytest.mark.slow
def test_the_chromium_check_sees_a_payload_that_runs(tmp_path: Path) -> None:
    page = tmp_path / "raw.html"
    page.write_text(f"<!DOCTYPE html><html><body><p>{PAYLOADS[0]}</p></body></html>")
    done = _dump_dom(page)
    assert re.search(r"<body[^>]*data-pwned", done.stdout) is not None
    assert any(":CONSOLE" in line and "PWNED" in line for line in done.stderr.splitlines())


def _hostile_numbers(documents: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """The numeric fields a crafted file got through as raw HTML, each carrying a payload."""
    plan, measured, tail, sim, bench, _ = documents
    return [
        ("goodput.gpus", _set(measured, ("goodput", "gpus"), PAYLOADS[1])),
        ("measured.tensors", _set(measured, ("measured", "tensors"), PAYLOADS[0])),
        ("ranks", {**sim, "ranks": PAYLOADS[0]}),
        ("samples", {**tail, "samples": PAYLOADS[1]}),
        ("seed", {**tail, "seed": PAYLOADS[0]}),
        ("base.gpus", _set(plan, ("base", "gpus"), PAYLOADS[1])),
        ("base.sizes[0].count", _set(plan, ("base", "sizes", 0, "count"), PAYLOADS[0])),
        ("rows[0].world_size", _set(bench, ("rows", 0, "world_size"), PAYLOADS[1])),
    ]


@pytest.mark.slow
def test_a_payload_in_a_number_never_runs_in_chromium(
    documents: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from allreduce.cli import main

    browser = next(filter(None, map(shutil.which, BROWSERS)), None)
    if browser is None:
        pytest.skip(f"no headless browser: none of {', '.join(BROWSERS)} is on PATH (.ci/run installs chromium)")
    for field, doc in _hostile_numbers(documents):
        page = tmp_path / "page.html"
        page.unlink(missing_ok=True)
        code = main(["report", str(_write(tmp_path / "crafted.json", doc)), "-o", str(page)])
        err = capsys.readouterr().err
        if code != 0:  # refused: one line naming the field, no page
            assert code == 2, err
            assert f"{field}: expected a" in err
            assert not page.exists()
            continue
        done = subprocess.run(
            [browser, *HEADLESS, "--dump-dom", page.as_uri()],
            capture_output=True,
            text=True,
            timeout=BROWSER_TIMEOUT_S,
            check=False,
        )
        assert re.search(r"<body[^>]*data-pwned", done.stdout) is None, field
        assert [line for line in done.stderr.splitlines() if ":CONSOLE" in line and "PWNED" in line] == [], field
