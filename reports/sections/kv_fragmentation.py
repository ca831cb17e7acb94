"""The KV-fragmentation section (workload `kv_memory`): KV-cache slots allocated against tokens
stored, per layout."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from reports.blocks import Block, Figure
from reports.data import ReportData
from reports.figures import base_layout, esc, series_styles
from reports.sections.registry import section
from reports.sections.common import MIB, Col, column, values_table, varying_labels, workload_rows


def kv_memory_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Per series, layout and point: slots allocated vs tokens stored, and the waste."""
    df = workload_rows(rows, None, "kv_layout", "slots_allocated", "tokens_stored")
    if df.empty:
        return df
    points = list(column(df, "point"))
    df["point_label"] = varying_labels(points, skip=("kv_layout",))
    short = varying_labels(points, skip=("kv_layout",), full_when_same=False)
    df["where"] = [f"{lay} · {s}" if s else str(lay) for lay, s in zip(df["kv_layout"], short)]
    alloc = pd.to_numeric(df["slots_allocated"], errors="coerce")
    df["waste"] = (1 - pd.to_numeric(df["tokens_stored"], errors="coerce") / alloc).where(alloc > 0)
    keep = ["engine", "series", "kv_layout", "point_label", "where", "slots_allocated", "tokens_stored", "waste",
            "kv_bytes_per_token", "kv_est_bytes_per_token", "kv_pool_bytes"]
    return pd.DataFrame({k: column(df, k) for k in keep}).reset_index(drop=True)


@section("kv-fragmentation", "KV fragmentation", "KV-cache slots allocated against tokens actually "
         "stored, per layout (paged blocks vs contiguous per-sequence pre-allocation).")
def kv_fragmentation(data: ReportData) -> list[Block]:
    df = kv_memory_frame(data.rows)
    if df.empty:
        return []
    fig = go.Figure()
    for s, st in series_styles(df, data.colours).items():
        d = df[df["series"] == s]
        for field, what, opacity in (("slots_allocated", "allocated", 0.35), ("tokens_stored", "stored", 1.0)):
            fig.add_trace(go.Bar(
                x=[esc(w) for w in d["where"]], y=list(d[field]), name=esc(f"{s} · {what}"), offsetgroup=esc(s),
                marker=dict(color=st["color"], opacity=opacity), texttemplate="%{y}", textposition="outside",
                hovertemplate=f"<b>{esc(s)}</b><br>%{{x}}<br>{what}: %{{y}} token slots<extra></extra>"))
    fig.update_layout(barmode="group")
    fig.update_xaxes(title_text="layout · point", type="category")
    fig.update_yaxes(title_text="KV token slots")
    table = values_table(df, [Col("engine", "series", text=True), Col("layout", "kv_layout", text=True),
                              Col("point", "point_label", text=True), Col("slots allocated", "slots_allocated"),
                              Col("tokens stored", "tokens_stored"), Col("waste %", "waste", 100, None, "lower"),
                              Col("bytes/token (engine)", "kv_bytes_per_token"),
                              Col("bytes/token (estimate)", "kv_est_bytes_per_token"),
                              Col("KV held MiB (the whole pool where reserved up front)", "kv_pool_bytes", MIB)],
                         "kv-fragmentation-values", group="point_label")
    return [Figure(base_layout(fig, height=420), "kv-fragmentation",
                   "Pale bar: slots allocated; solid bar: tokens stored in them.", table)]

