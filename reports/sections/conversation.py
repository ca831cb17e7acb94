"""The conversation section (workload `conversation`): per turn index, TTFT with prefix caching on
and off, and the hit rate the engine reported beside the share of the prompt the history made
reusable; one panel per KV pool size, so a pool smaller than the histories shows where the hit
rate falls below the reusable share (the eviction curve)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from reports.blocks import Block, Figure
from reports.data import ReportData
from reports.figures import facet_lines
from reports.sections.common import MS, Col, column, values_table, workload_rows
from reports.sections.registry import section


def pool_label(row: dict[str, Any]) -> str:
    blocks, bs = row.get("kv_blocks_total"), row.get("block_size")
    if blocks and bs:
        return f"KV pool {int(blocks) * int(bs):,} tokens"
    return "KV pool ?"


def conversation_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (series, caching, pool, turn index): median TTFT, the engine-reported hit rate,
    the reusable share, their difference, the mean prompt length."""
    df = workload_rows(rows, "conversation", "turns")
    if df.empty:
        return df
    out = []
    for r in df.to_dict("records"):
        caching = "caching on" if r.get("prefix_caching") is True else "caching off" if r.get("prefix_caching") is False \
            else "caching ?"
        for t in r.get("turns") or []:
            out.append({"engine": r["engine"], "base_series": r["series"], "caching": caching,
                        "series": f"{r['series']} · {caching}", "pool": pool_label(r), "turn": t["turn"],
                        "ttft_s": t.get("ttft_s"), "hit_rate": t.get("hit_rate"),
                        "reusable_share": t.get("reusable_share"),
                        "hit_minus_reusable": t.get("hit_minus_reusable"),
                        "prompt_tokens_mean": t.get("prompt_tokens_mean"), "requests": t.get("requests"),
                        "kv_occupancy": t.get("kv_occupancy")})
    f = pd.DataFrame(out)
    if f.empty:
        return f
    return f.sort_values(["pool", "base_series", "caching", "turn"], ascending=[True, True, False, True],
                         kind="stable").reset_index(drop=True)


def hit_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Hit rate (caching on) and reusable share per turn as series of one plot: per engine and pool,
    a `· hit rate` line and a `· reusable share` line."""
    on = df[df["caching"] == "caching on"]
    parts = []
    if not on.empty:
        hits = on.dropna(subset=["hit_rate"]).assign(series=lambda d: d["base_series"] + " · hit rate",
                                                     share=lambda d: d["hit_rate"])
        reuse = on.assign(series=lambda d: d["base_series"] + " · reusable share", share=lambda d: d["reusable_share"])
        parts = [hits, reuse]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


@section("conversation", "Conversations", "Multi-turn sessions: each turn's prompt is the whole history (the "
         "engine's own replies included) plus a new message. Per turn index: time to first token with prefix "
         "caching on and off, and the prefix-cache hit rate the engine reported beside the share of the prompt "
         "the history makes reusable (in whole KV blocks). A hit rate below the reusable share is history the "
         "engine no longer held (evicted); one panel per KV pool size.")
def conversation(data: ReportData) -> list[Block]:
    df = conversation_frame(data.rows)
    if df.empty:
        return []
    facet = "pool" if column(df, "pool").nunique() > 1 else None
    blocks: list[Block] = [Figure(facet_lines(
        df.dropna(subset=["ttft_s"]), x="turn", y="ttft_s", facet=facet, colours=data.colours,
        x_title="turn", y_title="TTFT, median (ms)", scale=MS),
        "conversation-ttft", "Median TTFT per turn index, caching on and off (each line named in the legend).")]
    hf = hit_frame(df)
    if not hf.empty:
        blocks.append(Figure(facet_lines(
            hf, x="turn", y="share", facet=facet, colours=data.colours, x_title="turn",
            y_title="share of prompt tokens (%)", scale=100),
            "conversation-hit-rate", "Engine-reported prefix-cache hit rate and the reusable share of the prompt, "
                                     "per turn, caching on (each line named in the legend; where they coincide the "
                                     "engine reused all it could)."))
    blocks[-1].table = values_table(
        df, [Col("engine", "base_series", text=True), Col("caching", "caching", text=True), Col("pool", "pool", text=True),
             Col("turn", "turn"), Col("prompt tokens", "prompt_tokens_mean"),
             Col("reusable %", "reusable_share", 100), Col("hit rate %", "hit_rate", 100),
             Col("hit − reusable (pts)", "hit_minus_reusable", 100), Col("KV in use %", "kv_occupancy", 100),
             Col("TTFT ms", "ttft_s", MS, better="lower")],
        "conversation-values", group=["pool", "turn"])
    return blocks
