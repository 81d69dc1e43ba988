"""Figures as data, drawn as inline SVG (no dependency, no network) or as PNG with matplotlib.

A :class:`Figure` is a line chart (series of x, y points, log-scaled axes as asked), a bar chart (categories,
stacked series) or a timeline (spans of time in lanes, the categories). :func:`figures_of` derives the figures
from result documents (``plan --json``, a sweep's rows, ``sim --json``); the report never runs a simulation.
"""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Figure", "Series", "Span", "document_kind", "figures_of", "svg", "write_pngs"]

# Drawing area in SVG user units (CSS pixels at 100% zoom) and the margins that hold axis labels.
WIDTH = 760
HEIGHT = 380
MARGIN_LEFT = 78
MARGIN_RIGHT = 180
MARGIN_TOP = 16
MARGIN_BOTTOM = 96
# Longest category label under a bar, in characters (longer ones are cut; the bar's tooltip has it whole).
CATEGORY_LABEL_CHARS = 24
TICKS = 5
# A colour-blind-safe palette (Okabe and Ito, 2008).
COLOURS = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")


@dataclass(frozen=True)
class Series:
    label: str
    x: tuple[float, ...]  # line charts: x values; bar charts: unused (the figure's categories)
    y: tuple[float, ...]


@dataclass(frozen=True)
class Span:
    """A timeline's interval ``start``..``end`` in lane ``lane`` (an index into the figure's categories), drawn in
    colour ``colour`` (an index into the palette); one of zero length is drawn as a tick."""

    lane: int
    start: float
    end: float
    label: str
    colour: int = 0


@dataclass(frozen=True)
class Figure:
    """``kind`` is "line", "bars" or "timeline"; bars stack their series per category; a timeline draws ``spans``
    in lanes named by ``categories``, top to bottom."""

    ident: str
    title: str
    caption: str
    kind: str
    series: tuple[Series, ...]
    x_label: str
    y_label: str
    categories: tuple[str, ...] = ()
    log_x: bool = False
    log_y: bool = False
    y_ticks: tuple[tuple[float, str], ...] = ()  # (position, label) replacing the automatic y ticks
    spans: tuple[Span, ...] = ()  # a timeline's


def _ticks(low: float, high: float, log: bool) -> list[float]:
    if log:
        first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
        stride = max(1, (last - first) // 6)
        inside = [10.0**e for e in range(first, last + 1, stride) if low <= 10.0**e <= high]
        return inside or [low, high]
    if high <= low:
        return [low]
    raw = (high - low) / TICKS
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = min((m * magnitude for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * magnitude >= raw), default=raw)
    start = math.ceil(low / step) * step
    count = int((high - start) / step) + 1
    return [start + i * step for i in range(count)]


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-2:
        mantissa, exponent = f"{value:.0e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{value:g}"


class _Axis:
    def __init__(self, low: float, high: float, log: bool, start_px: float, end_px: float) -> None:
        if log:
            low, high = max(low, 1e-300), max(high, low * 10)
        elif high <= low:
            high = low + 1.0
        self.low, self.high, self.log = low, high, log
        self.start_px, self.end_px = start_px, end_px

    def __call__(self, value: float) -> float:
        if self.log:
            t = (math.log10(max(value, self.low)) - math.log10(self.low)) / (
                math.log10(self.high) - math.log10(self.low)
            )
        else:
            t = (value - self.low) / (self.high - self.low)
        return self.start_px + t * (self.end_px - self.start_px)


def _frame(fig: Figure, x_axis: _Axis | None, y_axis: _Axis, parts: list[str]) -> None:
    left, right = MARGIN_LEFT, WIDTH - MARGIN_RIGHT
    top, bottom = MARGIN_TOP, HEIGHT - MARGIN_BOTTOM
    parts.append(f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" class="plot"/>')
    y_ticks = fig.y_ticks or tuple((t, _fmt(t)) for t in _ticks(y_axis.low, y_axis.high, y_axis.log))
    for tick, label in y_ticks:
        y = y_axis(tick)
        parts.append(f'<line x1="{left}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{html.escape(label)}</text>')
    if x_axis is not None:
        for tick in _ticks(x_axis.low, x_axis.high, x_axis.log):
            x = x_axis(tick)
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom}" class="grid"/>')
            parts.append(f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{_fmt(tick)}</text>')
    parts.append(
        f'<text x="{(left + right) / 2:.0f}" y="{HEIGHT - 8}" text-anchor="middle">{html.escape(fig.x_label)}</text>'
    )
    parts.append(
        f'<text transform="translate(16 {(top + bottom) / 2:.0f}) rotate(-90)" text-anchor="middle">'
        f"{html.escape(fig.y_label)}</text>"
    )


def _legend(labels: Sequence[str], parts: list[str]) -> None:
    x = WIDTH - MARGIN_RIGHT + 12
    for i, label in enumerate(labels):
        y = MARGIN_TOP + 8 + 18 * i
        colour = COLOURS[i % len(COLOURS)]
        parts.append(f'<rect x="{x}" y="{y - 8}" width="12" height="10" fill="{colour}"/>')
        parts.append(f'<text x="{x + 18}" y="{y + 1}">{html.escape(label[:26])}</text>')


def _line_svg(fig: Figure, parts: list[str]) -> None:
    xs = [x for s in fig.series for x in s.x if not fig.log_x or x > 0]
    ys = [y for s in fig.series for y in s.y if math.isfinite(y) and (not fig.log_y or y > 0)]
    if not xs or not ys:
        raise ValueError(f"figure {fig.ident}: no points to draw")
    x_axis = _Axis(min(xs), max(xs), fig.log_x, MARGIN_LEFT, WIDTH - MARGIN_RIGHT)
    y_low = min(ys) if fig.log_y else min(0.0, *ys)
    y_high = max(ys) * (1.0 if fig.log_y else 1.05)
    if fig.y_ticks:
        y_high = max(y_high, *(t for t, _ in fig.y_ticks))
    y_axis = _Axis(y_low, y_high, fig.log_y, HEIGHT - MARGIN_BOTTOM, MARGIN_TOP)
    _frame(fig, x_axis, y_axis, parts)
    for i, s in enumerate(fig.series):
        colour = COLOURS[i % len(COLOURS)]
        points = [(x_axis(x), y_axis(y)) for x, y in zip(s.x, s.y, strict=True) if math.isfinite(y)]
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        parts.extend(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{colour}"/>' for px, py in points)
    _legend([s.label for s in fig.series], parts)


def _bars_svg(fig: Figure, parts: list[str]) -> None:
    count = len(fig.categories)
    totals = [sum(s.y[i] for s in fig.series) for i in range(count)]
    y_axis = _Axis(
        0.0, max(totals) * 1.05 if totals and max(totals) > 0 else 1.0, False, HEIGHT - MARGIN_BOTTOM, MARGIN_TOP
    )
    _frame(fig, None, y_axis, parts)
    slot = (WIDTH - MARGIN_RIGHT - MARGIN_LEFT) / max(count, 1)
    width = slot * 0.7
    for i, category in enumerate(fig.categories):
        x = MARGIN_LEFT + slot * i + (slot - width) / 2
        base = 0.0
        for j, s in enumerate(fig.series):
            top, bottom = y_axis(base + s.y[i]), y_axis(base)
            colour = COLOURS[j % len(COLOURS)]
            parts.append(
                f'<rect x="{x:.1f}" y="{top:.1f}" width="{width:.1f}" height="{max(bottom - top, 0.0):.1f}" '
                f'fill="{colour}"><title>{html.escape(category)}: {html.escape(s.label)} {s.y[i]:.4g}</title></rect>'
            )
            base += s.y[i]
        label_x = x + width / 2
        label_y = HEIGHT - MARGIN_BOTTOM + 12
        parts.append(
            f'<text transform="translate({label_x:.1f} {label_y}) rotate(35)" class="category">'
            f"{html.escape(category[:CATEGORY_LABEL_CHARS])}</text>"
        )
    _legend([s.label for s in fig.series], parts)


def _timeline_svg(fig: Figure, parts: list[str]) -> None:
    if not fig.spans:
        raise ValueError(f"figure {fig.ident}: no spans to draw")
    low = min(0.0, *(span.start for span in fig.spans))
    high = max(span.end for span in fig.spans)
    x_axis = _Axis(low, high * 1.02 if high > low else low + 1.0, False, MARGIN_LEFT, WIDTH - MARGIN_RIGHT)
    top, bottom = MARGIN_TOP, HEIGHT - MARGIN_BOTTOM
    lanes = max(len(fig.categories), 1)
    lane_px = (bottom - top) / lanes
    y_axis = _Axis(0.0, float(lanes), False, bottom, top)
    _frame(
        dataclasses.replace(fig, y_ticks=tuple((float(i), "") for i in range(lanes + 1)), y_label=""),
        x_axis,
        y_axis,
        parts,
    )
    for i, lane in enumerate(fig.categories):
        y = top + lane_px * (i + 0.5) + 4
        parts.append(f'<text x="{MARGIN_LEFT - 6}" y="{y:.1f}" text-anchor="end">{html.escape(lane[:14])}</text>')
    for span in fig.spans:
        x0, x1 = x_axis(span.start), x_axis(span.end)
        y = top + lane_px * span.lane + lane_px * 0.2
        colour = COLOURS[span.colour % len(COLOURS)]
        parts.append(
            f'<rect x="{x0:.2f}" y="{y:.1f}" width="{max(x1 - x0, 1.5):.2f}" height="{lane_px * 0.6:.1f}" '
            f'fill="{colour}"><title>{html.escape(span.label)}</title></rect>'
        )


def svg(fig: Figure) -> str:
    """The figure as an inline ``<svg>`` element."""
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'role="img" aria-label="{html.escape(fig.title)}">'
    ]
    if fig.kind == "line":
        _line_svg(fig, parts)
    elif fig.kind == "bars":
        _bars_svg(fig, parts)
    elif fig.kind == "timeline":
        _timeline_svg(fig, parts)
    else:
        raise ValueError(f"figure {fig.ident}: unknown kind {fig.kind!r}")
    parts.append("</svg>")
    return "".join(parts)


def write_pngs(figures: Sequence[Figure], directory: str | Path) -> list[Path]:
    """Each figure as ``DIRECTORY/<ident>.png`` (needs matplotlib: pip install 'allreduce[plot]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--png needs matplotlib (pip install 'allreduce[plot]')") from None
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for fig in figures:
        figure, axes = plt.subplots(figsize=(8, 3.6))
        if fig.kind == "line":
            for i, s in enumerate(fig.series):
                axes.plot(s.x, s.y, marker="o", label=s.label, color=COLOURS[i % len(COLOURS)])
            axes.set_xscale("log" if fig.log_x else "linear")
            axes.set_yscale("log" if fig.log_y else "linear")
            if fig.y_ticks:
                axes.set_yticks([t for t, _ in fig.y_ticks], [label for _, label in fig.y_ticks])
        elif fig.kind == "timeline":
            lanes = len(fig.categories)
            for span in fig.spans:
                axes.broken_barh(
                    [(span.start, span.end - span.start)],
                    (lanes - span.lane - 0.8, 0.6),
                    color=COLOURS[span.colour % len(COLOURS)],
                )
            axes.set_yticks([lanes - i - 0.5 for i in range(lanes)], list(fig.categories))
        else:
            bottom = [0.0] * len(fig.categories)
            for i, s in enumerate(fig.series):
                axes.bar(fig.categories, s.y, bottom=bottom, label=s.label, color=COLOURS[i % len(COLOURS)])
                bottom = [b + y for b, y in zip(bottom, s.y, strict=True)]
            axes.tick_params(axis="x", labelrotation=20)
        axes.set_xlabel(fig.x_label)
        axes.set_ylabel(fig.y_label)
        axes.set_title(fig.title)
        if fig.series:
            # beside the axes, not loc="best": its search over the data is timed, and matplotlib warns when it takes
            # over a second (a loaded CI run's warning, an error under the suite's filterwarnings)
            axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        figure.tight_layout()
        path = out / f"{fig.ident}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------------------------
# Figures of result documents
# ------------------------------------------------------------------------------------------------------------
def _measured_series(bench: Sequence[dict[str, Any]]) -> list[Series]:
    """One series per (transport, algorithm, world size) of measured ``allreduce bench --json`` rows."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for row in bench:
        key = f"{row.get('transport', '?')} {row.get('algorithm', '?')} x{row.get('world_size', '?')} (measured)"
        groups.setdefault(key, []).append((float(row["size_bytes"]), float(row["busbw_Bps"]) / 1e9))
    series = []
    for key, unsorted in sorted(groups.items()):
        points = sorted(p for p in unsorted if p[0] > 0)
        if points:
            series.append(Series(key, tuple(p[0] for p in points), tuple(p[1] for p in points)))
    return series


def _busbw_figure(ident: str, predicted: Sequence[Series], measured: Sequence[Series], what: str) -> Figure:
    return Figure(
        ident,
        "Bus bandwidth versus message size",
        f"{what} (nccl-tests definition of busbw). Small messages are latency-bound; the plateau is what the fabric "
        "gives large buckets, so a bucket cap left of the knee wastes bandwidth. Measured rows, when given, show "
        "how far a real run is from the prediction.",
        "line",
        (*predicted, *measured),
        "bytes per rank",
        "busbw GB/s",
        log_x=True,
    )


def _links_figure(ident: str, title: str, caption: str, links: Sequence[dict[str, Any]]) -> Figure:
    """A bar per link: its utilization in percent."""
    return Figure(
        ident,
        title,
        caption,
        "bars",
        (Series("utilization %", (), tuple(100.0 * link["utilization"] for link in links)),),
        "",
        "utilization %",
        categories=tuple(link["link"] for link in links),
    )


def _goodput_figure(ident: str, rows: Sequence[dict[str, Any]]) -> Figure:
    gpus = tuple(float(r["gpus"]) for r in rows)
    first = rows[0]["goodput"]
    return Figure(
        ident,
        "Goodput versus GPUs",
        "The share of wall time that trains when failures, checkpoints and restarts count (restarting from the last "
        "checkpoint, at Daly's interval), beside the scaling efficiency without and with failures. A job stops at "
        "any failure of any part it uses, so goodput falls as the parts multiply; the policy table above says what "
        "spares or shrinking would buy back at the plan's own size.",
        "line",
        (
            Series("goodput", gpus, tuple(100.0 * r["goodput"] for r in rows)),
            Series("efficiency", gpus, tuple(100.0 * r["efficiency"] for r in rows)),
            Series(
                "efficiency with failures",
                gpus,
                tuple(100.0 * r["efficiency"] * r["goodput"] / first if first else math.nan for r in rows),
            ),
        ),
        "GPUs",
        "percent",
        log_x=True,
    )


# A timeline draws at most this many all-reduce spans; beyond, spans that follow each other within a thousandth of
# the step are drawn as one (a 25 MiB-bucket plan of a 70B model has thousands, a few pixels wide together).
TIMELINE_SPANS = 400


def _timeline_figure(ident: str, timeline: dict[str, Any], measured: dict[str, Any]) -> Figure:
    ms = 1e3
    buckets = timeline["buckets"]
    lanes = ("forward", "backward", "bucket ready", "all-reduce")
    spans = [
        Span(0, timeline["forward_start_s"] * ms, timeline["backward_start_s"] * ms, "forward", 0),
        Span(1, timeline["backward_start_s"] * ms, timeline["compute_end_s"] * ms, "backward", 2),
    ]
    spans += [
        Span(2, b["ready_s"] * ms, b["ready_s"] * ms, f"bucket {k} ({b['size_bytes']} bytes) ready", 3)
        for k, b in enumerate(buckets)
    ]
    runs = [(b["start_s"], b["end_s"], k, k) for k, b in enumerate(buckets)]  # start, end, first and last bucket
    if len(runs) > TIMELINE_SPANS:
        gap = 1e-3 * max(b["end_s"] for b in buckets)
        merged = runs[:1]
        for start, end, k, _ in runs[1:]:
            if start - merged[-1][1] <= gap:
                merged[-1] = (merged[-1][0], end, merged[-1][2], k)
            else:
                merged.append((start, end, k, k))
        runs = merged
    spans += [
        Span(
            3,
            start * ms,
            end * ms,
            f"bucket {a} all-reduce" if a == b else f"buckets {a}-{b} all-reduce",
            1 + 4 * (i % 2),
        )
        for i, (start, end, a, b) in enumerate(runs)
    ]
    source = measured.get("source", "the measured ready times")
    return Figure(
        ident,
        "One step: backward and each bucket's all-reduce",
        f"The last micro-batch of one step on the slowest GPU, from {source}: forward, backward, the moment each "
        "DDP bucket's last gradient is ready, and the bucket's all-reduce on the one communication stream. An "
        "all-reduce that starts later than its bucket is ready waits for the one before it; whatever runs past the "
        "end of backward is the step's exposed communication.",
        "timeline",
        (),
        "milliseconds from the step's start",
        "",
        categories=lanes,
        spans=tuple(spans),
    )


def _plan_figures(doc: dict[str, Any], prefix: str, bench: Sequence[dict[str, Any]] = ()) -> list[Figure]:
    figures: list[Figure] = []
    base = doc["base"]
    scaling = doc.get("scaling") or []
    if scaling:
        gpus = tuple(float(r["gpus"]) for r in scaling)
        figures.append(
            Figure(
                f"{prefix}scaling",
                "Step time versus GPUs",
                "Step time (and its exposed all-reduce) as data parallelism doubles at the same per-GPU batch. "
                "A flat step line is perfect weak scaling; the gap between the lines is compute, which stays "
                "constant, so any rise is communication the backward pass could not hide.",
                "line",
                (
                    Series("step", gpus, tuple(r["step_s"] * 1e3 for r in scaling)),
                    Series("exposed all-reduce", gpus, tuple(r["exposed_comm_s"] * 1e3 for r in scaling)),
                    Series("all-reduce in all", gpus, tuple(r["comm_s"] * 1e3 for r in scaling)),
                ),
                "GPUs",
                "milliseconds",
                log_x=True,
            )
        )
    goodput_rows = [r for r in scaling if "goodput" in r]
    if goodput_rows:
        figures.append(_goodput_figure(f"{prefix}goodput", goodput_rows))
    if "timeline" in doc:
        figures.append(_timeline_figure(f"{prefix}timeline", doc["timeline"], doc.get("measured", {})))
    # Random rows (packet loss: a p50 and a p99) are left to the table: a timeout-bound step can be 100x the base,
    # which would flatten every other bar.
    rows = [("base", base)] + [
        (w["change"], w)
        for w in doc.get("what_ifs", [])
        if "step_s" in w and "p99_step_s" not in w and "goodput" not in w  # a policy's row has the base's step
    ]
    figures.append(
        Figure(
            f"{prefix}breakdown",
            "Step-time breakdown: base and what-ifs",
            "Each bar is one step split into compute, waiting for the slowest GPU, and exposed all-reduce. "
            "Compare a bar's top segment with the base's to see which change buys back communication. "
            "The packet-loss rows are random (p50 and p99) and stay in the table above.",
            "bars",
            (
                Series("compute", (), tuple(r["compute_s"] * 1e3 for _, r in rows)),
                Series("waiting", (), tuple(r["waiting_s"] * 1e3 for _, r in rows)),
                Series("exposed all-reduce", (), tuple(r["exposed_comm_s"] * 1e3 for _, r in rows)),
            ),
            "",
            "milliseconds",
            categories=tuple(name for name, _ in rows),
        )
    )
    curve = doc.get("busbw_curve") or []
    if curve:
        algorithm = curve[0]["algorithm"]
        predicted = Series(
            f"{algorithm} (predicted)",
            tuple(float(p["size_bytes"]) for p in curve),
            tuple(p["busbw_GBps"] for p in curve),
        )
        what = f"Predicted busbw of {algorithm} on {base['gpus']} GPUs"
        figures.append(_busbw_figure(f"{prefix}busbw", [predicted], _measured_series(bench), what))
    links = doc.get("links") or []
    if links:
        of = doc.get("links_of", {})
        figures.append(
            _links_figure(
                f"{prefix}links",
                "Busiest links in the bottleneck region",
                f"Utilization of the busiest links during the all-reduce of one {of.get('size_bytes', '?')}-byte "
                f"bucket ({of.get('algorithm', '?')}). Links near 100% set the pace; many links at one level "
                "means the fabric's capacity, one outlier means a hot spot.",
                links,
            )
        )
    return figures


def _sweep_figures(doc: dict[str, Any], prefix: str) -> list[Figure]:
    rows = [r for r in doc["rows"] if not r.get("error") and "" not in (r.get("step_s", ""), r.get("gpus", ""))]
    groups: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        key = f"{r.get('topology', '?')} {r.get('algorithm', '?')}"
        groups.setdefault(key, []).append((float(r["gpus"]), float(r["step_s"]) * 1e3))
    series = []
    for key, points in sorted(groups.items()):
        by_gpus: dict[float, float] = {}
        for g, s in points:
            by_gpus[g] = min(s, by_gpus.get(g, math.inf))
        xs = tuple(sorted(by_gpus))
        series.append(Series(key, xs, tuple(by_gpus[x] for x in xs)))
    if not series:
        return []
    return [
        Figure(
            f"{prefix}sweep",
            "Sweep: step time versus GPUs per topology and algorithm",
            "One line per topology and algorithm (the best case at each GPU count). Lines that rise earlier "
            "scale worse; where lines cross, the better choice changes with scale.",
            "line",
            tuple(series),
            "GPUs",
            "step milliseconds",
            log_x=True,
        )
    ]


def _sim_figures(doc: dict[str, Any], prefix: str) -> list[Figure]:
    algorithms = doc["algorithms"]
    figures = [
        Figure(
            f"{prefix}sim",
            f"All-reduce of {doc['size_bytes']} B on {doc['ranks']} ranks",
            "Simulated time per algorithm on this topology; the shortest bar is the one to use at this size.",
            "bars",
            (Series("time ms", (), tuple(a["seconds"] * 1e3 for a in algorithms)),),
            "",
            "milliseconds",
            categories=tuple(a["name"] for a in algorithms),
        )
    ]
    links = doc.get("bottlenecks") or []
    if links:
        figures.append(
            _links_figure(
                f"{prefix}simlinks",
                f"Links {doc['best']} waited on",
                "Utilization of the links on the critical path of the fastest algorithm.",
                links,
            )
        )
    return figures


# The tail CDF's vertical axis: a quantile p sits at -log10(1 - p) ("nines"), so p50, p90, p99 and p99.9 are
# evenly spaced and the tail gets as much room as the body.
TAIL_QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p99.9", 0.999))


def _nines(p: float) -> float:
    return -math.log10(1.0 - p)


def tail_cdf_points(algorithm: dict[str, Any], samples: int) -> list[tuple[str, float, float]]:
    """(label, seconds, height) of the tail CDF of one algorithm of ``allreduce tail --json``: the noise-free time
    at 0, each reported quantile that ``samples`` resolve (at least one sample beyond it) at its nines, the
    largest sample one step above the last."""
    step = algorithm["step_s"]
    points = [("noise-free", float(algorithm["noise_free_s"]), 0.0)]
    for label, p in TAIL_QUANTILES:
        if (1.0 - p) * samples >= 1.0:
            points.append((label, float(step[label]), _nines(p)))
    points.append(("max", float(step["max"]), points[-1][2] + 1.0))
    return points


def _tail_figures(doc: dict[str, Any], prefix: str) -> list[Figure]:
    algorithms = doc["algorithms"]
    if not algorithms:
        return []
    samples = int(doc["samples"])
    curves = [(a["name"], tail_cdf_points(a, samples)) for a in algorithms]
    ticks = {height: label for _, points in curves for label, _, height in points}
    times = [s for _, points in curves for _, s, _ in points if s > 0]
    log_x = bool(times) and max(times) > 20 * min(times)
    return [
        Figure(
            f"{prefix}tail",
            f"Tail of the step time over {samples} samples",
            "The step time's cumulative distribution per algorithm, from the noise-free run (0%) through p50, p90, "
            "p99 and p99.9 to the slowest sample; the vertical axis is spaced in nines so the tail is as wide as "
            "the body. A line that bends right early means noise reaches the median (every step pays); one that "
            "bends only near the top means rare stalls (a timeout) that a barrier passes on to every rank.",
            "line",
            tuple(
                Series(name, tuple(s * 1e3 for _, s, _ in points), tuple(h for _, _, h in points))
                for name, points in curves
            ),
            "step milliseconds (arrival + all-reduce)",
            "samples at or below",
            log_x=log_x,
            y_ticks=tuple((h, "0%" if label == "noise-free" else label) for h, label in sorted(ticks.items())),
        )
    ]


def _is_tail(doc: dict[str, Any]) -> bool:
    algorithms = doc.get("algorithms")
    return (
        "samples" in doc
        and isinstance(algorithms, list)
        and all(isinstance(a, dict) and isinstance(a.get("step_s"), dict) for a in algorithms)
    )


def document_kind(doc: dict[str, Any]) -> str:
    if doc.get("kind") in ("plan", "sweep", "bench"):
        return str(doc["kind"])
    if "algorithms" in doc and "ranks" in doc:
        return "tail" if _is_tail(doc) else "sim"
    raise ValueError(
        "not a plan, sweep, sim, tail or bench result (expected the output of plan --json, sweep, sim --json, "
        "tail --json or bench --json)"
    )


def figures_of(documents: Sequence[dict[str, Any]]) -> list[Figure]:
    """The figures of ``documents``; measured bench rows are drawn beside every plan's predicted busbw."""
    bench = [row for doc in documents if document_kind(doc) == "bench" for row in doc["rows"]]
    has_plan = any(document_kind(doc) == "plan" for doc in documents)
    figures: list[Figure] = []
    for i, doc in enumerate(documents):
        prefix = f"d{i}-"
        kind = document_kind(doc)
        if kind == "plan":
            figures += _plan_figures(doc, prefix, bench)
        elif kind == "sweep":
            figures += _sweep_figures(doc, prefix)
        elif kind == "tail":
            figures += _tail_figures(doc, prefix)
        elif kind == "bench":
            if not has_plan:
                figures.append(_busbw_figure(f"{prefix}bench", [], _measured_series(doc["rows"]), "Measured busbw"))
        else:
            figures += _sim_figures(doc, prefix)
    return figures
