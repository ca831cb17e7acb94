"""The reasoning section (docs/metrics.md, "Reasoning"): for every served row whose streams told
reasoning from answer (a server over api=chat: `ttfo_s`), TTFT and TTFO side by side per point,
the reasoning time, the answer's own TPOT beside the TPOT of every token, and the reasoning and
answer token counts with where they came from. A point where no request answered shows TTFO as
missing, never 0."""

from __future__ import annotations

import pandas as pd

from reports.blocks import Block, Figure
from reports.data import ReportData
from reports.figures import bars
from reports.sections.common import MS, Col, column, int_columns, point_label, values_table
from reports.sections.registry import section


def reasoning_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows that carry TTFO fields (`ttfo_s_count`), one per engine and point, with a point label."""
    if "ttfo_s_count" not in rows.columns:
        return pd.DataFrame()
    df = rows[(rows["status"] == "ok") & rows["ttfo_s_count"].notna()]
    if df.empty:
        return pd.DataFrame()
    df = int_columns(df).copy()
    df["point_label"] = [f"{w} · {point_label(p)}" for w, p in zip(column(df, "workload"), column(df, "point"))]
    return df.reset_index(drop=True)


@section("reasoning", "Reasoning: time to the first answer token", "Served rows whose streams told reasoning from "
         "answer: TTFT (the first token of any kind) beside TTFO (the first answer or tool-call token), the reasoning "
         "time between them, and the reasoning and answer token counts.")
def reasoning(data: ReportData) -> list[Block]:
    df = reasoning_frame(data.rows)
    if df.empty:
        return []
    long = pd.concat([df.assign(metric="TTFT", value=column(df, "ttft_s")),
                      df.assign(metric="TTFO", value=column(df, "ttfo_s"))], ignore_index=True)
    long["x"] = long["point_label"] + " · " + long["metric"]
    fig = Figure(bars(long, x="x", y="value", colours=data.colours, x_title="point · metric",
                      y_title="median (ms)", scale=MS), "reasoning-ttfo",
                 "Median TTFT and TTFO per point; no TTFO bar where no request answered.")
    fig.table = values_table(df, [
        Col("engine", "series", text=True), Col("point", "point_label", text=True), Col("TTFT ms", "ttft_s", MS),
        Col("TTFO ms", "ttfo_s", MS), Col("reasoning time ms", "reasoning_time_s", MS),
        Col("TPOT ms (all tokens)", "tpot_s", MS), Col("TPOT ms (answer)", "tpot_answer_s", MS),
        Col("reasoning tokens", "reasoning_tokens"), Col("answer tokens", "answer_tokens"),
        Col("counted by", "reasoning_token_source", text=True),
        Col("requests without answer", "requests_without_answer")], "reasoning-values")
    return [fig]
