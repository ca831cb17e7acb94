"""The parity section (workload `parity`): per engine, agreement with the baseline engine."""

from __future__ import annotations

import pandas as pd

from reports.blocks import Block, Figure
from reports.data import ReportData
from reports.figures import bars
from reports.sections import section
from reports.sections.common import Col, column, point_label, values_table, workload_rows


def parity_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Per series and point: agreement with the reference engine and the first divergence."""
    df = workload_rows(rows, "parity", "agreement", ok_only=False)
    if df.empty:
        return df
    df["point_label"] = column(df, "point").map(point_label)
    keep = ["engine", "series", "status", "point_label", "agreement", "first_divergence", "parity_baseline"]
    return pd.DataFrame({k: column(df, k) for k in keep}).reset_index(drop=True)


@section("parity", "Parity", "Per engine, how far its greedy output tokens agree with the reference "
         "engine's on the same prompts, and the first position where they diverge.")
def parity(data: ReportData) -> list[Block]:
    df = parity_frame(data.rows)
    if df.empty:
        return []
    fig = bars(df, x="point_label", y="agreement", colours=data.colours, x_title="point",
               y_title="token agreement with the reference (%)", scale=100)
    table = values_table(df, [Col("engine", "series", text=True), Col("point", "point_label", text=True),
                              Col("compared with", "parity_baseline", text=True),
                              Col("agreement %", "agreement", 100, None, "higher"),
                              Col("first divergence (token index)", "first_divergence"),
                              Col("status", "status", text=True)], "parity-values")
    return [Figure(fig, "parity", "Share of output tokens equal to the reference engine's.", table)]

