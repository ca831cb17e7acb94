"""The LoRA section (rows with `workload.lora`; docs/metrics.md "LoRA adapters"): per engine and
load point, each adapter's latency (TTFT, TPOT, ITL, E2EL) beside its configured share and the
requests sent and completed; the split sent with its test; the outputs check (every request against
the same prompt with the same adapter served alone); and the swap cost (N adapters at max_loras=1
against one adapter, TTFT p50 difference with its 95 % interval, beside the engine's loads and
evictions)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from reports.blocks import Block, Figure, Table
from reports.data import ReportData
from reports.figures import bars
from reports.sections.common import MS, Col, column, values_table
from reports.sections.registry import section


def _load(point: Any) -> str:
    p = point if isinstance(point, dict) else {}
    if p.get("concurrency") is not None:
        return f"concurrency {p['concurrency']}"
    if p.get("request_rate") is not None:
        return f"rate {p['request_rate']}/s"
    if p.get("value") is not None:
        return f"{p.get('search')} {p['value']}"
    if p.get("sessions") is not None:
        return f"{p['sessions']} sessions"
    return "–"


def lora_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows that served LoRA traffic (ok, failed or unverified), one per engine and point."""
    if "lora_shares" not in rows.columns:
        return pd.DataFrame()
    df = rows[rows["lora_shares"].map(lambda v: isinstance(v, dict))
              & rows["status"].isin(["ok", "failed", "unverified"])].copy()
    if df.empty:
        return df
    df["load"] = column(df, "point").map(_load)
    return df.reset_index(drop=True)


def per_adapter_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per engine, load point and entry (the base model and each adapter): its share, the
    requests sent and completed, its latencies (p50, p90, p99)."""
    df = lora_rows(rows)
    out = []
    main = df[column(df, "lora_swap").isna()] if not df.empty else df
    for r in main.to_dict("records"):
        for a in r.get("lora_per_adapter") or []:
            out.append({"series": r["series"], "engine": r["engine"], "load": r["load"], "workload": r["workload"],
                        "adapter": a["adapter"],
                        "share": (r.get("lora_shares") or {}).get(a["adapter"]),
                        "sent": (r.get("lora_sent") or {}).get(a["adapter"]), **a,
                        "x": f"{a['adapter']} · {r['load']}", "status": r["status"]})
    return pd.DataFrame(out)


def split_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """The split sent per engine and point: the test, its p-value and verdict, and sent against the
    count the shares give."""
    df = lora_rows(rows)
    out = []
    for r in df.to_dict("records"):
        t = r.get("lora_split_test") or {}
        sent = r.get("lora_sent") or {}
        total = sum(sent.values())
        out.append({"series": r["series"], "load": r["load"], "split": r.get("lora_split"),
                    "unit": r.get("lora_split_unit") or "request",
                    "sent": ", ".join(f"{e} {sent.get(e, 0)} ({p * total:.1f})" for e, p in r["lora_shares"].items()),
                    "test": t.get("test"), "p_value": t.get("p_value"), "ok": "yes" if t.get("ok") else "no",
                    "detail": t.get("detail")})
    return pd.DataFrame(out)


def check_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """The outputs check per engine and point: its verdict, how many requests it compared, and the
    first request whose output differs (request, adapter, token position, both tokens)."""
    df = lora_rows(rows)
    out = []
    for r in df.to_dict("records"):
        c = r.get("lora_check")
        if not isinstance(c, dict):
            continue
        m = c.get("mismatch") or {}
        out.append({"series": r["series"], "load": r["load"], "verdict": c.get("verdict"), "compared": c.get("compared"),
                    "first": (f"{m['request']} ({m['adapter']}): token {m['position']} {m['got']}, alone "
                              f"{m['expected']}" if m else "–"), "detail": c.get("detail")})
    return pd.DataFrame(out)


def swap_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """The swap points per engine: N adapters, TTFT p50, the swap cost and its interval, loads and
    evictions over the point."""
    df = lora_rows(rows)
    if df.empty or "lora_swap" not in df.columns:
        return pd.DataFrame()
    df = df[df["lora_swap"].notna()].copy()
    if df.empty:
        return df
    stats = column(df, "lora_stats").map(lambda s: s if isinstance(s, dict) else {})
    df["loads"] = stats.map(lambda s: s.get("loads"))
    df["evictions"] = stats.map(lambda s: s.get("evictions"))
    ci = column(df, "swap_cost_ci").map(lambda v: v if isinstance(v, list) and len(v) == 2 else [None, None])
    df["swap_lo"], df["swap_hi"] = ci.map(lambda v: v[0]), ci.map(lambda v: v[1])
    df["adapters_n"] = df["lora_swap"].astype(int)
    return df.sort_values(["series", "adapters_n"], kind="stable").reset_index(drop=True)


@section("lora", "LoRA adapters", "Many adapters on one base model, mixed in the same batches: each adapter's latency "
         "beside its share of the traffic, the split sent and its test, whether every request was served by its own "
         "adapter (its output against the same prompt with the same adapter served alone), and what swapping "
         "adapters through one slot costs.")
def lora(data: ReportData) -> list[Block]:
    per = per_adapter_frame(data.rows)
    blocks: list[Block] = []
    if not per.empty:
        fig = Figure(bars(per, x="x", y="ttft_s_p50", colours=data.colours, x_title="adapter · load",
                          y_title="TTFT p50 (ms)", scale=MS), "lora-ttft",
                     "TTFT p50 per adapter (the base model: base), per engine and load point.")
        fig.table = values_table(per, [
            Col("engine", "series", text=True), Col("load", "load", text=True), Col("adapter", "adapter", text=True),
            Col("share", "share"), Col("sent", "sent"), Col("completed", "completed"),
            Col("output tokens", "output_tokens"), Col("TTFT p50 ms", "ttft_s_p50", MS),
            Col("TTFT p90 ms", "ttft_s_p90", MS), Col("TTFT p99 ms", "ttft_s_p99", MS),
            Col("TPOT p50 ms", "tpot_s_p50", MS), Col("TPOT p99 ms", "tpot_s_p99", MS), Col("ITL p50 ms", "itl_s_p50", MS),
            Col("E2EL p50 ms", "e2el_s_p50", MS), Col("E2EL p99 ms", "e2el_s_p99", MS)], "lora-per-adapter")
        blocks.append(fig)
    split = split_frame(data.rows)
    if not split.empty:
        blocks.append(values_table(split, [
            Col("engine", "series", text=True), Col("load", "load", text=True), Col("split", "split", text=True),
            Col("drawn per", "unit", text=True), Col("sent (configured)", "sent", text=True),
            Col("test", "test", text=True), Col("p-value", "p_value"), Col("as configured", "ok", text=True),
            Col("detail", "detail", text=True)], "lora-split",
            caption="The split sent against the configured shares: exact counts for round robin, Pearson's "
                    "chi-squared otherwise (rejected below p = 0.001, which fails the row).",
            row_classes=["bad" if ok != "yes" else "" for ok in split["ok"]]))
    checks = check_frame(data.rows)
    if not checks.empty:
        blocks.append(values_table(checks, [
            Col("engine", "series", text=True), Col("load", "load", text=True), Col("verdict", "verdict", text=True),
            Col("requests compared", "compared"), Col("first differing request", "first", text=True),
            Col("detail", "detail", text=True)], "lora-check",
            caption="Every request's output in mixed traffic against the same prompt with the same adapter served "
                    "alone (greedy): a difference fails the row; an adapter that changes no output leaves it "
                    "unverified.",
            row_classes=["bad" if v != "pass" else "" for v in checks["verdict"]]))
    swap = swap_frame(data.rows)
    if not swap.empty:
        t: Table = values_table(swap, [
            Col("engine", "series", text=True), Col("adapters (round robin)", "adapters_n"),
            Col("TTFT p50 ms", "ttft_s", MS), Col("swap cost ms", "swap_cost_s", MS),
            Col("95% CI low ms", "swap_lo", MS), Col("95% CI high ms", "swap_hi", MS),
            Col("loads", "loads"), Col("evictions", "evictions"), Col("status", "status", text=True)], "lora-swap",
            caption="One request at a time, max_loras=1: p50 TTFT with N adapters in round robin minus p50 TTFT with "
                    "one adapter, on the same prompts (paired bootstrap over the requests), beside the engine's "
                    "adapter loads and evictions over the point where it reports them.")
        blocks.append(t)
    return blocks
