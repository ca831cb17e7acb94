"""The regression comparison: baseline against current, ratio by ratio, with a verdict.

Rows are matched by engine, model, workload, point and dtype; rows found on one side only are
listed, not dropped. For each matched metric the ratio current/baseline of the medians gets a
percentile-bootstrap confidence interval (each side's repeat samples resampled independently;
`harness.core.bootstrap`). The verdict is **regressed** only when the whole interval lies beyond
the threshold in the bad direction (slower, less throughput, more memory), **improved** when it
lies beyond it in the good direction, and **unchanged** otherwise. It fails closed: a point that
was ok in the baseline and failed in the current run, or a metric the baseline has and the current
run lacks, is **failed**, and so is a comparison in which no metric was compared; `no-data` is left
only where neither side has the value.

Runs from different machines are not comparable: a baseline recorded on another CPU turned
identical code into x1.39 "regressed". `machine_differences` names what differs between two
runs' environments (CPU model and ISA, cores, GPUs, torch and engine versions); the command
line refuses such a comparison unless asked (`--allow-other-machine`), and then says
"different machines" in the verdict.

`infer-bench-compare` (harness.compare_cli) and the report's baseline section both call
`compare`, so they give the same verdicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.core.bootstrap import RESAMPLES, ratio_ci
from harness.core.compared import COMPARED_ON, METRICS, Metric, register_compared
from harness.core.errors import UserError

METHOD = ("ratio of medians (current / baseline) with a percentile-bootstrap confidence interval: each "
          f"side's repeat samples resampled independently with replacement, {RESAMPLES} resamples "
          "(scipy.stats.bootstrap)")



def default_metrics(workload: str, rows: tuple[dict[str, Any], ...] = ()) -> list[str]:
    """What `workload` is compared on: its declaration; in a process that never loaded the
    workload (a report rendered on its own), every metric of the table that one of `rows` holds."""
    if workload in COMPARED_ON:
        return list(COMPARED_ON[workload])
    return [m for m in METRICS if any(_has_metric(r, m) for r in rows)]


KEY_FIELDS = ("engine", "model", "workload", "point_key", "dtype")
# Workloads that are checks, not measurements: never compared.
NOT_COMPARED = ("parity",)


@dataclass
class Comparison:
    engine: str
    model: str
    workload: str
    point: str
    dtype: str
    metric: str
    better: str
    baseline: float | None
    current: float | None
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    verdict: str  # regressed | improved | unchanged | failed | no-data
    normalized_by: str | None = None
    note: str | None = None


def row_key(r: dict[str, Any]) -> tuple:
    return tuple(r.get(k) for k in KEY_FIELDS)


def verdict(lo: float | None, hi: float | None, better: str, threshold: float) -> str:
    if lo is None or hi is None:
        return "no-data"
    if better == "lower":
        return "regressed" if lo > 1 + threshold else "improved" if hi < 1 - threshold else "unchanged"
    return "regressed" if hi < 1 - threshold else "improved" if lo > 1 + threshold else "unchanged"


def _plain_ratio(mb: np.ndarray, mc: np.ndarray) -> np.ndarray:
    return mc / mb


def _normalised_ratio(mb: np.ndarray, mc: np.ndarray, rb: np.ndarray, rc: np.ndarray) -> np.ndarray:
    return (mc / rc) / (mb / rb)


def compare_metric(b: dict[str, Any], c: dict[str, Any], metric: str, confidence: float = 0.95,
                   ref_b: dict[str, Any] | None = None, ref_c: dict[str, Any] | None = None,
                   seed: int = 0) -> tuple[float | None, float | None, float | None, str | None]:
    """(ratio, ci_low, ci_high, note) of current/baseline for one metric; with ref_b/ref_c, each
    side is first divided by a reference engine's metric from the same run."""
    field, _, inverse = METRICS[metric][:3]
    sets = [b, c] + ([ref_b, ref_c] if ref_b is not None else [])
    if field is None:
        return _single_value_ratio(sets, metric)
    samples = [np.asarray(r.get(field) or [], dtype=float) for r in sets]
    if any(s.size < 2 for s in samples):
        return None, None, None, f"fewer than 2 samples of {field}"
    fn = _plain_ratio if ref_b is None else _normalised_ratio
    point = float(fn(*[np.median(s) for s in samples]))
    ci = ratio_ci(samples, fn, confidence, seed)
    if ci is None:
        return point, None, None, "no interval (degenerate samples)"
    lo, hi = ci
    if inverse:
        point, lo, hi = 1 / point, 1 / hi, 1 / lo
    return point, lo, hi, None


def _single_value_ratio(sets: list[dict[str, Any]], metric: str) -> tuple[float | None, float | None, float | None,
                                                                          str | None]:
    """One value per row: the ratio is its own interval, unless the rows bracket their value
    (a capacity search: the ratio lies between current low / baseline high and current high /
    baseline low; an open end is 0 or infinity)."""
    m = METRICS[metric]
    vals = [r.get(metric) for r in sets]
    if any(v is None for v in vals) or (not m.zero_ok and any(v == 0 for v in vals)):
        return None, None, None, "missing"
    if len(sets) == 2 and vals[0] == 0:  # zero_ok: 0 -> 0 is no change, 0 -> more is unbounded
        ratio = 1.0 if vals[1] == 0 else math.inf
        return ratio, ratio, ratio, "single value: the baseline is 0"
    if any(v == 0 for v in vals):
        return None, None, None, "a reference engine's value is 0: no normalised ratio"
    ratio = vals[1] / vals[0] if len(sets) == 2 else (vals[1] / vals[3]) / (vals[0] / vals[2])
    if m.bracket and len(sets) == 2:
        (b_lo, b_hi), (c_lo, c_hi) = (list(r.get(m.bracket) or [None, None]) for r in sets)
        lo = (c_lo or 0) / b_hi if b_hi else 0.0
        hi = c_hi / (b_lo or vals[0]) if c_hi else math.inf
        return ratio, min(lo, ratio), max(hi, ratio), "single value: the interval is from the search's brackets"
    return ratio, ratio, ratio, "single value: no repeat samples, the ratio is its own interval"


def compare(base_rows: list[dict[str, Any]], cur_rows: list[dict[str, Any]], metrics: list[str] | None,
            threshold: float, confidence: float = 0.95,
            normalize_by: str | None = None) -> tuple[list[Comparison], dict[str, list[str]]]:
    """Every matched (row, metric) with its ratio, interval and verdict; and the unmatched keys."""
    base = {row_key(r): r for r in base_rows if r.get("point_key") and r.get("workload") not in NOT_COMPARED}
    cur = {row_key(r): r for r in cur_rows if r.get("point_key") and r.get("workload") not in NOT_COMPARED}
    unmatched = {"baseline_only": _unmatched(base, cur, metrics), "current_only": _unmatched(cur, base, metrics)}
    out: list[Comparison] = []
    for i, k in enumerate(sorted(base.keys() & cur.keys(), key=str)):
        b, c = base[k], cur[k]
        engine, model, workload, point, dtype = k
        if normalize_by and engine == normalize_by:
            continue
        names = metrics or default_metrics(workload, (b, c))
        common = dict(engine=engine, model=model, workload=workload, point=point, dtype=dtype,
                      normalized_by=normalize_by)
        if b.get("status") != "ok" or c.get("status") != "ok":
            if b.get("status") == "ok":
                out.append(Comparison(**common, metric="status", better="ok", baseline=None, current=None,
                                      ratio=None, ci_low=None, ci_high=None, verdict="failed",
                                      note=(c.get("error") or c.get("status") or "")[:200]))
            continue
        ref_b = ref_c = None
        if normalize_by:
            rk = (normalize_by, model, workload, point, dtype)
            ref_b, ref_c = base.get(rk), cur.get(rk)
            if not ref_b or not ref_c or ref_b.get("status") != "ok" or ref_c.get("status") != "ok":
                for m in names:
                    out.append(Comparison(**common, metric=m, better=METRICS[m][1], baseline=b.get(m),
                                          current=c.get(m), ratio=None, ci_low=None, ci_high=None,
                                          verdict="no-data", note=f"{normalize_by} has no ok row at this point"))
                continue
        for j, m in enumerate(names):
            ratio, lo, hi, note = compare_metric(b, c, m, confidence, ref_b, ref_c, seed=i * 131 + j)
            v = verdict(lo, hi, METRICS[m][1], threshold)
            if v == "no-data":  # fail closed: a value the baseline has and the current run lacks
                has_b, has_c = _has_metric(b, m), _has_metric(c, m)
                if has_b and not has_c:
                    v, note = "failed", f"the current run has no {METRICS[m][0] or m} (the baseline has): {note}"
                elif has_c and not has_b:
                    v, note = "new", f"only the current run has {METRICS[m][0] or m}"
            out.append(Comparison(**common, metric=m, better=METRICS[m][1], baseline=b.get(m), current=c.get(m),
                                  ratio=ratio, ci_low=lo, ci_high=hi, verdict=v, note=note))
    return out, unmatched


def _unmatched(side: dict[tuple, dict[str, Any]], other: dict[tuple, dict[str, Any]],
               metrics: list[str] | None) -> list[str]:
    """The keys of `side` missing from `other`, except ok rows that hold none of the metrics their
    workload is compared on (a capacity search's probes: only its result is compared)."""
    out = []
    for k in side.keys() - other.keys():
        r = side[k]
        names = metrics or default_metrics(k[2], (r,))
        if r.get("status") != "ok" or any(_has_metric(r, m) for m in names):
            out.append(" ".join(map(str, k)))
    return sorted(out)


def _has_metric(r: dict[str, Any], metric: str) -> bool:
    """Whether a row holds what `metric` is compared on: two or more samples, or a positive value."""
    field = METRICS[metric][0]
    if field is None:
        v = r.get(metric)
        return (isinstance(v, (int, float)) and not isinstance(v, bool)
                and (v > 0 or (METRICS[metric].zero_ok and v == 0)))
    return len(r.get(field) or []) >= 2


VERDICTS = ("regressed", "failed", "improved", "unchanged", "new", "no-data")


def overall_verdict(comps: list[Comparison]) -> tuple[str, dict[str, int]]:
    """failed (a point failed or lost a metric, or nothing was compared), regressed (a metric
    regressed), improved (one improved and none regressed) or unchanged."""
    counts = {v: sum(c.verdict == v for c in comps) for v in VERDICTS}
    compared = counts["regressed"] + counts["improved"] + counts["unchanged"]
    if counts["failed"] or not compared:
        return "failed", counts
    return ("regressed" if counts["regressed"] else "improved" if counts["improved"] else "unchanged"), counts


def format_table(comps: list[Comparison], interval: str = "95% CI") -> str:
    head = ["engine", "workload", "point", "metric", "baseline", "current", "ratio", interval, "verdict"]
    body = []
    for c in comps:
        point = c.point.split(":", 1)[-1] if c.point else ""
        fmt = (lambda v: "-" if v is None else f"{v:.4g}")
        body.append([c.engine, c.workload, point, c.metric, fmt(c.baseline), fmt(c.current),
                     "-" if c.ratio is None else f"{c.ratio:.3f}",
                     "-" if c.ci_low is None else f"[{c.ci_low:.3f}, {c.ci_high:.3f}]",
                     c.verdict.upper() if c.verdict in ("regressed", "failed") else c.verdict])
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def parse_threshold(text: str) -> float:
    t = text.strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise UserError(f"--threshold {text}: give a percentage such as 5% (or a fraction such as 0.05).") from None
    if not 0 <= v < 1:
        raise UserError(f"--threshold {text}: must be between 0% and 100%.")
    return v


# ---- same machine? ---------------------------------------------------------------------------

def machine_kind(env: dict[str, Any] | None, rows: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """What makes two runs' timings comparable, from environment.json and the rows: CPU model and
    ISA, the cores the run could use, GPUs, torch, and each engine's version."""
    env = env or {}
    cpu = env.get("cpu") or {}
    engines = {}
    for r in rows:
        if r.get("engine") and r.get("engine_version"):
            engines[r["engine"]] = r["engine_version"]
    return {
        "cpu model": cpu.get("model"),
        "cpu ISA": " ".join(cpu.get("isa") or []) or None,
        "cpu cores": cpu.get("affinity") or cpu.get("logical_cores"),
        "GPUs": ", ".join(g.get("name", "?") for g in env.get("gpus") or []) or "none",
        "torch": (env.get("packages") or {}).get("torch"),
        **{f"engine {e}": v for e, v in sorted(engines.items())},
    }


def machine_differences(base: dict[str, Any], cur: dict[str, Any]) -> list[str]:
    """'what: baseline X, current Y' for each property of `machine_kind` that differs (an engine
    known on one side only is not a difference: it is simply not compared)."""
    out = []
    for k in dict.fromkeys(list(base) + list(cur)):
        if k.startswith("engine ") and (k not in base or k not in cur):
            continue
        b, c = base.get(k), cur.get(k)
        if b != c:
            out.append(f"{k}: baseline {b if b is not None else 'unknown'}, current {c if c is not None else 'unknown'}")
    return out
