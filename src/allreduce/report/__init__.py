"""Reports of results: one self-contained HTML page with inline SVG figures, or the figures as PNG files.

Reads results (``plan --json``, a sweep's CSV, ``sim --json``); runs nothing.
"""

from allreduce.report._figures import Figure, Series, document_kind, figures_of, svg, write_pngs
from allreduce.report._files import read_at_most
from allreduce.report._html import MAX_JSON_BYTES, load_documents, render_report, write_report

__all__ = [
    "MAX_JSON_BYTES",
    "Figure",
    "Series",
    "document_kind",
    "figures_of",
    "load_documents",
    "read_at_most",
    "render_report",
    "svg",
    "write_pngs",
    "write_report",
]
