"""The KV-ablation section (workload `kv_ablation`): decode step latency against context length
with and without the KV cache, and a straight line fitted to each curve."""

from __future__ import annotations

import pandas as pd

from harness.core.stats import fit_slope
from reports.blocks import Block, Figure
from reports.data import ReportData
from reports.figures import facet_lines
from reports.sections.registry import section
from reports.sections.common import MS, Col, column, facet_if_varies, values_table, workload_rows


def kv_ablation_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Per series, mode (cache / no_cache) and context length: decode step latency (+ CI), and
    the slowdown without the cache (no_cache / cache at the same context)."""
    df = workload_rows(rows, "kv_ablation", "mode", "context_len", "decode_step_latency_s")
    if df.empty:
        return df
    df["base_series"] = df["series"]
    df["mode_label"] = df["mode"].map({"cache": "with KV cache", "no_cache": "without KV cache"}).fillna(df["mode"].astype(str))
    df["series"] = df["base_series"] + " · " + df["mode_label"]
    df["batch_size"] = column(df, "batch_size")
    df["_mode_order"] = df["mode"].map({"cache": 0, "no_cache": 1}).fillna(2)
    df = df.sort_values(["base_series", "_mode_order", "context_len"], kind="stable")
    cache = df[df["mode"] == "cache"].set_index(["base_series", "batch_size", "context_len"])["decode_step_latency_s"]
    key = list(zip(df["base_series"], df["batch_size"], df["context_len"]))
    df["slowdown_vs_cache"] = [v / cache[k] if k in cache.index and m == "no_cache" and cache[k] else None
                               for k, v, m in zip(key, df["decode_step_latency_s"], df["mode"])]
    keep = ["engine", "series", "base_series", "mode", "mode_label", "batch_size", "context_len",
            "decode_step_latency_s", "decode_step_latency_s_ci", "decode_step_latency_s_p90", "slowdown_vs_cache"]
    return pd.DataFrame({k: column(df, k) for k in keep}).reset_index(drop=True)


def kv_ablation_fits(df: pd.DataFrame) -> pd.DataFrame:
    """A least-squares line step latency = a + b × context per series, mode and batch size:
    the slope b (s per context token), the intercept a, and how many times slower the step is at
    the longest context than at the shortest."""
    out = []
    for (s, mode, b), g in df.groupby(["base_series", "mode_label", "batch_size"], sort=False, dropna=False):
        g = g.sort_values("context_len")
        if g["context_len"].nunique() < 2:
            continue
        slope, intercept = fit_slope(list(g["context_len"]), list(g["decode_step_latency_s"]))
        first, last = g.iloc[0], g.iloc[-1]
        out.append({"engine": g["engine"].iloc[0], "base_series": s, "mode_label": mode, "batch_size": b,
                    "slope_s_per_token": float(slope), "intercept_s": float(intercept),
                    "growth": float(last["decode_step_latency_s"] / first["decode_step_latency_s"]),
                    "span": f"{first['context_len']} → {last['context_len']}"})
    return pd.DataFrame(out)


@section("kv-ablation", "KV ablation", "Decode step latency against context length with the KV cache "
         "and without it (every step recomputes attention over the whole context).")
def kv_ablation(data: ReportData) -> list[Block]:
    df = kv_ablation_frame(data.rows)
    if df.empty:
        return []
    fig = facet_lines(df, x="context_len", y="decode_step_latency_s", facet=facet_if_varies(df, "batch_size"),
                      facet_label=lambda b: f"batch size {b}", colours=data.colours,
                      x_title="context length (tokens)", y_title="decode step latency (ms)", scale=MS,
                      ci="decode_step_latency_s_ci", log_y=df["decode_step_latency_s"].max() /
                      max(df["decode_step_latency_s"].min(), 1e-12) > 50)
    table = values_table(df, [Col("engine", "base_series", text=True), Col("mode", "mode_label", text=True),
                              Col("batch", "batch_size"), Col("context", "context_len"),
                              Col("step ms [95% CI]", "decode_step_latency_s", MS, "decode_step_latency_s_ci"),
                              Col("p90 ms", "decode_step_latency_s_p90", MS),
                              Col("× slower without cache", "slowdown_vs_cache")], "kv-ablation-values")
    blocks: list[Block] = [Figure(fig, "kv-ablation", "Solid: with the KV cache; dashed: without it.", table)]
    fits = kv_ablation_fits(df)
    if not fits.empty:
        blocks.append(values_table(fits, [
            Col("engine", "base_series", text=True), Col("mode", "mode_label", text=True), Col("batch", "batch_size"),
            Col("slope µs per context token", "slope_s_per_token", 1e6), Col("intercept ms", "intercept_s", MS),
            Col("context", "span", text=True), Col("× slower at the longest context", "growth")],
            "kv-ablation-fits", "A straight line fitted to each curve (least squares): step latency = "
                                "intercept + slope × context length."))
    return blocks

