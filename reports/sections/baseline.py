"""Comparison with a baseline (`--baseline`): the ratio current / baseline per metric and
point, with its 95% CI; regressions highlighted. Data prep: `reports.comparison.compare_rows`."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from reports.blocks import Block, Cell, Figure, Note, Table, fmt_num
from reports.comparison import DEFAULT_TOLERANCE, compare_rows, unmatched
from reports.data import ReportData
from reports.figures import base_layout, esc
from reports.sections import section
from reports.sections.common import point_label

VERDICT_CLASS = {"regression": "bad", "improvement": "good", "no change": "", "no CI": "muted"}


def ratio_figure(cmp: pd.DataFrame, colours: dict[str, str]) -> go.Figure:
    metrics = list(dict.fromkeys(cmp["label"]))
    nrows = len(metrics)   # one panel per metric, stacked: the point labels need the width
    fig = make_subplots(rows=nrows, cols=1, subplot_titles=[esc(f"{m} (current / baseline)") for m in metrics],
                        vertical_spacing=min(0.08, 0.5 / nrows))
    cmp = cmp.assign(where=[f"{s} · {point_label(p)}" for s, p in zip(cmp["series"], cmp["point"])])
    n_cat = cmp["where"].nunique()
    for i, m in enumerate(metrics):
        r, c = i + 1, 1
        d = cmp[cmp["label"] == m]
        for engine, g in d.groupby("engine", sort=False):
            has_ci = g["ci_lo"].notna()
            fig.add_trace(go.Scatter(
                x=list(g["ratio"]), y=[esc(w) for w in g["where"]], mode="markers+text", name=esc(engine),
                legendgroup=esc(engine), showlegend=i == 0,
                marker=dict(color=colours.get(str(engine), "#444"), size=9,
                            symbol=["triangle-up" if v == "regression" else "triangle-down" if v == "improvement"
                                    else "circle" for v in g["verdict"]],
                            line=dict(width=[2 if v == "regression" else 0 for v in g["verdict"]], color="#B00020")),
                text=[f"{v:.3f}×" for v in g["ratio"]], textposition="middle right", textfont=dict(size=10),
                error_x=dict(type="data", symmetric=False,
                             array=[(h - v) if ok else None for v, h, ok in zip(g["ratio"], g["ci_hi"], has_ci)],
                             arrayminus=[(v - lo) if ok else None for v, lo, ok in zip(g["ratio"], g["ci_lo"], has_ci)],
                             color=colours.get(str(engine), "#444"), thickness=1.5, width=4),
                customdata=[[esc(v), b * s, cu * s, esc(u)] for v, b, cu, s, u in
                            zip(g["verdict"], g["baseline"], g["current"], g["scale"], g["unit"])],
                hovertemplate="%{y}<br>ratio %{x:.4f}<br>baseline %{customdata[1]:.6~g} %{customdata[3]}"
                              "<br>current %{customdata[2]:.6~g} %{customdata[3]}<br>%{customdata[0]}<extra></extra>",
                cliponaxis=False), row=r, col=c)
        fig.add_vline(x=1, line=dict(color="#888", dash="dash", width=1), row=r, col=c)
        fig.update_xaxes(title_text="ratio (1 = unchanged; > 1 slower / larger)" if r == nrows else None,
                         row=r, col=c)
        fig.update_yaxes(type="category", automargin=True, row=r, col=c)
    return base_layout(fig, height=(22 * n_cat + 70) * nrows + 60)


def comparison_table(cmp: pd.DataFrame) -> Table:
    rows, classes = [], []
    for r in cmp.itertuples():
        ci = f"[{r.ci_lo:.3f}–{r.ci_hi:.3f}]" if r.ci_lo is not None and not pd.isna(r.ci_lo) else "–"
        rows.append([
            Cell(str(r.series)), Cell(str(r.workload)), Cell(point_label(r.point)), Cell(r.label),
            Cell(f"{fmt_num(r.baseline * r.scale)} {r.unit}", r.baseline, cls="num"),
            Cell(f"{fmt_num(r.current * r.scale)} {r.unit}", r.current, cls="num"),
            Cell(f"{r.ratio:.3f}×" if r.ratio is not None else "–", r.ratio, cls="num"),
            Cell(ci, cls="num"), Cell(f"{r.n_baseline} / {r.n_current}", cls="num"),
            Cell(r.verdict, cls=VERDICT_CLASS.get(r.verdict, "")),
        ])
        classes.append(VERDICT_CLASS.get(r.verdict, ""))
    return Table(["engine", "workload", "point", "metric", "baseline", "current", "ratio",
                  "95% CI", "samples (base / current)", "verdict"], rows, "", "comparison", classes)


@section("baseline", "Comparison with the baseline",
         f"Ratio of medians, current / baseline, with a 95% bootstrap CI from both runs' raw samples. "
         f"A regression: the whole CI above 1 and the ratio more than {DEFAULT_TOLERANCE:.0%} above 1 "
         f"(peak memory, which has no samples: the ratio alone). Throughputs are the inverse of these "
         f"latency ratios.")
def baseline(data: ReportData) -> list[Block]:
    if data.baseline is None:
        return []
    cmp = compare_rows(data.baseline, data.rows)
    only_cur, only_base = unmatched(data.baseline, data.rows)
    note = Note(f"{only_cur} points only in the current results, {only_base} only in the baseline, in the "
                f"workloads both have (matched on engine, workload, point, model, dtype, device and "
                f"engine options).")
    if cmp.empty:
        return [Note("No point of the current results matches a point of the baseline."), note]
    counts = cmp["verdict"].value_counts()
    head = Note(", ".join(f"{n} {v}{'s' if n != 1 and v in ('regression', 'improvement') else ''}"
                          for v, n in counts.items()) + ".")
    return [head, Figure(ratio_figure(cmp, data.colours), "baseline-ratio",
                         "Ratio current / baseline with 95% CI; ▲ with a red outline: regression, ▼: improvement.",
                         comparison_table(cmp)), note]
