"""Loading results for the report: results files (or run directories, single runs and
multiruns) into one pandas DataFrame, plus what each run recorded about itself
(environment.json, config.resolved.yaml).

Everything here is plain data; nothing knows about HTML.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from harness.core.errors import UserError
from harness.core.results import load_results

# Engines with a fixed colour (Okabe-Ito, colour-blind safe); others take the rest in order.
ENGINE_COLOURS = {"reference": "#D55E00", "hf": "#0072B2", "vllm": "#009E73", "trtllm": "#CC79A7"}
SPARE_COLOURS = ["#E69F00", "#56B4E9", "#000000", "#8C564B", "#7F7F7F", "#BCBD22", "#17BECF"]
# What tells two series of one engine apart, in this order.
VARIANT_FIELDS = ("model", "dtype", "device")


class ReportInputError(UserError):
    """Input the report cannot use (missing files, no rows): one clear message, exit 2."""

    prog = "infer-bench-report"


@dataclass
class RunInfo:
    """One results file and what its run directory recorded."""

    results: Path
    rows: int
    environment: dict[str, Any] | None = None
    config_text: str | None = None
    other_version_rows: int = 0  # rows of another results schema version, left out

    @property
    def directory(self) -> Path:
        return self.results.parent


@dataclass
class ReportData:
    """Everything a section may read."""

    rows: pd.DataFrame                      # every row, every status
    runs: list[RunInfo]
    baseline: pd.DataFrame | None = None    # the baseline's rows (same columns), or None
    baseline_runs: list[RunInfo] = field(default_factory=list)
    colours: dict[str, str] = field(default_factory=dict)   # engine -> colour
    threshold: float = 0.05                 # smallest change the baseline comparison counts

    @property
    def ok(self) -> pd.DataFrame:
        return self.rows[self.rows["status"] == "ok"]

    def workload(self, name: str, status: str = "ok") -> pd.DataFrame:
        """Rows of one workload (ok rows by default)."""
        df = self.rows
        return df[(df["workload"] == name) & (df["status"] == status)]

    def engines(self) -> list[str]:
        return list(dict.fromkeys(self.rows["engine"].dropna()))


def load_runs(paths: list[str | Path], what: str = "results") -> tuple[pd.DataFrame, list[RunInfo]]:
    """All rows of the given results files / run directories (read by the one results loader,
    `harness.core.results.load_results`; rows of another schema version are left out and noted),
    with a `source` column (the results file) and a `series` column (see `add_series`).
    Raises ReportInputError."""
    try:
        files = load_results(list(paths), what, other_versions="drop")
    except UserError as e:
        raise ReportInputError(e.problems) from None
    rows: list[dict[str, Any]] = []
    runs: list[RunInfo] = []
    for f in files:
        file_rows = [r for r in f.rows if r.get("engine") is not None]
        for r in file_rows:
            r["source"] = str(f.path)
        rows += file_rows
        runs.append(RunInfo(f.path, len(file_rows), f.environment, f.config_text, f.other_version_rows))
    if not rows:
        raise ReportInputError(f"{what} {', '.join(str(f.path) for f in files)}: no rows (has the run "
                               f"finished a point?).")
    return frame(rows), runs


def frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Rows (dicts) as a DataFrame with the columns every section may rely on."""
    # a null kv_reserved_bytes says "nothing reserved"; its absence (an older row) says nothing
    df = pd.DataFrame([{**r, "_kv_reserved_recorded": "kv_reserved_bytes" in r} for r in rows])
    for col in ("engine", "status", "workload", "model", "point_key", "error", "run_id",
                "batch_size", "prompt_len", "output_len", "dtype", "device", "source"):
        if col not in df.columns:
            df[col] = None
    df["status"] = df["status"].fillna("ok")
    df["workload"] = df["workload"].fillna("")
    return add_series(df)


def add_series(df: pd.DataFrame) -> pd.DataFrame:
    """A `series` label per row: the engine name, plus what tells apart rows of one engine that
    ran with different models, dtypes, devices or engine options (a multirun over those), plus
    the run id when the same configuration was measured at the same point by several runs.
    Rows that lack a field (an `unavailable` row has only engine, status and error) are not
    told apart by it. One line in a figure is one series; colours follow the engine."""
    df = df.copy()
    labels: dict[Any, str] = {}
    for engine, g in df.groupby("engine", sort=False):
        records = g.to_dict("records")
        varying = [c for c in VARIANT_FIELDS if len({str(r[c]) for r in records if _present(r.get(c))}) > 1]
        options = [r.get("engine_options") if isinstance(r.get("engine_options"), dict) else None for r in records]
        differing = _differing_options([o for o in options if o is not None])
        # an option that changes within one run is a workload's per-point override (kv_cache
        # for the KV ablation, prefix_caching for prefix sharing): the point already says it
        per_run: dict[Any, list[dict[str, Any]]] = {}
        for r, o in zip(records, options):
            if o is not None:
                per_run.setdefault(r.get("run_id"), []).append(o)
        overrides = {k for opts in per_run.values() for k in _differing_options(opts)}
        differing = [k for k in differing if k not in overrides]
        for idx, r, opts in zip(g.index, records, options):
            parts = [f"{c}={r[c]}" for c in varying if _present(r.get(c))]
            if opts is not None:
                parts += [f"{k}={opts.get(k)}" for k in differing]
            labels[idx] = f"{engine} ({', '.join(parts)})" if parts else str(engine)
        ok = g[g["status"] == "ok"].assign(_label=[labels[i] for i in g.index[g["status"] == "ok"]])
        dup = ok.duplicated(["_label", "point_key"], keep=False)
        if dup.any() and ok.loc[dup, "run_id"].nunique() > 1:
            for idx, run in zip(g.index, g["run_id"]):
                labels[idx] += f" · run {run}"
    df["series"] = [labels.get(i, str(e)) for i, e in zip(df.index, df["engine"])]
    return df


def _present(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def _differing_options(options: list[dict[str, Any]]) -> list[str]:
    """Option keys whose values are not the same in every options dict."""
    keys: list[str] = []
    for d in options:
        keys += [k for k in d if k not in keys]
    return [k for k in keys if len({json.dumps(d.get(k), sort_keys=True, default=str) for d in options}) > 1]


def engine_colours(engines: list[str]) -> dict[str, str]:
    """A fixed colour per engine: known engines always get theirs, others the spares in order."""
    spare = [c for c in SPARE_COLOURS]
    out: dict[str, str] = {}
    for e in engines:
        if e in ENGINE_COLOURS:
            out[e] = ENGINE_COLOURS[e]
    for e in engines:
        if e not in out:
            out[e] = spare.pop(0) if spare else "#444444"
    return out


def load_report_data(paths: list[str | Path], baseline: list[str | Path] | None = None,
                     threshold: float = 0.05) -> ReportData:
    rows, runs = load_runs(paths, "results")
    base, base_runs = (None, [])
    if baseline:
        base, base_runs = load_runs(baseline, "baseline")
    engines = list(dict.fromkeys(list(rows["engine"].dropna()) +
                                 (list(base["engine"].dropna()) if base is not None else [])))
    return ReportData(rows, runs, base, base_runs, engine_colours([str(e) for e in engines]), threshold)
