"""Sections of the other workloads: KV ablation, prefix sharing, serving, KV fragmentation,
roofline and parity. Each reads the fields its workload writes and is left out when they are
absent (their row fields may still change; a missing field only hides a figure)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from reports.blocks import Block, Figure, Note, fmt_num
from reports.data import ReportData
from reports.figures import bars, base_layout, esc, facet_lines, series_styles
from reports.sections import section
from reports.sections.common import MIB, MS, Col, column, has, int_columns, point_label, values_table, varying_labels
from harness.core.stats import fit_slope

PERCENTILE_KEYS = ("p50", "p90", "p99")
CDF_MAX_POINTS = 400


def _rows(rows: pd.DataFrame, workload: str | None, *need: str, ok_only: bool = True) -> pd.DataFrame:
    """Rows of a workload (any workload when None) that carry every field in `need`."""
    df = rows if workload is None else rows[rows["workload"] == workload]
    if ok_only:
        df = df[df["status"] == "ok"]
    if df.empty or not all(c in df.columns for c in need):
        return pd.DataFrame()
    return int_columns(df.dropna(subset=list(need)))


def _facet(df: pd.DataFrame, col: str) -> str | None:
    return col if col in df.columns and df[col].nunique() > 1 else None


# ---- KV ablation -----------------------------------------------------------------------------

def kv_ablation_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Per series, mode (cache / no_cache) and context length: decode step latency (+ CI), and
    the slowdown without the cache (no_cache / cache at the same context)."""
    df = _rows(rows, "kv_ablation", "mode", "context_len", "decode_step_latency_s")
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
    fig = facet_lines(df, x="context_len", y="decode_step_latency_s", facet=_facet(df, "batch_size"),
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


# ---- prefix sharing --------------------------------------------------------------------------

def prefix_sharing_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Per series, caching on/off, shared-prefix length (and request count): median TTFT and
    the prefix-cache hit rate."""
    df = _rows(rows, "prefix_sharing", "prefix_len", "ttft_s")
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
    facet = _facet(df, "num_requests")
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


# ---- serving ---------------------------------------------------------------------------------

SERVING_METRICS = [("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2el_s", "E2EL")]


ALL_AT_ONCE = "all at once"


def serving_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Serving rows (ok) in point order, with `rate_x` (the request rate to plot at; a rate of
    infinity, stored as null, sits one step right of the largest finite rate) and `rate_label`."""
    df = _rows(rows, "serving")
    if df.empty:
        return df
    rate = pd.to_numeric(column(df, "request_rate"), errors="coerce")
    finite = rate[np.isfinite(rate)]
    top = float(finite.max()) * 2 if len(finite) else 1.0
    df["rate_x"] = rate.where(np.isfinite(rate), top)
    df["rate_label"] = [f"{v:g}" if np.isfinite(v) else ALL_AT_ONCE for v in rate.fillna(np.inf)]
    return df.sort_values(["series", "rate_x"], kind="stable").reset_index(drop=True)


def _rate_ticks(fig: go.Figure, df: pd.DataFrame) -> go.Figure:
    """Label the request-rate axis with the rates (and 'all at once')."""
    ticks = df.drop_duplicates("rate_x").sort_values("rate_x")
    fig.update_xaxes(tickvals=list(ticks["rate_x"]), ticktext=list(ticks["rate_label"]))
    return fig


def serving_percentiles(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Long format for one metric: series, engine, rate_x, rate_label, percentile ('p50'...), value (s)."""
    recs = []
    for r in df.to_dict("records"):
        for p in PERCENTILE_KEYS:
            v = r.get(f"{metric}_{p}")
            if v is not None and not (isinstance(v, float) and np.isnan(v)):
                recs.append({"engine": r["engine"], "series": r["series"], "rate_x": r["rate_x"],
                             "rate_label": r["rate_label"], "percentile": p, "value": float(v)})
    return pd.DataFrame(recs)


def cdf_frame(df: pd.DataFrame, samples: str = "ttft_s_samples") -> pd.DataFrame:
    """Empirical CDF per series and request rate: value (s) and fraction ≤ value. Long sample
    lists are cut to CDF_MAX_POINTS quantiles."""
    recs = []
    if samples not in df.columns:
        return pd.DataFrame()
    for r in df.to_dict("records"):
        x = r.get(samples)
        if not isinstance(x, list) or not x:
            continue
        xs = np.sort(np.asarray([v for v in x if v is not None], dtype=float))
        n = len(xs)
        idx = np.unique(np.linspace(0, n - 1, min(n, CDF_MAX_POINTS)).round().astype(int))
        for i in idx:
            recs.append({"engine": r["engine"], "series": r["series"], "rate_x": r["rate_x"],
                         "rate_label": r["rate_label"], "value": float(xs[i]), "fraction": (i + 1) / n})
    return pd.DataFrame(recs)


@section("serving", "Serving", "Requests arriving over time at a given rate: TTFT, TPOT and ITL "
         "percentiles against the request rate, the TTFT distribution, and goodput.")
def serving(data: ReportData) -> list[Block]:
    df = serving_frame(data.rows)
    if df.empty:
        return []
    blocks: list[Block] = []
    for metric, label in SERVING_METRICS:
        long = serving_percentiles(df, metric)
        if long.empty:
            continue
        blocks.append(Figure(_rate_ticks(facet_lines(
            long, x="rate_x", y="value", facet="percentile", facet_label=lambda p: p, colours=data.colours,
            x_title="request rate (req/s)", y_title=f"{label} (ms)", scale=MS), df),
            f"serving-{metric.removesuffix('_s')}", f"{label} percentiles vs request rate."))
    cdf = cdf_frame(df)
    if not cdf.empty:
        labels = dict(zip(df["rate_x"], df["rate_label"]))
        fig = facet_lines(cdf, x="value", y="fraction", facet="rate_x",
                          facet_label=lambda r: labels.get(r, ALL_AT_ONCE) + (" req/s" if labels.get(r) != ALL_AT_ONCE else ""),
                          colours=data.colours,
                          x_title="TTFT (s)", y_title="fraction of requests", labels=False)
        fig.update_xaxes(tickvals=None)
        blocks.append(Figure(fig, "serving-ttft-cdf", "Cumulative distribution of TTFT, one panel per request rate."))
    if has(df, "goodput_req_s"):
        blocks.append(Figure(_rate_ticks(facet_lines(
            df, x="rate_x", y="goodput_req_s", facet=None, colours=data.colours,
            x_title="request rate (req/s)", y_title="goodput (req/s)"), df), "serving-goodput",
            "Requests per second meeting every SLO."))
    cols = [Col("engine", "series", text=True), Col("rate req/s", "rate_label", text=True)]
    for metric, label in SERVING_METRICS:
        cols += [Col(f"{label} {p} ms", f"{metric}_{p}", MS, None, "lower") for p in PERCENTILE_KEYS
                 if has(df, f"{metric}_{p}")]
    if has(df, "goodput_req_s"):
        cols.append(Col("goodput req/s", "goodput_req_s", 1, None, "higher"))
    if blocks:
        blocks[-1].table = values_table(df, cols, "serving-values", group="rate_x")
    return blocks


# ---- KV fragmentation ------------------------------------------------------------------------

def kv_memory_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Per series, layout and point: slots allocated vs tokens stored, and the waste."""
    df = _rows(rows, None, "kv_layout", "slots_allocated", "tokens_stored")
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
                              Col("pool MiB", "kv_pool_bytes", MIB)],
                         "kv-fragmentation-values", group="point_label")
    return [Figure(base_layout(fig, height=420), "kv-fragmentation",
                   "Pale bar: slots allocated; solid bar: tokens stored in them.", table)]


# ---- roofline --------------------------------------------------------------------------------

def roofline_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows with an achieved fraction of the roofline bound (decode: memory bandwidth;
    prefill: compute), any workload."""
    df = rows[rows["status"] == "ok"]
    fields = [f for f in ("decode_bw_fraction", "prefill_compute_fraction") if f in df.columns]
    if not fields:
        return pd.DataFrame()
    df = int_columns(df[df[fields].notna().any(axis=1)])
    if df.empty:
        return df
    df["point_label"] = column(df, "point").map(point_label)
    keep = ["engine", "series", "workload", "point_label", "batch_size", "prompt_len", *fields,
            "roofline_mem_bw_bytes_s", "roofline_matmul_flops"]
    return pd.DataFrame({k: column(df, k) for k in keep}).reset_index(drop=True)


@section("roofline", "Roofline", "Achieved fraction of the bound that applies: decode is bound by "
         "memory bandwidth (weights + KV read once per step), prefill by arithmetic (about 2 × "
         "parameters × tokens FLOPs plus attention), against the ceilings measured at start.")
def roofline(data: ReportData) -> list[Block]:
    df = roofline_frame(data.rows)
    if df.empty:
        return []
    blocks: list[Block] = []
    for field, what, x, facet in (("decode_bw_fraction", "decode: fraction of memory bandwidth", "batch_size", "prompt_len"),
                                  ("prefill_compute_fraction", "prefill: fraction of compute", "prompt_len", "batch_size")):
        d = df.dropna(subset=[field]) if field in df.columns else pd.DataFrame()
        if d.empty:
            continue
        if (d["workload"] == "sweep").any():      # lines over the sweep's grid; other workloads: the table
            d = d[d["workload"] == "sweep"]
            fig = facet_lines(d, x=x, y=field, facet=_facet(d, facet), colours=data.colours,
                              facet_label=lambda v, f=facet: f"{'prompt length' if f == 'prompt_len' else 'batch size'} {v}",
                              x_title="prompt length (tokens)" if x == "prompt_len" else "batch size",
                              y_title=f"{what} (%)", scale=100)
        else:
            fig = bars(d, x="point_label", y=field, colours=data.colours, x_title="point",
                       y_title=f"{what} (%)", scale=100)
        blocks.append(Figure(fig, f"roofline-{field.split('_')[0]}", f"{what.capitalize()} achieved (100% = the bound)."))
    cols = [Col("engine", "series", text=True), Col("workload", "workload", text=True), Col("point", "point_label", text=True)]
    cols += [Col(h, f, 100, None, "higher") for f, h in (("decode_bw_fraction", "decode % of bandwidth"),
                                                          ("prefill_compute_fraction", "prefill % of compute")) if has(df, f)]
    if blocks:
        blocks[-1].table = values_table(df, cols, "roofline-values", group="point_label")
    bw, flops = column(df, "roofline_mem_bw_bytes_s").dropna(), column(df, "roofline_matmul_flops").dropna()
    if len(bw) or len(flops):
        blocks.insert(0, Note("Ceilings measured on this machine: "
                              + ", ".join(([f"memory bandwidth {fmt_num(bw.iloc[0] / 1e9)} GB/s"] if len(bw) else [])
                                          + ([f"matrix multiply {fmt_num(flops.iloc[0] / 1e9)} GFLOP/s"] if len(flops) else []))
                              + "."))
    return blocks


# ---- parity ----------------------------------------------------------------------------------

def parity_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Per series and point: agreement with the reference engine and the first divergence."""
    df = _rows(rows, "parity", "agreement", ok_only=False)
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
