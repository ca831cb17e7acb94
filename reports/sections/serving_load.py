"""The serving section (workload `serving`): TTFT, TPOT, ITL and E2EL percentiles against the
request rate, the TTFT distribution, and goodput."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from reports.blocks import Block, Figure, Note
from reports.data import ReportData
from reports.figures import facet_lines
from reports.sections.registry import section
from reports.sections.common import MS, Col, column, has, values_table, workload_rows

PERCENTILE_KEYS = ("p50", "p90", "p99")
CDF_MAX_POINTS = 400


SERVING_METRICS = [("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2el_s", "E2EL")]


ALL_AT_ONCE = "all at once"


CLIENT_COLS = [  # what the load generator did during the point (endpoints): did it keep up?
    Col("send lag p99 ms", "send_lag_s_p99", MS),
    Col("loop lag max ms", "loop_lag_s_max", MS),
    Col("client CPU % of a core", "client_cpu_frac", 100),
    Col("achieved req/s", "achieved_rate"),
]


LOAD = {  # load mode -> (x-axis title, what one panel's value is, load column)
    "open": ("request rate (req/s)", "req/s", "request_rate"),
    "closed": ("concurrent requests (closed loop)", "concurrent", "concurrency"),
    "trace": ("trace's mean request rate (req/s)", "req/s (trace)", "offered_rate"),
}
MODE = {  # load mode -> (figure name prefix, "against" in captions, the table's load column)
    "open": ("serving-", "request rate", "rate req/s"),
    "closed": ("serving-closed-", "concurrency", "concurrency"),
    "trace": ("serving-trace-", "the trace's mean request rate", "trace req/s"),
}


def yes_no(v: object) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    return "–"


def serving_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Serving rows (ok) in point order, with `load_mode` ("open" when the row does not say),
    `rate_x` (the load to plot at: the request rate in an open loop, where a rate of infinity,
    stored as null, sits one step right of the largest finite rate; the concurrency in a closed
    loop; a replayed trace's mean rate after its time scale, `offered_rate`) and `rate_label`."""
    df = workload_rows(rows, "serving")
    if df.empty:
        return df
    df["load_mode"] = column(df, "load_mode").map(lambda m: m if m in LOAD else "open")
    rate = pd.to_numeric(column(df, "request_rate"), errors="coerce")
    conc = pd.to_numeric(column(df, "concurrency"), errors="coerce")
    finite = rate[np.isfinite(rate) & (df["load_mode"] == "open")]
    top = float(finite.max()) * 2 if len(finite) else 1.0
    offered = pd.to_numeric(column(df, "offered_rate"), errors="coerce")
    closed, trace = df["load_mode"] == "closed", df["load_mode"] == "trace"
    df["rate_x"] = rate.where(np.isfinite(rate), top).where(~closed, conc).where(~trace, offered)
    df["rate_label"] = [(f"{c:g}" if np.isfinite(c) else "?") if m == "closed" else
                        (f"{o:.3g}" if np.isfinite(o) else "?") if m == "trace" else
                        (f"{v:g}" if np.isfinite(v) else ALL_AT_ONCE)
                        for m, v, c, o in zip(df["load_mode"], rate.fillna(np.inf), conc.fillna(np.nan),
                                              offered.fillna(np.nan))]
    df["saturated_text"] = column(df, "saturated").map(yes_no)
    df["stopped_early_text"] = column(df, "stopped_early").map(yes_no)
    df["client_limited_text"] = column(df, "client_limited").map(yes_no)   # null (in-process engine): "–"
    return df.sort_values(["load_mode", "series", "rate_x"], kind="stable").reset_index(drop=True)


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


def _mode_figures(df: pd.DataFrame, mode: str, colours: dict[str, str]) -> list[Block]:
    x_title, unit, _ = LOAD[mode]
    prefix, against, load_header = MODE[mode]
    blocks: list[Block] = []
    for metric, label in SERVING_METRICS:
        long = serving_percentiles(df, metric)
        if long.empty:
            continue
        blocks.append(Figure(_rate_ticks(facet_lines(
            long, x="rate_x", y="value", facet="percentile", facet_label=lambda p: p, colours=colours,
            x_title=x_title, y_title=f"{label} (ms)", scale=MS), df),
            f"{prefix}{metric.removesuffix('_s')}", f"{label} percentiles vs {against}."))
    cdf = cdf_frame(df)
    if not cdf.empty:
        labels = dict(zip(df["rate_x"], df["rate_label"]))
        fig = facet_lines(cdf, x="value", y="fraction", facet="rate_x",
                          facet_label=lambda r: labels.get(r, ALL_AT_ONCE) + (f" {unit}" if labels.get(r) != ALL_AT_ONCE else ""),
                          colours=colours, x_title="TTFT (s)", y_title="fraction of requests", labels=False)
        fig.update_xaxes(tickvals=None)
        blocks.append(Figure(fig, f"{prefix}ttft-cdf", f"Cumulative distribution of TTFT, one panel per {against}."))
    if has(df, "goodput_req_s"):
        blocks.append(Figure(_rate_ticks(facet_lines(
            df, x="rate_x", y="goodput_req_s", facet=None, colours=colours,
            x_title=x_title, y_title="goodput (req/s)"), df), f"{prefix}goodput",
            "Requests per second meeting every SLO."))
    cols = [Col("engine", "series", text=True),
            Col(load_header, "rate_label", text=True)]
    for metric, label in SERVING_METRICS:
        cols += [Col(f"{label} {p} ms", f"{metric}_{p}", MS, None, "lower") for p in PERCENTILE_KEYS
                 if has(df, f"{metric}_{p}")]
    if has(df, "goodput_req_s"):
        cols.append(Col("goodput req/s", "goodput_req_s", 1, None, "higher"))
    cols += [c for c in (Col("output tok/s", "output_tok_s", 1, None, "higher"),
                         Col("per-user tok/s", "per_user_tok_s", 1, None, "higher")) if has(df, c.field)]
    if has(df, "saturated"):
        cols.append(Col("saturated", "saturated_text", text=True))
    if has(df, "stopped_early"):
        cols.append(Col("stopped early", "stopped_early_text", text=True))
    if has(df, "client_limited"):   # the load generator's own distortion (endpoints; null in-process)
        cols.append(Col("client-limited", "client_limited_text", text=True))
    cols += [c for c in CLIENT_COLS if has(df, c.field)]
    if blocks:
        blocks[-1].table = values_table(df, cols, f"{prefix}values", group="rate_x")
    return blocks


@section("serving", "Serving", "Requests arriving over time, at a given rate (open loop) or from a "
         "fixed number of users who each send the next request when the last one ends (closed loop), "
         "or at a replayed trace's recorded times: "
         "TTFT, TPOT, ITL and E2EL percentiles against the load, the TTFT distribution, and goodput.")
def serving(data: ReportData) -> list[Block]:
    df = serving_frame(data.rows)
    if df.empty:
        return []
    blocks: list[Block] = []
    for mode in LOAD:
        part = df[df["load_mode"] == mode]
        if not part.empty:
            blocks += _mode_figures(part, mode, data.colours)
    sat = df[df["saturated_text"] == "yes"]
    if not sat.empty:
        where = "; ".join(f"{s} at {', '.join(g['rate_label'])} {LOAD[m][1]}"
                          for (s, m), g in sat.groupby(["series", "load_mode"], sort=False))
        blocks.append(Note(f"Saturated (the queue grew through the run, TTFT rising with arrival index: the load "
                           f"is past what the engine sustains): {where}."))
    limited = df[df["client_limited_text"] == "yes"]
    if not limited.empty:
        blocks.append(Note(client_limited_text(limited), kind="warning", name="serving-client-limited"))
    early = df[df["stopped_early_text"] == "yes"]
    if not early.empty:
        blocks.append(Note("Stopped early (the point ended before every request was sent): "
                           + "; ".join(f"{s} at {', '.join(g['rate_label'])}" for s, g in early.groupby("series", sort=False))
                           + "."))
    return blocks


def client_limited_text(limited: pd.DataFrame) -> str:
    """The note for points where the load generator did not keep up: each series with its loads
    and the rows' reasons (client_limited_reasons), and what to do about it."""
    parts = []
    for (s, m), g in limited.groupby(["series", "load_mode"], sort=False):
        why = sorted({str(w) for v in column(g, "client_limited_reasons") if isinstance(v, (list, tuple)) for w in v})
        parts.append(f"{s} at {', '.join(g['rate_label'])} {LOAD[m][1]}"
                     + (f" ({'; '.join(why)})" if why else ""))
    return ("Client-limited (the load generator did not keep up: send lag p99 or event-loop lag past its limit, or a "
            "client process near a full core; these points' latencies include the client's own delays, not only the "
            "engine's, and are treated like saturated ones): " + "; ".join(parts)
            + ". Raise workload.client_processes to spread the requests over more client processes.")
