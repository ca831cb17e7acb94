"""The quality section (workload `quality`): quality vs memory vs speed. Per engine, dtype and KV
dtype: the KV cache's bytes per token, a short decode's output tokens/s, the teacher-forced
perplexity of held-out text and its difference from the float32 baseline's, and top-1 agreement
and mean KL against the baseline, also over the long-context positions (docs/metrics.md,
"Quality"; workloads/quality.py)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from reports.blocks import Block, Cell, Figure, Note, Table, fmt_num
from reports.data import ReportData
from reports.figures import bars
from reports.sections.registry import section
from reports.sections.common import column, present

KV_ORDER = {"fp32": 0, "bf16": 1, "fp16": 2, "int8": 3, "fp8": 4}
DTYPE_ORDER = {"float32": 0, "bfloat16": 1, "float16": 2}


def quality_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per quality row that ran (ok) or was skipped, with `setting` = "engine · dtype ·
    KV dtype" and `delta_perplexity`: the row's own Δ from its baseline, or, for a row without a
    baseline, from a float32 reference-engine row with the KV cache in float32 among the
    results (another run of the same windows)."""
    if "workload" not in rows.columns:
        return pd.DataFrame()
    df = rows[(rows["workload"] == "quality") & rows["status"].isin(["ok", "skipped"])]
    if df.empty:
        return pd.DataFrame()
    keep = ["engine", "series", "status", "error", "dtype", "kv_dtype", "point", "kv_bytes_per_token",
            "kv_est_bytes_per_token", "output_tok_s", "quality_perplexity", "quality_perplexity_long",
            "quality_baseline_perplexity", "quality_delta_perplexity", "quality_top1_agreement",
            "quality_top1_agreement_long", "quality_mean_kl", "quality_mean_kl_long", "quality_positions",
            "quality_long_positions", "quality_baseline", "quality_note", "quality_margin_p50"]
    out = pd.DataFrame({k: column(df, k) for k in keep}).reset_index(drop=True)
    out["kv_dtype"] = [kv if present(kv) else (p or {}).get("kv_dtype", "–") if isinstance(p, dict) else "–"
                       for kv, p in zip(out["kv_dtype"], out["point"])]
    base = out[(out["engine"] == "reference") & (out["dtype"] == "float32") & (out["kv_dtype"] == "fp32")
               & (out["status"] == "ok")]["quality_perplexity"].dropna()
    fallback = float(base.iloc[0]) if len(base) else None
    out["delta_perplexity"] = [
        float(d) if present(d) else (float(p) - fallback if present(p) and fallback is not None else None)
        for d, p in zip(out["quality_delta_perplexity"], out["quality_perplexity"])]
    out["setting"] = [f"{e} · {d} · KV {kv}" for e, d, kv in zip(out["engine"], out["dtype"], out["kv_dtype"])]
    out["_order"] = [(str(e), DTYPE_ORDER.get(str(d), 9), KV_ORDER.get(str(kv), 9)) for e, d, kv in
                     zip(out["engine"], out["dtype"], out["kv_dtype"])]
    return out.sort_values("_order", kind="stable").drop(columns="_order").reset_index(drop=True)


def _num(v: Any, fmt: str = "{:.4g}") -> Cell:
    if not present(v):
        return Cell("–", None, cls="num muted")
    return Cell(fmt.format(float(v)), float(v), cls="num", title=repr(v))


def quality_table(df: pd.DataFrame) -> Table:
    rows, classes = [], []
    for r in df.to_dict("records"):
        if r["status"] != "ok":
            rows.append([Cell(str(r["engine"])), Cell(str(r["dtype"])), Cell(str(r["kv_dtype"]))]
                        + [Cell("–", None, cls="num muted")] * 9
                        + [Cell(f"skipped: {r.get('error') or ''}", cls="wrap muted")])
            classes.append("muted")
            continue
        bpt = r.get("kv_bytes_per_token") if present(r.get("kv_bytes_per_token")) else r.get("kv_est_bytes_per_token")
        note = r.get("quality_baseline") if present(r.get("quality_baseline")) else r.get("quality_note")
        rows.append([
            Cell(str(r["engine"])), Cell(str(r["dtype"])), Cell(str(r["kv_dtype"])),
            _num(bpt, "{:.0f}"), _num(r.get("output_tok_s"), "{:.1f}"),
            _num(r.get("quality_perplexity"), "{:.4f}"), _num(r.get("delta_perplexity"), "{:+.4f}"),
            _num(r.get("quality_top1_agreement"), "{:.4f}"), _num(r.get("quality_mean_kl"), "{:.2e}"),
            _num(r.get("quality_perplexity_long"), "{:.4f}"), _num(r.get("quality_top1_agreement_long"), "{:.4f}"),
            _num(r.get("quality_mean_kl_long"), "{:.2e}"),
            Cell(str(note) if present(note) else "–", cls="wrap"),
        ])
        classes.append("")
    return Table(["engine", "dtype", "KV dtype", "KV bytes / token", "output tok/s", "perplexity",
                  "Δ perplexity vs fp32", "top-1 agreement", "mean KL (nats)", "perplexity, long context",
                  "top-1 agreement, long", "mean KL, long", "compared with"], rows,
                 "Per engine, dtype and KV-cache dtype: memory, speed and quality on the same page.",
                 "quality-values", classes,
                 note="Teacher-forced on held-out text of the trained model: every position predicted from the "
                      "true tokens before it. Agreement and KL are against the reference engine's float32 "
                      "scores with a float32 KV cache; 'long context' is the last positions of every window, "
                      "where KV error accumulates. Output tok/s: a short decode at the same settings, on this "
                      "run's machine.")


@section("quality", "Quality vs memory vs speed", "What a dtype or a quantised KV cache costs in quality "
         "beside what it saves in KV memory and gains in speed: perplexity of held-out text from a model "
         "trained here, and agreement with the float32 reference engine.")
def quality(data: ReportData) -> list[Block]:
    df = quality_frame(data.rows)
    if df.empty:
        return []
    blocks: list[Block] = []
    ok = df[(df["status"] == "ok") & df["delta_perplexity"].notna()]
    ok = ok.iloc[sorted(range(len(ok)), key=lambda i: KV_ORDER.get(str(ok["kv_dtype"].iloc[i]), 9))]
    if not ok.empty:
        fig = bars(ok.assign(series=ok["engine"].astype(str) + " · " + ok["dtype"].astype(str),
                             label="KV " + ok["kv_dtype"].astype(str)),
                   x="label", y="delta_perplexity", colours=data.colours, x_title="KV-cache dtype",
                   y_title="Δ perplexity vs float32 reference", fmt=".4g")
        blocks.append(Figure(fig, "quality", "Perplexity of held-out text minus the float32 reference engine's, "
                                             "per engine · dtype and KV-cache dtype (lower is better; 0: no loss)."))
    blocks.append(quality_table(df))
    notes = sorted({str(n) for n in df["quality_note"] if present(n)})
    for n in notes:
        blocks.append(Note(n))
    if not ok.empty and ok["quality_margin_p50"].notna().any():
        m = ok["quality_margin_p50"].dropna().median()
        blocks.append(Note(f"Median top-1/top-2 log-probability margin of the model on this text: {fmt_num(m)} nats "
                           "(random weights: a few hundredths)."))
    return blocks
