"""The capacity section: per model, throughput per device against per-user speed (a
Pareto figure, one curve per engine over its rate or concurrency sweep: serving rows and the
capacity search's probes), and the capacity each engine was found to have under the SLOs
(workload `capacity`, one conclusion row per engine). In-process engines and HTTP endpoints alike:
an endpoint is an engine with another name."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from reports.blocks import Block, Cell, Figure, Note, Table, fmt_num, nice
from reports.data import ReportData
from reports.figures import base_layout, esc, series_styles
from reports.sections.registry import section
from reports.sections.common import MS, Col, present, values_table

KIND = {"rate": ("request rate", "req/s"), "concurrency": ("concurrency", "concurrent")}
SATURATED_COLOUR = "#B00020"
CLIENT_LIMITED_COLOUR = "#E65100"   # the load generator did not keep up: a miss like saturation, drawn apart


def _point(r: dict[str, Any]) -> dict[str, Any]:
    return r.get("point") if isinstance(r.get("point"), dict) else {}


def _f(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if not math.isnan(x) else None


def _bool(v: Any) -> bool | None:
    return bool(v) if isinstance(v, (bool, np.bool_)) else None


def _yes_no(v: Any) -> str:
    return "yes" if v is True else "no" if v is False else "–"


def load_label(kind: str, value: float | None) -> str:
    if kind == "rate":
        return "all at once" if value is None or math.isinf(value) else f"{value:g} req/s"
    return "?" if value is None else f"c={value:g}"


def pareto_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Every ok serving row and capacity probe with a device throughput (`output_tok_s`) and a
    per-user speed (`per_user_tok_s`; older serving rows without it: 1 / median TPOT, marked
    derived): series, model, kind (rate | concurrency), load (its value; inf: all at once),
    load_label, source, saturated, client_limited (the load generator did not keep up; null: no
    client, an in-process engine), meets_slo, slo_violations."""
    ok = rows[(rows["status"] == "ok") & rows["workload"].isin(["serving", "capacity"])]
    out = []
    for r in ok.to_dict("records"):
        p = _point(r)
        if r["workload"] == "capacity":
            if p.get("result") or p.get("search") not in KIND:
                continue
            kind, load, source = p["search"], _f(p.get("value")), f"capacity probe {p.get('probe', '')}".strip()
        elif r.get("load_mode") == "trace":           # a replayed trace: at its mean rate (after its time scale)
            kind, load, source = "rate", _f(r.get("offered_rate")), "serving (trace)"
        else:
            closed = r.get("load_mode") == "closed"
            kind = "concurrency" if closed else "rate"
            load = _f(r.get("concurrency")) if closed else _f(r.get("request_rate"))
            if not closed and load is None:
                load = math.inf                       # all at once
            source = "serving"
        per_user, derived = _f(r.get("per_user_tok_s")), False
        if per_user is None and (_f(r.get("tpot_s")) or 0) > 0:
            per_user, derived = 1 / _f(r.get("tpot_s")), True     # type: ignore[operator]
        thr = _f(r.get("output_tok_s"))
        if per_user is None or thr is None:
            continue
        viol = r.get("slo_violations")
        out.append({"engine": r["engine"], "series": r["series"], "model": r.get("model") or "?", "kind": kind,
                    "curve": curve_of(kind, source),
                    "load": load if load is not None else float("nan"),
                    "load_label": load_label(kind, load) if source != "serving (trace)" else
                    f"trace {'?' if load is None else f'{load:.3g}'} req/s",
                    "source": source, "per_user_tok_s": per_user, "per_user_derived": derived,
                    "output_tok_s": thr, "saturated": _bool(r.get("saturated")),
                    "cost_per_good_mtok_output": _f(r.get("cost_per_good_mtok_output")),
                    "cost_currency": r.get("cost_currency") if isinstance(r.get("cost_currency"), str) else None,
                    "client_limited": _bool(r.get("client_limited")),
                    "meets_slo": _bool(r.get("meets_slo")),
                    "slo_violations": "; ".join(map(str, viol)) if isinstance(viol, list) and viol else None})
    df = pd.DataFrame(out)
    if df.empty:
        return df
    df["_probes"] = df["curve"].str.startswith("capacity")     # sweeps first, then the probes
    df["_model"] = df["model"].map({m: i for i, m in enumerate(dict.fromkeys(df["model"]))})   # as the rows come
    return df.sort_values(["_model", "series", "_probes", "curve", "load"], kind="stable").drop(
        columns=["_probes", "_model"]).reset_index(drop=True)


def curve_of(kind: str, source: str) -> str:
    """Which curve a point belongs to (besides its series): the serving sweep over rates, over
    concurrencies, the capacity search's probes over either, or replayed traces."""
    if source == "serving (trace)":
        return "trace replay"
    return f"capacity probes ({KIND[kind][0]})" if source.startswith("capacity") else f"{KIND[kind][0]} sweep"


def pareto_figure(df: pd.DataFrame, colours: dict[str, str], model: str, y: str = "output_tok_s",
                  y_title: str = "throughput per device: output tok/s",
                  title: str = "throughput per device vs per-user speed") -> go.Figure:
    """One model: x per-user speed, y device throughput (or `y`: the cost per good Mtok); one curve
    per series and sweep (rates, concurrencies, the capacity search's probes) in load order, each
    point labelled with its load; saturated points drawn as a red ✕, client-limited ones (not
    saturated) as an orange ✚. A series with one curve is named by the series alone."""
    fig = go.Figure()
    styles = series_styles(df, colours)
    curves_per_series = df.groupby("series", sort=False)["curve"].nunique()
    for (s, curve), d in df.groupby(["series", "curve"], sort=False):
        st = styles[s]
        kind = d["kind"].iloc[0]
        name = str(s) if curves_per_series[s] == 1 else f"{s} · {curve}"
        probes = str(curve).startswith("capacity")
        sat = [v is True for v in d["saturated"]]
        lim = [v is True and not x for v, x in zip(d["client_limited"], sat)]
        fig.add_trace(go.Scatter(
            x=list(d["per_user_tok_s"]), y=list(d[y]), name=esc(name), legendgroup=esc(name),
            mode="lines+markers+text", showlegend=True,
            text=[esc(v) for v in d["load_label"]], texttemplate="%{text}",
            textposition="top right", textfont=dict(size=10, color=st["color"]), cliponaxis=False,
            line=dict(color=st["color"], dash="dot" if probes else "dash" if kind == "concurrency" else "solid",
                      width=1 if probes else 2),
            marker=dict(color=[SATURATED_COLOUR if x else CLIENT_LIMITED_COLOUR if c else st["color"]
                               for x, c in zip(sat, lim)],
                        symbol=["x" if x else "cross" if c else "diamond-open" if probes else st["symbol"]
                                for x, c in zip(sat, lim)],
                        size=[12 if x or c else 10 if probes else 8 for x, c in zip(sat, lim)],
                        line=dict(width=2 if probes else 0, color=st["color"])),
            customdata=[[esc(lbl), esc(src), _yes_no(s_), _yes_no(m), " (1 / median TPOT)" if der else "",
                         _yes_no(c)]
                        for lbl, src, s_, m, der, c in zip(d["load_label"], d["source"], d["saturated"], d["meets_slo"],
                                                           d["per_user_derived"], d["client_limited"])],
            hovertemplate=(f"<b>{esc(name)}</b> at %{{customdata[0]}} (%{{customdata[1]}})<br>"
                           f"per-user: %{{x:.4~g}} tok/s%{{customdata[4]}}<br>{esc(y_title)}: %{{y:.5~g}}<br>"
                           "saturated: %{customdata[2]}<br>client-limited: %{customdata[5]}<br>"
                           "meets SLO: %{customdata[3]}<extra></extra>")))
    log = lambda col: (df[col] > 0).all() and df[col].max() / df[col].min() > 50  # noqa: E731
    fig.update_xaxes(title_text="per-user speed: output tok/s per request (1 / median TPOT)",
                     type="log" if log("per_user_tok_s") else None, rangemode="tozero")
    fig.update_yaxes(title_text=esc(y_title), type="log" if log(y) else None, rangemode="tozero")
    return base_layout(fig, height=440, title=f"{model}: {title}")


def capacity_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per capacity conclusion (workload capacity, point.result): series, model, search,
    capacity, the SLOs, bracket, resolution, probes (how many, met the SLO, saturated,
    client-limited: the loads where the load generator did not keep up), status."""
    df = rows[rows["workload"] == "capacity"]
    records = df.to_dict("records")
    out = []
    for r in records:
        p = _point(r)
        if not p.get("result"):
            continue
        limited = client_limited_loads(r, records)
        search = p.get("search") if p.get("search") in KIND else ("concurrency" if present(r.get("capacity_concurrency"))
                                                                 else "rate")
        value = _f(r.get("capacity_rps") if search == "rate" else r.get("capacity_concurrency"))
        probes = r.get("capacity_probes") if isinstance(r.get("capacity_probes"), list) else []
        probes = [q for q in probes if isinstance(q, (list, tuple)) and len(q) >= 2]
        met = [q for q in probes if q[1] is True]
        sat = [q for q in probes if len(q) > 2 and q[2] is True]
        bracket = r.get("capacity_bracket") if isinstance(r.get("capacity_bracket"), (list, tuple)) else None
        out.append({"engine": r["engine"], "series": r["series"], "model": r.get("model") or "?", "search": search,
                    "capacity": value,
                    "capacity_text": capacity_text(search, value, probes, r.get("status"), r.get("capacity_note")),
                    "slo_text": slo_text(r.get("capacity_slo")),
                    "bracket": bracket_text(bracket, search),
                    "resolution": _f(r.get("capacity_resolution")),
                    "probes": len(probes) if probes else None, "probes_met": len(met), "probes_saturated": len(sat),
                    "client_limited": limited,
                    "cost": _f(r.get("cost_per_good_mtok_output")), "cost_min": _f(r.get("cost_min_per_good_mtok_output")),
                    "cost_min_value": _f(r.get("cost_min_value")),
                    "cost_currency": r.get("cost_currency") if isinstance(r.get("cost_currency"), str) else None,
                    "cost_basis": r.get("cost_price_basis") if isinstance(r.get("cost_price_basis"), str) else None,
                    "status": r.get("status"), "error": r.get("error")})
    return pd.DataFrame(out)


def client_limited_loads(result: dict[str, Any], records: list[dict[str, Any]]) -> list[float]:
    """The probed loads of a capacity conclusion where the load generator did not keep up: its
    `capacity_client_limited`; rows written without that field: its series' probe rows of the same
    search that say `client_limited`."""
    own = result.get("capacity_client_limited")
    if isinstance(own, (list, tuple)):
        return sorted(v for v in map(_f, own) if v is not None)
    search = _point(result).get("search")
    return sorted(v for r in records if r.get("series") == result.get("series") and r.get("client_limited") is True
                  and not _point(r).get("result") and _point(r).get("search") == search
                  and (v := _f(_point(r).get("value"))) is not None)


def capacity_text(search: str, value: float | None, probes: list, status: Any, note: Any = None) -> str:
    """The capacity found, or why there is none (the row's capacity_note, else what the probes say)."""
    if status != "ok":
        return f"{status}"
    if value is not None:
        if probes and all(q[1] is True for q in probes):     # no probe missed: the upper end was never found
            return f"≥ {fmt_num(nice(value))} {KIND[search][1]} (every probe met the SLOs)"
        return f"{fmt_num(nice(value))} {KIND[search][1]}"
    if isinstance(note, str) and note:
        return f"not found: {note}"
    loads = [_f(q[0]) for q in probes if _f(q[0]) is not None]
    if probes and not any(q[1] is True for q in probes) and loads:
        return f"not found: every probe missed the SLOs (lowest {fmt_num(nice(min(loads)))} {KIND[search][1]})"
    if probes and all(q[1] is True for q in probes) and loads:
        return f"not found: every probe met the SLOs (highest {fmt_num(nice(max(loads)))} {KIND[search][1]})"
    return "not found"


def slo_text(slo: Any) -> str:
    """'TTFT p99 ≤ 500 ms · TPOT p99 ≤ 50 ms · E2EL p99 unset'."""
    if not isinstance(slo, dict):
        return "–"
    parts = []
    for key, label in (("ttft_p99_s", "TTFT p99"), ("tpot_p99_s", "TPOT p99"), ("e2el_p99_s", "E2EL p99")):
        v = _f(slo.get(key))
        parts.append(f"{label} ≤ {fmt_num(v * MS)} ms" if v is not None else f"{label} unset")
    return " · ".join(parts)


def bracket_text(bracket: Any, search: str) -> str:
    if not bracket or len(bracket) != 2:
        return "–"
    lo, hi = (_f(v) for v in bracket)
    return f"[{fmt_num(nice(lo)) if lo is not None else '–'}, {fmt_num(nice(hi)) if hi is not None else '–'}] {KIND[search][1]}"


def cost_cells(r: dict[str, Any]) -> list[Cell]:
    """The cost per good Mtok of output at the capacity, and the cheapest probe that met the SLOs."""
    cur = r["cost_currency"] if isinstance(r["cost_currency"], str) else ""
    cost, low, load = _f(r["cost"]), _f(r["cost_min"]), _f(r["cost_min_value"])    # NaN in a frame: none
    at = (Cell(f"{fmt_num(cost)} {cur}", cost, cls="num", title=r["cost_basis"] or "") if cost is not None else
          Cell("no load met the SLOs" if cur else "–", None, cls="muted"))
    cheapest = (Cell(f"{fmt_num(low)} {cur} at {fmt_num(nice(load))} {KIND[r['search']][1]}", low, cls="num")
                if low is not None else Cell("–", None, cls="muted"))
    return [at, cheapest]


def capacity_table(cap: pd.DataFrame) -> Table:
    rows, classes = [], []
    several_models = cap["model"].nunique() > 1
    priced = "cost_currency" in cap and cap["cost_currency"].notna().any()
    for r in cap.to_dict("records"):
        ok = r["status"] == "ok"
        rows.append([
            Cell(str(r["series"])), *([Cell(str(r["model"]))] if several_models else []),
            Cell(KIND[r["search"]][0]),
            (Cell(r["capacity_text"], r["capacity"], cls="num") if _f(r["capacity"]) is not None else
             # why none was found: its first clause here (the column stays narrow), the whole on hover
             Cell(r["capacity_text"].split(";")[0], None, title=r["capacity_text"])),
            Cell(r["slo_text"], cls="wrap"),
            Cell(r["bracket"], cls="num"),
            Cell(fmt_num(nice(r["resolution"])) if r["resolution"] is not None else "–", r["resolution"], cls="num"),
            Cell("–" if r["probes"] is None else f"{r['probes']} ({r['probes_met']} met the SLOs, "
                                                 f"{r['probes_saturated']} saturated"
                                                 + (f", {len(r['client_limited'])} client-limited" if r["client_limited"]
                                                    else "") + ")", r["probes"], cls="num"),
            *(cost_cells(r) if priced else []),
            Cell("" if ok else str(r["error"] or ""), cls="error" if not ok else ""),
        ])
        classes.append("" if ok else "bad")
    return Table(["engine", *(["model"] if several_models else []), "search", "capacity", "SLOs it was found under",
                  "bracket [meets, misses]", "resolution", "probes",
                  *(["cost per good Mtok of output at the capacity", "cheapest probe that met the SLOs"] if priced else []),
                  "error"], rows,
                 "The largest load at which every SLO held, found by the capacity search: the bracket is the last "
                 "load that met the SLOs and the first that missed them, searched down to the resolution."
                 + (" The cost per good million output tokens counts only the tokens of requests that met the SLOs, at "
                    "the price in the Cost section (hover a cost for the price it used)." if priced else ""),
                 "capacity", classes)


@section("capacity", "Capacity", "How much load each engine sustains, and what each user gets at it: "
         "throughput per device (output tokens/s) against per-user speed (output tokens/s of one "
         "request, 1 / median TPOT) over the rate or concurrency sweep, and the capacity found under "
         "the SLOs.")
def capacity(data: ReportData) -> list[Block]:
    blocks: list[Block] = []
    cap = capacity_frame(data.rows)
    if not cap.empty:
        blocks.append(capacity_table(cap))
        limited = cap[cap["client_limited"].map(bool)]
        if not limited.empty:
            blocks.append(Note(client_limited_note(limited), kind="warning", name="capacity-client-limited"))
    pf = pareto_frame(data.rows)
    for model, d in (pf.groupby("model", sort=False) if not pf.empty else []):
        any_limited = any(v is True for v in d["client_limited"])
        table = values_table(d.assign(saturated_text=d["saturated"].map(_yes_no), meets_text=d["meets_slo"].map(_yes_no),
                                      client_limited_text=d["client_limited"].map(_yes_no)),
                             [Col("engine", "series", text=True), Col("load", "load_label", text=True),
                              Col("from", "source", text=True),
                              Col("per-user tok/s", "per_user_tok_s"), Col("device tok/s", "output_tok_s"),
                              Col("saturated", "saturated_text", text=True),
                              *([Col("client-limited", "client_limited_text", text=True)]
                                if d["client_limited"].notna().any() else []),
                              Col("meets SLOs", "meets_text", text=True),
                              Col("SLO violations", "slo_violations", text=True)],
                             "capacity-pareto-values")
        blocks.append(Figure(pareto_figure(d, data.colours, str(model)), "capacity-pareto",
                             f"{model}: each point is one load (labelled: c = concurrent requests, or the request "
                             "rate); up is more throughput for the device, right is faster for each user. Solid: a "
                             "rate sweep; dashed: a concurrency sweep; open diamonds on a dotted line: the capacity search's "
                             "probes, in load order. "
                             "Red ✕: saturated (the queue grew through the run)."
                             + (" Orange ✚: client-limited (the load generator did not keep up; its latencies are "
                                "partly the client's, and a probe there is a miss, never the engine's capacity)."
                                if any_limited else ""), table))
    blocks += cost_pareto_blocks(pf, data.colours)
    if pf.empty and cap.empty:
        return []
    if not pf.empty and pf["per_user_derived"].any():
        blocks.append(Note("Rows without per_user_tok_s (older serving rows): per-user speed is 1 / their median TPOT."))
    return blocks


def cost_pareto_blocks(pf: pd.DataFrame, colours: dict[str, str]) -> list[Block]:
    """Per model and currency: the cost per good Mtok of output against per-user speed, the same
    curves as the throughput figure (points with no good token have no cost and are left out)."""
    if pf.empty or "cost_per_good_mtok_output" not in pf or not pf["cost_per_good_mtok_output"].notna().any():
        return []
    blocks: list[Block] = []
    priced = pf[pf["cost_currency"].notna()]
    for (model, cur), d in priced.groupby(["model", "cost_currency"], sort=False):
        shown = d[d["cost_per_good_mtok_output"].notna()]
        if shown.empty:
            continue
        label = f"cost per good Mtok of output ({cur})"
        table = values_table(shown.assign(meets_text=shown["meets_slo"].map(_yes_no)),
                             [Col("engine", "series", text=True), Col("load", "load_label", text=True),
                              Col("from", "source", text=True), Col("per-user tok/s", "per_user_tok_s"),
                              Col(label, "cost_per_good_mtok_output"), Col("meets SLOs", "meets_text", text=True)],
                             "capacity-cost-pareto-values")
        left = len(d) - len(shown)
        blocks.append(Figure(pareto_figure(shown, colours, str(model), y="cost_per_good_mtok_output", y_title=label,
                                           title="cost per good million tokens vs per-user speed"),
                             "capacity-cost-pareto",
                             f"{model}: the same loads as the throughput figure, priced: down is cheaper per good "
                             "million output tokens (tokens of requests that met the SLOs, at the price in the Cost "
                             "section), right is faster for each user. A point where no request met the SLOs has no "
                             "cost per good token"
                             + (f" ({left} such point{'s' if left != 1 else ''}, left out)" if left else "") + ".",
                             table))
    return blocks


def client_limited_note(limited: pd.DataFrame) -> str:
    """Which probes of which search the load generator could not keep up with, and what follows."""
    where = "; ".join(f"{r['series']} ({KIND[r['search']][0]}) at "
                      f"{', '.join(fmt_num(nice(v)) for v in r['client_limited'])} {KIND[r['search']][1]}"
                      for r in limited.to_dict("records"))
    return ("Client-limited probes (the load generator did not keep up, so their latencies are partly the client's): "
            f"{where}. They were counted as misses, never as the engine's capacity, so a capacity found below them "
            "may be an underestimate. Raise workload.client_processes and search again.")
