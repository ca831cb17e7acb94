"""The cost section: the price each engine's rows were costed at and where it came from, and what a
million tokens cost at every point that served tokens - all of them, and only the good ones
(docs/metrics.md, "Cost"); energy per token and its cost, measured or modelled (labelled), or
unavailable with the reason. Absent when no row was priced."""

from __future__ import annotations

from typing import Any

import pandas as pd

from reports.blocks import Block, Cell, Note, Table, fmt_num, num_cell
from reports.data import ReportData
from reports.sections.capacity import KIND, _f, load_label
from reports.sections.common import column, point_label, present
from reports.sections.registry import section


def _text(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


def cost_point_label(point: Any) -> str:
    """A capacity or tune probe by its load ('0.5 req/s', 'c=8'; a tune trial's and a confirmation
    round's number after it), any other point by its parameters."""
    p = point if isinstance(point, dict) else {}
    if p.get("search") in KIND and "value" in p:
        label = load_label(p["search"], p["value"])
        extra = [f"{p['role']} {p['trial']}" if p.get("role") and "trial" in p else "",
                 f"round {p['round']}" if "round" in p else ""]
        return " · ".join([label, *[e for e in extra if e]])
    return point_label(point)


COSTS = ("cost_per_mtok_input", "cost_per_mtok_output", "cost_per_mtok_total", "cost_per_good_mtok_output",
         "cost_per_good_mtok_total", "energy_cost_per_mtok_output")


def prices_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per series and price: currency, the rate and its unit, the resources held, the price
    per hour, its basis and source; how many rows used it."""
    if "cost_currency" not in rows.columns:
        return pd.DataFrame()
    priced = rows[column(rows, "cost_currency").map(present)]
    out = []
    for (series, basis), g in priced.groupby(["series", column(priced, "cost_price_basis").fillna("–")], sort=False):
        r = g.iloc[0]
        out.append({"series": series, "currency": r.get("cost_currency"), "rate": r.get("cost_price_rate"),
                    "unit": r.get("cost_price_unit"), "units": r.get("cost_units"),
                    "per_hour": r.get("cost_price_per_hour"), "basis": basis,
                    "source": _text(r.get("cost_price_source")) or "–", "rows": len(g)})
    return pd.DataFrame(out)


def cost_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Every priced row that served tokens (a capacity or tune conclusion is shown by its own
    section): series, workload, point, the costs per Mtok and per good Mtok, the good share and
    basis, energy per output token (measured or modelled) and its cost."""
    if "cost_per_mtok_output" not in rows.columns:
        return pd.DataFrame()
    df = rows[column(rows, "cost_wall_s").map(present)]
    if df.empty:
        return pd.DataFrame()
    out = []
    for r in df.to_dict("records"):
        measured = present(r.get("joules_per_output_token")) and r.get("energy_valid") is not False
        energy = (r.get("joules_per_output_token") if measured else r.get("joules_per_output_token_modelled"))
        out.append({"series": r["series"], "workload": r.get("workload"), "point_label": cost_point_label(r.get("point")),
                    "point_key": r.get("point_key"), "status": r.get("status"),
                    "currency": r.get("cost_currency"),
                    **{k: r.get(k) if present(r.get(k)) else None for k in (*COSTS, "cost_good_output_share")},
                    "good_basis": _text(r.get("cost_good_basis")) or "–",
                    "note": _text(r.get("cost_note")),
                    "energy_per_token": energy if present(energy) else None,
                    "energy_kind": "measured" if measured else "modelled" if present(energy) else "unavailable",
                    "energy_basis": _text(r.get("energy_cost_basis")) or "unavailable",
                    "energy_note": _text(r.get("energy_cost_note"))})
    return pd.DataFrame(out)


def prices_table(pr: pd.DataFrame) -> Table:
    rows = [[Cell(str(r["series"])), Cell(str(r["basis"]), cls="wrap"),
             Cell(f"{fmt_num(r['per_hour'])} {r['currency']}/h", r["per_hour"], cls="num"),
             Cell(str(r["source"]), cls="wrap"), num_cell(r["rows"])] for r in pr.to_dict("records")]
    return Table(["engine", "price used", "per hour", "where it comes from", "rows"], rows,
                 "The price every row of each engine was costed at: what the point held (GPUs, or the cores it was "
                 "pinned to) times the price per unit, or one price for the whole deployment; and where the price "
                 "comes from (your cost.* settings, or the price table's entry with its vendor page, the date it was "
                 "read and how far it was checked).", "cost-prices")


def energy_cell(r: dict[str, Any]) -> Cell:
    if r["energy_per_token"] is None:
        return Cell("unavailable", None, cls="muted", title=r["energy_note"] or r["energy_basis"])
    return Cell(f"{fmt_num(r['energy_per_token'])} ({r['energy_kind']})", r["energy_per_token"], cls="num",
                title=r["energy_basis"])


def cost_table(cf: pd.DataFrame) -> Table:
    several = cf["currency"].nunique() > 1
    keys = ["point_key", "currency"]  # never compared across currencies
    best = cf.groupby(keys, dropna=False)["cost_per_good_mtok_output"].transform("min")
    peers = cf.groupby(keys, dropna=False)["series"].transform("count")
    rows, classes = [], []
    for r, b, n in zip(cf.to_dict("records"), best, peers):
        cur = f" {r['currency']}" if several else ""
        r.update({k: _f(r[k]) for k in (*COSTS, "cost_good_output_share", "energy_per_token")})  # NaN: none
        good = r["cost_per_good_mtok_output"]
        rows.append([
            Cell(str(r["series"])), Cell(str(r["workload"])), Cell(str(r["point_label"]), cls="wrap"),
            *[Cell(fmt_num(r[k]) + cur, r[k], cls="num") if r[k] is not None else Cell("–", None, cls="muted")
              for k in COSTS[:3]],
            (Cell(fmt_num(good) + cur, good, cls="num", best=good == b and n > 1)
             if good is not None else Cell("none good", None, cls="muted", title=r["note"] or "")),
            num_cell(r["cost_good_output_share"]),
            Cell(str(r["good_basis"]), cls="wrap"),
            energy_cell(r),
            Cell(fmt_num(r["energy_cost_per_mtok_output"]) + cur, r["energy_cost_per_mtok_output"], cls="num",
                 title=r["energy_basis"]) if r["energy_cost_per_mtok_output"] is not None else
            Cell("–", None, cls="muted", title=r["energy_note"] or ""),
        ])
        classes.append("" if r["status"] == "ok" else "bad")
    currency = "" if several else f" ({cf['currency'].iloc[0]})"
    return Table(["engine", "workload", "point", f"per Mtok input{currency}", f"per Mtok output{currency}",
                  f"per Mtok total{currency}", f"per good Mtok output{currency}", "good share of output",
                  "good tokens are", "J per output token", f"energy per Mtok output{currency}"], rows,
                 "What a million tokens cost at each point: the point's price per hour × its wall time, over its "
                 "input, output or all tokens (each the whole cost: three views, never to be added), and over the "
                 "good tokens only (requests that met the SLO and passed any correctness check). ★: the cheapest per "
                 "good Mtok among engines at the same point. Energy per output token is measured (NVML, RAPL) or "
                 "modelled from a rated power (labelled; hover for its basis), or unavailable (hover for why). Red: "
                 "a row that failed its check (its tokens are not good). Click a header to sort.",
                 "cost", classes, sortable=True)


def mixed_currencies(pr: pd.DataFrame) -> list[str]:
    return sorted({str(c) for c in pr["currency"].dropna()}) if not pr.empty else []


@section("cost", "Cost", "What a million tokens cost on each engine at the price stated below, counting all tokens "
         "and only the good ones (of requests that met the SLO and passed any correctness check).")
def cost(data: ReportData) -> list[Block]:
    pr = prices_frame(data.rows)
    if pr.empty:
        return []
    blocks: list[Block] = []
    currencies = mixed_currencies(pr)
    if len(currencies) > 1:
        blocks.append(Note(f"These results are priced in {', '.join(currencies)}: costs in different currencies are "
                           "not compared (no ★ across them); re-run with prices in one currency to compare them.",
                           kind="warning", name="cost-currencies"))
    blocks.append(prices_table(pr))
    if pr["source"].str.contains("NOT VERIFIED").any():
        blocks.append(Note("A price used is marked NOT VERIFIED in the price table: it could not be confirmed from a "
                           "public source. Give your own (cost.price_per_core_hour, cost.price_per_device_hour or "
                           "cost.price_per_hour) before quoting these costs.", kind="warning", name="cost-unverified"))
    cf = cost_frame(data.rows)
    if not cf.empty:
        blocks.append(cost_table(cf))
        none_good = cf[cf["cost_per_good_mtok_output"].isna() & cf["note"].notna()]
        if not none_good.empty:
            blocks.append(Note("No request counted as good, so no cost per good Mtok (unbounded: shown as \"none "
                               "good\", never 0) at: " + "; ".join(
                f"{r.series} {r.workload} {r.point_label}" for r in none_good.head(8).itertuples())
                + (f" and {len(none_good) - 8} more" if len(none_good) > 8 else "") + ".", name="cost-none-good"))
    return blocks
