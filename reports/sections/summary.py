"""The summary: per engine, the headline metrics with their CIs, best value marked; every
point's numbers; and every engine or point that failed, was unavailable or was skipped, with
its reason."""

from __future__ import annotations

import pandas as pd

from reports.blocks import Block, Cell, Note, Table
from reports.data import ReportData
from reports.sections.registry import section
from reports.sections.common import (MIB, MS, Col, add_memory_columns, column, has, int_columns, inverse_ci,
                                     point_label, values_table)

POINT_COLS = [
    Col("prefill latency ms [95% CI]", "prefill_latency_s", MS, "prefill_latency_s_ci", "lower"),
    Col("prefill tok/s [95% CI]", "prefill_tok_s", 1, "prefill_tok_s_ci", "higher"),
    Col("decode step ms [95% CI]", "decode_step_latency_s", MS, "decode_step_latency_s_ci", "lower"),
    Col("decode tok/s [95% CI]", "decode_tok_s", 1, "decode_tok_s_ci", "higher"),
    Col("end-to-end ms [95% CI]", "e2e_latency_s", MS, "e2e_latency_s_ci", "lower"),
    Col("output tok/s [95% CI]", "output_tok_s", 1, "output_tok_s_ci", "higher"),
    Col("process peak MiB", "peak_memory_bytes", MIB),
    Col("KV reserved up front MiB", "kv_reserved", MIB),
    Col("working memory MiB", "working_memory_bytes", MIB, None, "lower"),
    Col("repeats", "repeats"),
]
HEADLINE = [  # (field, CI field, which way is better, header)
    ("prefill_tok_s", "prefill_tok_s_ci", "higher", "best prefill tok/s [95% CI]"),
    ("decode_tok_s", "decode_tok_s_ci", "higher", "best decode tok/s [95% CI]"),
    ("output_tok_s", "output_tok_s_ci", "higher", "best output tok/s [95% CI]"),
    ("decode_step_latency_s", "decode_step_latency_s_ci", "lower", "lowest decode step ms [95% CI]"),
    ("peak_memory_bytes", None, "higher", "largest process peak MiB"),
    ("kv_reserved", None, "higher", "KV reserved up front MiB"),
    ("working_memory_bytes", None, "higher", "largest working memory MiB"),
]
# memory: the largest value is the headline; only working memory compares engines like with like
# (a pool reserved up front is in the process peak whatever the batch needs), so only it gets a ★
STARRED_MEMORY = {"working_memory_bytes"}


def sweep_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """The sweep's ok rows with the derived throughput CIs and a point label, in point order."""
    df = int_columns(rows[(rows["workload"] == "sweep") & (rows["status"] == "ok")])
    if df.empty:
        return df
    df = add_memory_columns(df)
    b, s = column(df, "batch_size"), column(df, "prompt_len")
    df["prefill_tok_s_ci"] = inverse_ci(b * s, column(df, "prefill_latency_s_ci"))
    df["decode_tok_s_ci"] = inverse_ci(b.astype(float), column(df, "decode_step_latency_s_ci"))
    df["point_label"] = column(df, "point").map(point_label)
    order = {s: i for i, s in enumerate(dict.fromkeys(df["series"]))}
    df["_order"] = df["series"].map(order)
    df = df.sort_values(["batch_size", "prompt_len", "output_len", "_order"], kind="stable")
    return df.drop(columns="_order")


def headline_frame(sweep: pd.DataFrame) -> pd.DataFrame:
    """One row per series: for each headline metric the best value over its points, that
    value's CI and the point it was measured at."""
    out = []
    for s, g in sweep.groupby("series", sort=False):
        rec = {"series": s, "engine": g["engine"].iloc[0], "points": len(g)}
        for field, ci, better, _ in HEADLINE:
            vals = pd.to_numeric(column(g, field), errors="coerce").dropna()
            if vals.empty:
                rec.update({field: None, f"{field}_ci": None, f"{field}_at": None})
                continue
            i = vals.idxmin() if better == "lower" else vals.idxmax()
            rec.update({field: float(vals[i]), f"{field}_ci": g.at[i, ci] if ci else None,
                        f"{field}_at": g.at[i, "point_label"]})
        out.append(rec)
    return pd.DataFrame(out)


def failures_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows that did not finish ok: engine, status, workload, point, reason."""
    bad = rows[rows["status"] != "ok"]
    return pd.DataFrame({
        "series": bad["series"], "status": bad["status"], "workload": bad["workload"],
        "point": column(bad, "point").map(point_label),
        "error": bad["error"].fillna("(no reason recorded)").astype(str),
    }).reset_index(drop=True)


@section("summary", "Summary",
         "Medians with 95% bootstrap confidence intervals. ★ marks the best value in each column "
         "(per engine for the headline; among engines at the same point below).")
def summary(data: ReportData) -> list[Block]:
    sweep = sweep_frame(data.rows)
    blocks: list[Block] = []
    if not sweep.empty and has(sweep, "prefill_latency_s"):
        head = headline_frame(sweep)
        cols = [Col("engine", "series", text=True), Col("points", "points")]
        for field, ci, better, header in HEADLINE:
            memory = field.endswith("bytes") or field == "kv_reserved"
            scale = MS if field.endswith("latency_s") else MIB if memory else 1
            if has(head, field):
                better_way = ("lower" if field in STARRED_MEMORY else None) if memory else better
                cols.append(Col(header, field, scale, f"{field}_ci", better_way))
        caption = "Per engine: the best value over the points it ran (memory: the largest)."
        if has(head, "kv_reserved"):
            caption += (" KV reserved up front is a pool allocated at load, whatever the batch needs, and is "
                        "inside the process peak; working memory takes its idle part out where the peak "
                        "counts it (see Memory), so it, not the process peak, compares engines.")
        table = values_table(head, cols, "summary-engines", caption + " Where each was measured is in the table below.")
        blocks.append(table)
        cols = [Col("point", "point_label", text=True), Col("engine", "series", text=True)]
        cols += [c for c in POINT_COLS if has(sweep, c.field)]
        blocks.append(values_table(sweep, cols, "summary-points", "Every point (sweep workload).",
                                   group="point_key"))
    fails = failures_frame(data.rows)
    if not fails.empty:
        rows = [[Cell(r.series), Cell(r.status, cls=f"status-{r.status}"), Cell(r.workload),
                 Cell(r.point), Cell(r.error, cls="error")] for r in fails.itertuples()]
        blocks.append(Table(["engine", "status", "workload", "point", "reason"], rows,
                            f"{len(fails)} rows did not finish: failed, unavailable or skipped.",
                            "failures", [f"status-{s}" for s in fails["status"]]))
    elif blocks:
        blocks.append(Note("Every point of every engine finished."))
    return blocks
