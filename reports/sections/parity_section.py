"""The parity section (workload `parity`): per engine, greedy agreement with the baseline engine
and the teacher-forced comparison of log-probabilities beside the dtype's thresholds, with the
verdict and its reason (docs/results-schema.md, "Parity"; harness/core/parity.py)."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from reports.blocks import Block, Cell, Figure, Note, Table, fmt_num
from reports.data import ReportData
from reports.figures import bars
from reports.sections.registry import section
from reports.sections.common import column, int_columns, point_label, present

# teacher-forced metric -> (threshold key, which way passes, header)
TEACHER_FORCED = (("parity_max_abs_err", "max_abs_err", "le", "max |Δ log p| (nats)"),
                  ("parity_mean_kl", "mean_kl", "le", "mean KL (nats)"),
                  ("parity_top1_agreement", "top1_agreement", "ge", "top-1 agreement, confident positions"))


def parity_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """Every parity row (any status but unavailable), one per series and point: greedy
    agreement, teacher-forced metrics and thresholds, status and reason."""
    df = rows[(rows["workload"] == "parity") & (rows["status"] != "unavailable")]
    if df.empty:
        return pd.DataFrame()
    df = int_columns(df)
    df = df.assign(point_label=column(df, "point").map(point_label))
    keep = ["engine", "series", "status", "error", "dtype", "point_label", "agreement", "first_divergence",
            "parity_baseline", "parity_teacher", "positions_compared", "positions_expected", "parity_max_abs_err", "parity_mean_kl",
            "parity_top1_agreement", "parity_confident_positions", "parity_margin_bound", "parity_margin_p50",
            "parity_thresholds", "parity_note"]
    return pd.DataFrame({k: column(df, k) for k in keep}).reset_index(drop=True)


def _num(v: Any) -> float | None:
    return float(v) if present(v) and isinstance(v, (int, float)) else None


def metric_check(value: Any, threshold: Any, way: str) -> bool | None:
    """True: within the threshold; False: past it; None: nothing to check."""
    v, t = _num(value), _num(threshold)
    if v is None or t is None:
        return None
    return v <= t if way == "le" else v >= t


def verdict(r: dict[str, Any]) -> tuple[str, str]:
    """(pass | fail | no verdict, the reason)."""
    if r.get("status") == "failed":
        return "fail", str(r.get("error") or "(no reason recorded)")
    if r.get("status") == "unverified":  # never shown as a pass: the check could not decide
        return "unverified", str(r.get("error") or "")
    if r.get("status") != "ok":
        return str(r.get("status")), str(r.get("error") or "")
    base, engine = r.get("parity_baseline"), r.get("engine")
    if present(base) and base == engine:
        return "baseline", "the engine the others are compared with"
    thresholds = r.get("parity_thresholds") if isinstance(r.get("parity_thresholds"), dict) else {}
    checks = [metric_check(r.get(f), thresholds.get(k), way) for f, k, way, _ in TEACHER_FORCED]
    failed = [h for (_, _, _, h), c in zip(TEACHER_FORCED, checks) if c is False]
    if failed:   # the row says ok but a metric is past its threshold: say so rather than trust the status
        return "fail", "past the threshold: " + ", ".join(failed)
    if any(c is True for c in checks):
        return "pass", f"teacher-forced log-probabilities within the {r.get('dtype') or ''} thresholds".replace("  ", " ")
    if present(r.get("parity_note")):
        return "greedy only", str(r["parity_note"])
    agreement = _num(r.get("agreement"))
    if agreement is not None:
        return "pass" if agreement == 1 else "greedy only", (
            "greedy tokens identical; no teacher-forced comparison" if agreement == 1 else
            "greedy tokens differ; no teacher-forced comparison to tell rounding from a wrong model")
    return "no verdict", ""


def _with_threshold(value: Any, threshold: Any, way: str, fmt=fmt_num) -> Cell:
    v = _num(value)
    if v is None:
        return Cell("–", None, cls="num muted")
    t = _num(threshold)
    ok = metric_check(v, t, way)
    text = fmt(v) + (f" {'≤' if way == 'le' else '≥'} {fmt(t)}" if t is not None else "")
    if ok is False:
        text = fmt(v) + f" (threshold {'≤' if way == 'le' else '≥'} {fmt(t)})"
    return Cell(text, v, cls="num" + (" bad" if ok is False else " good" if ok else ""), title=repr(v))


def _pct(v: float) -> str:
    return f"{v * 100:.1f}%" if math.isfinite(v) else "–"


def parity_table(df: pd.DataFrame) -> Table:
    rows, classes = [], []
    several_points = df["point_label"].nunique() > 1
    for r in df.to_dict("records"):
        thresholds = r.get("parity_thresholds") if isinstance(r.get("parity_thresholds"), dict) else {}
        verdict_text, reason = verdict(r)
        agreement = _num(r.get("agreement"))
        fd = r.get("first_divergence")
        top1 = _with_threshold(r.get("parity_top1_agreement"), thresholds.get("top1_agreement"), "ge", _pct)
        conf = _num(r.get("parity_confident_positions"))
        if conf is not None and top1.value is not None:
            top1.text += f" of {int(conf)}"
        bound, p50 = _num(r.get("parity_margin_bound")), _num(r.get("parity_margin_p50"))
        rows.append([
            Cell(str(r["series"]) + (f" · {r['point_label']}" if several_points else "")),
            Cell(str(r["dtype"]) if present(r.get("dtype")) else "–"),
            Cell(str(r["parity_baseline"]) if present(r.get("parity_baseline")) else "–"),
            Cell(_pct(agreement) if agreement is not None else "–", agreement, cls="num"),
            Cell(str(int(fd)) if present(fd) else ("none" if agreement is not None else "–"),
                 float(fd) if present(fd) else None, cls="num"),
            _with_threshold(r.get("parity_max_abs_err"), thresholds.get("max_abs_err"), "le"),
            _with_threshold(r.get("parity_mean_kl"), thresholds.get("mean_kl"), "le"),
            top1,
            Cell(f"{fmt_num(p50)} / {fmt_num(bound)}" if p50 is not None and bound is not None else "–", cls="num"),
            Cell(verdict_text, cls={"pass": "good", "fail": "bad", "unverified": "bad"}.get(verdict_text, "muted")),
            Cell(reason, cls="wrap"),
        ])
        classes.append({"fail": "bad", "unverified": "bad"}.get(verdict_text, ""))
    return Table(["engine", "dtype", "compared with", "greedy agreement", "first divergence (step)",
                  "max |Δ log p| vs threshold", "mean KL vs threshold", "top-1 agreement vs threshold",
                  "margin p50 / bound (nats)", "verdict", "reason"], rows,
                 "Per engine: greedy agreement, and the teacher-forced metrics beside its dtype's thresholds.",
                 "parity-values", classes,
                 note="Teacher-forced: every engine is fed the baseline's sequence, so one rounding flip cannot "
                      "cascade. Greedy agreement is free-running: in bfloat16 one flip changes every later token, "
                      "so it decides nothing by itself. Margin: the baseline's median top-1/top-2 log-probability "
                      "margin beside the dtype's bound (positions above the bound count as confident).")


@section("parity", "Parity", "Does each engine compute the same model as the baseline engine? Greedy "
         "output tokens against the baseline's, and teacher-forced log-probabilities (max |Δ log p|, "
         "mean KL, top-1 agreement where the baseline's margin exceeds the dtype's error bound) against "
         "the dtype's thresholds.")
def parity(data: ReportData) -> list[Block]:
    df = parity_frame(data.rows)
    if df.empty:
        return []
    blocks: list[Block] = []
    greedy = df.dropna(subset=["agreement"])
    if not greedy.empty:
        fig = bars(greedy.assign(agreement=pd.to_numeric(greedy["agreement"])), x="point_label", y="agreement",
                   colours=data.colours, x_title="point", y_title="greedy token agreement with the baseline (%)",
                   scale=100)
        blocks.append(Figure(fig, "parity", "Share of greedy output tokens equal to the baseline engine's."))
    blocks.append(parity_table(df))
    if df["status"].eq("failed").any():
        blocks.append(Note(f"{int(df['status'].eq('failed').sum())} parity row(s) failed: see the reason column."))
    if df["status"].eq("unverified").any():
        blocks.append(Note(f"{int(df['status'].eq('unverified').sum())} parity row(s) unverified: the engine cannot "
                           "be scored teacher-forced and greedy agreement decides nothing in this dtype. Run parity "
                           "in float32, or use an engine that returns log-probabilities."))
    return blocks
