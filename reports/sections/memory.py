"""Memory: peak memory per point, the engine's KV pool and used KV beside the estimator's
figure, and the memory timeline of a chosen point (a selector switches points)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from reports.blocks import Block, Figure
from reports.data import ReportData
from reports.figures import base_layout, esc, facet_lines, series_styles
from reports.sections import section
from reports.sections.common import MIB, Col, column, has, point_label, values_table
from reports.sections.summary import sweep_frame

TIMELINE_MAX_SAMPLES = 400   # per line, after downsampling (the maximum of each bucket is kept)
TIMELINE_MAX_POINTS = 40     # points offered in the selector (the largest ones)


def memory_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Per series and point: peak memory and its source, KV pool / used / estimate, and the
    tokens the batch's KV cache holds at the end (batch × (prompt + output − 1))."""
    df = sweep_frame(rows)
    if df.empty or not (has(df, "peak_memory_bytes") or has(df, "kv_est_bytes")):
        return pd.DataFrame()
    keep = ["engine", "series", "batch_size", "prompt_len", "output_len", "peak_memory_bytes",
            "memory_source", "kv_cache_bytes", "kv_used_bytes", "kv_est_bytes", "kv_est_bytes_per_token"]
    out = pd.DataFrame({k: column(df, k) for k in keep}).reset_index(drop=True)
    out["kv_tokens"] = out["batch_size"] * (out["prompt_len"] + out["output_len"] - 1)
    used, est = pd.to_numeric(out["kv_used_bytes"], errors="coerce"), pd.to_numeric(out["kv_est_bytes"], errors="coerce")
    out["kv_used_over_est"] = (used / est).where(est > 0)
    return out


def downsample_max(timeline: list, n: int = TIMELINE_MAX_SAMPLES) -> list[tuple[float, float]]:
    """At most n samples: the timeline split into n buckets, the largest sample of each kept
    (so the peak always survives)."""
    pts = [(float(t), float(b)) for t, b in timeline if t is not None and b is not None]
    if len(pts) <= n:
        return pts
    size = len(pts) / n
    out = []
    for i in range(n):
        bucket = pts[int(i * size):int((i + 1) * size)] or [pts[min(int(i * size), len(pts) - 1)]]
        out.append(max(bucket, key=lambda p: p[1]))
    return out


def timeline_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Long format: series, point_key, point label, size (batch × prompt), t_s, bytes."""
    if "memory_timeline" not in rows.columns:
        return pd.DataFrame()
    ok = rows[(rows["status"] == "ok") & rows["memory_timeline"].map(lambda v: isinstance(v, list) and len(v) > 0)]
    recs = []
    for r in ok.to_dict("records"):
        size = (r.get("batch_size") or 0) * (r.get("prompt_len") or 0)
        for t, b in downsample_max(r["memory_timeline"]):
            recs.append({"engine": r["engine"], "series": r["series"], "point_key": r.get("point_key"),
                         "point": point_label(r.get("point")), "workload": r.get("workload"),
                         "size": size, "t_s": t, "bytes": b})
    return pd.DataFrame(recs)


def chosen_points(tl: pd.DataFrame) -> list[str]:
    """Points for the selector, largest first (the first is shown)."""
    sizes = tl.groupby("point_key", sort=False)["size"].max()
    return list(sizes.sort_values(ascending=False, kind="stable").index[:TIMELINE_MAX_POINTS])


def timeline_figure(tl: pd.DataFrame, colours: dict[str, str]) -> go.Figure:
    points = chosen_points(tl)
    styles = series_styles(tl, colours)
    fig = go.Figure()
    owner: list[str] = []
    for pk in points:
        part = tl[tl["point_key"] == pk]
        for s in styles:
            d = part[part["series"] == s]
            if d.empty:
                continue
            st = styles[s]
            fig.add_trace(go.Scatter(
                x=list(d["t_s"]), y=list(d["bytes"] * MIB), mode="lines", name=esc(s),
                line=dict(color=st["color"], dash=st["dash"], width=2), visible=pk == points[0],
                hovertemplate=f"<b>{esc(s)}</b><br>{esc(d['point'].iloc[0])}<br>t: %{{x:.4~g}} s<br>"
                              f"memory: %{{y:.6~g}} MiB<extra></extra>"))
            owner.append(pk)
    labels = {pk: tl.loc[tl["point_key"] == pk, "point"].iloc[0] for pk in points}
    if len(points) > 1:
        fig.update_layout(updatemenus=[dict(
            type="dropdown", x=0, xanchor="left", y=1.01, yanchor="bottom", showactive=True,
            buttons=[dict(label=esc(labels[pk]), method="update",
                          args=[{"visible": [o == pk for o in owner]},
                                {"title.text": esc(f"Memory timeline: {labels[pk]}")}]) for pk in points])])
    fig.update_xaxes(title_text="time since the measurement started (s)")
    fig.update_yaxes(title_text="memory (MiB)")
    fig = base_layout(fig, height=400, title=f"Memory timeline: {labels[points[0]]}")
    if len(points) > 1:  # the selector takes the top left; the legend goes right
        fig.update_layout(legend=dict(x=1, xanchor="right"))
    return fig


@section("memory", "Memory", "Peak memory while each point ran (resident memory of the engine's "
         "process tree on CPU; NVML per-process memory on GPU), and the KV cache: what the engine "
         "reports (its pool and what the batch uses) beside the estimator's figure "
         "(2 × layers × KV heads × head_dim × bytes per element, per token).")
def memory(data: ReportData) -> list[Block]:
    df = memory_frame(data.rows)
    blocks: list[Block] = []
    if not df.empty and has(df, "peak_memory_bytes"):
        fig = facet_lines(df, x="prompt_len", y="peak_memory_bytes", facet="batch_size",
                          facet_label=lambda b: f"batch size {b}", colours=data.colours,
                          x_title="prompt length (tokens)", y_title="peak memory (MiB)", scale=MIB,
                          hover=[("memory_source", "source", "")])
        fig.update_yaxes(rangemode="normal")
        blocks.append(Figure(fig, "memory-peak", "Peak memory vs prompt length, one panel per batch size."))
    if not df.empty and has(df, "kv_est_bytes"):
        blocks.append(Figure(kv_figure(df, data.colours), "memory-kv",
                             "KV cache vs the tokens it holds: the engine's pool (allocated) and used "
                             "bytes, measured, beside the estimator's line."))
    if blocks:
        blocks[-1].table = values_table(df, [
            Col("batch", "batch_size"), Col("prompt", "prompt_len"), Col("engine", "series", text=True),
            Col("peak MiB", "peak_memory_bytes", MIB, None, "lower"), Col("source", "memory_source", text=True),
            Col("KV tokens", "kv_tokens"), Col("KV pool MiB", "kv_cache_bytes", MIB),
            Col("KV used MiB", "kv_used_bytes", MIB), Col("KV estimate MiB", "kv_est_bytes", MIB),
            Col("used / estimate", "kv_used_over_est")], "memory-values", group=["batch_size", "prompt_len"])
    tl = timeline_frame(data.rows)
    if not tl.empty:
        blocks.append(Figure(timeline_figure(tl, data.colours), "memory-timeline",
                             "Memory over time while one point was measured; the selector (top right) "
                             "switches points. Largest point first."))
    return blocks


def kv_figure(df: pd.DataFrame, colours: dict[str, str]) -> go.Figure:
    fig = go.Figure()
    styles = series_styles(df, colours)
    for s, st in styles.items():
        d = df[df["series"] == s].sort_values("kv_tokens")
        for field, what, dash, symbol in (("kv_cache_bytes", "pool", "dot", "square-open"),
                                          ("kv_used_bytes", "used", "solid", "circle"),
                                          ("kv_est_bytes", "estimate", "dash", None)):
            dd = d.dropna(subset=[field])
            if dd.empty:
                continue
            fig.add_trace(go.Scatter(
                x=list(dd["kv_tokens"]), y=list(dd[field] * MIB), name=esc(f"{s} · {what}"),
                mode="lines" if symbol is None else "lines+markers",
                line=dict(color=st["color"], dash=dash, width=1.5 if symbol is None else 2),
                marker=dict(symbol=symbol, size=8, color=st["color"]) if symbol else None,
                customdata=[[b, p] for b, p in zip(dd["batch_size"], dd["prompt_len"])],
                hovertemplate=f"<b>{esc(s)}</b> {what}<br>batch %{{customdata[0]}}, prompt %{{customdata[1]}}<br>"
                              f"KV tokens: %{{x}}<br>{what}: %{{y:.6~g}} MiB<extra></extra>"))
    vals = pd.concat([pd.to_numeric(df[c], errors="coerce") for c in ("kv_cache_bytes", "kv_used_bytes", "kv_est_bytes")]).dropna()
    vals = vals[vals > 0]
    log_y = bool(len(vals)) and vals.max() / vals.min() > 100     # a pre-allocated pool dwarfs the rest
    toks = pd.to_numeric(df["kv_tokens"], errors="coerce").dropna()
    log_x = bool(len(toks)) and toks.min() > 0 and toks.max() / toks.min() > 100
    fig.update_xaxes(title_text="KV tokens held: batch × (prompt + output − 1)", type="log" if log_x else None)
    fig.update_yaxes(title_text="KV cache (MiB)", type="log" if log_y else None, dtick=1 if log_y else None)
    return base_layout(fig, height=420, title="KV cache: measured vs estimated")
