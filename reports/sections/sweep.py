"""The sweep's prefill and decode figures: latency and throughput against prompt length (one
panel per batch size) and against batch size (one panel per prompt length), and a batch ×
prompt-length heatmap of decode throughput per engine."""

from __future__ import annotations

import pandas as pd

from reports.blocks import Block, Figure, Note
from reports.data import ReportData
from reports.figures import facet_lines, heatmap
from reports.sections.registry import section
from reports.sections.common import MS, Col, column, has, values_table
from reports.sections.summary import sweep_frame


def prefill_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Prefill per series and point: latency median/p90/p99 with CI, throughput with CI."""
    df = sweep_frame(rows)
    if df.empty or not has(df, "prefill_latency_s"):
        return pd.DataFrame()
    keep = ["engine", "series", "batch_size", "prompt_len", "output_len", "prefill_latency_s",
            "prefill_latency_s_ci", "prefill_latency_s_p90", "prefill_latency_s_p99",
            "prefill_tok_s", "prefill_tok_s_ci", "repeats"]
    return pd.DataFrame({k: column(df, k) for k in keep}).reset_index(drop=True)


def decode_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Decode per series and point: step latency median/p90/p99 with CI, throughput with CI."""
    df = sweep_frame(rows)
    if df.empty or not has(df, "decode_step_latency_s"):
        return pd.DataFrame()
    keep = ["engine", "series", "batch_size", "prompt_len", "output_len", "decode_step_latency_s",
            "decode_step_latency_s_ci", "decode_step_latency_s_p90", "decode_step_latency_s_p99",
            "decode_tok_s", "decode_tok_s_ci", "decode_steps"]
    df = pd.DataFrame({k: column(df, k) for k in keep}).reset_index(drop=True)
    return df[df["decode_step_latency_s"].notna()]


def decode_heatmaps(decode: pd.DataFrame, value: str = "decode_tok_s") -> dict[str, pd.DataFrame]:
    """series -> pivot of `value` (rows: batch size, columns: prompt length). Only where the
    grid has more than one cell."""
    out = {}
    for s, g in decode.groupby("series", sort=False):
        z = g.pivot_table(index="batch_size", columns="prompt_len", values=value, aggfunc="last")
        if z.size > 1:
            out[s] = z.sort_index().sort_index(axis=1)
    return out


@section("prefill", "Prefill", "Wall time from submitting the batch until every sequence has its "
         "first output token, and batch × prompt tokens per second of it. One panel per batch size; "
         "error bars are 95% bootstrap confidence intervals of the median.")
def prefill(data: ReportData) -> list[Block]:
    df = prefill_frame(data.rows)
    if df.empty:
        return []
    label = lambda b: f"batch size {b}"  # noqa: E731
    hover = [("prefill_latency_s_p90", "p90 latency (s)", ".6~g"), ("prefill_latency_s_p99", "p99 latency (s)", ".6~g"),
             ("repeats", "repeats", "")]
    lat = facet_lines(df, x="prompt_len", y="prefill_latency_s", facet="batch_size", facet_label=label,
                      colours=data.colours, x_title="prompt length (tokens)", y_title="prefill latency (ms)",
                      scale=MS, ci="prefill_latency_s_ci", hover=hover)
    thr = facet_lines(df, x="prompt_len", y="prefill_tok_s", facet="batch_size", facet_label=label,
                      colours=data.colours, x_title="prompt length (tokens)",
                      y_title="prefill throughput (tok/s)", ci="prefill_tok_s_ci")
    table = values_table(df, [Col("batch", "batch_size"), Col("prompt", "prompt_len"),
                              Col("engine", "series", text=True),
                              Col("latency ms [95% CI]", "prefill_latency_s", MS, "prefill_latency_s_ci", "lower"),
                              Col("p90 ms", "prefill_latency_s_p90", MS), Col("p99 ms", "prefill_latency_s_p99", MS),
                              Col("tok/s [95% CI]", "prefill_tok_s", 1, "prefill_tok_s_ci", "higher")],
                         "prefill-values", group=["batch_size", "prompt_len"])
    return [Figure(lat, "prefill-latency", "Prefill latency vs prompt length (median, ms)."),
            Figure(thr, "prefill-throughput", "Prefill throughput vs prompt length (tokens/s).", table)]


@section("decode", "Decode", "Wall time of one decode step (one new token for every live sequence), "
         "and batch size / median step latency in tokens per second. One panel per prompt length.")
def decode(data: ReportData) -> list[Block]:
    df = decode_frame(data.rows)
    if df.empty:
        return [Note("No decode steps were measured (output length 1).")] if not prefill_frame(data.rows).empty else []
    label = lambda s: f"prompt length {s}"  # noqa: E731
    hover = [("decode_step_latency_s_p90", "p90 step (s)", ".6~g"), ("decode_step_latency_s_p99", "p99 step (s)", ".6~g"),
             ("decode_steps", "steps measured", "")]
    lat = facet_lines(df, x="batch_size", y="decode_step_latency_s", facet="prompt_len", facet_label=label,
                      colours=data.colours, x_title="batch size", y_title="decode step latency (ms)",
                      scale=MS, ci="decode_step_latency_s_ci", hover=hover)
    thr = facet_lines(df, x="batch_size", y="decode_tok_s", facet="prompt_len", facet_label=label,
                      colours=data.colours, x_title="batch size", y_title="decode throughput (tok/s)",
                      ci="decode_tok_s_ci")
    table = values_table(df, [Col("prompt", "prompt_len"), Col("batch", "batch_size"),
                              Col("engine", "series", text=True),
                              Col("step ms [95% CI]", "decode_step_latency_s", MS, "decode_step_latency_s_ci", "lower"),
                              Col("p90 ms", "decode_step_latency_s_p90", MS), Col("p99 ms", "decode_step_latency_s_p99", MS),
                              Col("tok/s [95% CI]", "decode_tok_s", 1, "decode_tok_s_ci", "higher"),
                              Col("steps", "decode_steps")],
                         "decode-values", group=["batch_size", "prompt_len"])
    blocks: list[Block] = [
        Figure(lat, "decode-latency", "Decode step latency vs batch size (median, ms)."),
        Figure(thr, "decode-throughput", "Decode throughput vs batch size (tokens/s).", table)]
    for s, z in decode_heatmaps(df).items():
        fig = heatmap(z, x_title="prompt length (tokens)", y_title="batch size", z_title="decode tok/s",
                      title=f"{s}: decode throughput (tok/s)")
        blocks.append(Figure(fig, "decode-heatmap", f"{s}: decode throughput over batch size × prompt "
                                                    f"length; values written in the cells."))
    return blocks
