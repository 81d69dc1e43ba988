"""The report page: self-contained, one figure per view, and its numbers are the plan's numbers."""

from __future__ import annotations

import copy
import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from allreduce.report import figures_of, load_documents, render_report, write_pngs


class _Cells(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, str] = {}
        self.figures: list[str] = []
        self.svg_shapes = 0
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        found = dict(attrs)
        if "data-key" in found and found.get("data-value") is not None:
            self.values[str(found["data-key"])] = found["data-value"]
        if tag == "figure":
            self.figures.append(str(found.get("id")))
        if tag in ("rect", "polyline", "circle"):
            self.svg_shapes += 1


def _lookup(document: dict[str, Any], path: list[str]) -> Any:
    value: Any = document
    for part in path:
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


def parse(page: str) -> _Cells:
    cells = _Cells()
    cells.feed(page)
    return cells


@pytest.mark.slow
def test_every_number_on_the_page_is_the_plans_number(plan_document: dict[str, Any]) -> None:
    cells = parse(render_report([plan_document]))
    assert len(cells.values) >= 20
    for key, text in cells.values.items():
        index, *path = key.split(".")
        assert index == "0"
        assert float(text) == _lookup(plan_document, path), key
    assert float(cells.values["0.base.step_s"]) == plan_document["base"]["step_s"]


def test_the_page_is_self_contained(plan_document: dict[str, Any]) -> None:
    page = render_report([plan_document])
    cells = parse(page)
    assert not cells.tags & {"script", "link", "img", "iframe"}
    urls = set(re.findall(r"https?://[^\s\"'<>]+", page))
    assert urls <= {"http://www.w3.org/2000/svg"}


def test_a_plan_has_scaling_breakdown_busbw_and_link_figures_with_captions(plan_document: dict[str, Any]) -> None:
    figures = figures_of([plan_document])
    assert [f.ident for f in figures] == ["d0-scaling", "d0-breakdown", "d0-busbw", "d0-links"]
    assert all(len(f.caption) > 40 for f in figures)
    page = render_report([plan_document])
    assert page.count("<figcaption>") == 4


def test_a_sweep_csv_and_a_sim_json_are_reported_too(tmp_path: Path, plan_document: dict[str, Any]) -> None:
    sweep = tmp_path / "s.csv"
    sweep.write_text(
        "case_id,gpus,topology,algorithm,step_s,error\n"
        "a,8,t1,ring,0.5,\nb,16,t1,ring,0.6,\nc,8,t2,ring,0.4,\nd,16,t2,ring,,ValueError: too many GPUs\n"
    )
    sim = tmp_path / "sim.json"
    sim.write_text(
        json.dumps(
            {
                "topology": "switch:8",
                "ranks": 8,
                "size_bytes": 1024,
                "algorithms": [{"name": "ring", "seconds": 1e-5, "busbw_GBps": 1.0}],
                "best": "ring",
                "bottlenecks": [{"link": "gpu0->sw0", "utilization": 0.5, "waited_s": 1e-6}],
            }
        )
    )
    documents = load_documents([sweep, sim])
    page = render_report(documents)
    cells = parse(page)
    assert cells.figures == ["d0-sweep", "d1-sim", "d1-simlinks"]
    assert "ValueError: too many GPUs" in page
    assert float(cells.values["1.algorithms.0.seconds"]) == 1e-5


def test_a_file_that_is_no_result_is_refused_with_its_name(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match=r"x\.json: not a plan, sweep, sim, tail or bench result"):
        load_documents([bad])


@pytest.mark.slow
def test_png_figures_are_written_with_matplotlib(tmp_path: Path, plan_document: dict[str, Any]) -> None:
    pytest.importorskip("matplotlib")
    paths = write_pngs(figures_of([plan_document]), tmp_path / "png")
    assert [p.name for p in paths] == ["d0-scaling.png", "d0-breakdown.png", "d0-busbw.png", "d0-links.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_measured_bench_rows_are_drawn_beside_the_predicted_busbw(
    tmp_path: Path, plan_document: dict[str, Any]
) -> None:
    # The fields of `allreduce bench --json` rows.
    rows = [
        {
            "size_bytes": size,
            "count": size // 4,
            "dtype": "float32",
            "op": "sum",
            "algorithm": "ring",
            "transport": "shm",
            "world_size": 4,
            "iters": 10,
            "time_s": size / 1e9,
            "algbw_Bps": 1e9,
            "busbw_Bps": 1.5e9,
            "wrong": 0,
        }
        for size in (4096, 1 << 20, 16 << 20)
    ]
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(rows))
    saved = tmp_path / "plan.json"
    saved.write_text(json.dumps(plan_document))
    documents = load_documents([saved, bench])
    busbw = next(f for f in figures_of(documents) if f.ident == "d0-busbw")
    assert [s.label for s in busbw.series][1:] == ["shm ring x4 (measured)"]
    assert busbw.series[1].x == (4096.0, float(1 << 20), float(16 << 20))
    cells = parse(render_report(documents))
    assert float(cells.values["1.rows.2.busbw_Bps"]) == 1.5e9


@pytest.mark.slow
def test_a_tail_json_is_a_table_and_a_cdf_whose_numbers_are_the_jsons(
    tmp_path: Path, tail_document: dict[str, Any]
) -> None:
    saved = tmp_path / "tail.json"
    saved.write_text(json.dumps(tail_document))
    documents = load_documents([saved])
    cells = parse(render_report(documents))
    assert cells.figures == ["d0-tail"]
    keys = {"noise_free_s", "step_s.p50", "step_s.p90", "step_s.p99", "step_s.p99.9", "step_s.max", "step_s.mean"}
    for i, _ in enumerate(tail_document["algorithms"]):
        for key in keys:
            algorithm = tail_document["algorithms"][i]
            expected = algorithm["noise_free_s"] if key == "noise_free_s" else algorithm["step_s"][key[7:]]
            assert float(cells.values[f"0.algorithms.{i}.{key}"]) == expected, key


def test_the_tail_cdf_draws_each_algorithms_reported_quantiles_at_their_nines(tail_document: dict[str, Any]) -> None:
    (figure,) = figures_of([tail_document])
    assert [s.label for s in figure.series] == ["ring", "halving_doubling"]
    ring = tail_document["algorithms"][0]
    step = ring["step_s"]
    # 300 samples resolve p50, p90 and p99 (at least one sample beyond each), not p99.9.
    expected_ms = [ring["noise_free_s"], step["p50"], step["p90"], step["p99"], step["max"]]
    assert figure.series[0].x == pytest.approx([s * 1e3 for s in expected_ms], rel=1e-12)
    assert figure.series[0].y == pytest.approx([0.0, math.log10(2), 1.0, 2.0, 3.0], rel=1e-12)
    assert [label for _, label in figure.y_ticks] == ["0%", "p50", "p90", "p99", "max"]
    assert "nines" in figure.caption


def test_the_breakdown_bars_leave_the_random_loss_rows_to_the_table(plan_document: dict[str, Any]) -> None:
    breakdown = next(f for f in figures_of([plan_document]) if f.ident == "d0-breakdown")
    loss_rows = [w["change"] for w in plan_document["what_ifs"] if "p99_step_s" in w]
    assert loss_rows
    assert not set(loss_rows) & set(breakdown.categories)
    assert breakdown.categories[0] == "base"
    assert len(breakdown.categories) == 1 + len(plan_document["what_ifs"]) - len(loss_rows)


def test_every_goodput_and_timeline_number_on_the_page_is_the_plans(measured_plan_document: dict[str, Any]) -> None:
    cells = parse(render_report([measured_plan_document]))
    policies = measured_plan_document["goodput"]["policies"]
    for i, row in enumerate(policies):
        assert float(cells.values[f"0.goodput.policies.{i}.goodput"]) == row["goodput"]
        assert float(cells.values[f"0.goodput.policies.{i}.lost_work_s"]) == row["lost_work_s"]
    for i, row in enumerate(measured_plan_document["scaling"]):
        assert float(cells.values[f"0.scaling.{i}.goodput"]) == row["goodput"]
    assert [p["policy"] for p in policies] == ["restart", "spares", "elastic"]
    recovery = measured_plan_document["goodput"]["elastic_recovery"]
    assert float(cells.values["0.goodput.elastic_recovery.seconds"]) == recovery["seconds"]


def test_the_goodput_figure_plots_the_scaling_tables_goodput(measured_plan_document: dict[str, Any]) -> None:
    figure = next(f for f in figures_of([measured_plan_document]) if f.ident == "d0-goodput")
    goodput = figure.series[0]
    assert goodput.x == tuple(float(r["gpus"]) for r in measured_plan_document["scaling"])
    assert goodput.y == tuple(100.0 * r["goodput"] for r in measured_plan_document["scaling"])


def test_the_timeline_draws_each_buckets_ready_time_and_all_reduce(measured_plan_document: dict[str, Any]) -> None:
    figure = next(f for f in figures_of([measured_plan_document]) if f.ident == "d0-timeline")
    buckets = measured_plan_document["timeline"]["buckets"]
    ready = [s for s in figure.spans if s.lane == 2]
    reduced = [s for s in figure.spans if s.lane == 3]
    assert [s.start for s in ready] == [b["ready_s"] * 1e3 for b in buckets]
    assert [(s.start, s.end) for s in reduced] == [(b["start_s"] * 1e3, b["end_s"] * 1e3) for b in buckets]


def test_a_timeline_of_many_buckets_draws_back_to_back_all_reduces_as_one(
    measured_plan_document: dict[str, Any],
) -> None:
    timeline = measured_plan_document["timeline"]
    many = [{"size_bytes": 10, "ready_s": 0.01, "start_s": 0.01 + k * 1e-4, "end_s": 0.01 + (k + 1) * 1e-4} for k in
            range(1000)]  # fmt: skip
    doc = {**measured_plan_document, "timeline": {**timeline, "buckets": many}}
    figure = next(f for f in figures_of([doc]) if f.ident == "d0-timeline")
    reduced = [s for s in figure.spans if s.lane == 3]
    assert [(s.start, s.end, s.label) for s in reduced] == [(10.0, 10.0 + 1000 * 0.1, "buckets 0-999 all-reduce")]


@pytest.mark.slow
def test_goodput_and_timeline_pngs_are_written_with_matplotlib(
    tmp_path: Path, measured_plan_document: dict[str, Any]
) -> None:
    pytest.importorskip("matplotlib")
    figures = [f for f in figures_of([measured_plan_document]) if f.ident in ("d0-goodput", "d0-timeline")]
    paths = write_pngs(figures, tmp_path / "png")
    assert [p.name for p in paths] == ["d0-goodput.png", "d0-timeline.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_the_page_says_whether_the_elastic_pause_was_modelled_or_given(measured_plan_document: dict[str, Any]) -> None:
    modelled = render_report([measured_plan_document])
    assert 'the mean over failure kinds (<i data-key="0.goodput.elastic_recovery.basis">stored</i>)' in modelled
    assert "modelled from the runtime&#x27;s kill benchmark, benchmarks/bench_elastic.py" in modelled
    given = copy.deepcopy(measured_plan_document)
    given["goodput"]["elastic_recovery"] = {"seconds": 42.0, "basis": "given", "source": "--elastic-recovery-s"}
    page = render_report([given])
    assert "given</i> (--elastic-recovery-s).</p>" in page
    assert float(parse(page).values["0.goodput.elastic_recovery.seconds"]) == 42.0


def test_the_page_says_how_a_silent_failure_is_found(measured_plan_document: dict[str, Any]) -> None:
    page = render_report([measured_plan_document])
    assert "is silent, dead to the store after its 10 s lease (no heartbeat), found in 9.75 s on average" in page
    off = copy.deepcopy(measured_plan_document)
    off["goodput"]["elastic_recovery"].update(lease_s=0.0, detect_s=600.0)
    assert "is silent, found after two 300 s timeouts" in render_report([off])
