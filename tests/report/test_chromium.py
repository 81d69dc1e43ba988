"""The report as a person sees it: headless Chromium opens the file, logs nothing, draws every figure.

The test keeps a screenshot: under ``$ALLREDUCE_ARTIFACTS`` when set, else in the test's tmp directory (its path
is printed). Skipped, with the reason, where no Chromium is installed.
"""

from __future__ import annotations

import html
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from allreduce.cli import main
from allreduce.report import write_report
from allreduce.units import format_seconds
from profiler_traces import record_mlp_execution_trace, record_mlp_trace

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
# Every figure's SVG is 760 CSS pixels wide (report/_figures.py); the window fits it with the tables.
WINDOW = "1100,2600"
BROWSER_TIMEOUT_S = 120
HEADLESS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr", "--v=0"]
# Measures each figure once the page has laid out, and writes the result into the DOM for --dump-dom.
PROBE = """<script>
const figures = [...document.querySelectorAll("figure")].map((f) => {
  const svg = f.querySelector("svg");
  const box = svg ? svg.getBBox() : {width: 0, height: 0};
  const shown = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
  return {id: f.id, width: box.width, height: box.height, shown: shown.width * shown.height,
          shapes: svg ? svg.querySelectorAll("rect, polyline, circle").length : 0};
});
document.body.setAttribute("data-probe", JSON.stringify(figures));
const shown = Object.fromEntries([...document.querySelectorAll("[data-key]")]
  .filter((e) => e.getBoundingClientRect().width > 0).map((e) => [e.dataset.key, e.innerText]));
document.body.setAttribute("data-shown", JSON.stringify(shown));
</script>"""


def _browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(f"no headless browser: none of {', '.join(BROWSERS)} is on PATH (.ci/run installs chromium)")


def _run(browser: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [browser, *HEADLESS, *args], capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S, check=False
    )


def _console(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def _probe(browser: str, page: Path) -> tuple[list[dict[str, Any]], list[str], dict[str, str]]:
    """The figures as laid out, the console's lines, and the text of every number the page shows (by key)."""
    probe = page.with_name("probe-" + page.name)
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    done = _run(browser, "--dump-dom", probe.as_uri())
    match = re.search(r'data-probe="([^"]*)"', done.stdout)
    assert match, f"the browser did not run the probe (exit {done.returncode}): {done.stderr[-500:]}"
    shown = re.search(r'data-shown="([^"]*)"', done.stdout)
    assert shown, "the probe did not list the numbers shown"
    return json.loads(html.unescape(match.group(1))), _console(done.stderr), json.loads(html.unescape(shown[1]))


def _assert_drawn(figure: dict[str, Any]) -> None:
    """The figure's SVG laid out at a readable size and shown on the page."""
    assert figure["width"] > 100, figure
    assert figure["height"] > 100, figure
    assert figure["shown"] > 0, figure


def _screenshot(browser: str, page: Path, name: str) -> bytes:
    """A screenshot of ``page``, kept as ``name`` under $ALLREDUCE_ARTIFACTS (else beside the page); its bytes."""
    artifacts = Path(os.environ.get("ALLREDUCE_ARTIFACTS", page.parent))
    artifacts.mkdir(parents=True, exist_ok=True)
    screenshot = artifacts / name
    shot = _run(browser, f"--window-size={WINDOW}", f"--screenshot={screenshot}", page.as_uri())
    assert shot.returncode == 0, shot.stderr[-500:]
    assert _console(shot.stderr) == []
    data = screenshot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot: {screenshot}")
    return data


@pytest.mark.slow
def test_the_harness_sees_a_console_error(tmp_path: Path) -> None:
    browser = _browser()
    page = tmp_path / "bad.html"
    page.write_text("<!DOCTYPE html><html><body><figure id='f'></figure><script>missing();</script></body></html>")
    figures, console, _ = _probe(browser, page)
    assert any("missing is not defined" in line for line in console)
    assert figures == [{"id": "f", "width": 0, "height": 0, "shown": 0, "shapes": 0}]


@pytest.mark.slow
def test_chromium_renders_every_figure_without_console_errors(tmp_path: Path, plan_document: dict[str, Any]) -> None:
    browser = _browser()
    page = write_report(tmp_path / "report.html", [plan_document])
    figures, console, _ = _probe(browser, page)
    assert console == []
    assert [f["id"] for f in figures] == ["d0-scaling", "d0-breakdown", "d0-busbw", "d0-links"]
    for figure in figures:
        _assert_drawn(figure)
        assert figure["shapes"] > 3, figure
    assert len(_screenshot(browser, page, "report.png")) > 20_000  # a blank page compresses to a few KB


@pytest.mark.slow
def test_chromium_draws_the_tail_cdf_beside_a_plan(
    tmp_path: Path, plan_document: dict[str, Any], tail_document: dict[str, Any]
) -> None:
    browser = _browser()
    page = write_report(tmp_path / "tail.html", [plan_document, tail_document])
    figures, console, _ = _probe(browser, page)
    assert console == []
    assert [f["id"] for f in figures] == ["d0-scaling", "d0-breakdown", "d0-busbw", "d0-links", "d1-tail"]
    tail = figures[-1]
    _assert_drawn(tail)
    assert tail["shapes"] > 3, tail  # the frame, two polylines and their points
    _screenshot(browser, page, "report-tail.png")


@pytest.mark.slow
def test_chromium_draws_goodput_and_the_measured_step_timeline(
    tmp_path: Path, measured_plan_document: dict[str, Any]
) -> None:
    browser = _browser()
    page = write_report(tmp_path / "measured.html", [measured_plan_document])
    figures, console, shown = _probe(browser, page)
    assert console == []
    drawn = {f["id"]: f for f in figures}
    assert {"d0-goodput", "d0-timeline"} <= set(drawn)
    buckets = len(measured_plan_document["timeline"]["buckets"])
    # the frame, forward, backward, and a ready tick and an all-reduce per bucket
    assert drawn["d0-timeline"]["shapes"] >= 3 + 2 * buckets, drawn["d0-timeline"]
    assert drawn["d0-goodput"]["shapes"] > 3, drawn["d0-goodput"]
    _assert_drawn(drawn["d0-goodput"])
    _assert_drawn(drawn["d0-timeline"])
    # the pause per failure of shrink-and-continue, and where it comes from, shown beside the policies
    recovery = measured_plan_document["goodput"]["elastic_recovery"]
    assert shown["0.goodput.elastic_recovery.seconds"] == format_seconds(recovery["seconds"])
    assert shown["0.goodput.elastic_recovery.basis"] == recovery["basis"] == "stored"
    # a what-if row per recovery policy, each with its step per useful step
    policies = [i for i, w in enumerate(measured_plan_document["what_ifs"]) if "goodput" in w]
    assert len(policies) == 3
    for i in policies:
        effective = measured_plan_document["what_ifs"][i]["effective_step_s"]
        assert shown[f"0.what_ifs.{i}.effective_step_s"] == f"{effective * 1e3:.2f} ms"
    _screenshot(browser, page, "report-measured.png")


@pytest.mark.slow
def test_chromium_draws_a_profiled_plans_timeline_as_the_command_line_writes_it(tmp_path: Path) -> None:
    # allreduce plan --profile TRACE.json --report: a torch.profiler trace this test records, the report the
    # command writes, the timeline and goodput drawn and the elastic pause shown; then a Chakra ET of the same
    # model (recorded and converted here), its timeline drawn
    pytest.importorskip("torch")
    trace, et = tmp_path / "step.json", None
    if importlib.util.find_spec("chakra") is None:
        record_mlp_trace(trace)  # the Chakra converter is not installed: no execution trace's page
    else:
        et, trace = record_mlp_execution_trace(tmp_path)
    page = tmp_path / "profiled.html"
    argv = ["plan", "--profile", str(trace), "--gpus", "16", "--topology", "fat-tree:k=4", "--no-what-if"]
    assert main([*argv, "--report", str(page)]) == 0
    figures, console, shown = _probe(_browser(), page)
    assert console == []
    drawn = {f["id"]: f for f in figures}
    _assert_drawn(drawn["d0-timeline"])
    _assert_drawn(drawn["d0-goodput"])
    assert shown["0.goodput.elastic_recovery.basis"] == "stored"
    assert "0.goodput.elastic_recovery.seconds" in shown
    if et is None:
        return
    et_page = tmp_path / "replayed.html"
    assert main([*argv[:2], str(et), *argv[3:], "--report", str(et_page)]) == 0
    figures, console, _ = _probe(_browser(), et_page)
    assert console == []
    _assert_drawn({f["id"]: f for f in figures}["d0-timeline"])
