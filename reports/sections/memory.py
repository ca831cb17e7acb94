"""Memory: per engine, the process peak, the KV cache reserved up front and the KV in use kept
apart, with a working memory that compares like with like; peak memory per point; the
engine's KV figures beside the estimator's; and the memory timeline of a chosen point (a selector
switches points)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from reports.blocks import Block, Figure, Note
from reports.data import ReportData
from reports.figures import base_layout, esc, facet_lines, series_styles
from reports.sections.registry import section
from reports.sections.common import (MIB, POOL_COUNTED_SOURCES, Col, add_memory_columns, column, has, int_columns,
                                     point_label, present, values_table)
from reports.sections.summary import sweep_frame

TIMELINE_MAX_SAMPLES = 400   # per line, after downsampling (the maximum of each bucket is kept)
TIMELINE_MAX_POINTS = 40     # points offered in the selector (the largest ones)


def memory_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Per series and sweep point: the process peak and its source, the KV reserved up front, in
    use and estimated, the working memory (`reports.sections.common.working_memory`), the
    device-wide peak, and the tokens the batch's KV cache holds at the end
    (batch × (prompt + output − 1))."""
    df = sweep_frame(rows)
    if df.empty or not (has(df, "peak_memory_bytes") or has(df, "kv_est_bytes")):
        return pd.DataFrame()
    keep = ["engine", "series", "batch_size", "prompt_len", "output_len", "peak_memory_bytes",
            "memory_source", "kv_reserved", "kv_reserved_from", "kv_used_bytes", "kv_est_bytes",
            "kv_est_bytes_per_token", "working_memory_bytes", "working_memory_basis", "device_peak_memory_bytes"]
    out = pd.DataFrame({k: column(df, k) for k in keep}).reset_index(drop=True)
    out["kv_tokens"] = out["batch_size"] * (out["prompt_len"] + out["output_len"] - 1)
    used, est = pd.to_numeric(out["kv_used_bytes"], errors="coerce"), pd.to_numeric(out["kv_est_bytes"], errors="coerce")
    out["kv_used_over_est"] = (used / est).where(est > 0)
    return out


def _largest(values: pd.Series) -> float | None:
    v = pd.to_numeric(values, errors="coerce").dropna()
    return float(v.max()) if len(v) else None


def memory_engines_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per series and workload (ok rows with a process peak): the memory source, the
    largest process peak, the KV reserved up front, the largest KV in use, the largest working
    memory and how it was obtained, the largest device-wide peak."""
    df = rows[(rows["status"] == "ok")]
    if df.empty or not has(df, "peak_memory_bytes"):
        return pd.DataFrame()
    df = add_memory_columns(int_columns(df[df["peak_memory_bytes"].notna()]))
    out = []
    for (s, w), g in df.groupby(["series", "workload"], sort=False):
        bases = list(dict.fromkeys(b for b in g["working_memory_basis"] if b))
        sources = list(dict.fromkeys(str(v) for v in g["memory_source"].dropna())) if "memory_source" in g else []
        out.append({"engine": g["engine"].iloc[0], "series": s, "workload": w, "points": len(g),
                    "memory_source": ", ".join(sources) or None,
                    "peak_memory_bytes": _largest(g["peak_memory_bytes"]),
                    "kv_reserved": _largest(g["kv_reserved"]), "kv_used_bytes": _largest(column(g, "kv_used_bytes")),
                    "working_memory_bytes": _largest(g["working_memory_bytes"]),
                    "device_peak_memory_bytes": _largest(column(g, "device_peak_memory_bytes")),
                    "memory_scope": ", ".join(dict.fromkeys(str(v) for v in column(g, "memory_scope").dropna())) or None,
                    "working_memory_basis": "; ".join(bases) or None})
    return pd.DataFrame(out)


def reserved_note(engines: pd.DataFrame) -> Note | None:
    """What the memory comparison compares, when an engine reserved its KV cache up front."""
    if engines.empty or not engines["kv_reserved"].map(present).any():
        return None
    pooled = engines[engines["kv_reserved"].map(present)]
    sources = " ".join(pooled["memory_source"].fillna(""))
    text = (f"KV reserved up front by {', '.join(dict.fromkeys(pooled['series']))}: a pool allocated at load, "
            f"whatever the batch needs, and part of the process peak from the start; process peaks are therefore "
            f"not compared across engines (no ★). Working memory compares like with like. ")
    if any(s in sources for s in POOL_COUNTED_SOURCES):
        text += ("Where the peak is device memory (NVML counts an allocated pool whole), working memory = "
                 "process peak − KV reserved up front + KV in use: the peak as if the pool had been sized to "
                 "what the sequences used. ")
    if "psutil-rss" in sources:
        text += ("Where the peak is resident memory (CPU), a pool counts only as far as it was written, so "
                 "working memory is the process peak as measured. ")
    return Note(text + "KV in use compares the caches themselves.")


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


ENGINE_COLS = [
    Col("engine", "series", text=True), Col("workload", "workload", text=True), Col("points", "points"),
    Col("source", "memory_source", text=True),
    Col("process peak MiB", "peak_memory_bytes", MIB),
    Col("KV reserved up front MiB", "kv_reserved", MIB),
    Col("KV in use MiB (largest)", "kv_used_bytes", MIB),
    Col("working memory MiB", "working_memory_bytes", MIB, None, "lower"),
    Col("device-wide peak MiB", "device_peak_memory_bytes", MIB),
    Col("memory seen from", "memory_scope", text=True),
    Col("working memory is", "working_memory_basis", text=True),
]


@section("memory", "Memory", "The engine process tree's peak memory (resident memory on CPU; NVML "
         "per-process memory on GPU), the KV cache an engine reserved up front and the KV its "
         "sequences used, kept apart, and a working memory that compares engines like with like; "
         "the KV cache as the engine reports it beside the estimator's figure "
         "(2 × layers × KV heads × head_dim × bytes per element, per token).")
def memory(data: ReportData) -> list[Block]:
    blocks: list[Block] = []
    engines = memory_engines_frame(data.rows)
    if not engines.empty:
        note = reserved_note(engines)
        if note:
            blocks.append(note)
        cols = [c for c in ENGINE_COLS if c.field != "memory_scope" or has(engines, "memory_scope")]
        blocks.append(values_table(engines, cols, "memory-engines",
                                   "Per engine and workload, the largest value over its points. ★: the "
                                   "least working memory among engines of the same workload.", group="workload"))
    df = memory_frame(data.rows)
    if not df.empty and has(df, "peak_memory_bytes"):
        pooled = df["kv_reserved"].map(present).any()
        y_title = "working memory (MiB)" if pooled else "peak memory (MiB)"
        fig = facet_lines(df.dropna(subset=["working_memory_bytes"]).assign(
                              working_memory_bytes=lambda d: pd.to_numeric(d["working_memory_bytes"])),
                          x="prompt_len", y="working_memory_bytes", facet="batch_size",
                          facet_label=lambda b: f"batch size {b}", colours=data.colours,
                          x_title="prompt length (tokens)", y_title=y_title, scale=MIB,
                          hover=[("peak_memory_bytes", "process peak (bytes)", ",d"),
                                 ("kv_reserved", "KV reserved up front (bytes)", ",d"),
                                 ("memory_source", "source", "")])
        fig.update_yaxes(rangemode="normal")
        caption = ("Working memory vs prompt length, one panel per batch size: " + (
            "the process peak with the idle part of a KV pool reserved up front taken out where the peak "
            "counts it (see above); hover shows the process peak." if pooled else "the process peak."))
        blocks.append(Figure(fig, "memory-peak", caption))
    if not df.empty and has(df, "kv_est_bytes"):
        blocks.append(Figure(kv_figure(df, data.colours), "memory-kv",
                             "KV cache vs the tokens it holds: the KV reserved up front (a pool allocated "
                             "at load, whatever the batch needs) and the bytes in use, measured, beside "
                             "the estimator's line."))
    if not df.empty and any(isinstance(b, Figure) for b in blocks):
        blocks[-1].table = values_table(df, [
            Col("batch", "batch_size"), Col("prompt", "prompt_len"), Col("engine", "series", text=True),
            Col("process peak MiB", "peak_memory_bytes", MIB), Col("source", "memory_source", text=True),
            Col("KV reserved up front MiB", "kv_reserved", MIB), Col("KV in use MiB", "kv_used_bytes", MIB),
            Col("working memory MiB", "working_memory_bytes", MIB, None, "lower"),
            Col("device-wide peak MiB", "device_peak_memory_bytes", MIB),
            Col("KV tokens", "kv_tokens"), Col("KV estimate MiB", "kv_est_bytes", MIB),
            Col("in use / estimate", "kv_used_over_est")], "memory-values", group=["batch_size", "prompt_len"])
    tl = timeline_frame(data.rows)
    if not tl.empty:
        blocks.append(Figure(timeline_figure(tl, data.colours), "memory-timeline",
                             "Memory over time while one point was measured; the selector above the plot "
                             "switches points. Largest point first."))
    return blocks


def kv_figure(df: pd.DataFrame, colours: dict[str, str]) -> go.Figure:
    fig = go.Figure()
    styles = series_styles(df, colours)
    for s, st in styles.items():
        d = df[df["series"] == s].sort_values("kv_tokens")
        for field, what, dash, symbol in (("kv_reserved", "reserved up front", "dot", "square-open"),
                                          ("kv_used_bytes", "in use", "solid", "circle"),
                                          ("kv_est_bytes", "estimate", "dash", None)):
            dd = d.dropna(subset=[field])
            if dd.empty:
                continue
            fig.add_trace(go.Scatter(
                x=list(dd["kv_tokens"]), y=[float(v) * MIB for v in dd[field]], name=esc(f"{s} · {what}"),
                mode="lines" if symbol is None else "lines+markers",
                line=dict(color=st["color"], dash=dash, width=1.5 if symbol is None else 2),
                marker=dict(symbol=symbol, size=8, color=st["color"]) if symbol else None,
                customdata=[[b, p] for b, p in zip(dd["batch_size"], dd["prompt_len"])],
                hovertemplate=f"<b>{esc(s)}</b> {what}<br>batch %{{customdata[0]}}, prompt %{{customdata[1]}}<br>"
                              f"KV tokens: %{{x}}<br>{what}: %{{y:.6~g}} MiB<extra></extra>"))
    vals = pd.concat([pd.to_numeric(df[c], errors="coerce") for c in ("kv_reserved", "kv_used_bytes", "kv_est_bytes")]).dropna()
    vals = vals[vals > 0]
    log_y = bool(len(vals)) and vals.max() / vals.min() > 100     # a pre-allocated pool dwarfs the rest
    toks = pd.to_numeric(df["kv_tokens"], errors="coerce").dropna()
    log_x = bool(len(toks)) and toks.min() > 0 and toks.max() / toks.min() > 100
    fig.update_xaxes(title_text="KV tokens held: batch × (prompt + output − 1)", type="log" if log_x else None)
    fig.update_yaxes(title_text="KV cache (MiB)", type="log" if log_y else None, dtick=1 if log_y else None)
    return base_layout(fig, height=420, title="KV cache: measured vs estimated")
