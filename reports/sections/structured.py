"""The structured-output section (workload `structured`, docs/metrics.md "Structured output"):
per engine, constraint kind and share, the verdicts on the constrained replies (conforming,
truncated, non-conforming, unparseable) beside how often the free replies conformed on the same
prompts, the overhead (TPOT and output tok/s over share 0) and whether the constraint was
applied; and the compile cost (first-request TTFT with a new JSON schema against a cached one)."""

from __future__ import annotations

import pandas as pd

from reports.blocks import Block, Figure, Table
from reports.data import ReportData
from reports.figures import stacked_bars
from reports.sections.common import MS, Col, column, int_columns, values_table
from reports.sections.registry import section

WORKLOAD = "structured"
VERDICTS = (("structured_conforming", "conforming", "#2ca02c"), ("structured_truncated", "truncated", "#ffbf00"),
            ("structured_non_conforming", "non-conforming", "#d62728"), ("structured_unparseable", "unparseable",
                                                                          "#7f7f7f"))


def structured_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """The structured rows that ran (ok or failed), one per engine and point: kind, share, the
    verdict counts, the share of free replies that conformed, the overhead ratios, the check."""
    if "workload" not in rows.columns:
        return pd.DataFrame()
    df = rows[(rows["workload"] == WORKLOAD) & rows["status"].isin(["ok", "failed"])]
    if df.empty:
        return pd.DataFrame()
    df = int_columns(df).copy()
    points = column(df, "point").map(lambda p: p if isinstance(p, dict) else {})
    df["kind"] = points.map(lambda p: p.get("kind"))
    df["share"] = points.map(lambda p: p.get("share"))
    df["compile"] = points.map(lambda p: bool(p.get("compile")))
    free_n = sum(column(df, f"free_{k}").fillna(0) for k in ("conforming", "truncated", "non_conforming",
                                                              "unparseable"))
    df["free_conforming_frac"] = column(df, "free_conforming") / free_n.where(free_n > 0)
    df["label"] = [f"{s} · {k} {share:.0%}" if pd.notna(share) else f"{s} · {k}"
                   for s, k, share in zip(df["series"], df["kind"], df["share"])]
    return df.sort_values(["series", "kind", "share"], kind="stable").reset_index(drop=True)


@section("structured", "Structured output", "Constrained requests (a JSON schema, a regex, a choice list, a grammar): "
         "every reply validated, the overhead over the same prompts without constraints, and what compiling a new "
         "schema costs the first request.")
def structured(data: ReportData) -> list[Block]:
    df = structured_frame(data.rows)
    if df.empty:
        return []
    blocks: list[Block] = []
    shares = df[~df["compile"] & (column(df, "share").fillna(0) > 0)]
    if not shares.empty:
        fig = stacked_bars(shares.assign(x=shares["kind"].astype(str) + " " + shares["share"].map("{:.0%}".format)),
                           x="x", parts=VERDICTS, facet="series", x_title="constraint kind, share constrained",
                           y_title="constrained replies")
        fig_block = Figure(fig, "structured-verdicts", "Verdicts on the constrained replies, per engine.")
        grid = df[~df["compile"]]
        fig_block.table = values_table(grid, [
            Col("engine", "series", text=True), Col("kind", "kind", text=True), Col("share", "share", 100),
            Col("conforming", "structured_conforming"), Col("truncated", "structured_truncated"),
            Col("non-conforming", "structured_non_conforming"), Col("unparseable", "structured_unparseable"),
            Col("free replies conforming %", "free_conforming_frac", 100),
            Col("TPOT ms", "tpot_s", MS), Col("TPOT / share 0", "tpot_ratio"),
            Col("out tok/s / share 0", "output_tok_s_ratio"), Col("applied", "constraint_applied", text=True),
            Col("status", "status", text=True)], "structured-values",
            row_classes=["bad" if s != "ok" else "" for s in grid["status"]])
        blocks.append(fig_block)
    comp = df[df["compile"]]
    if not comp.empty:
        t: Table = values_table(comp, [
            Col("engine", "series", text=True), Col("TTFT, new schema ms", "compile_ttft_new_s", MS),
            Col("TTFT, cached ms", "compile_ttft_cached_s", MS), Col("compile cost ms (median of pairs)",
                                                                    "compile_cost_s", MS)],
            "structured-compile", caption="Schema compile cost: each JSON schema made new to the engine (a $comment "
            "nonce), sent alone, then sent again cached; TTFT medians and the median of the paired differences.")
        blocks.append(t)
    return blocks
