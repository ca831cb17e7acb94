"""The trend page of a history store (`infer-bench-history report -o trends.html`): one small
chart per series (metric against commit, every run of a commit drawn, its median joined), the
change points drawn as dashed lines between the two commits with their ratio, a table of the
change points newest first, and a machine selector. Self-contained like the run report (same
CSS, Plotly embedded, nothing fetched)."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import plotly.graph_objects as go
from markupsafe import Markup

from harness.core.history import ChangePoint, Series, STORE_SCHEMA_VERSION
from harness.core.results import atomic_write_text
from reports.blocks import Cell, Figure, Table, fmt_short
from reports.figures import base_layout, esc
from reports.render import PLOTLY_CONFIG, _environment

POINT_COLOUR = "#4C78A8"
MEDIAN_COLOUR = "#1f3b5c"
CHANGE_COLOUR = "#d62728"
FAILED_COLOUR = "#999999"


@dataclass
class MachineSection:
    id: str
    desc: str
    figures: list[Figure]


def series_figure(s: Series, changes: list[ChangePoint]) -> Figure:
    commits: list[str] = []
    dates: dict[str, datetime] = {}
    for p in s.points:
        c = p.commit or "?"
        if c not in dates:
            commits.append(c)
            dates[c] = p.commit_date
    failed = [(c, d) for c, d in s.failed_commits if c not in dates]
    for c, d in failed:
        dates[c] = d
    order = sorted(dates, key=lambda c: (dates[c], commits.index(c) if c in commits else -1))
    x_of = {c: i for i, c in enumerate(order)}
    xs = [x_of[p.commit or "?"] for p in s.points]
    ys = [p.value for p in s.points]
    fig = go.Figure()
    fig.add_trace(go.Scatter(
        x=xs, y=ys, mode="markers", name="runs", marker=dict(color=POINT_COLOUR, size=6, opacity=0.7),
        customdata=[[esc((p.commit or "?")[:12]), esc(p.run_id)] for p in s.points],
        hovertemplate="commit %{customdata[0]}<br>run %{customdata[1]}<br>%{y:.4g}<extra></extra>"))
    med_x = sorted({x for x in xs})
    med_y = [statistics.median([y for x, y in zip(xs, ys) if x == mx]) for mx in med_x]
    fig.add_trace(go.Scatter(x=med_x, y=med_y, mode="lines", name="median of the runs",
                             line=dict(color=MEDIAN_COLOUR, width=1.5), hoverinfo="skip"))
    if failed:
        low = min(ys) if ys else 0
        fig.add_trace(go.Scatter(
            x=[x_of[c] for c, _ in failed], y=[low] * len(failed), mode="markers", name="failed",
            marker=dict(color=FAILED_COLOUR, symbol="x", size=9),
            customdata=[esc(c[:12]) for c, _ in failed],
            hovertemplate="commit %{customdata}: failed<extra></extra>"))
    for cp in changes:
        x = (x_of[cp.commit_before] + x_of[cp.commit_after]) / 2
        fig.add_shape(type="line", x0=x, x1=x, y0=0, y1=1, yref="paper",
                      line=dict(color=CHANGE_COLOUR, width=2, dash="dash"), name="change point")
        fig.add_annotation(x=x, y=1, yref="paper", yanchor="bottom", showarrow=False,
                           text=esc(f"{cp.commit_range} ×{cp.magnitude:.3f}"), font=dict(color=CHANGE_COLOUR, size=11))
    base_layout(fig, height=260, title=f"{s.engine} · {s.metric}")
    fig.update_layout(showlegend=False, margin=dict(l=60, r=20, t=80, b=70))
    fig.update_xaxes(tickmode="array", tickvals=list(range(len(order))), ticktext=[esc(c[:8]) for c in order],
                     tickangle=-45, title_text="commit (by commit date)")
    fig.update_yaxes(title_text=esc(s.metric))
    caption = (f"{s.workload} {s.point_label}; {s.model}, config {s.config_hash}: "
               f"{len(s.points)} runs of {len(commits)} commits"
               + (f", {len(failed)} commits failed" if failed else "")
               + (f"; {len(changes)} change points" if changes else "; no change point"))
    return Figure(fig, s.anchor, caption)


def changes_table(changes: list[ChangePoint]) -> Table:
    rows, classes = [], []
    for cp in changes:
        s = cp.series
        rows.append([
            Cell(cp.commit_range), Cell(s.engine), Cell(f"{s.workload} {s.point_label}"), Cell(s.metric),
            Cell(fmt_short(cp.mean_before), cp.mean_before, cls="num"),
            Cell(fmt_short(cp.mean_after), cp.mean_after, cls="num"),
            Cell(f"{cp.magnitude:.3f}", cp.magnitude, cls="num bad" if _worse(cp) else "num good"),
            Cell(f"{cp.pvalue:.2g}", cp.pvalue, cls="num"), Cell(str(cp.n_before), cp.n_before, cls="num"),
            Cell(str(cp.n_after), cp.n_after, cls="num"), Cell(s.machine_desc, title=s.machine)])
        classes.append(f"machine-{s.machine}")
    return Table(["commits", "engine", "point", "metric", "mean before", "mean after", "ratio", "p-value",
                  "runs before", "runs after", "machine"], rows, name="change-points", row_classes=classes,
                 caption="Change points, newest first (by the date of the first commit after the change)")


def _worse(cp: ChangePoint) -> bool:
    higher_better = cp.series.metric.endswith("tok_s") or "throughput" in cp.series.metric
    return cp.magnitude < 1 if higher_better else cp.magnitude > 1


def render_trends(series: list[Series], changes: list[ChangePoint], title: str | None = None) -> str:
    by_series: dict[str, list[ChangePoint]] = {}
    for cp in changes:
        by_series.setdefault(cp.series.key, []).append(cp)
    machines: dict[str, MachineSection] = {}
    for s in sorted(series, key=lambda s: (s.machine, s.engine, s.point_key, s.metric)):
        sec = machines.setdefault(s.machine, MachineSection(s.machine, s.machine_desc, []))
        sec.figures.append(series_figure(s, by_series.get(s.key, [])))
    from plotly.offline import get_plotlyjs
    template = _environment().get_template("trends.html.j2")
    return template.render(
        title=title or "infer-bench: performance history", machines=list(machines.values()),
        table=changes_table(changes),
        plotly_js=Markup(get_plotlyjs().replace("</script", "<\\/script")),  # noqa: S704 - the library's own code
        plotly_config=Markup(json.dumps(PLOTLY_CONFIG)),  # noqa: S704 - a constant
        generated=datetime.now(timezone.utc).isoformat(timespec="seconds"), schema_version=STORE_SCHEMA_VERSION,
        n_series=len(series), n_changes=len(changes))


def write_trends(series: list[Series], changes: list[ChangePoint], out: str | Path, title: str | None = None) -> Path:
    out = Path(out)
    atomic_write_text(out, render_trends(series, changes, title))
    return out
