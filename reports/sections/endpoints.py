"""The HTTP endpoints section: engines run as OpenAI-compatible servers. Who answered
(server version, model, launch command, TLS verification, how requests authenticated - never a
key), every point where the server's token count and the client's differ or requests failed,
and the server's own telemetry (KV-cache usage, requests running and waiting) over each point."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from reports.blocks import Block, Cell, Figure, Note, Table, fmt_num
from reports.data import ReportData
from reports.figures import base_layout, esc, series_styles
from reports.sections.registry import section
from reports.sections.common import column, point_label, present

TELEMETRY_MAX_POINTS = 40   # points offered in the selector
TELEMETRY_MAX_SAMPLES = 400  # per line
# what a Prometheus sample name is about (vLLM, infer-bench-serve, SGLang, others by their words)
TELEMETRY = (
    ("kv", ("kv_cache_usage_perc", "gpu_cache_usage_perc", "token_usage")),
    ("running", ("num_requests_running", "num_running_reqs")),
    ("waiting", ("num_requests_waiting", "num_queue_reqs")),
)
TELEMETRY_LABEL = {"kv": "KV-cache usage", "running": "running", "waiting": "waiting"}


def http_rows(rows: pd.DataFrame) -> pd.DataFrame:
    if "transport" not in rows.columns:
        return rows.iloc[0:0]
    return rows[rows["transport"] == "http"]


def auth_text(auth: Any) -> str:
    """How requests authenticated, from the row's `auth`: the method and where the key came from,
    never anything else the dict might hold."""
    if auth is None or (isinstance(auth, float) and math.isnan(auth)):
        return "–"
    if isinstance(auth, str):
        return auth if auth == "none" else "recorded (not shown)"
    if isinstance(auth, dict):
        method = auth.get("method")
        if method == "env" and isinstance(auth.get("variable"), str):
            return f"API key from environment variable {auth['variable']}"
        if method == "file" and isinstance(auth.get("path"), str):
            return f"API key from file {auth['path']}"
        return f"method {method}" if isinstance(method, str) else "recorded (not shown)"
    return "recorded (not shown)"


def differing_text(d: Any) -> str:
    """`options_differing_from_defaults` of a row: `option value (server default: x)`."""
    if not isinstance(d, dict):
        return "–"
    if not d:
        return "none"
    return ", ".join(f"{k} {v.get('value')} (default: {v.get('default')})" if isinstance(v, dict) else f"{k} {v}"
                     for k, v in d.items())


def _distinct(g: pd.DataFrame, col: str, show=str) -> str:
    vals = [show(v) for v in column(g, col) if isinstance(v, (dict, list)) or present(v)]
    return " / ".join(dict.fromkeys(vals)) or "–"


def identity_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per HTTP series: what answered and how the client talked to it."""
    df = http_rows(rows)
    out = []
    for s, g in df.groupby("series", sort=False):
        tls = [v for v in column(g, "tls_verify") if isinstance(v, bool) or str(v) in ("True", "False")]
        out.append({
            "engine": g["engine"].iloc[0], "series": s, "transport": "http",
            "kind": _distinct(g, "endpoint_kind"), "endpoint": _distinct(g, "endpoint_url"),
            "server_version": _distinct(g, "server_version"), "server_model": _distinct(g, "server_model"),
            "launch_command": (_distinct(g, "launch_command") if column(g, "launch_command").map(present).any()
                               else "attached (not launched by the harness)"),
            "tls_verify": ("NO (verify_tls=false)" if any(str(v) == "False" for v in tls)
                           else "yes" if tls else "–"),
            "auth": _distinct(g, "auth", auth_text),
            "itl_chunking": _distinct(g, "itl_chunking"),
            "differing": _distinct(g, "options_differing_from_defaults", differing_text),
        })
    return pd.DataFrame(out)


SETTING_LABEL = {"cuda_graphs": "CUDA graphs", "gpu_memory_utilization": "memory share",
                 "chunked_prefill": "chunked prefill", "tensor_parallel_size": "tensor parallel size",
                 "max_num_seqs": "most sequences per batch", "max_num_batched_tokens": "most tokens per step",
                 "kv_cache_bytes": "KV-cache bytes"}


def settings_differences(rows: pd.DataFrame) -> dict[str, dict[str, list[str]]]:
    """The server settings (`server_settings` of launched HTTP servers: graphs or eager, memory
    share, chunked prefill, parallelism, batch limits) that differ between the series of one
    report: {setting: {series: [values]}}, only settings with more than one value overall."""
    df = http_rows(rows)
    if df.empty or "server_settings" not in df.columns:
        return {}
    seen: dict[str, dict[str, list[str]]] = {}
    for s, g in df.groupby("series", sort=False):
        for st in column(g, "server_settings"):
            if not isinstance(st, dict):
                continue
            for k, v in st.items():
                vals = seen.setdefault(str(k), {}).setdefault(str(s), [])
                if str(v) not in vals:
                    vals.append(str(v))
    return {k: per for k, per in seen.items()
            if len(per) > 1 and len({v for vs in per.values() for v in vs}) > 1}


def settings_note(diff: dict[str, dict[str, list[str]]]) -> Note:
    parts = [f"{SETTING_LABEL.get(k, k)}: " + ", ".join(f"{s} {' / '.join(v)}" for s, v in per.items())
             for k, per in diff.items()]
    return Note("The servers ran with different settings, so their comparison measures these settings too, "
                "not the servers alone: " + "; ".join(parts) + ". Give the same engine_options (e.g. "
                "gpu_memory_utilization) to every server, or read the comparison with this in mind.",
                kind="warning", name="http-settings-differ")


def _int(v: Any) -> int | None:
    if isinstance(v, bool) or not present(v):
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def reasons_text(reasons: Any) -> str:
    if not isinstance(reasons, dict) or not reasons:
        return "–"
    return "; ".join(f"{k}: {v}" for k, v in sorted(reasons.items(), key=lambda kv: -(_int(kv[1]) or 0)))


def flags_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Every row (any engine, any status) whose server and client output-token counts differ, or
    that had failed requests: the counts, the failures and their reasons."""
    out = []
    for r in rows.to_dict("records"):
        server, client = _int(r.get("output_tokens_server")), _int(r.get("output_tokens_client"))
        failed = _int(r.get("failed_requests")) or 0
        mismatch = (server is not None and client is not None and server != client) or r.get("token_count_mismatch") is True
        if not mismatch and failed <= 0:
            continue
        out.append({"engine": r["engine"], "series": r["series"], "workload": r.get("workload"),
                    "point": point_label(r.get("point")), "status": r.get("status"),
                    "output_tokens_server": server, "output_tokens_client": client, "mismatch": mismatch,
                    "failed_requests": failed, "reasons": reasons_text(r.get("failed_request_reasons"))})
    return pd.DataFrame(out)


def telemetry_kind(name: str) -> str | None:
    for kind, needles in TELEMETRY:
        if any(n in name for n in needles):
            return kind
    return None


def telemetry_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Long format of every row's `server_metrics` that is about KV-cache usage or the queue:
    series, point_key, point (label), metric (sample name), kind (kv | running | waiting),
    t_s, value (KV-cache usage in percent; request counts as they are)."""
    if "server_metrics" not in rows.columns:
        return pd.DataFrame()
    recs = []
    for r in rows.to_dict("records"):
        sm = r.get("server_metrics")
        if not isinstance(sm, dict):
            continue
        label = f"{r.get('workload')} · {point_label(r.get('point'))}"
        for name, samples in sm.items():
            kind = telemetry_kind(str(name))
            if kind is None or not isinstance(samples, list):
                continue
            pts = [(float(s[0]), float(s[1])) for s in samples
                   if isinstance(s, (list, tuple)) and len(s) == 2 and all(isinstance(x, (int, float)) for x in s)]
            if len(pts) > TELEMETRY_MAX_SAMPLES:
                step = len(pts) / TELEMETRY_MAX_SAMPLES
                pts = [pts[int(i * step)] for i in range(TELEMETRY_MAX_SAMPLES)] + [pts[-1]]
            for t, v in pts:
                recs.append({"engine": r["engine"], "series": r["series"], "point_key": r.get("point_key"),
                             "point": label, "metric": str(name), "kind": kind, "t_s": t,
                             "value": v * 100 if kind == "kv" else v})
    return pd.DataFrame(recs)


def telemetry_figure(tl: pd.DataFrame, colours: dict[str, str]) -> go.Figure:
    """Two panels (KV-cache usage; requests running and waiting) over time, one line per engine;
    a selector switches points (the first point is shown)."""
    points = list(dict.fromkeys(tl["point_key"]))[:TELEMETRY_MAX_POINTS]
    labels = {pk: tl.loc[tl["point_key"] == pk, "point"].iloc[0] for pk in points}
    styles = series_styles(tl, colours)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=["KV-cache usage (%)", "requests running (solid) and waiting (dotted)"])
    owner: list[str] = []
    for pk in points:
        part = tl[tl["point_key"] == pk]
        for s, st in styles.items():
            for kind, row, dash in (("kv", 1, "solid"), ("running", 2, "solid"), ("waiting", 2, "dot")):
                d = part[(part["series"] == s) & (part["kind"] == kind)]
                if d.empty:
                    continue
                d = d[d["metric"] == d["metric"].iloc[0]].sort_values("t_s")   # one sample name per kind
                fig.add_trace(go.Scatter(
                    x=list(d["t_s"]), y=list(d["value"]), mode="lines+markers", marker=dict(size=4),
                    name=esc(f"{s} · {TELEMETRY_LABEL[kind]}"), legendgroup=esc(s),
                    line=dict(color=st["color"], dash=dash, width=2, shape="hv"), visible=pk == points[0],
                    hovertemplate=f"<b>{esc(s)}</b> {esc(d['metric'].iloc[0])}<br>{esc(labels[pk])}<br>"
                                  f"t: %{{x:.4~g}} s<br>%{{y:.4~g}}<extra></extra>"), row=row, col=1)
                owner.append(pk)
    if len(points) > 1:
        fig.update_layout(updatemenus=[dict(
            type="dropdown", x=0, xanchor="left", y=1.01, yanchor="bottom", showactive=True,
            buttons=[dict(label=esc(labels[pk]), method="update",
                          args=[{"visible": [o == pk for o in owner]},
                                {"title.text": esc(f"Server telemetry: {labels[pk]}")}]) for pk in points])])
    fig.update_xaxes(title_text="time since the point started (s)", row=2, col=1)
    fig.update_yaxes(title_text="KV-cache usage (%)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="requests", rangemode="tozero", row=2, col=1)
    fig = base_layout(fig, height=520, title=f"Server telemetry: {labels[points[0]]}")
    if len(points) > 1:
        fig.update_layout(legend=dict(x=1, xanchor="right"))
    return fig


def identity_table(ident: pd.DataFrame) -> Table:
    cols = [("engine", "series"), ("transport", "transport"), ("server", "kind"), ("endpoint", "endpoint"),
            ("server version", "server_version"), ("model", "server_model"), ("launch command", "launch_command"),
            ("TLS verified", "tls_verify"), ("authentication", "auth"),
            ("settings differing from the server's defaults", "differing")]
    rows = [[Cell(str(r[f]), cls="bad" if f == "tls_verify" and str(r[f]).startswith("NO")
                  else "wrap error" if f == "launch_command" else "wrap" if f == "differing" else "")
             for _, f in cols]
            for r in ident.to_dict("records")]
    return Table([h for h, _ in cols], rows, "Who answered each HTTP engine's requests, as the rows record it. "
                 "Authentication says where the key came from, never the key.", "http-servers")


def flags_table(flags: pd.DataFrame) -> Table:
    rows, classes = [], []
    for r in flags.to_dict("records"):
        server, client = r["output_tokens_server"], r["output_tokens_client"]
        rows.append([Cell(str(r["series"])), Cell(str(r["workload"])), Cell(str(r["point"])),
                     Cell(fmt_num(server) if server is not None else "–", server, cls="num"),
                     Cell(fmt_num(client) if client is not None else "–", client, cls="num"),
                     Cell("MISMATCH" if r["mismatch"] else "equal", cls="bad" if r["mismatch"] else ""),
                     Cell(fmt_num(r["failed_requests"]), r["failed_requests"],
                          cls="num bad" if r["failed_requests"] else "num"),
                     Cell(r["reasons"], cls="wrap")])
        classes.append("bad")
    return Table(["engine", "workload", "point", "output tokens (server's usage)", "output tokens (client counted)",
                  "token counts", "failed requests", "why they failed"], rows,
                 "Points where the server's and the client's output-token counts differ (a finding, not noise), "
                 "or where requests failed: their metrics are over the completed requests only.",
                 "http-flags", classes)


@section("http-endpoints", "HTTP endpoints", "Engines run as OpenAI-compatible servers: who answered, "
         "whether the server's token counts agree with the tokens the client received, which requests "
         "failed and why, and the server's own telemetry (its /metrics) over each point.")
def endpoints(data: ReportData) -> list[Block]:
    ident = identity_frame(data.rows)
    flags = flags_frame(data.rows)
    tl = telemetry_frame(data.rows)
    if ident.empty and flags.empty and tl.empty:
        return []
    blocks: list[Block] = []
    diff = settings_differences(data.rows)
    if diff:
        blocks.append(settings_note(diff))
    if not ident.empty:
        blocks.append(identity_table(ident))
        chunking = [c for c in dict.fromkeys(ident["itl_chunking"]) if c != "–"]
        if chunking:
            blocks.append(Note("How tokens that arrive in one SSE chunk are timed (ITL): " + " / ".join(chunking) + "."))
    if not flags.empty:
        blocks.append(Note(f"{len(flags)} point(s) flagged: "
                           + "; ".join(f"{r.series} at {r.point}: "
                                       + ", ".join(([f"server counted {fmt_num(r.output_tokens_server)} output tokens, "
                                                     f"the client {fmt_num(r.output_tokens_client)}"] if r.mismatch else [])
                                                   + ([f"{r.failed_requests} failed requests ({r.reasons}); metrics "
                                                       f"over the completed requests only"] if r.failed_requests else []))
                                       for r in flags.itertuples()) + ".", kind="warning", name="http-flags"))
        blocks.append(flags_table(flags))
    elif not ident.empty:
        blocks.append(Note("Every HTTP point: server and client output-token counts equal, no failed requests.",
                           name="http-no-flags"))
    if not tl.empty:
        blocks.append(Figure(telemetry_figure(tl, data.colours), "http-telemetry",
                             "The server's KV-cache usage and its queue (requests running, waiting) while each "
                             "point ran, scraped from its /metrics; the selector above the plot switches points."))
    return blocks
