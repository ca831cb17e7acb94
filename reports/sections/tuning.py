"""The tuning section (workload `tune`): per engine, every trial of the search over its options
(a table sortable by any column, the best starred), the best configuration against the engine's
defaults with the interleaved confirmation's ratio, interval and verdict, each option's
importance, capacity per trial, and the engines' best configurations on the capacity section's
Pareto axes (throughput per device against per-user speed, drawn by its `pareto_figure`).

Rows (docs/results-schema.md): probe rows (`point.probe`), one trial row per trial
(`point.result`, `tune_*` fields), one conclusion row per engine (`point.tune == "conclusion"`)."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from harness.core.shell import launch_script
from reports.blocks import Block, Cell, Figure, Note, Pre, Table, fmt_num, nice, num_cell
from reports.data import ReportData, add_series
from reports.figures import bars, base_layout, esc, series_styles
from reports.sections.capacity import SATURATED_COLOUR, bracket_text, load_label, pareto_figure, slo_text
from reports.sections.common import Col, present, values_table
from reports.sections.registry import section

SEARCH_ROLES = ("default", "trial")              # trials of the search; "confirm-*" are the confirmation's
NO_VALUE_COLOUR = "#7F7F7F"
CONFIRMED = ("gain confirmed",)                            # the interval lies above 1
NEUTRAL = ("no significant difference",)                   # within the interval's noise either way
VERDICT_CLASS = {**{v: "good" for v in CONFIRMED}, "best < default": "bad"}
BUDGET_KEYS = ("trials", "seed", "sampler", "slos", "search", "load")   # the same for every engine (not the space)


def _point(r: dict[str, Any]) -> dict[str, Any]:
    return r.get("point") if isinstance(r.get("point"), dict) else {}


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        return None
    return float(v) if math.isfinite(float(v)) else None


def _flag(v: Any) -> bool | None:
    return bool(v) if isinstance(v, (bool, np.bool_)) else None


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def options_text(options: Any) -> str:
    """'max_num_seqs=8 · block_size=16'; an empty dict: the engine's configured options."""
    if not isinstance(options, dict) or not options:
        return "(the engine's configured options)"
    return " · ".join(f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in options.items())


def unit_of(metric: Any, objective: Any, currency: Any = None) -> str:
    """The objective's unit: concurrent requests for a concurrency search, a currency per good Mtok
    for a cost, else requests/s."""
    if objective == "cost":
        return currency if isinstance(currency, str) else "per good Mtok"
    return "concurrent" if "concurrency" in str(metric or "") else "req/s"


def objective_label(objective: Any, unit: str) -> str:
    if objective == "cost":  # of the cheapest load that met the SLOs (docs/tuning.md)
        return f"cost per good Mtok ({unit})"
    return f"goodput at the rate ({unit})" if objective == "goodput_at_rate" else f"capacity ({unit})"


def lower_better(objective: Any) -> bool:
    return objective == "cost"


def tune_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """The workload's rows, each engine one series: a trial's options (its engine_options) tell
    no series apart here, they are the trial's own; models, dtypes, devices and runs measuring the
    same point still do (reports.data.add_series)."""
    if rows.empty or "workload" not in rows.columns:
        return pd.DataFrame()
    df = rows[rows["workload"] == "tune"]
    return add_series(df.drop(columns=["engine_options"], errors="ignore")) if not df.empty else df


def _search(r: dict[str, Any]) -> str:
    return "concurrency" if present(r.get("capacity_concurrency")) and not present(r.get("capacity_rps")) else "rate"


def trials_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per trial of the search (workload tune, `point.result`, role default or trial):
    engine, series, model, trial, role, options (dict), value (the objective; None: nothing met
    the SLOs or the trial failed), objective, search, bracket, output_tok_s, per_user_tok_s, probes,
    status, error, best (the engine's best trial: its conclusion's `tune_best_trial`, else the
    largest value). Ordered by series, then trial."""
    df = tune_rows(rows)
    if df.empty or "tune_trial" not in df.columns:
        return pd.DataFrame()
    conc = conclusions_frame(rows)
    best = {c["series"]: c["best_trial"] for c in conc.to_dict("records")}
    front = {c["series"]: set(c["pareto_trials"]) for c in conc.to_dict("records") if c["pareto_trials"] is not None}
    out = []
    for r in df.to_dict("records"):
        p = _point(r)
        role = r.get("tune_role") if isinstance(r.get("tune_role"), str) else p.get("role")
        if not p.get("result") or role not in SEARCH_ROLES:
            continue
        trial = _num(r.get("tune_trial")) if present(r.get("tune_trial")) else _num(p.get("trial"))
        trial = int(trial) if trial is not None else None
        repeat = _num(r.get("tune_repeat_of")) if present(r.get("tune_repeat_of")) else _num(p.get("repeat_of"))
        ok = r.get("status") == "ok"
        search = _search(r)
        bracket = r.get("capacity_bracket") if isinstance(r.get("capacity_bracket"), (list, tuple)) else None
        out.append({"engine": r["engine"], "series": r["series"], "model": r.get("model") or "?",
                    "trial": trial, "role": role if repeat is None else f"{role} (repeat of {int(repeat)})",
                    "on_front": (trial in front[r["series"]]) if r["series"] in front else None,
                    "options": _dict(r.get("tune_options")) or _dict(p.get("options")),
                    "value": _num(r.get("tune_value")) if ok else None,
                    "objective": r.get("tune_objective"), "search": search,
                    "currency": r.get("cost_currency") if isinstance(r.get("cost_currency"), str) else None,
                    "bracket": bracket_text(bracket, search) if bracket else "–",
                    "output_tok_s": _num(r.get("output_tok_s")), "per_user_tok_s": _num(r.get("per_user_tok_s")),
                    "probes": int(_num(r.get("tune_probes"))) if _num(r.get("tune_probes")) is not None else None,
                    "load_s": _num(r.get("tune_load_s")), "ready_s": _num(r.get("tune_ready_s")),
                    "status": r.get("status") or "ok",
                    "error": r.get("error") if not ok else None})
    tf = pd.DataFrame(out, dtype=object)            # None stays None, ints stay ints
    if tf.empty:
        return tf
    tf["best"] = False
    for s, g in tf.groupby("series", sort=False):
        want = best.get(s)
        hit = g.index[(g["trial"] == want) & (g["status"] == "ok")] if want is not None else g.index[:0]
        if not len(hit):                             # no conclusion (yet): the best value (a cost: the smallest)
            vals = pd.to_numeric(g["value"], errors="coerce").dropna()
            top = vals.min() if lower_better(g["objective"].iloc[0]) else vals.max()
            hit = vals.index[vals == top] if len(vals) else hit
        tf.loc[hit, "best"] = True
    return _in_page_order(tf, ["trial"])


def conclusions_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per engine's conclusion (workload tune, `point.tune == "conclusion"`)."""
    df = tune_rows(rows)
    if df.empty:
        return pd.DataFrame()
    out = []
    for r in df.to_dict("records"):
        if _point(r).get("tune") != "conclusion":
            continue
        confirm = _dict(r.get("tune_confirm"))
        interval = confirm.get("interval")
        out.append({"engine": r["engine"], "series": r["series"], "model": r.get("model") or "?",
                    "status": r.get("status") or "ok", "error": r.get("error"),
                    "objective": r.get("tune_objective"), "metric": r.get("tune_metric"),
                    "budget": _dict(r.get("tune_budget")),
                    "trials_run": _num(r.get("tune_trials_run")), "trials_failed": _num(r.get("tune_trials_failed")),
                    "best_trial": int(_num(r.get("tune_best_trial"))) if _num(r.get("tune_best_trial")) is not None
                    else None,
                    "best_options": _dict(r.get("tune_best_options")),
                    "best_value": _num(r.get("tune_best_value")), "default_value": _num(r.get("tune_default_value")),
                    "gain": _num(r.get("tune_gain")),
                    "confirm_rounds": _num(confirm.get("rounds")),
                    "confirm_best": [v for v in confirm.get("best") or [] if _num(v) is not None],
                    "confirm_default": [v for v in confirm.get("default") or [] if _num(v) is not None],
                    "ratio": _num(confirm.get("ratio")),
                    "interval": [float(v) for v in interval] if isinstance(interval, (list, tuple)) and len(interval) == 2
                    and all(_num(v) is not None for v in interval) else None,
                    "confidence": _num(confirm.get("confidence")),
                    "verdict": confirm.get("verdict") if isinstance(confirm.get("verdict"), str) else "not measured",
                    "confirm_note": confirm.get("note") if isinstance(confirm.get("note"), str) else None,
                    "pareto_trials": [int(v) for v in r["tune_pareto_trials"] if _num(v) is not None]
                    if isinstance(r.get("tune_pareto_trials"), list) else None,
                    "importance": _dict(r.get("tune_importance")) or None,
                    "launches": {k: (r.get(f"tune_{k}_launch_command"), _dict(r.get(f"tune_{k}_launch_env")),
                                     _dict(r.get(f"tune_{k}_server_extra_options")))
                                 for k in ("best", "default") if isinstance(r.get(f"tune_{k}_launch_command"), str)},
                    "loads": _num(r.get("tune_loads")), "load_s_total": _num(r.get("tune_load_s_total")),
                    "note": r.get("tune_note") if isinstance(r.get("tune_note"), str) and r.get("tune_note") else None})
    return pd.DataFrame(out, dtype=object)


def importance_frame(conc: pd.DataFrame) -> pd.DataFrame:
    """engine, series, option, importance, rank (1: the most important), per engine from its
    conclusion's `tune_importance`; largest first."""
    out = []
    for c in conc.to_dict("records") if not conc.empty else []:
        imp = [(str(k), _num(v)) for k, v in (c["importance"] or {}).items() if _num(v) is not None]
        for rank, (opt, v) in enumerate(sorted(imp, key=lambda kv: -kv[1]), 1):
            out.append({"engine": c["engine"], "series": c["series"], "option": opt, "importance": v, "rank": rank})
    return pd.DataFrame(out)


def best_pareto_frame(rows: pd.DataFrame, conc: pd.DataFrame) -> pd.DataFrame:
    """The capacity probes of each engine's best trial and of its defaults (trial rows of role
    default), in the columns of `capacity.pareto_frame`: the best configuration as a line of its
    own, the defaults as probes (dotted), so `capacity.pareto_figure` draws both."""
    df = tune_rows(rows)
    if df.empty or conc.empty:
        return pd.DataFrame()
    probes = df[df["status"] == "ok"]
    out = []
    for c in conc.to_dict("records"):
        mine = [r for r in probes[probes["series"] == c["series"]].to_dict("records")
                if "probe" in _point(r) and _point(r).get("role") in SEARCH_ROLES]
        default_trials = {_point(r).get("trial") for r in mine if _point(r).get("role") == "default"}
        best = c["best_trial"]
        for r in mine:
            p = _point(r)
            is_best, is_default = p.get("trial") == best, p.get("trial") in default_trials
            if not (is_best or is_default) or p.get("search") not in ("rate", "concurrency"):
                continue
            per_user, thr = _num(r.get("per_user_tok_s")), _num(r.get("output_tok_s"))
            if per_user is None or thr is None:
                continue
            kind, load = p["search"], _num(p.get("value"))
            if is_best:
                curve = (f"best = defaults (trial {best})" if is_default else
                         f"best configuration (trial {best}: {options_text(c['best_options'])})")
            else:
                curve = f"capacity probes of the defaults (trial {p.get('trial')})"
            viol = r.get("slo_violations")
            out.append({"engine": c["engine"], "series": c["series"], "model": c["model"], "kind": kind,
                        "curve": curve, "load": load if load is not None else float("nan"),
                        "load_label": load_label(kind, load), "source": f"trial {p.get('trial')}, probe {p.get('probe')}",
                        "per_user_tok_s": per_user, "per_user_derived": False, "output_tok_s": thr,
                        "saturated": _flag(r.get("saturated")), "client_limited": _flag(r.get("client_limited")),
                        "meets_slo": _flag(r.get("meets_slo")),
                        "slo_violations": "; ".join(map(str, viol)) if isinstance(viol, list) and viol else None})
    df = pd.DataFrame(out)
    if df.empty:
        return df
    df["_defaults"] = df["curve"].str.startswith("capacity")
    return _in_page_order(df, ["_defaults", "load"]).drop(columns="_defaults")


def _in_page_order(df: pd.DataFrame, then: list[str]) -> pd.DataFrame:
    """Engines in the order their rows came (as everywhere on the page), then by `then`."""
    rank = {s: i for i, s in enumerate(dict.fromkeys(df["series"]))}
    return (df.assign(_series=df["series"].map(rank)).sort_values(["_series", *then], kind="stable")
            .drop(columns="_series").reset_index(drop=True))


# ---- tables ------------------------------------------------------------------------------------

def _option_cell(v: Any) -> Cell:
    n = _num(v)
    if n is not None:
        return Cell(fmt_num(nice(v) if isinstance(v, float) else v), n, cls="num")
    return Cell("–" if v is None else str(v))


def trials_table(tf: pd.DataFrame, series: str, label: str) -> Table:
    """One engine's trials: trial, role, one column per option it set, the objective (`label`; ★
    the best trial, whose row is green; failed rows red), the bracket, the throughput and per-user
    speed at the best load that met the SLOs, probes, whether on the sampler's Pareto front (NSGA-II
    only), status, error. Sortable by any column."""
    g = tf[tf["series"] == series]
    opts = list(dict.fromkeys(k for o in g["options"] for k in o))
    front = g["on_front"].notna().any()
    ready = "ready_s" in g and g["ready_s"].notna().any()  # a launched server: start to ready
    rows, classes = [], []
    for r in g.to_dict("records"):
        ok = r["status"] == "ok"
        value = num_cell(r["value"], best=bool(r["best"]))
        if ok and not present(r["value"]):
            value = Cell("none met the SLOs", None, cls="muted")
        elif not ok:
            value = Cell(str(r["status"]), None, cls=f"status-{r['status']}")
        rows.append([num_cell(r["trial"]), Cell(str(r["role"])),
                     *[_option_cell(r["options"].get(k)) if r["options"] else Cell("(configured)", cls="muted")
                       for k in opts],
                     value, Cell(r["bracket"], cls="num"),
                     num_cell(r["output_tok_s"]), num_cell(r["per_user_tok_s"]), num_cell(r["probes"]),
                     num_cell(r["ready_s"] if ready else r["load_s"]),
                     *([Cell("yes" if r["on_front"] else "no")] if front else []),
                     Cell(str(r["status"]), cls="" if ok else f"status-{r['status']}"),
                     Cell(str(r["error"] or ""), cls="error" if not ok else "")])
        classes.append("bad" if not ok else "good" if r["best"] else "")
    return Table(["trial", "role", *opts, label, "bracket [meets, misses]", "device tok/s",
                  "per-user tok/s", "probes", "launch to ready s" if ready else "load s",
                  *(["on the Pareto front"] if front else []), "status", "error"], rows,
                 f"{series}: every trial of the search (trial 0 is the engine's configured options, its defaults); "
                 "the capacity is the largest load at which every SLO held with that trial's options; device and "
                 "per-user tok/s are at that load. A repeat is a configuration the sampler proposed again: its "
                 "earlier trial's value, not measured twice. ★ and green: the best trial; red: a trial whose options "
                 "could not run (a server that refused its flags: its own words in the error). Load s: reloading "
                 "the engine with the trial's options; a launched server's launch to ready s: its start until it "
                 "answered ready, on every trial it was relaunched for. Neither is in any measurement. Click a "
                 "column's header to sort by it.",
                 f"tuning-trials-{series}", classes, sortable=True)


def _values(vs: list[Any]) -> str:
    return ", ".join(fmt_num(nice(v)) for v in vs) if vs else "–"


def budget_text(b: dict[str, Any]) -> str:
    parts = []
    if present(b.get("trials")):
        parts.append(f"{b['trials']} trials")
    if present(b.get("seed")):
        parts.append(f"seed {b['seed']}")
    if b.get("sampler"):
        parts.append(str(b["sampler"]).upper())
    if b.get("search"):
        parts.append(f"{b['search']} search")
    if isinstance(b.get("load"), dict) and b["load"]:
        parts.append("load " + ", ".join(f"{k}={v}" for k, v in b["load"].items()))
    return " · ".join(parts) or "–"


def conclusion_table(conc: pd.DataFrame, tf: pd.DataFrame) -> Table:
    rows, classes = [], []
    for c in conc.to_dict("records"):
        unit = unit_of(c["metric"], c["objective"], series_currency(tf, c["series"]))
        best_row = tf[(tf["series"] == c["series"]) & tf["best"]] if not tf.empty else tf
        bracket = best_row["bracket"].iloc[0] if len(best_row) else "–"
        ratio = num_cell(c["ratio"], ci=c["interval"])
        verdict = c["verdict"]
        note = "; ".join(str(n) for n in (c["note"], c["confirm_note"],
                                           c["error"] if c["status"] != "ok" and c["error"] != c["note"] else None) if n)
        rows.append([
            Cell(str(c["series"])), Cell(str(c["objective"] or "–")),
            Cell(budget_text(c["budget"]), cls="wrap"), Cell(slo_text(c["budget"].get("slos")), cls="wrap"),
            Cell(f"{fmt_num(nice(c['trials_run']))} ({fmt_num(nice(c['trials_failed'] or 0))} failed)"
                 if c["trials_run"] is not None else "–", c["trials_run"], cls="num"),
            num_cell(c["best_trial"]), Cell(options_text(c["best_options"]) if c["best_trial"] is not None else "–",
                                            cls="wrap"),
            Cell(f"{fmt_num(nice(c['best_value']))} {unit}" if c["best_value"] is not None else "none",
                 c["best_value"], cls="num"),
            Cell(bracket, cls="num"),
            Cell(f"{fmt_num(nice(c['default_value']))} {unit}" if c["default_value"] is not None else "none",
                 c["default_value"], cls="num"),
            num_cell(c["gain"]),
            Cell(f"best {_values(c['confirm_best'])}; default {_values(c['confirm_default'])}", cls="wrap"),
            ratio,
            Cell(verdict, cls=VERDICT_CLASS.get(verdict, "muted")),
            Cell(note, cls="wrap"),
        ])
        classes.append("bad" if c["status"] != "ok" or verdict == "best < default" else "")
    cost = not conc.empty and any(lower_better(o) for o in conc["objective"])
    conf = {c for c in conc["confidence"] if c is not None} if not conc.empty else set()
    level = f"{next(iter(conf)):.0%} " if len(conf) == 1 else ""
    return Table(["engine", "objective", "budget", "SLOs", "trials", "best trial", "best options", "best",
                  "bracket of the best", "default",
                  "gain (best / default; a cost: default / best)" if cost else "gain (best / default)",
                  "confirmation rounds",
                  f"confirmed ratio [{level}interval]", "verdict", "note"], rows,
                 "Each engine's best configuration against its defaults, both measured in this run under the same "
                 "budget and SLOs (trial 0 is the defaults). The confirmation measures best and default again, "
                 "interleaved, round by round: the ratio best / default over the rounds comes with its interval, and "
                 "the verdict says whether the gain held (gain confirmed: the interval lies above 1; best < default: "
                 "below 1; no significant difference: it contains 1)."
                 + (" A cost is minimised: its ratio and gain are default / best, how many times cheaper the best is, "
                    "so above 1 is a gain as for the others." if cost else ""),
                 "tuning-conclusion", classes)


def series_currency(tf: pd.DataFrame, series: Any) -> str | None:
    """The currency a series' trials were costed in (objective cost)."""
    if tf.empty or "currency" not in tf:
        return None
    cur = tf[(tf["series"] == series) & tf["currency"].notna()]["currency"]
    return str(cur.iloc[0]) if len(cur) else None


def budget_differences(conc: pd.DataFrame) -> list[str]:
    """What of the budget (trials, seed, sampler, SLOs, search, load shape) differs between engines."""
    out = []
    for key in BUDGET_KEYS:
        vals = {c["series"]: json.dumps(c["budget"].get(key), sort_keys=True, default=str)
                for c in conc.to_dict("records")}
        if len(set(vals.values())) > 1:
            out.append(f"{key}: " + "; ".join(f"{s} {v}" for s, v in vals.items()))
    return out


# ---- figures -----------------------------------------------------------------------------------

def trials_figure(tf: pd.DataFrame, conc: pd.DataFrame, colours: dict[str, str], label: str) -> go.Figure:
    """x trial, y the objective; per engine its trials (★ the best), a dotted line at its
    defaults' value, failed trials as a red ✕ and trials where nothing met the SLOs as a grey ○ at 0."""
    fig = go.Figure()
    styles = series_styles(tf, colours)
    defaults = {c["series"]: c["default_value"] for c in conc.to_dict("records")} if not conc.empty else {}
    for s, g in tf.groupby("series", sort=False):
        colour = styles[s]["color"]
        have = g[g["value"].notna()]
        custom = [[esc(options_text(o)), esc(r)] for o, r in zip(have["options"], have["role"])]
        fig.add_trace(go.Scatter(
            x=list(have["trial"]), y=list(have["value"]), name=esc(s), legendgroup=esc(s), mode="markers+text",
            marker=dict(color=colour, size=8, symbol=styles[s]["symbol"]),
            text=[fmt_num(nice(v)) for v in have["value"]], texttemplate="%{text}", textposition="top center",
            textfont=dict(size=10, color=colour), cliponaxis=False, customdata=custom,
            hovertemplate=(f"<b>{esc(s)}</b> trial %{{x}} (%{{customdata[1]}})<br>%{{customdata[0]}}<br>"
                           f"{esc(label)}: %{{y:.4~g}}<extra></extra>")))
        best = g[g["best"] & g["value"].notna()]
        if len(best):
            fig.add_trace(go.Scatter(
                x=list(best["trial"]), y=list(best["value"]), name=esc(f"{s} · best"), legendgroup=esc(s),
                mode="markers", marker=dict(symbol="star", size=18, color=colour, line=dict(width=1, color="black")),
                customdata=[[esc(options_text(o))] for o in best["options"]],
                hovertemplate=(f"<b>{esc(s)}</b> best: trial %{{x}}<br>%{{customdata[0]}}<br>"
                               f"{esc(label)}: %{{y:.4~g}}<extra></extra>")))
        dv = defaults.get(s)
        if dv is not None and g["trial"].notna().any():
            fig.add_trace(go.Scatter(
                x=[g["trial"].min(), g["trial"].max()], y=[dv, dv], name=esc(f"{s} · defaults"), legendgroup=esc(s),
                mode="lines", line=dict(color=colour, dash="dot", width=1),
                hovertemplate=f"<b>{esc(s)}</b> defaults: %{{y:.4~g}}<extra></extra>"))
        for what, d, colour_, symbol in (
                ("failed", g[g["status"] != "ok"], SATURATED_COLOUR, "x"),
                ("none met the SLOs", g[(g["status"] == "ok") & g["value"].isna()], NO_VALUE_COLOUR, "circle-open")):
            if d.empty:
                continue
            fig.add_trace(go.Scatter(
                x=list(d["trial"]), y=[0] * len(d), name=esc(f"{s} · {what}"), legendgroup=esc(s), mode="markers",
                marker=dict(symbol=symbol, size=12, color=colour_, line=dict(width=2, color=colour_)),
                customdata=[[esc(options_text(o)), esc(str(e or what)[:300])] for o, e in zip(d["options"], d["error"])],
                hovertemplate=(f"<b>{esc(s)}</b> trial %{{x}}: {esc(what)}<br>%{{customdata[0]}}<br>"
                               "%{customdata[1]}<extra></extra>")))
    fig.update_xaxes(title_text="trial (0: the engine's configured options)", dtick=1, rangemode="tozero")
    fig.update_yaxes(title_text=esc(f"{label} under the SLOs"), rangemode="tozero")
    return base_layout(fig, height=380, title="Capacity per trial" if label.startswith("capacity") else
                       "Cost per trial" if label.startswith("cost") else "Goodput per trial")


# ---- the section -------------------------------------------------------------------------------

@section("tuning", "Tuning", "Each engine's options searched for the highest capacity (or, objective cost, the lowest cost per "
         "good million tokens) under the run's SLOs, with the "
         "same budget for every engine (trials, seed, SLOs, load shape), so the engines are compared at their best: "
         "every trial, the best configuration against the defaults with an interleaved confirmation, which options "
         "mattered, and the best configurations on the capacity section's axes.")
def tuning(data: ReportData) -> list[Block]:
    tf = trials_frame(data.rows)
    conc = conclusions_frame(data.rows)
    if tf.empty and conc.empty:
        return []
    return (conclusion_blocks(conc, tf) + trials_blocks(tf, conc, data.colours) + importance_blocks(conc, data.colours)
            + pareto_blocks(data.rows, conc, data.colours))


def conclusion_blocks(conc: pd.DataFrame, tf: pd.DataFrame) -> list[Block]:
    """The conclusion table, and what to be wary of: budgets that differ between the engines, a
    gain the confirmation did not bear out, a gain within its noise."""
    if conc.empty:
        return []
    blocks: list[Block] = [conclusion_table(conc, tf)]
    for c in conc.to_dict("records"):  # a launched server: the best configuration's command, to copy
        for key, what in (("best", f"the best configuration (trial {c['best_trial']})"), ("default", "its defaults")):
            launch = c["launches"].get(key)
            if launch and (key == "best" or c["best_trial"] != 0):
                blocks.append(Pre(f"{c['series']}: launch command of {what}"
                                  + (f", {c['loads']:.0f} launches in the run took {c['load_s_total']:.0f} s outside "
                                     "every measurement" if key == "best" and c["loads"] and c["load_s_total"] else ""),
                                  launch_script(*launch), open=key == "best"))
    differ = budget_differences(conc)
    if differ:
        blocks.append(Note("The engines were not tuned with the same budget, so their best configurations are "
                           "not compared on equal terms: " + " | ".join(differ) + ".", kind="warning",
                           name="tuning-budget-differs"))
    unconfirmed = conc[~conc["verdict"].isin(CONFIRMED + NEUTRAL)]
    if not unconfirmed.empty:
        blocks.append(Note("The confirmation did not show the best configuration at least as good as the defaults "
                           "for: " + "; ".join(f"{c['series']} ({c['verdict']})" for c in
                                              unconfirmed.to_dict("records"))
                           + ". Its gain may be noise; do not quote it as the engine's tuned capacity.",
                           kind="warning", name="tuning-unconfirmed"))
    neutral = conc[conc["verdict"].isin(NEUTRAL)]
    if not neutral.empty:
        blocks.append(Note("Best and defaults within the confirmation's noise (its interval contains 1) for: "
                           + "; ".join(map(str, neutral["series"])) + ". The tuning found no gain the confirmation "
                           "could tell from noise.", name="tuning-no-difference"))
    return blocks


def trials_blocks(tf: pd.DataFrame, conc: pd.DataFrame, colours: dict[str, str]) -> list[Block]:
    """A trials table per engine, and a figure of the value per trial per objective (capacity in
    req/s, in concurrent requests, or goodput)."""
    if tf.empty:
        return []
    labels = {c["series"]: objective_label(c["objective"], unit_of(c["metric"], c["objective"],
                                                                    series_currency(tf, c["series"])))
              for c in conc.to_dict("records")} if not conc.empty else {}
    fallback = {s: objective_label(o, unit_of(None, o, series_currency(tf, s)))
                for s, o in zip(tf["series"], tf["objective"])}
    labels = {s: labels.get(s, fallback[s]) for s in dict.fromkeys(tf["series"])}
    blocks: list[Block] = [trials_table(tf, s, labels[s]) for s in labels]
    for label in dict.fromkeys(labels.values()):
        part = tf[[labels[s] == label for s in tf["series"]]]
        table = values_table(part.assign(options_text=part["options"].map(options_text)),
                             [Col("engine", "series", text=True), Col("trial", "trial"),
                              Col("options", "options_text", text=True), Col(label, "value"),
                              Col("status", "status", text=True)], "tuning-trials-values")
        what = label.split(" (")[0]
        blocks.append(Figure(trials_figure(part, conc, colours, label), "tuning-trials",
                             f"The {what} under the SLOs per trial, one colour per engine; ★ its best trial, the "
                             f"dotted line its defaults' {what}. Red ✕: a trial whose options could not run; grey ○: "
                             "no load met the SLOs.", table))
    return blocks


def importance_blocks(conc: pd.DataFrame, colours: dict[str, str]) -> list[Block]:
    blocks: list[Block] = []
    imp = importance_frame(conc)
    if not imp.empty:
        blocks.append(Figure(bars(imp, x="option", y="importance", colours=colours, x_title="option",
                                  y_title="importance (an engine's sum to 1)", title="Option importance"),
                             "tuning-importance",
                             "How much each option explained of the objective's variation over the engine's trials "
                             "(Optuna's importance evaluator; one engine's importances sum to 1).",
                             values_table(imp, [Col("engine", "series", text=True), Col("option", "option", text=True),
                                                Col("importance", "importance"), Col("rank", "rank")],
                                          "tuning-importance")))
    missing = conc[conc["importance"].isna()] if not conc.empty else conc
    if not missing.empty:
        blocks.append(Note("Option importance not computed for " + "; ".join(
            f"{c['series']}" + (f" ({c['note']})" if c["note"] else "") for c in missing.to_dict("records"))
            + ".", name="tuning-no-importance"))
    return blocks


def pareto_blocks(rows: pd.DataFrame, conc: pd.DataFrame, colours: dict[str, str]) -> list[Block]:
    """Per model, the engines' best configurations and defaults, drawn by the capacity section's
    Pareto figure."""
    blocks: list[Block] = []
    pf = best_pareto_frame(rows, conc)
    for model, d in (pf.groupby("model", sort=False) if not pf.empty else []):
        fig = pareto_figure(d, colours, str(model))
        fig.update_layout(title_text=esc(f"{model}: best configurations — throughput per device vs per-user speed"))
        blocks.append(Figure(fig, "tuning-pareto",
                             f"{model}: each engine's best configuration (its probes, a solid line for a rate search, "
                             "dashed for concurrency) and its defaults (open diamonds on a dotted line), on the "
                             "capacity section's axes: up is more throughput for the device, right is faster for each "
                             "user; each point is one load. Red ✕: saturated.",
                             values_table(d, [Col("engine", "series", text=True), Col("configuration", "curve", text=True),
                                              Col("load", "load_label", text=True),
                                              Col("per-user tok/s", "per_user_tok_s"),
                                              Col("device tok/s", "output_tok_s")], "tuning-pareto-values")))
    return blocks
