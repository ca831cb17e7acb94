"""Comparison with a baseline (`--baseline`): the ratio current / baseline per metric and
point with its CI, and the regression check's verdict; regressions highlighted. Data prep:
`reports.comparison.compare_rows` (the same numbers `infer-bench-compare` gates on)."""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from reports.blocks import Block, Cell, Figure, Note, Table, fmt_num
from reports.comparison import MachineCheck, compare_rows, machine_check, method_text
from reports.data import ReportData
from reports.figures import base_layout, esc
from reports.sections.registry import section
from reports.sections.common import point_label

VERDICT_CLASS = {"regressed": "bad", "failed": "bad", "improved": "good", "unchanged": "", "new": "muted", "no-data": "muted"}
SYMBOL = {"regressed": "triangle-up", "improved": "triangle-down"}


def _num(v: object) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)  # type: ignore[arg-type]


def ratio_figure(cmp: pd.DataFrame, colours: dict[str, str]) -> go.Figure:
    """One panel per metric (stacked): each point's ratio with its CI as an error bar, 1 marked."""
    cmp = cmp[cmp["ratio"].notna()]
    metrics = list(dict.fromkeys(cmp["label"]))
    nrows = len(metrics)
    fig = make_subplots(rows=nrows, cols=1, subplot_titles=[esc(f"{m} (current / baseline)") for m in metrics],
                        vertical_spacing=min(0.08, 0.5 / nrows))
    cmp = cmp.assign(where=[f"{s} · {point_label(p)}" for s, p in zip(cmp["series"], cmp["point"])])
    for i, m in enumerate(metrics):
        d = cmp[cmp["label"] == m]
        for engine, g in d.groupby("engine", sort=False):
            colour = colours.get(str(engine), "#444444")
            lo = [_num(v) for v in g["ci_lo"]]
            hi = [_num(v) for v in g["ci_hi"]]
            fig.add_trace(go.Scatter(
                x=list(g["ratio"]), y=[esc(w) for w in g["where"]], mode="markers+text", name=esc(engine),
                legendgroup=esc(engine), showlegend=i == 0,
                marker=dict(color=colour, size=9, symbol=[SYMBOL.get(v, "circle") for v in g["verdict"]],
                            line=dict(width=[2 if v == "regressed" else 0 for v in g["verdict"]], color="#B00020")),
                text=[f"{r:.3f}×" for r in g["ratio"]], textposition="middle right", textfont=dict(size=10),
                error_x=dict(type="data", symmetric=False, color=colour, thickness=1.5, width=4,
                             array=[(h - r) if h is not None else None for r, h in zip(g["ratio"], hi)],
                             arrayminus=[(r - l_) if l_ is not None else None for r, l_ in zip(g["ratio"], lo)]),
                customdata=[[esc(v), b * s if b is not None else None, c * s if c is not None else None, esc(u),
                             lo_ if lo_ is not None else "–", hi_ if hi_ is not None else "–"]
                            for v, b, c, s, u, lo_, hi_ in zip(g["verdict"], map(_num, g["baseline"]),
                                                               map(_num, g["current"]), g["scale"], g["unit"], lo, hi)],
                hovertemplate="%{y}<br>ratio %{x:.4f} (CI %{customdata[4]:.4f} – %{customdata[5]:.4f})"
                              "<br>baseline %{customdata[1]:.6~g} %{customdata[3]}"
                              "<br>current %{customdata[2]:.6~g} %{customdata[3]}<br>%{customdata[0]}<extra></extra>",
                cliponaxis=False), row=i + 1, col=1)
        fig.add_vline(x=1, line=dict(color="#888", dash="dash", width=1), row=i + 1, col=1)
        fig.update_xaxes(title_text="ratio current / baseline (1 = unchanged)" if i == nrows - 1 else None,
                         row=i + 1, col=1)
        fig.update_yaxes(type="category", automargin=True, row=i + 1, col=1)
    n_cat = max(1, cmp.groupby("label")["where"].nunique().max() if len(cmp) else 1)
    return base_layout(fig, height=(22 * n_cat + 70) * max(1, nrows) + 60)


def comparison_table(cmp: pd.DataFrame) -> Table:
    rows, classes = [], []
    for r in cmp.to_dict("records"):
        b, c, ratio = _num(r["baseline"]), _num(r["current"]), _num(r["ratio"])
        lo, hi = _num(r["ci_lo"]), _num(r["ci_hi"])
        unit = f" {r['unit']}" if r["unit"] else ""
        rows.append([
            Cell(str(r["series"])), Cell(str(r["workload"])), Cell(point_label(r["point"])), Cell(r["label"]),
            Cell(f"{fmt_num(b * r['scale'])}{unit}" if b is not None else "–", b, cls="num"),
            Cell(f"{fmt_num(c * r['scale'])}{unit}" if c is not None else "–", c, cls="num"),
            Cell(f"{ratio:.3f}×" if ratio is not None else "–", ratio, cls="num"),
            Cell(f"[{lo:.3f}–{hi:.3f}]" if lo is not None and hi is not None and lo != hi else "–", cls="num"),
            Cell(r["verdict"], cls=VERDICT_CLASS.get(r["verdict"], "")),
            Cell(r["note"] or "", cls="wrap muted"),
        ])
        classes.append(VERDICT_CLASS.get(r["verdict"], ""))
    return Table(["engine", "workload", "point", "metric", "baseline", "current", "ratio", "95% CI", "verdict",
                  "note"], rows, "", "comparison", classes)


def machine_note(check: MachineCheck) -> Note:
    """'Same machine' or 'different machines' (naming what differs), as infer-bench-compare decides."""
    if check.same is False:
        return Note("WARNING: different machines. The baseline and the current results differ in "
                    + "; ".join(check.differences) + ". The ratios below mix the change under test with the "
                    "machines' differences (infer-bench-compare refuses such a comparison unless "
                    "--allow-other-machine)." + (f" No environment.json for part of the {' and '.join(check.unknown)} "
                                                 f"results." if check.unknown else ""),
                    kind="warning", name="different-machines")
    if check.same is None:
        return Note(f"Cannot tell whether the baseline and the current results ran on the same machine: no "
                    f"environment.json beside the {' and '.join(check.unknown)} results.",
                    kind="warning", name="machine-unknown")
    return Note("Same machine: the baseline and the current results agree on CPU model and ISA, cores, GPUs, "
                "torch and engine versions.", name="same-machine")


@section("baseline", "Comparison with the baseline",
         "The ratio of medians, current / baseline, with its 95% bootstrap confidence interval, and "
         "the verdict of the regression check (infer-bench-compare): regressed only when the whole "
         "interval lies beyond the threshold in the bad direction. Throughput is compared through "
         "the latency samples it comes from.")
def baseline(data: ReportData) -> list[Block]:
    if data.baseline is None:
        return []
    machines = machine_note(machine_check(data.baseline_runs, data.baseline, data.runs, data.rows))
    cmp, unmatched = compare_rows(data.baseline, data.rows, data.threshold)
    only_cur, only_base = len(unmatched["current_only"]), len(unmatched["baseline_only"])
    note = Note(f"Threshold {data.threshold:.1%}. Method: {method_text()}. Rows match on engine, model, "
                f"workload, point and dtype: {only_cur} only in the current results, {only_base} only in "
                f"the baseline.")
    if cmp.empty:
        return [machines, Note("No point of the current results matches a point of the baseline."), note]
    counts = cmp["verdict"].value_counts()
    head = Note(", ".join(f"{n} {v}" for v, n in counts.items()) + ".")
    blocks: list[Block] = [machines, head]
    if cmp["ratio"].notna().any():
        blocks.append(Figure(ratio_figure(cmp, data.colours), "baseline-ratio",
                             "Ratio current / baseline with its CI; ▲ with a red outline: regressed, ▼: improved.",
                             comparison_table(cmp)))
    else:
        blocks.append(comparison_table(cmp))
    blocks.append(note)
    return blocks
