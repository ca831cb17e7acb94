"""Baseline vs current for the report's comparison section. The numbers and verdicts are
exactly those of the regression check (`harness.core.compare.compare`, what `infer-bench-compare`
runs), so the page and the CI gate never disagree; this module only shapes them for display
(labels, units, the point's parameters, the series name)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd

from harness.core.compare import METHOD, compare, machine_differences, machine_kind

DEFAULT_THRESHOLD = 0.05   # infer-bench-compare's default (--threshold 5%)
# metric -> (label, unit, display scale)
LABELS: dict[str, tuple[str, str, float]] = {
    "prefill_latency_s": ("prefill latency", "ms", 1e3),
    "decode_step_latency_s": ("decode step latency", "ms", 1e3),
    "e2e_latency_s": ("end-to-end latency", "ms", 1e3),
    "output_tok_s": ("output throughput", "tok/s", 1.0),
    "ttft_s": ("TTFT", "ms", 1e3),
    "tpot_s": ("TPOT", "ms", 1e3),
    "itl_s": ("ITL", "ms", 1e3),
    "e2el_s": ("E2EL", "ms", 1e3),
    "peak_memory_bytes": ("peak memory", "MiB", 1 / 2**20),
    "status": ("status (ok → not ok)", "", 1.0),
}
COLUMNS = ["engine", "series", "model", "workload", "point_key", "point", "dtype", "metric", "label", "unit",
           "scale", "better", "baseline", "current", "ratio", "ci_lo", "ci_hi", "verdict", "note"]


def method_text() -> str:
    return METHOD


def _records(rows: pd.DataFrame | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Plain row dicts (a DataFrame's gaps, NaN, back to None), parity rows left out as the
    regression check does."""
    recs = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else [dict(r) for r in rows]
    out = []
    for r in recs:
        if r.get("workload") == "parity":
            continue
        out.append({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()})
    return out


def compare_rows(baseline: pd.DataFrame | list[dict[str, Any]], current: pd.DataFrame | list[dict[str, Any]],
                 threshold: float = DEFAULT_THRESHOLD, metrics: list[str] | None = None
                 ) -> tuple[pd.DataFrame, dict[str, list[str]]]:
    """(one row per compared metric and matched point, in COLUMNS; the unmatched points per
    side). `metrics` None: the regression check's defaults per workload."""
    base, cur = _records(baseline), _records(current)
    comps, unmatched = compare(base, cur, metrics, threshold)
    by_key = {(r.get("engine"), r.get("model"), r.get("workload"), r.get("point_key"), r.get("dtype")): r for r in cur}
    out = []
    for c in comps:
        row = by_key.get((c.engine, c.model, c.workload, c.point, c.dtype), {})
        label, unit, scale = LABELS.get(c.metric, (c.metric, "", 1.0))
        d = asdict(c)
        out.append({"engine": c.engine, "series": row.get("series", c.engine), "model": c.model,
                    "workload": c.workload, "point_key": c.point, "point": row.get("point"), "dtype": c.dtype,
                    "metric": c.metric, "label": label, "unit": unit, "scale": scale, "better": c.better,
                    "baseline": d["baseline"], "current": d["current"], "ratio": c.ratio,
                    "ci_lo": c.ci_low, "ci_hi": c.ci_high, "verdict": c.verdict, "note": c.note})
    return pd.DataFrame(out, columns=COLUMNS), unmatched


@dataclass
class MachineCheck:
    """Did the baseline and the current results run on the same machine?"""

    same: bool | None                    # None: cannot tell (no environment.json on a side)
    differences: list[str]               # 'what: baseline X, current Y'
    unknown: list[str]                   # the sides without environment.json


def _run_kinds(runs: list[Any], rows: pd.DataFrame | None) -> tuple[list[dict[str, Any]], int]:
    """(machine_kind of every run that recorded its environment, runs without one)."""
    kinds, missing = [], 0
    for run in runs:
        if not run.environment:
            missing += 1
            continue
        mine = rows[rows["source"] == str(run.results)] if rows is not None and "source" in rows.columns else None
        kind = machine_kind(run.environment, _records(mine) if mine is not None else [])
        if kind not in kinds:
            kinds.append(kind)
    return kinds, missing


def machine_check(base_runs: list[Any], base_rows: pd.DataFrame | None, cur_runs: list[Any],
                  cur_rows: pd.DataFrame | None) -> MachineCheck:
    """The check infer-bench-compare makes before it compares (harness.core.compare.machine_kind /
    machine_differences), over every run on each side."""
    base, base_missing = _run_kinds(base_runs, base_rows)
    cur, cur_missing = _run_kinds(cur_runs, cur_rows)
    unknown = [side for side, kinds, missing in (("baseline", base, base_missing), ("current", cur, cur_missing))
               if missing or not kinds]
    diffs: list[str] = []
    for b in base:
        for c in cur:
            diffs += [d for d in machine_differences(b, c) if d not in diffs]
    if diffs:
        return MachineCheck(False, diffs, unknown)
    return MachineCheck(None if unknown else True, [], unknown)


__all__ = ["DEFAULT_THRESHOLD", "LABELS", "MachineCheck", "compare_rows", "machine_check",
           "method_text"]
