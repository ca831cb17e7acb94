"""The speculative-decoding section (workload `speculative`): the speed-up over the same engine
without speculation against batch size (per engine, method and k; one panel per content
category), the acceptance at each draft position, the mean acceptance length per content
category, the lossless verdict of every engine and method, and how closely the engines agree on
the tokens accepted per request at batch 1 (docs/metrics.md, "Speculative decoding")."""

from __future__ import annotations

from typing import Any

import pandas as pd

from harness.core.specdecode import accepted_agreement
from reports.blocks import Block, Cell, Figure, Note, Table, fmt_num
from reports.data import ReportData
from reports.figures import bars, facet_lines
from reports.sections.common import Col, column, int_columns, present, values_table
from reports.sections.registry import section

WORKLOAD = "speculative"
CONTENT_ORDER = {"code": 0, "prose": 1, "random": 2}


def method_label(method: Any, k: Any) -> str:
    return str(method) if method in (None, "none") or not present(k) else f"{method} k={int(k)}"


def speculative_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Every speculative row that ran (ok, failed or unverified), one per engine and point, with
    its method label (`ngram k=4`) and `spec_series` = series · method label."""
    if "workload" not in rows.columns:
        return pd.DataFrame()
    df = rows[(rows["workload"] == WORKLOAD) & rows["status"].isin(["ok", "failed", "unverified"])]
    if df.empty:
        return pd.DataFrame()
    df = int_columns(df).copy()
    points = column(df, "point").map(lambda p: p if isinstance(p, dict) else {})
    df["method"] = points.map(lambda p: p.get("method"))
    df["k"] = points.map(lambda p: p.get("k"))
    df["content"] = points.map(lambda p: p.get("content"))
    df["batch_size"] = points.map(lambda p: p.get("batch_size"))
    df["method_label"] = [method_label(m, k) for m, k in zip(df["method"], df["k"])]
    df["spec_series"] = [f"{s} · {m}" for s, m in zip(df["series"], df["method_label"])]
    df["_content_rank"] = df["content"].map(lambda c: CONTENT_ORDER.get(c, 9))
    return df.sort_values(["series", "method", "k", "_content_rank", "batch_size"], kind="stable",
                          na_position="first").reset_index(drop=True)


def speedup_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Speculative rows whose output passed the lossless check, with their speed-up: one line per
    engine · method · k over the batch sizes, one panel per content category. A row whose output
    changed is left out (its speed-up is not of the same computation): the lossless table shows it."""
    if df.empty:
        return df
    d = df[(df["method"] != "none") & (df["status"] == "ok") & column(df, "speedup").notna()]
    return d.assign(series=d["spec_series"]).reset_index(drop=True)


def pooled(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Counters summed over the rows of each group (every batch size of one content category, say):
    the acceptance rate, mean acceptance length and acceptance per position of the group as one
    sample. Rows without counters are left out."""
    d = df[(df["method"] != "none") & column(df, "spec_drafts").notna()]
    if d.empty:
        return pd.DataFrame()
    out = []
    for key, g in d.groupby(by, sort=False, dropna=False):
        drafts = float(pd.to_numeric(g["spec_drafts"]).sum())
        proposed = float(pd.to_numeric(column(g, "spec_draft_tokens"), errors="coerce").sum())
        accepted = float(pd.to_numeric(column(g, "spec_accepted_tokens"), errors="coerce").sum())
        width = max((len(p) for p in column(g, "spec_accepted_per_pos") if isinstance(p, list)), default=0)
        per_pos = [sum(p[i] for p in column(g, "spec_accepted_per_pos") if isinstance(p, list) and len(p) > i)
                   for i in range(width)]
        rec = dict(zip(by, key if isinstance(key, tuple) else (key,)))
        rec.update(engine=g["engine"].iloc[0], rows=len(g), drafts=drafts, proposed=proposed, accepted=accepted,
                   acceptance_rate=accepted / proposed if proposed else None,
                   mean_acceptance_length=1 + accepted / drafts if drafts else None,
                   acceptance_per_pos=[a / drafts for a in per_pos] if drafts and per_pos else None)
        out.append(rec)
    return pd.DataFrame(out)


def position_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Acceptance at each draft position (1-based), pooled over the batch sizes: one line per
    engine · method · k, one panel per content category."""
    p = pooled(df, ["spec_series", "content"])
    if p.empty:
        return p
    out = [{"engine": r["engine"], "series": r["spec_series"], "content": r["content"], "position": i + 1,
            "acceptance": a, "drafts": r["drafts"]}
           for r in p.to_dict("records") for i, a in enumerate(r["acceptance_per_pos"] or [])]
    return pd.DataFrame(out)


def content_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Mean acceptance length and acceptance rate per content category, pooled over the batch
    sizes: one bar per engine · method · k at each category."""
    p = pooled(df, ["spec_series", "content"])
    if p.empty:
        return p
    p = p.assign(series=p["spec_series"], _rank=p["content"].map(lambda c: CONTENT_ORDER.get(c, 9)))
    return p.sort_values(["_rank"], kind="stable").reset_index(drop=True)


def lossless_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Per engine and method (with k): the speculative points whose output was identical to the
    engine's output without speculation, different, or not compared, and the first problem."""
    d = df[df["method"] != "none"] if not df.empty else df
    if d.empty:
        return pd.DataFrame()
    out = []
    for (series, label), g in d.groupby(["series", "method_label"], sort=False):
        verdicts = column(g, "lossless").fillna("unverified")
        bad = g[verdicts.isin(["fail", "unverified"])]
        first = bad.iloc[0] if len(bad) else None
        verdict = "fail" if (verdicts == "fail").any() else "unverified" if (verdicts == "unverified").any() else "pass"
        out.append({"series": series, "method": label, "points": len(g), "pass": int((verdicts == "pass").sum()),
                    "fail": int((verdicts == "fail").sum()), "unverified": int((verdicts == "unverified").sum()),
                    "tokens": int(pd.to_numeric(column(g, "lossless_tokens"), errors="coerce").fillna(0).sum()),
                    "verdict": verdict,
                    "detail": "" if first is None else
                    f"batch {first['batch_size']} · {first['content']}: {first.get('lossless_detail') or first.get('error')}"})
    return pd.DataFrame(out)


def agreement_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """The accepted tokens per request at batch 1, compared across engines (harness.core.specdecode)."""
    if "workload" not in rows.columns:
        return pd.DataFrame()
    recs = rows[rows["workload"] == WORKLOAD].to_dict("records")
    return pd.DataFrame(accepted_agreement(recs))


@section("speculative", "Speculative decoding",
         "Each point is a closed loop through the engine's serve() at concurrency = batch size, beside the same "
         "engine's point without speculation (same requests, same run, same cores). Speed-up = TPOT without / with "
         "speculation, its 95% interval a bootstrap over the requests paired by request. Acceptance comes from the "
         "engine's own spec-decode counters over the point. Lossless: every request's output must be the run "
         "without speculation's, token for token.")
def speculative(data: ReportData) -> list[Block]:
    df = speculative_frame(data.rows)
    if df.empty:
        return []
    blocks: list[Block] = []
    sp = speedup_frame(df)
    facet = "content" if column(sp, "content").nunique() > 1 else None
    if not sp.empty:
        fig = Figure(facet_lines(sp, x="batch_size", y="speedup", facet=facet, colours=data.colours, ci="speedup_ci",
                                 x_title="batch size (requests in flight)", y_title="speed-up (TPOT off / on)",
                                 log_x=True, hover=[("tpot_s", "TPOT with (s)", ".4g"),
                                                    ("baseline_tpot_s", "TPOT without (s)", ".4g")]),
                     "speculative-speedup", "Speed-up over the same engine without speculation against batch size, "
                     "per engine, method and k (one panel per content category); 1 = no gain, below 1 = a loss.")
        fig.table = values_table(sp, [Col("engine · method", "series", text=True), Col("content", "content", text=True),
                                      Col("batch", "batch_size"), Col("TPOT ms", "tpot_s", 1e3, ci="tpot_s_ci"),
                                      Col("TPOT ms without", "baseline_tpot_s", 1e3),
                                      Col("speed-up [95% CI]", "speedup", ci="speedup_ci", better="higher"),
                                      Col("tokens / step", "tokens_per_step"),
                                      Col("accept length", "mean_acceptance_length"),
                                      Col("accept rate %", "acceptance_rate", 100),
                                      Col("draft time %", "draft_time_share", 100)],
                                 "speculative-values", group=["content", "batch_size"])
        blocks.append(fig)
    pos = position_frame(df)
    if not pos.empty:
        pfacet = "content" if pos["content"].nunique() > 1 else None
        fig = Figure(facet_lines(pos, x="position", y="acceptance", facet=pfacet, colours=data.colours, scale=100,
                                 x_title="draft position", y_title="drafts with this token accepted (%)"),
                     "speculative-positions", "Acceptance at each draft position (drafts whose i-th token the target "
                     "accepted / drafts), pooled over the batch sizes.")
        fig.table = values_table(pos, [Col("engine · method", "series", text=True), Col("content", "content", text=True),
                                       Col("position", "position"), Col("accepted %", "acceptance", 100),
                                       Col("drafts", "drafts")], "speculative-positions-values")
        blocks.append(fig)
    cont = content_frame(df)
    if not cont.empty:
        fig = Figure(bars(cont.dropna(subset=["mean_acceptance_length"]), x="content", y="mean_acceptance_length",
                          colours=data.colours, x_title="content", y_title="mean acceptance length (tokens)"),
                     "speculative-content", "Mean acceptance length (1 + accepted / drafts: tokens a drafting step "
                     "emits per sequence) per content category, pooled over the batch sizes.")
        fig.table = values_table(cont, [Col("engine · method", "series", text=True), Col("content", "content", text=True),
                                        Col("accept length", "mean_acceptance_length", better="higher"),
                                        Col("accept rate %", "acceptance_rate", 100), Col("drafts", "drafts"),
                                        Col("accepted tokens", "accepted")],
                                 "speculative-content-values", group="content")
        blocks.append(fig)
    blocks += lossless_blocks(lossless_frame(df))
    blocks += agreement_blocks(agreement_frame(data.rows))
    skipped = data.rows[(data.rows["workload"] == WORKLOAD) & (data.rows["status"] == "skipped")] \
        if "workload" in data.rows.columns else pd.DataFrame()
    if not skipped.empty:
        why = sorted({f"{e}: {(err or '').splitlines()[0]}" for e, err in zip(skipped["engine"], skipped["error"])})
        blocks.append(Note(f"{len(skipped)} point(s) skipped: " + "; ".join(why), name="speculative-skipped"))
    agg = df[column(df, "spec_aggregate_only").map(lambda v: bool(v) if isinstance(v, list) else False)]
    if not agg.empty:
        blocks.append(Note("reported only in aggregate (those figures are left empty, not zero): " + "; ".join(
            sorted({f"{s}: {', '.join(v)}" for s, v in zip(agg["series"], agg["spec_aggregate_only"])})),
            name="speculative-aggregate-only"))
    return blocks


def lossless_blocks(lf: pd.DataFrame) -> list[Block]:
    if lf.empty:
        return []
    rows, classes = [], []
    for r in lf.to_dict("records"):
        cls = {"pass": "good", "fail": "bad", "unverified": "bad"}[r["verdict"]]
        rows.append([Cell(str(r["series"])), Cell(str(r["method"])), Cell(r["verdict"], cls=cls),
                     Cell(fmt_num(r["pass"]), r["pass"], cls="num"), Cell(fmt_num(r["fail"]), r["fail"], cls="num"),
                     Cell(fmt_num(r["unverified"]), r["unverified"], cls="num"),
                     Cell(fmt_num(r["tokens"]), r["tokens"], cls="num"), Cell(r["detail"] or "–", cls="wrap")])
        classes.append("" if r["verdict"] == "pass" else "bad")
    out: list[Block] = [Table(["engine", "method", "lossless", "points identical", "points different",
                               "points not compared", "tokens compared", "first problem"], rows,
                              "Lossless check: every speculative point's output against the same engine's output "
                              "without speculation, request by request, token for token.", "speculative-lossless",
                              classes)]
    bad = lf[lf["verdict"] != "pass"]
    if not bad.empty:
        out.append(Note(f"{len(bad)} engine/method pair(s) not lossless or not verified: speculation changed the output "
                        "or could not be compared (the rows are failed or unverified).", kind="warning",
                        name="speculative-lossless-failed"))
    return out


def agreement_blocks(af: pd.DataFrame) -> list[Block]:
    if af.empty:
        return []
    rows = []
    for r in af.to_dict("records"):
        share = r["identical_share"]
        first = r["first_difference"]
        rows.append([Cell(method_label(r["method"], r["k"]) + (f" ({r['draft']})" if r.get("draft") else "")),
                     Cell(str(r["content"])), Cell(", ".join(r["engines"])),
                     Cell(fmt_num(r["requests"]), r["requests"], cls="num"),
                     Cell(fmt_num(r["identical"]), r["identical"], cls="num"),
                     Cell("–" if share is None else f"{share:.0%}", share, cls="num " + ("good" if share == 1 else "bad")),
                     Cell("–" if first is None else ", ".join(f"{k}: {v}" for k, v in first.items()), cls="wrap"),
                     Cell(", ".join(f"{e}: {s}" for e, s in r["sources"].items()), cls="wrap")])
    return [Table(["method", "content", "engines", "requests", "identical", "share identical",
                   "first difference (accepted tokens)", "counted from"], rows,
                  "Accepted tokens per request at batch 1 (same target, draft, k, n-gram windows and prompts), "
                  "compared across engines: with greedy drafting and verification they are a property of the models, "
                  "not of the engine.", "speculative-agreement")]
