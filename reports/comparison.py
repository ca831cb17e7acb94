"""Baseline vs current: for every point both measured, the ratio current / baseline of each
metric's median with a 95% bootstrap CI (`harness.stats.bootstrap_ratio_ci` on the raw
samples), and a verdict. Pure pandas + numpy, so the regression check can reuse it.

Matching: rows match when engine, workload, point, model, dtype, device and engine options are
equal (only ok rows).

Verdict, for a metric where lower is better (latencies, memory), with tolerance `tol`:
  regression   the whole CI is above 1 and the ratio is above 1 + tol
  improvement  the whole CI is below 1 and the ratio is below 1 − tol
  no change    otherwise
  no CI        fewer than two samples on a side: the ratio alone, no verdict
Metrics without samples (peak memory) are judged on the ratio alone against the tolerance.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from harness.stats import bootstrap_ratio_ci


@dataclass(frozen=True)
class Metric:
    field: str            # the median's field; samples in f"{field}_samples" when `sampled`
    label: str
    unit: str
    scale: float          # display scale (s -> ms ...)
    better: str = "lower"
    sampled: bool = True


METRICS: list[Metric] = [
    Metric("prefill_latency_s", "prefill latency", "ms", 1e3),
    Metric("decode_step_latency_s", "decode step latency", "ms", 1e3),
    Metric("e2e_latency_s", "end-to-end latency", "ms", 1e3),
    Metric("ttft_s", "TTFT", "ms", 1e3),
    Metric("tpot_s", "TPOT", "ms", 1e3),
    Metric("itl_s", "ITL", "ms", 1e3),
    Metric("e2el_s", "E2EL", "ms", 1e3),
    Metric("peak_memory_bytes", "peak memory", "MiB", 1 / 2**20, sampled=False),
]
DEFAULT_TOLERANCE = 0.05
MATCH_FIELDS = ("engine", "workload", "point_key", "model", "dtype", "device")


def _match_key(r: dict[str, Any]) -> tuple:
    opts = json.dumps(r.get("engine_options"), sort_keys=True, default=str)
    return tuple(str(r.get(f)) for f in MATCH_FIELDS) + (opts,)


def _samples(v: Any) -> list[float]:
    if not isinstance(v, (list, tuple)):
        return []
    return [float(x) for x in v if isinstance(x, (int, float)) and math.isfinite(x)]


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def verdict(ratio: float | None, lo: float | None, hi: float | None, better: str, tol: float,
            sampled: bool = True) -> str:
    if ratio is None:
        return "no data"
    r, l, h = (ratio, lo, hi) if better == "lower" else (
        1 / ratio if ratio else math.inf, 1 / hi if hi else None, 1 / lo if lo else None)
    if not sampled:
        return "regression" if r > 1 + tol else "improvement" if r < 1 - tol else "no change"
    if l is None or h is None:
        return "no CI"
    if l > 1 and r > 1 + tol:
        return "regression"
    if h < 1 and r < 1 - tol:
        return "improvement"
    return "no change"


def compare_rows(baseline: pd.DataFrame | list[dict[str, Any]], current: pd.DataFrame | list[dict[str, Any]],
                 metrics: list[Metric] | None = None, tolerance: float = DEFAULT_TOLERANCE) -> pd.DataFrame:
    """One row per (matched point, metric both sides have): engine, workload, point_key, point,
    metric, label, unit, scale, better, baseline, current, ratio, ci_lo, ci_hi, n_baseline,
    n_current, verdict. Empty when nothing matches."""
    metrics = metrics or METRICS
    base = baseline.to_dict("records") if isinstance(baseline, pd.DataFrame) else list(baseline)
    cur = current.to_dict("records") if isinstance(current, pd.DataFrame) else list(current)
    base_by_key = {_match_key(r): r for r in base if r.get("status") == "ok"}   # the last row wins
    cur_by_key = {_match_key(r): r for r in cur if r.get("status") == "ok"}
    out = []
    for key, c in cur_by_key.items():
        b = base_by_key.get(key)
        if b is None:
            continue
        for m in metrics:
            bv, cv = _number(b.get(m.field)), _number(c.get(m.field))
            if bv is None or cv is None:
                continue
            bs, cs = _samples(b.get(f"{m.field}_samples")), _samples(c.get(f"{m.field}_samples"))
            ratio = lo = hi = None
            if m.sampled and len(bs) >= 2 and len(cs) >= 2:
                res = bootstrap_ratio_ci(bs, cs)
                if res is not None:
                    ratio, lo, hi = res
            if ratio is None and bv:
                ratio = cv / bv
            out.append({
                "engine": c.get("engine"), "series": c.get("series", c.get("engine")),
                "workload": c.get("workload"), "point_key": c.get("point_key"), "point": c.get("point"),
                "metric": m.field, "label": m.label, "unit": m.unit, "scale": m.scale, "better": m.better,
                "baseline": bv, "current": cv, "ratio": ratio, "ci_lo": lo, "ci_hi": hi,
                "n_baseline": len(bs), "n_current": len(cs),
                "verdict": verdict(ratio, lo, hi, m.better, tolerance, m.sampled),
            })
    return pd.DataFrame(out)


def unmatched(baseline: pd.DataFrame, current: pd.DataFrame) -> tuple[int, int]:
    """(ok points only in the current results, ok points only in the baseline), counted over
    the workloads both have."""
    shared = set(baseline["workload"]) & set(current["workload"])
    b = {_match_key(r) for r in baseline.to_dict("records") if r.get("status") == "ok" and r.get("workload") in shared}
    c = {_match_key(r) for r in current.to_dict("records") if r.get("status") == "ok" and r.get("workload") in shared}
    return len(c - b), len(b - c)
