"""The conversation section (workload `conversation`): per turn index, TTFT with prefix caching on
and off, and the hit rate the engine reported beside the share of the prompt the history made
reusable; one panel per KV pool size, so a pool smaller than the histories shows where the hit
rate falls below the reusable share (the eviction curve). With KV tiers (`kv_tiers`: the pool
alone, the full pool, a second tier of some capacity) a panel of its own: the eviction curve of
each mode beside the reusable share, the prompt tokens each tier supplied (stacked) per turn, and
a table of TTFT beside recompute and the full-pool bound. An agent's trace (turns that answer a
tool's result beside those that answer a user's message) gets a panel per turn kind: TTFT, hit
rate beside reusable share, and how much each turn adds to the prompt."""

from __future__ import annotations

from typing import Any

import pandas as pd

from reports.blocks import Block, Figure
from reports.data import ReportData
from harness.core.sizes import human_size
from reports.figures import bars, facet_lines, stacked_bars
from reports.sections.common import MS, Col, column, values_table, workload_rows
from reports.sections.registry import section


def pool_label(row: dict[str, Any]) -> str:
    blocks, bs = row.get("kv_blocks_total"), row.get("block_size")
    if blocks and bs:
        return f"KV pool {int(blocks) * int(bs):,} tokens"
    return "KV pool ?"


def tier_label(mode: Any) -> str | None:
    """How a row's KV tier mode reads in a legend (None: the run had no kv_tiers dimension)."""
    if mode is None or (isinstance(mode, float) and pd.isna(mode)):
        return None
    if mode == "off":
        return "pool alone (recompute)"
    if mode == "full":
        return "full pool (bound)"
    if isinstance(mode, (int, float)) and not isinstance(mode, bool):
        return f"+ tier 2 of {human_size(int(mode))}"
    return str(mode)


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
        tiers = tier_label(r.get("kv_tiers"))
        for t in r.get("turns") or []:
            hit, t1, t2 = t.get("hit_rate"), t.get("hit_rate_tier1"), t.get("hit_rate_tier2")
            if t1 is None and hit is not None:  # no second tier: every hit was the pool's
                t1, t2 = hit, 0.0
            out.append({"engine": r["engine"], "base_series": r["series"], "caching": caching,
                        "series": f"{r['series']} · {caching}" + (f" · {tiers}" if tiers else ""),
                        "tiers": tiers, "pool": pool_label(r), "turn": t["turn"],
                        "hit_rate_tier1": t1, "hit_rate_tier2": t2,
                        "miss_share": 1 - (t1 or 0.0) - (t2 or 0.0) if hit is not None else None,
                        "ttft_recompute_s": t.get("ttft_recompute_s"), "ttft_full_s": t.get("ttft_full_s"),
                        "ttft_between": t.get("ttft_between"), "ttft_over_full": t.get("ttft_over_full"),
                        "ttft_over_full_ci": t.get("ttft_over_full_ci"),
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
        label = on["tiers"].map(lambda t: f" · {t}" if t else "")
        hits = on.assign(series=on["base_series"] + label + " · hit rate", share=on["hit_rate"]).dropna(subset=["share"])
        reuse = on.assign(series=lambda d: d["base_series"] + " · reusable share", share=lambda d: d["reusable_share"])
        reuse = reuse.drop_duplicates(subset=["series", "pool", "turn"])  # the same share in every tier mode
        parts = [hits, reuse]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def tier_frame(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of a run with a kv_tiers dimension (caching on), one per (engine, tier mode, turn)."""
    if df.empty or "tiers" not in df.columns:
        return pd.DataFrame()
    t = df[(df["caching"] == "caching on") & df["tiers"].notna()]
    return t.assign(panel=t["base_series"] + " · " + t["tiers"]) if not t.empty else t


TIER_PARTS = (("hit_rate_tier1", "tier-1 hit (the pool)", "#2b8a3e"), ("hit_rate_tier2", "tier-2 hit (reloaded)",
                                                                      "#1c7ed6"),
              ("miss_share", "miss (prefilled)", "#c92a2a"))


def tier_blocks(df: pd.DataFrame, data: ReportData) -> list[Block]:
    """The KV-tier panel: the eviction curve of each tier mode, hits stacked by tier, and TTFT
    beside recompute and the full-pool bound."""
    t = tier_frame(df)
    if t.empty:
        return []
    curve = hit_frame(t)
    blocks: list[Block] = [Figure(facet_lines(
        curve, x="turn", y="share", facet=None, colours=data.colours, x_title="turn",
        y_title="share of prompt tokens (%)", scale=100),
        "conversation-tiers", "The eviction curve with and without a second KV tier: the hit rate (both tiers) per "
                              "turn of each tier mode beside the reusable share. The pool alone falls below the "
                              "share once it evicts histories; a second tier brings the evicted blocks back.")]
    blocks.append(Figure(stacked_bars(
        t.dropna(subset=["hit_rate"]), x="turn", parts=TIER_PARTS, facet="panel", x_title="turn",
        y_title="share of prompt tokens (%)", scale=100),
        "conversation-tier-hits", "Where each turn's prompt tokens came from, per tier mode: the pool (tier 1), "
                                  "the second tier (reloaded instead of prefilled), or prefilled (a miss)."))
    blocks[-1].table = values_table(
        t, [Col("engine", "base_series", text=True), Col("tiers", "tiers", text=True), Col("turn", "turn"),
            Col("reusable %", "reusable_share", 100), Col("tier-1 hit %", "hit_rate_tier1", 100),
            Col("tier-2 hit %", "hit_rate_tier2", 100), Col("hit (both) %", "hit_rate", 100),
            Col("hit − reusable (pts)", "hit_minus_reusable", 100), Col("TTFT ms", "ttft_s", MS, better="lower"),
            Col("TTFT recompute ms", "ttft_recompute_s", MS), Col("TTFT full pool ms", "ttft_full_s", MS),
            Col("TTFT / full pool [95% CI]", "ttft_over_full", ci="ttft_over_full_ci")],
        "conversation-tier-values", group=["turn"])
    return blocks


KIND_LABELS = {"user": "user turn", "tool": "tool-result turn"}


def kind_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (series, caching, pool, turn kind) of the runs whose turns are of more than one
    kind (an agent's trace: turns that answer a user's message, turns that answer a tool's result):
    TTFT, hit rate beside reusable share, the prompt's length and its growth per turn."""
    df = workload_rows(rows, "conversation", "turn_kinds")
    if df.empty:
        return df
    out = []
    for r in df.to_dict("records"):
        kinds = r.get("turn_kinds") or []
        if len(kinds) < 2:
            continue
        caching = "caching on" if r.get("prefix_caching") is True else "caching off" if r.get("prefix_caching") is False \
            else "caching ?"
        for k in kinds:
            out.append({"engine": r["engine"], "base_series": r["series"], "caching": caching,
                        "series": f"{r['series']} · {caching}", "pool": pool_label(r),
                        "kind": KIND_LABELS.get(k.get("kind"), str(k.get("kind"))), **{
                            f: k.get(f) for f in ("requests", "prompt_tokens_mean", "growth_tokens_mean",
                                                  "output_tokens_mean", "reusable_share", "hit_rate",
                                                  "hit_minus_reusable", "ttft_s", "ttft_s_p90")}})
    f = pd.DataFrame(out)
    return f if f.empty else f.sort_values(["pool", "base_series", "caching", "kind"], ascending=[True, True, False, False],
                                           kind="stable").reset_index(drop=True)


def kind_blocks(rows: pd.DataFrame, data: ReportData) -> list[Block]:
    """Per turn kind: median TTFT (bars) and a table of TTFT, hit rate beside reusable share and
    the prompt's growth."""
    k = kind_frame(rows)
    if k.empty:
        return []
    fig = Figure(bars(k.dropna(subset=["ttft_s"]), x="kind", y="ttft_s", colours=data.colours, x_title="turn kind",
                      y_title="TTFT, median (ms)", scale=MS),
                 "conversation-kinds", "Median TTFT per turn kind, caching on and off: a user turn answers a user's "
                                       "message, a tool-result turn answers a tool's result (the agent's next step).")
    fig.table = values_table(
        k, [Col("engine", "base_series", text=True), Col("caching", "caching", text=True), Col("pool", "pool", text=True),
            Col("turn kind", "kind", text=True), Col("requests", "requests"),
            Col("prompt tokens", "prompt_tokens_mean"), Col("growth per turn", "growth_tokens_mean"),
            Col("reply tokens", "output_tokens_mean"), Col("reusable %", "reusable_share", 100),
            Col("hit rate %", "hit_rate", 100), Col("hit − reusable (pts)", "hit_minus_reusable", 100),
            Col("TTFT ms", "ttft_s", MS, better="lower"), Col("TTFT p90 ms", "ttft_s_p90", MS)],
        "conversation-kind-values", group=["pool", "kind"])
    return [fig]


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
    return blocks + kind_blocks(data.rows, data) + tier_blocks(df, data)
