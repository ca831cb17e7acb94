"""Render the report: load the results, build every section that has data, fill the Jinja2
template (autoescape on), embed Plotly's JavaScript once, write the page atomically."""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader
from markupsafe import Markup

from harness.core.results import SCHEMA_VERSION, atomic_write_text
from reports.blocks import Block, Figure, KeyValues, Note, Pre, Table
from reports.data import ReportData, load_report_data
from reports.sections.registry import load_sections

TEMPLATES = Path(__file__).resolve().parent / "templates"
PLOTLY_CONFIG = {"displaylogo": False, "responsive": True,
                 "modeBarButtonsToRemove": ["sendDataToCloud", "select2d", "lasso2d"]}


@dataclass
class RenderedSection:
    id: str
    title: str
    intro: str
    blocks: list[Block]


def _environment() -> Environment:
    env = Environment(loader=FileSystemLoader(str(TEMPLATES)), autoescape=True,
                      trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.tests["table"] = lambda b: isinstance(b, Table)
    env.tests["figure"] = lambda b: isinstance(b, Figure)
    env.tests["note"] = lambda b: isinstance(b, Note)
    env.tests["pre"] = lambda b: isinstance(b, Pre)
    env.tests["keyvalues"] = lambda b: isinstance(b, KeyValues)
    env.filters["figure_json"] = figure_json
    env.filters["data_value"] = data_value
    return env


def data_value(v: Any) -> str:
    """A number for a data-value attribute: exact (Python's shortest round-trip repr)."""
    if isinstance(v, numbers.Integral):
        return str(int(v))
    return repr(float(v))


def figure_json(fig: Any) -> Markup:
    """A figure's JSON for a <script type="application/json"> element. Plotly's serializer
    writes '<', '>' and '/' as \\u escapes; '&' is escaped here too, so no string in the data
    can close the element or be read as markup."""
    text = fig.to_json(validate=False, pretty=False)
    for ch, code in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                     ("\u2029", "\\u2029")):
        text = text.replace(ch, code)
    return Markup(text)  # noqa: S704 - every markup character is escaped above


def build_sections(data: ReportData) -> list[RenderedSection]:
    out = []
    for s in load_sections():
        blocks = s.build(data)
        if blocks:
            out.append(RenderedSection(s.id, s.title, s.intro, blocks))
    return out


def _title(data: ReportData) -> str:
    workloads = ", ".join(dict.fromkeys(str(w) for w in data.rows["workload"] if w)) or "results"
    models = ", ".join(dict.fromkeys(str(m) for m in data.rows["model"].dropna())) or "?"
    engines = " vs ".join(data.engines())
    return f"infer-bench: {workloads} on {models} — {engines}"


def render_report(data: ReportData, title: str | None = None) -> str:
    sections = build_sections(data)
    has_figures = any(isinstance(b, Figure) for s in sections for b in s.blocks)
    plotly_js = ""
    if has_figures:
        from plotly.offline import get_plotlyjs
        plotly_js = Markup(get_plotlyjs().replace("</script", "<\\/script"))  # noqa: S704 - the library's own code
    template = _environment().get_template("report.html.j2")
    return template.render(
        title=title or _title(data), sections=sections, plotly_js=plotly_js,
        plotly_config=Markup(json.dumps(PLOTLY_CONFIG)),  # noqa: S704 - a constant
        generated=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        schema_version=SCHEMA_VERSION, colours=data.colours,
    )


def write_report(paths: list[Path | str], out: Path | str, baseline: list[Path | str] | None = None,
                 *, threshold: float = 0.05) -> Path:
    """Render the report of the given results files / run directories (and an optional
    baseline, compared with `threshold` as infer-bench-compare does) to `out`, atomically.
    Returns the path written. Raises ReportInputError (a UserError) on input it cannot use."""
    data = load_report_data(list(paths), list(baseline) if baseline else None, threshold)
    out = Path(out)
    atomic_write_text(out, render_report(data))
    return out
