"""The report page: one self-contained HTML file (inline CSS and SVG, no script, nothing fetched).

Every number in a table carries its exact value in ``data-value`` (``repr`` of the float) under a ``data-key``
path into the result document, so a reader (or a test) can check the page against the result it came from.
"""

from __future__ import annotations

import csv
import html
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from allreduce.report._figures import TAIL_QUANTILES, Figure, document_kind, figures_of, svg
from allreduce.report._files import read_at_most
from allreduce.report._schema import MAX_SWEEP_ROWS, SWEEP_COLUMNS, check_document
from allreduce.units import format_bytes, format_seconds

__all__ = ["MAX_JSON_BYTES", "load_documents", "render_report", "write_report"]

MAX_JSON_BYTES = 64 << 20
"""The largest JSON result a report reads (it is parsed whole): a plan's is about 11 KB, a bench's a few KB."""

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1000px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0 16px; }
td, th { padding: 3px 10px; border-bottom: 1px solid #eee; text-align: right; }
td:first-child, th:first-child { text-align: left; }
figure { margin: 16px 0 28px; } figcaption { color: #444; max-width: 760px; }
figcaption b { color: #000; }
svg text { font: 11px system-ui, sans-serif; fill: #333; }
svg .plot { fill: #fff; stroke: #999; } svg .grid { stroke: #eee; }
.bottleneck { background: #fff6e0; padding: 8px 12px; border-left: 4px solid #E69F00; }
"""


def _text(value: object) -> str:
    """Any value as page text, escaped (quotes too: the same text may go into an attribute)."""
    return html.escape(str(value), quote=True)


def _cell(key: str, value: float, text: str) -> str:
    return f'<td data-key="{html.escape(key)}" data-value="{html.escape(repr(value))}">{html.escape(text)}</td>'


def _time_and_busbw(key: str, row: dict[str, Any], time_key: str, busbw_key: str, per_GBps: float) -> str:
    """The cells of one all-reduce's time and its busbw (``row[busbw_key]`` in units of ``per_GBps`` GB/s)."""
    busbw = row[busbw_key]
    return _cell(f"{key}.{time_key}", row[time_key], format_seconds(row[time_key])) + _cell(
        f"{key}.{busbw_key}", busbw, f"{busbw / per_GBps:.3g} GB/s"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _plan_section(doc: dict[str, Any], index: int) -> list[str]:
    base = doc["base"]
    out = [
        f"<h2>Plan: {_text(base['model'])} on {_text(base['gpus'])} GPUs of {_text(base['topology'])}</h2>",
        f'<p class="bottleneck"><b>Bottleneck:</b> {html.escape(doc["bottleneck"])}</p>',
        "<table><tr><th>step</th><th>compute</th><th>waiting</th><th>exposed all-reduce</th>"
        "<th>all-reduce in all</th><th>buckets</th></tr><tr>",
    ]
    out += [
        _cell(f"{index}.base.{key}", base[key], format_seconds(base[key]))
        for key in ("step_s", "compute_s", "waiting_s", "exposed_comm_s", "comm_s")
    ]
    out.append(_cell(f"{index}.base.buckets", base["buckets"], str(base["buckets"])) + "</tr></table>")
    if "p99_step_s" in base:
        out.append(
            "<table><tr><th>with compute drawn from "
            f"{html.escape(str(base.get('compute_distribution')))}</th><th>p50 step</th><th>p99 step</th></tr>"
            f"<tr><td>{html.escape(base['method'])}</td>"
            + _cell(f"{index}.base.p50_step_s", base["p50_step_s"], format_seconds(base["p50_step_s"]))
            + _cell(f"{index}.base.p99_step_s", base["p99_step_s"], format_seconds(base["p99_step_s"]))
            + "</tr></table>"
        )
    out.append("<table><tr><th>bucket size</th><th>count</th><th>algorithm</th><th>all-reduce</th><th>busbw</th></tr>")
    for i, size in enumerate(base["sizes"]):
        out.append(
            f"<tr><td>{html.escape(format_bytes(size['size_bytes']))}</td><td>{_text(size['count'])}</td>"
            f"<td>{html.escape(size['algorithm'])}</td>"
            + _time_and_busbw(f"{index}.base.sizes.{i}", size, "seconds", "busbw_GBps", 1.0)
            + "</tr>"
        )
    out.append("</table>")
    if doc.get("scaling"):
        spread = any("p99_step_s" in row for row in doc["scaling"])
        failing = any("goodput" in row for row in doc["scaling"])
        out.append(
            "<h3>Scaling (same per-GPU batch)</h3><table><tr><th>GPUs</th><th>step</th>"
            "<th>exposed all-reduce</th><th>efficiency</th>"
            + ("<th>goodput</th>" if failing else "")
            + ("<th>p50 step</th><th>p99 step</th>" if spread else "")
            + "<th>algorithm</th></tr>"
        )
        for i, row in enumerate(doc["scaling"]):
            quantiles = (
                "".join(
                    _cell(f"{index}.scaling.{i}.{key}", row[key], _ms(row[key])) for key in ("p50_step_s", "p99_step_s")
                )
                if "p99_step_s" in row
                else ("<td></td><td></td>" if spread else "")
            )
            out.append(
                f"<tr><td>{_text(row['gpus'])}</td>"
                + _cell(f"{index}.scaling.{i}.step_s", row["step_s"], _ms(row["step_s"]))
                + _cell(f"{index}.scaling.{i}.exposed_comm_s", row["exposed_comm_s"], _ms(row["exposed_comm_s"]))
                + _cell(f"{index}.scaling.{i}.efficiency", row["efficiency"], f"{row['efficiency']:.1%}")
                + (_percent_cell(f"{index}.scaling.{i}.goodput", row.get("goodput")) if failing else "")
                + quantiles
                + f"<td>{html.escape(row['algorithm'])}</td></tr>"
            )
        out.append("</table>")
    if doc.get("what_ifs"):
        out += _what_if_table(doc["what_ifs"], base["step_s"], index)
    if "goodput" in doc:
        out += _goodput_table(doc["goodput"], base["step_s"], f"{index}.goodput")
    if "measured" in doc:
        out.append(_measured_paragraph(doc["measured"]))
    out.extend(f"<p><i>Note: {html.escape(n)}</i></p>" for n in doc.get("notes", []))
    return out


def _optional_cell(key: str, row: dict[str, Any], field: str, show: Callable[[float], str]) -> str:
    """The cell of ``row[field]`` (keyed ``key.field``), or an empty one where the row has no such field."""
    return _cell(f"{key}.{field}", row[field], show(row[field])) if field in row else "<td></td>"


def _percent_cell(key: str, value: float | None) -> str:
    return "<td></td>" if value is None else _cell(key, value, f"{value:.1%}")


def _what_if_table(what_ifs: list[dict[str, Any]], base_step_s: float, index: int) -> list[str]:
    """One change per row; a recovery policy's row (failures counted) gives its step per useful step, and its
    "vs base" compares that with the first such row's (restarting from checkpoints)."""
    policies = [w for w in what_ifs if "goodput" in w and w["goodput"] > 0]
    base_effective = policies[0]["effective_step_s"] if policies else None
    out = [
        "<h3>What if (one change each)</h3><table><tr><th>change</th><th>step</th>"
        "<th>vs base</th><th>exposed all-reduce</th><th>p99 step</th>"
        + ("<th>per useful step (failures)</th>" if policies else "")
        + "</tr>"
    ]
    for i, w in enumerate(what_ifs):
        if "step_s" not in w:
            out.append(f"<tr><td>{_text(w['change'])}</td><td colspan=3>n/a: {_text(w.get('note', ''))}</td></tr>")
            continue
        effective = w.get("effective_step_s")
        if "goodput" in w and base_effective:
            delta = effective / base_effective - 1 if effective is not None else math.inf
        else:
            delta = w["step_s"] / base_step_s - 1 if base_step_s else 0.0
        out.append(
            f"<tr><td>{html.escape(w['change'])}</td>"
            + _cell(f"{index}.what_ifs.{i}.step_s", w["step_s"], _ms(w["step_s"]))
            + f"<td>{delta:+.1%}</td>"
            + _cell(f"{index}.what_ifs.{i}.exposed_comm_s", w["exposed_comm_s"], _ms(w["exposed_comm_s"]))
            + _optional_cell(f"{index}.what_ifs.{i}", w, "p99_step_s", _ms)
            + (
                ""
                if not policies
                else _cell(f"{index}.what_ifs.{i}.effective_step_s", effective, _ms(effective))
                if effective is not None
                else "<td></td>"
            )
            + "</tr>"
        )
    out.append("</table>")
    return out


# How the page names each recovery policy of a plan's goodput table.
POLICY_NAMES = {
    "restart": "restart from the last checkpoint",
    "spares": "the same, with hot spare hosts",
    "elastic": "shrink and continue",
}


def _hours(seconds: float) -> str:
    if math.isnan(seconds):  # a null in the result: nothing can fail
        return "never"
    return format_seconds(seconds) if seconds < 3600 else f"{seconds / 3600:.3g} h"


def _goodput_table(goodput: dict[str, Any], step_s: float, key: str) -> list[str]:
    counts = goodput.get("counts", {})
    parts = ", ".join(f"{n:,} {kind}" for kind, n in counts.items() if n and kind != "software")
    assumed = ", ".join(a.removesuffix("_s").replace("_", " ") for a in goodput.get("assumed", []))
    out = [
        f"<h3>Failures and goodput on {_text(goodput['gpus'])} GPUs</h3>",
        f"<p>A failure every <b>{html.escape(_hours(goodput['mtbf_s']))}</b>"
        + (f" ({html.escape(parts)})" if parts else "")
        + f"; rates: {_text(goodput['rates_source'])}. Checkpoint written in "
        f"{html.escape(format_seconds(goodput['checkpoint_write_s']))}, restart "
        f"{html.escape(format_seconds(goodput['restart_s']))}"
        + (f"; assumed, not from a study: {html.escape(assumed)}" if assumed else "")
        + ".</p>",
        "<table><tr><th>recovery policy</th><th>goodput</th><th>effective step</th><th>checkpoint every</th>"
        "<th>pause per failure</th><th>work lost per failure</th></tr>",
    ]
    for i, row in enumerate(goodput["policies"]):
        effective = step_s / row["goodput"] if row["goodput"] > 0 else math.inf
        interval = row.get("interval_s")
        out.append(
            f"<tr><td>{_text(POLICY_NAMES.get(row['policy'], row['policy']))}</td>"
            + _percent_cell(f"{key}.policies.{i}.goodput", row["goodput"])
            + f"<td>{html.escape(format_seconds(effective))}</td>"
            + f"<td>{'-' if interval is None or math.isnan(interval) else html.escape(format_seconds(interval))}</td>"
            + _cell(f"{key}.policies.{i}.restart_s", row["restart_s"], _hours(row["restart_s"]))
            + _optional_cell(f"{key}.policies.{i}", row, "lost_work_s", _hours)
            + "</tr>"
        )
    out.append("</table>")
    if "elastic_recovery" in goodput:
        out.append(_recovery_paragraph(goodput["elastic_recovery"], f"{key}.elastic_recovery"))
    return out


def _recovery_paragraph(recovery: dict[str, Any], key: str) -> str:
    """Shrink-and-continue's pause per failure: how long, and whether it was measured (here, or by the runtime's
    kill benchmark) and modelled at the job's size, or given."""
    basis = recovery["basis"]
    pause = (
        f'<span data-key="{html.escape(key)}.seconds" data-value="{html.escape(repr(recovery["seconds"]))}">'
        f"{html.escape(_hours(recovery['seconds']))}</span>"
    )
    tag = f'<i data-key="{html.escape(key)}.basis">{_text(basis)}</i>'
    out = f"<p><b>Shrink and continue</b> pauses {pause} a failure, "
    if basis == "given":
        return out + f"{tag} ({_text(recovery['source'])}).</p>"
    out += f"the mean over failure kinds ({tag}), modelled from {_text(recovery['source'])}"
    if all(k in recovery for k in ("ranks", "exit_s", "silent_s", "store_s", "silent_share", "timeout_s")):
        out += (
            f". At {recovery['ranks']:,} ranks the agreement's store requests add "
            f"{html.escape(_hours(recovery['store_s']))}; a process exit (GPU, software) costs "
            f"{html.escape(_hours(recovery['exit_s']))}; a host, NIC, cable or switch failure "
            f"({recovery['silent_share']:.0%} of them) is silent, {_silent_found(recovery)}: "
            f"{html.escape(_hours(recovery['silent_s']))}"
        )
    return out + ".</p>"


def _silent_found(recovery: dict[str, Any]) -> str:
    """How the survivors find a silent rank: the store's lease (the heartbeat on, and sooner than two timeouts),
    else two timeouts."""
    lease, detect, timeout = recovery.get("lease_s", 0.0), recovery.get("detect_s", 0.0), recovery["timeout_s"]
    if lease > 0 and detect < 2 * timeout:
        return (
            f"dead to the store after its {html.escape(format_seconds(lease))} lease (no heartbeat), found in "
            f"{html.escape(format_seconds(detect))} on average"
        )
    return f"found after two {html.escape(format_seconds(timeout))} timeouts"


def _measured_paragraph(measured: dict[str, Any]) -> str:
    flops = measured.get("flops")
    return (
        f"<p><b>Backward timing</b> from {_text(measured['source'])}: forward "
        f"{html.escape(format_seconds(measured['forward_s']))}, backward "
        f"{html.escape(format_seconds(measured['backward_s']))}, optimizer "
        f"{html.escape(format_seconds(measured['optimizer_s']))}; {_text(measured['tensors'])} gradient tensors, "
        f"{_text(measured['params'])} parameters"
        + (f", {flops / 1e9:.4g} GFLOP per micro-batch" if flops is not None else "")
        + ". Each bucket is ready when its last gradient is (the timeline below).</p>"
    )


def _sweep_section(doc: dict[str, Any], index: int) -> list[str]:
    rows = doc["rows"]
    failed = [r for r in rows if r.get("error")]
    out = [f"<h2>Sweep: {len(rows)} cases, {len(failed)} failed</h2>"]
    if failed:
        out.append("<table><tr><th>case</th><th>error</th></tr>")
        out += [
            f"<tr><td>{html.escape(str(r.get('case_id', '?')))}</td><td>{html.escape(str(r['error']))}</td></tr>"
            for r in failed[:50]
        ]
        out.append("</table>")
    return out


def _sim_section(doc: dict[str, Any], index: int) -> list[str]:
    out = [
        f"<h2>Simulation: {_text(doc['ranks'])} ranks, {html.escape(format_bytes(doc['size_bytes']))} on "
        f"{html.escape(doc['topology'])}</h2><table><tr><th>algorithm</th><th>time</th><th>busbw</th></tr>"
    ]
    for i, a in enumerate(doc["algorithms"]):
        out.append(
            f"<tr><td>{html.escape(a['name'])}</td>"
            + _time_and_busbw(f"{index}.algorithms.{i}", a, "seconds", "busbw_GBps", 1.0)
            + "</tr>"
        )
    out.append("</table>")
    return out


def _tail_section(doc: dict[str, Any], index: int) -> list[str]:
    keys = [label for label, _ in TAIL_QUANTILES] + ["max", "mean"]
    out = [
        f"<h2>Tail: {_text(doc['ranks'])} ranks, {html.escape(format_bytes(doc['size_bytes']))} on "
        f"{_text(doc['topology'])}, {_text(doc['samples'])} samples (seed {_text(doc.get('seed', '?'))})</h2>",
        "<table><tr><th>algorithm</th><th>noise-free</th>"
        + "".join(f"<th>{k}</th>" for k in keys)
        + "<th>method</th><th>noise</th></tr>",
    ]
    for i, a in enumerate(doc["algorithms"]):
        step = a["step_s"]
        out.append(
            f"<tr><td>{html.escape(a['name'])}</td>"
            + _cell(f"{index}.algorithms.{i}.noise_free_s", a["noise_free_s"], format_seconds(a["noise_free_s"]))
            + "".join(_cell(f"{index}.algorithms.{i}.step_s.{k}", step[k], format_seconds(step[k])) for k in keys)
            + f"<td>{html.escape(str(a.get('engine', '')))}{'' if a.get('exact', True) else ' ~'}</td>"
            f"<td>{html.escape(str(a.get('noise', '')))}</td></tr>"
        )
    out.append("</table>")
    out.extend(f"<p><i>Note: {html.escape(str(n))}</i></p>" for n in doc.get("skipped", []))
    return out


def _bench_section(doc: dict[str, Any], index: int) -> list[str]:
    out = [
        f"<h2>Measured: {len(doc['rows'])} rows of allreduce bench</h2><table><tr><th>transport</th>"
        "<th>algorithm</th><th>ranks</th><th>size</th><th>time</th><th>busbw</th></tr>"
    ]
    for i, row in enumerate(doc["rows"]):
        out.append(
            f"<tr><td>{html.escape(str(row.get('transport', '?')))}</td>"
            f"<td>{_text(row.get('algorithm', '?'))}</td><td>{_text(row.get('world_size', '?'))}</td>"
            f"<td>{html.escape(format_bytes(row['size_bytes']))}</td>"
            + _time_and_busbw(f"{index}.rows.{i}", row, "time_s", "busbw_Bps", 1e9)
            + "</tr>"
        )
    out.append("</table>")
    return out


def _figure_html(fig: Figure) -> str:
    return (
        f'<figure id="{html.escape(fig.ident)}" class="figure">{svg(fig)}'
        f"<figcaption><b>{html.escape(fig.title)}.</b> {html.escape(fig.caption)}</figcaption></figure>"
    )


def render_report(documents: Sequence[dict[str, Any]], *, title: str = "allreduce report") -> str:
    """The HTML page of ``documents`` (``plan --json`` output, sweep documents, ``sim --json`` output), each
    checked against its schema first (``ValueError`` names the document and the field)."""
    if not documents:
        raise ValueError("nothing to report: give at least one result")
    documents = [checked(doc, f"result {i}") for i, doc in enumerate(documents)]
    figures = figures_of(documents)
    body: list[str] = []
    for i, doc in enumerate(documents):
        kind = document_kind(doc)
        if kind == "plan":
            body += _plan_section(doc, i)
        elif kind == "sweep":
            body += _sweep_section(doc, i)
        elif kind == "bench":
            body += _bench_section(doc, i)
        elif kind == "tail":
            body += _tail_section(doc, i)
        else:
            body += _sim_section(doc, i)
        body += [_figure_html(fig) for fig in figures if fig.ident.startswith(f"d{i}-")]
    page = "\n".join(body)
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>\n{page}\n</body></html>\n"
    )


def write_report(path: str | Path, documents: Sequence[dict[str, Any]], *, title: str = "allreduce report") -> Path:
    out = Path(path)
    out.write_text(render_report(documents, title=title), encoding="utf-8")
    return out


def _number(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            continue
    return text


def checked(doc: Any, where: str) -> dict[str, Any]:
    """``doc`` as the report reads it: its kind told, its fields checked (:func:`check_document`), or
    ``ValueError`` naming ``where`` (a file) and the field."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected the JSON of plan --json, sim --json, tail --json or bench --json")
    try:
        return check_document(doc, document_kind(doc))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _sweep_csv(path: Path) -> dict[str, Any]:
    """A sweep's CSV as a sweep document: its header must have the sweep's columns; read row by row, at most
    :data:`MAX_SWEEP_ROWS` of them."""
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            missing = [c for c in SWEEP_COLUMNS if c not in header]
            if missing:
                raise ValueError(
                    f"{path}: not a sweep's CSV (no column {missing[0]!r}; allreduce sweep writes "
                    f"{', '.join(SWEEP_COLUMNS)}, ...)"
                )
            rows: list[dict[str, Any]] = []
            for row in reader:
                if len(rows) == MAX_SWEEP_ROWS:
                    raise ValueError(
                        f"{path}: more than {MAX_SWEEP_ROWS:,} rows, the most a report reads (it holds them in "
                        "memory); report a part of the sweep"
                    )
                rows.append({k: _number(row[k]) for k in SWEEP_COLUMNS})
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"{path}: cannot read it as CSV ({exc})") from None
    return {"kind": "sweep", "rows": rows}


def load_documents(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Read results: JSON of ``plan --json`` / ``sim --json`` / ``bench --json``, or a sweep's CSV, each checked
    against its schema (``ValueError`` names the file and the field)."""
    documents = []
    for path in map(Path, paths):
        if path.suffix == ".csv":
            documents.append(checked(_sweep_csv(path), str(path)))
            continue
        try:
            data = read_at_most(
                path,
                MAX_JSON_BYTES,
                why="the most a report reads of a JSON result (a plan's with its scaling and what-if tables is "
                "about 11 KB)",
            )
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: cannot read it ({exc})") from None
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        except RecursionError:
            raise ValueError(f"{path}: nested too deeply to be a result") from None
        if isinstance(doc, list) and all(isinstance(r, dict) and {"size_bytes", "busbw_Bps"} <= set(r) for r in doc):
            doc = {"kind": "bench", "rows": doc}
        documents.append(checked(doc, str(path)))
    return documents
