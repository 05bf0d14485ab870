"""The report as one self-explanatory HTML page next to its PNG plots."""

from __future__ import annotations

import datetime
import html
import pathlib
from collections.abc import Mapping, Sequence

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1060px; color: #222; }
h1 { margin-bottom: 0.2rem; }
.subtitle { color: #666; margin-top: 0; }
.cards { display: flex; flex-wrap: wrap; gap: 0.8rem; margin: 1.2rem 0; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 0.6rem 1rem; min-width: 9rem; }
.card .value { font-size: 1.5rem; font-weight: 600; }
.card .label { color: #666; font-size: 0.85rem; }
table { border-collapse: collapse; margin: 0.5rem 0 1.5rem; }
td, th { border: 1px solid #ddd; padding: 0.25rem 0.7rem; text-align: right; }
th { background: #f5f5f5; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5rem 0 1.5rem; }
"""


def format_timestamp(moment: datetime.datetime | None) -> str:
    return "-" if moment is None else moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def format_number(value: float | int | None, unit: str = "") -> str:
    if value is None:
        return "-"
    text = f"{value:,}" if isinstance(value, int) else f"{value:,.1f}"
    return f"{text} {unit}".strip()


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_report_html(
    *,
    title: str,
    subtitle: str,
    cards: Mapping[str, str],
    sections: Sequence[tuple[str, pathlib.Path | None, Sequence[str], Sequence[Sequence[object]]]],
    out_dir: pathlib.Path,
) -> str:
    """`sections` are (heading, plot or None, table headers, table rows); plot
    paths are written relative to `out_dir`, where the page is saved."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1><p class='subtitle'>{html.escape(subtitle)}</p>",
        "<div class='cards'>",
    ]
    for label, value in cards.items():
        parts.append(
            f"<div class='card'><div class='value'>{html.escape(value)}</div>"
            f"<div class='label'>{html.escape(label)}</div></div>"
        )
    parts.append("</div>")
    for heading, plot, headers, rows in sections:
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        if plot is not None:
            relative = plot.relative_to(out_dir).as_posix()
            parts.append(f"<img src='{html.escape(relative)}' alt='{html.escape(heading)}'>")
        if rows:
            parts.append(_table(headers, rows))
    parts.append("</body></html>")
    return "\n".join(parts)
