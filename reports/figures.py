"""Plotly figure helpers shared by the sections: one look, one colour per engine, axis titles
with units, hover with exact values, and values drawn on the figure where they fit (so a
printed page needs no hover).

Plotly renders trace names, titles, hover and text labels as a small subset of HTML. Every
string that comes from results or configs passes through `esc` before it goes into a figure,
so it shows as text.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from reports.blocks import fmt_short, nice

DASHES = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"]
SYMBOLS = ["circle", "square", "diamond", "triangle-up", "x", "cross"]
MAX_LABELLED_POINTS = 12   # per trace; beyond this, values only in the table beside the figure
FACET_COLS = 3
FACET_HEIGHT = 330


def esc(s: Any) -> str:
    """Text for Plotly: '&', '<' and '>' as entities (Plotly shows entities as their
    characters and never parses them as tags)."""
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def base_layout(fig: go.Figure, height: int = 380, title: str | None = None) -> go.Figure:
    """The common look. `title` is plain text (escaped here)."""
    total = height + (30 if title else 0)
    fig.update_layout(
        template="plotly_white", height=total, margin=dict(l=70, r=20, t=95 if title else 65, b=60),
        font=dict(family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size=12),
        hovermode="closest", paper_bgcolor="white", plot_bgcolor="white",
        legend=dict(orientation="h", yref="container", yanchor="top", y=1 - (34 / total if title else 0.0),
                    xanchor="left", x=0),
        title=dict(text=esc(title), x=0, xref="paper", y=1, yref="container", yanchor="top", pad=dict(t=12),
                   font=dict(size=14)) if title else None,
    )
    return fig


def series_styles(df: pd.DataFrame, colours: dict[str, str]) -> dict[str, dict[str, Any]]:
    """series -> colour (its engine's), dash and marker symbol (by variant within the engine)."""
    out: dict[str, dict[str, Any]] = {}
    for engine, g in df.groupby("engine", sort=False):
        for i, s in enumerate(dict.fromkeys(g["series"])):
            out[s] = {"color": colours.get(str(engine), "#444444"), "dash": DASHES[i % len(DASHES)],
                      "symbol": SYMBOLS[i % len(SYMBOLS)]}
    return out


def _ci_arrays(d: pd.DataFrame, y: str, ci: str | None, scale: float) -> tuple[list, list] | None:
    if not ci or ci not in d.columns:
        return None
    lo, hi, any_ci = [], [], False
    for v, c in zip(d[y], d[ci]):
        if isinstance(c, (list, tuple)) and len(c) == 2 and None not in c and v is not None:
            lo.append(max(0.0, (v - c[0]) * scale))
            hi.append(max(0.0, (c[1] - v) * scale))
            any_ci = True
        else:
            lo.append(None)
            hi.append(None)
    return (lo, hi) if any_ci else None


def facet_lines(df: pd.DataFrame, *, x: str, y: str, facet: str | None, colours: dict[str, str],
                x_title: str, y_title: str, facet_label: Callable[[Any], str] = str,
                scale: float = 1.0, ci: str | None = None, fmt: str = ".6~g",
                hover: Sequence[tuple[str, str, str]] = (), log_x: bool = False,
                log_y: bool = False, title: str | None = None, labels: bool = True) -> go.Figure:
    """One line per series (colour = engine), x vs y × scale, one panel per value of `facet`.
    `ci`: a column of [lo, hi] drawn as error bars. `hover`: extra (column, label, d3-format)
    shown on hover. `labels`: write each point's value beside it (when there are few)."""
    facets = sorted(df[facet].dropna().unique()) if facet else [None]
    cols = min(FACET_COLS, len(facets))
    nrows = math.ceil(len(facets) / cols)
    fig = make_subplots(rows=nrows, cols=cols, subplot_titles=[esc(facet_label(nice(f))) for f in facets] if facet else None,
                        horizontal_spacing=0.08, vertical_spacing=min(0.12, 0.3 / max(1, nrows)))
    styles = series_styles(df, colours)
    shown: set[str] = set()
    for i, fv in enumerate(facets):
        r, c = i // cols + 1, i % cols + 1
        part = df if facet is None else df[df[facet] == fv]
        for s in styles:
            d = part[part["series"] == s].dropna(subset=[y]).sort_values(x)
            if d.empty:
                continue
            st = styles[s]
            custom = [[row.get(h) for h, _, _ in hover] for row in d.to_dict("records")]
            tmpl = (f"<b>{esc(s)}</b><br>{esc(x_title)}: %{{x}}<br>{esc(y_title)}: %{{y:{fmt}}}")
            err = _ci_arrays(d, y, ci, scale)
            if err:
                tmpl += f"<br>95% CI: −%{{error_y.arrayminus:{fmt}}} / +%{{error_y.array:{fmt}}}"
            for k, (_, label, hfmt) in enumerate(hover):
                tmpl += f"<br>{esc(label)}: %{{customdata[{k}]{':' + hfmt if hfmt else ''}}}"
            label_points = labels and len(d) <= MAX_LABELLED_POINTS
            fig.add_trace(go.Scatter(
                x=list(d[x]), y=[v * scale for v in d[y]], name=esc(s), legendgroup=esc(s),
                showlegend=s not in shown, mode="lines+markers+text" if label_points else "lines+markers",
                line=dict(color=st["color"], dash=st["dash"], width=2),
                marker=dict(color=st["color"], symbol=st["symbol"], size=7),
                text=[fmt_short(v * scale) for v in d[y]] if label_points else None,
                texttemplate="%{text}" if label_points else None,
                textposition="top center", textfont=dict(size=10, color=st["color"]),
                error_y=dict(type="data", array=err[1], arrayminus=err[0], visible=True, thickness=1,
                             width=3, color=st["color"]) if err else None,
                customdata=custom if hover else None, hovertemplate=tmpl + "<extra></extra>",
                cliponaxis=False,
            ), row=r, col=c)
            shown.add(s)
        fig.update_xaxes(title_text=esc(x_title), type="log" if log_x else None, row=r, col=c)
        fig.update_yaxes(title_text=esc(y_title) if c == 1 else None, type="log" if log_y else None,
                         rangemode="tozero" if not log_y else None, row=r, col=c)
    if log_x:
        ticks = sorted(df[x].dropna().unique())
        fig.update_xaxes(tickvals=ticks, ticktext=[str(t) for t in ticks])
    else:
        ticks = sorted(df[x].dropna().unique())
        if len(ticks) <= 12:
            fig.update_xaxes(tickvals=ticks)
    return base_layout(fig, height=FACET_HEIGHT * nrows + 80, title=title)


def heatmap(z: pd.DataFrame, *, x_title: str, y_title: str, z_title: str, fmt: str = ".6~g",
            title: str | None = None, reverse: bool = False) -> go.Figure:
    """A labelled heatmap of a pivot table (index = y, columns = x); values written in cells."""
    fig = go.Figure(go.Heatmap(
        z=z.values.tolist(), x=[str(c) for c in z.columns], y=[str(i) for i in z.index],
        colorscale="Viridis", reversescale=reverse, colorbar=dict(title=dict(text=esc(z_title))),
        text=[[fmt_short(v) for v in row] for row in z.values.tolist()], texttemplate="%{text}",
        textfont=dict(size=11),
        hovertemplate=f"{esc(x_title)}: %{{x}}<br>{esc(y_title)}: %{{y}}<br>{esc(z_title)}: %{{z:{fmt}}}<extra></extra>",
    ))
    fig.update_xaxes(title_text=esc(x_title), type="category")
    fig.update_yaxes(title_text=esc(y_title), type="category")
    return base_layout(fig, height=max(260, 60 * len(z.index) + 140), title=title)


def bars(df: pd.DataFrame, *, x: str, y: str, colours: dict[str, str], x_title: str, y_title: str,
         scale: float = 1.0, fmt: str = ".6~g", title: str | None = None,
         ci: str | None = None) -> go.Figure:
    """One bar per series at each x (grouped), value written on the bar."""
    fig = go.Figure()
    styles = series_styles(df, colours)
    for s, st in styles.items():
        d = df[df["series"] == s].dropna(subset=[y])
        if d.empty:
            continue
        err = _ci_arrays(d, y, ci, scale)
        fig.add_trace(go.Bar(
            x=[esc(v) for v in d[x]], y=[v * scale for v in d[y]], name=esc(s),
            marker=dict(color=st["color"], pattern=dict(shape=["", "/", ".", "x"][list(styles).index(s) % 4]
                                                        if st["dash"] != "solid" else "")),
            text=[fmt_short(v * scale) for v in d[y]], texttemplate="%{text}", textposition="outside",
            cliponaxis=False,
            error_y=dict(type="data", array=err[1], arrayminus=err[0], visible=True) if err else None,
            hovertemplate=f"<b>{esc(s)}</b><br>{esc(x_title)}: %{{x}}<br>{esc(y_title)}: %{{y:{fmt}}}<extra></extra>",
        ))
    fig.update_layout(barmode="group")
    fig.update_xaxes(title_text=esc(x_title), type="category")
    fig.update_yaxes(title_text=esc(y_title), rangemode="tozero")
    return base_layout(fig, height=380, title=title)


def stacked_bars(df: pd.DataFrame, *, x: str, parts: Sequence[tuple[str, str, str]], facet: str,
                 x_title: str, y_title: str, scale: float = 1.0, fmt: str = ".3~g",
                 title: str | None = None) -> go.Figure:
    """Bars of `parts` (column, label, colour) stacked at each x, one panel per value of `facet`
    (e.g. one per engine and tier mode); each part's value written in its segment."""
    facets = list(dict.fromkeys(df[facet].dropna()))
    cols = min(FACET_COLS, max(1, len(facets)))
    nrows = max(1, math.ceil(len(facets) / cols))
    fig = make_subplots(rows=nrows, cols=cols, subplot_titles=[esc(f) for f in facets],
                        horizontal_spacing=0.08, vertical_spacing=min(0.12, 0.3 / max(1, nrows)))
    for i, fv in enumerate(facets):
        r, c = i // cols + 1, i % cols + 1
        d = df[df[facet] == fv].sort_values(x)
        for col, label, colour in parts:
            vals = [None if v is None or pd.isna(v) else v * scale for v in d[col]]
            fig.add_trace(go.Bar(
                x=list(d[x]), y=vals, name=esc(label), legendgroup=esc(label), showlegend=i == 0,
                marker=dict(color=colour), text=[fmt_short(v) if v else "" for v in vals], texttemplate="%{text}",
                textposition="inside", hovertemplate=(f"<b>{esc(fv)}</b><br>{esc(x_title)}: %{{x}}<br>{esc(label)}: "
                                                      f"%{{y:{fmt}}}<extra></extra>")), row=r, col=c)
        fig.update_xaxes(title_text=esc(x_title), tickvals=sorted(d[x].unique()), row=r, col=c)
        fig.update_yaxes(title_text=esc(y_title) if c == 1 else None, rangemode="tozero", row=r, col=c)
    fig.update_layout(barmode="stack")
    return base_layout(fig, height=FACET_HEIGHT * nrows + 80, title=title)
