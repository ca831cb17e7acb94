"""The prefix-sharing section (workload `prefix_sharing`): TTFT and the prefix-cache hit rate
against the shared-prefix length, caching on and off."""

from __future__ import annotations

import pandas as pd

from reports.blocks import Block, Figure
from reports.data import ReportData
from reports.figures import facet_lines
from reports.sections.registry import section
from reports.sections.common import MS, Col, column, facet_if_varies, values_table, workload_rows


def prefix_sharing_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Per series, caching on/off, shared-prefix length (and request count): median TTFT and
    the prefix-cache hit rate."""
    df = workload_rows(rows, "prefix_sharing", "prefix_len", "ttft_s")
    if df.empty:
        return df
    caching = column(df, "prefix_caching").map(lambda v: "caching on" if v is True else "caching off" if v is False else "caching ?")
    df["base_series"] = df["series"]
    df["caching"] = caching
    df["series"] = df["base_series"] + " · " + caching
    df = df.sort_values(["base_series", "caching", "prefix_len"], ascending=[True, False, True], kind="stable")
    keep = ["engine", "series", "base_series", "caching", "num_requests", "prefix_len", "ttft_s", "ttft_s_ci",
            "prefix_hit_rate"]
    return pd.DataFrame({k: column(df, k) for k in keep}).reset_index(drop=True)


@section("prefix-sharing", "Prefix sharing", "Time to first token and prefix-cache hit rate against "
         "the length of the prefix the requests share, with prefix caching on and off.")
def prefix_sharing(data: ReportData) -> list[Block]:
    df = prefix_sharing_frame(data.rows)
    if df.empty:
        return []
    facet = facet_if_varies(df, "num_requests")
    label = lambda n: f"{n} requests"  # noqa: E731
    blocks: list[Block] = [Figure(facet_lines(
        df, x="prefix_len", y="ttft_s", facet=facet, facet_label=label, colours=data.colours,
        x_title="shared prefix length (tokens)", y_title="TTFT, median (ms)", scale=MS, ci="ttft_s_ci"),
        "prefix-ttft", "Median TTFT vs shared-prefix length; solid: caching on, dashed: off.")]
    hits = df.dropna(subset=["prefix_hit_rate"]) if "prefix_hit_rate" in df.columns else pd.DataFrame()
    if not hits.empty:
        blocks.append(Figure(facet_lines(
            hits, x="prefix_len", y="prefix_hit_rate", facet=facet, facet_label=label, colours=data.colours,
            x_title="shared prefix length (tokens)", y_title="prefix-cache hit rate (%)", scale=100),
            "prefix-hit-rate", "Fraction of prompt tokens served from the prefix cache."))
    blocks[-1].table = values_table(df, [Col("engine", "base_series", text=True), Col("caching", "caching", text=True),
                                         Col("requests", "num_requests"), Col("prefix", "prefix_len"),
                                         Col("TTFT ms [95% CI]", "ttft_s", MS, "ttft_s_ci", "lower"),
                                         Col("hit rate %", "prefix_hit_rate", 100)], "prefix-values",
                                    group=["num_requests", "prefix_len"])
    return blocks

