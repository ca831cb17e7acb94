"""Helpers the sections share: point labels, derived confidence intervals, best-value marking,
and a table of values built from a DataFrame."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from reports.blocks import Cell, Table, fmt_num, num_cell

MS = 1e3
MIB = 1 / 2**20
SHORT = {"batch_size": "batch", "prompt_len": "prompt", "output_len": "out", "context_len": "context",
         "request_rate": "rate", "prefix_len": "prefix", "num_requests": "requests"}


def point_label(point: Any) -> str:
    """'batch 4 · prompt 128 · out 8' from a row's point dict."""
    if not isinstance(point, dict) or not point:
        return "–"
    return " · ".join(f"{SHORT.get(k, k)} {v}" for k, v in point.items())


INT_FIELDS = ("batch_size", "prompt_len", "output_len", "repeats", "decode_steps", "context_len", "prefix_len",
              "num_requests", "slots_allocated", "tokens_stored", "first_divergence", "peak_memory_bytes",
              "kv_cache_bytes", "kv_used_bytes", "kv_est_bytes", "kv_est_bytes_per_token", "warmup")


def int_columns(df: pd.DataFrame) -> pd.DataFrame:
    """Integer fields back to int64 where they have no gaps (a gap elsewhere in the results
    makes pandas store the whole column as float)."""
    df = df.copy()
    for c in INT_FIELDS:
        if c in df.columns and len(df) and df[c].notna().all():
            vals = pd.to_numeric(df[c], errors="coerce")
            if vals.notna().all() and (vals == vals.round()).all():
                df[c] = vals.astype("int64")
    return df


def varying_labels(points: list[Any], skip: tuple[str, ...] = (), full_when_same: bool = True) -> list[str]:
    """Point labels naming only the parameters that differ between the points (and not those
    in `skip`, shown elsewhere); where nothing differs, the full label (or "" when not
    `full_when_same`)."""
    dicts = [p if isinstance(p, dict) else {} for p in points]
    keys = list(dict.fromkeys(k for d in dicts for k in d if k not in skip))
    vary = [k for k in keys if len({repr(d.get(k)) for d in dicts}) > 1]
    if not vary:
        if not full_when_same:
            return [""] * len(dicts)
        return [point_label({k: v for k, v in d.items() if k not in skip}) for d in dicts]
    return [point_label({k: d.get(k) for k in vary}) for d in dicts]


def has(df: pd.DataFrame, *cols: str) -> bool:
    """Every column present with at least one value."""
    return not df.empty and all(c in df.columns and df[c].notna().any() for c in cols)


def valid_ci(c: Any) -> bool:
    return (isinstance(c, (list, tuple)) and len(c) == 2 and all(isinstance(v, (int, float)) and
            math.isfinite(v) for v in c))


def inverse_ci(numerator: pd.Series, ci: pd.Series) -> pd.Series:
    """CI of numerator / latency from the latency's CI [lo, hi]: [num/hi, num/lo]."""
    out = []
    for n, c in zip(numerator, ci):
        if valid_ci(c) and c[0] > 0 and n is not None and not pd.isna(n):
            out.append([float(n) / c[1], float(n) / c[0]])
        else:
            out.append(None)
    return pd.Series(out, index=numerator.index, dtype=object)


def column(df: pd.DataFrame, name: str) -> pd.Series:
    """A column, or all-None when the rows lack it."""
    if name in df.columns:
        return df[name]
    return pd.Series([None] * len(df), index=df.index, dtype=object)


def mark_best(df: pd.DataFrame, columns: dict[str, str], group: list[str] | str | None = None) -> pd.DataFrame:
    """Booleans `best_<col>` for each column ("lower" or "higher" is better): True on the best
    value within each group. Only where the group has two or more values to compare."""
    out = pd.DataFrame(index=df.index)
    groups = [df] if group is None else [g for _, g in df.groupby(group, sort=False, dropna=False)]
    for col, better in columns.items():
        flags = pd.Series(False, index=df.index)
        if col in df.columns:
            for g in groups:
                vals = pd.to_numeric(g[col], errors="coerce").dropna()
                if len(vals) < 2:
                    continue
                best = vals.min() if better == "lower" else vals.max()
                flags.loc[vals.index[vals == best]] = True
        out[f"best_{col}"] = flags
    return out


@dataclass
class Col:
    """A table column: header, row field, display scale, CI field, which way is better."""

    header: str
    field: str
    scale: float = 1.0
    ci: str | None = None
    better: str | None = None   # "lower" | "higher": mark the best value
    text: bool = False          # show as text, not a number


def values_table(df: pd.DataFrame, cols: list[Col], name: str, caption: str = "",
                 group: list[str] | str | None = None, row_classes: list[str] | None = None) -> Table:
    """Rows of df as a table. Numeric columns keep the raw value (data-value) beside the
    formatted text; the best value per column (within `group`) is marked."""
    cols = [c for c in cols if c.text or has(df, c.field)]   # no all-empty columns
    best = mark_best(df, {c.field: c.better for c in cols if c.better}, group)
    rows = []
    for idx, r in zip(df.index, df.to_dict("records")):
        cells = []
        for c in cols:
            v = r.get(c.field)
            if c.text:
                cells.append(Cell("–" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)))
                continue
            ci = r.get(c.ci) if c.ci else None
            is_best = bool(best.at[idx, f"best_{c.field}"]) if c.better else False
            v = None if v is None or (isinstance(v, float) and math.isnan(v)) else v
            cells.append(num_cell(v, c.scale, ci if valid_ci(ci) else None, best=is_best))
        rows.append(cells)
    return Table([c.header for c in cols], rows, caption, name, row_classes or [])




def workload_rows(rows: pd.DataFrame, workload: str | None, *need: str, ok_only: bool = True) -> pd.DataFrame:
    """Rows of a workload (any workload when None) that carry every field in `need`."""
    df = rows if workload is None else rows[rows["workload"] == workload]
    if ok_only:
        df = df[df["status"] == "ok"]
    if df.empty or not all(c in df.columns for c in need):
        return pd.DataFrame()
    return int_columns(df.dropna(subset=list(need)))


def facet_if_varies(df: pd.DataFrame, col: str) -> str | None:
    """`col` when its values differ between the rows (one panel per value), else None."""
    return col if col in df.columns and df[col].nunique() > 1 else None


# ---- memory accounting: KV reserved up front apart from KV in use ----------------------------
# A pre-reserved KV pool (the reference engine, vLLM, TensorRT-LLM) sits in an engine's process
# peak from the start; transformers holds only the live cache. Compared raw, the two read as
# "needs 116× more memory". Like with like: each row's KV reserved up front apart from what its
# sequences use, and a working memory with the idle part of the pool taken out where the
# measured peak counts the pool.

POOL_COUNTED_SOURCES = ("nvml",)   # device memory: an allocated pool counts whole, written or not
RECORDED_KV_RESERVED = "_kv_reserved_recorded"   # set by reports.data.frame: the row has the field


def present(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def kv_reserved(row: dict[str, Any]) -> tuple[Any, str]:
    """(bytes of KV the engine reserved up front or None, where the number comes from). Rows
    with `kv_reserved_bytes` say it themselves (null: nothing pre-allocated); older rows carry
    only `kv_cache_bytes`, which is the whole pool for an engine with a block pool
    (kv_info.num_blocks or kv_info.extra.reserved_bytes) and the live cache otherwise."""
    v = row.get("kv_reserved_bytes")
    if present(v):
        return v, "kv_reserved_bytes"
    if row.get(RECORDED_KV_RESERVED) is True:     # recorded as null: nothing pre-allocated
        return None, "kv_reserved_bytes"
    info = row.get("kv_info") if isinstance(row.get("kv_info"), dict) else {}
    extra = info.get("extra") if isinstance(info.get("extra"), dict) else {}
    if present(extra.get("reserved_bytes")):
        return extra["reserved_bytes"], "kv_info.extra.reserved_bytes (older row)"
    if present(info.get("num_blocks")) and present(row.get("kv_cache_bytes")):
        return row["kv_cache_bytes"], "kv_cache_bytes of a block pool (older row)"
    return None, ""


def working_memory(row: dict[str, Any]) -> tuple[Any, str]:
    """(the memory comparable across engines, how it was obtained). With a reserved pool that
    the measured peak counts whole (device memory): process peak − reserved pool + KV in use,
    i.e. the peak as if the pool had been sized to what the sequences used. Otherwise the
    process peak itself (resident memory counts pool pages only once written)."""
    peak = row.get("peak_memory_bytes")
    if not present(peak):
        return None, "no process peak"
    reserved, _ = kv_reserved(row)
    if not present(reserved):
        return peak, "process peak (nothing reserved up front)"
    if row.get("memory_source") not in POOL_COUNTED_SOURCES:
        return peak, f"process peak ({row.get('memory_source') or 'this source'}: the pool counts as far as written)"
    used = row.get("kv_used_bytes")
    if reserved > peak:
        return None, "none: the reserved pool exceeds the measured peak"
    if not present(used):
        return peak - reserved, "process peak − reserved (KV in use unknown)"
    return peak - reserved + min(used, reserved), "process peak − reserved + KV in use"


def add_memory_columns(df: pd.DataFrame) -> pd.DataFrame:
    """`kv_reserved` (+ `kv_reserved_from`), `working_memory_bytes` (+ `working_memory_basis`)
    on every row (None where they do not apply)."""
    df = df.copy()
    recs = df.to_dict("records")
    res = [kv_reserved(r) for r in recs]
    work = [working_memory(r) for r in recs]
    df["kv_reserved"] = pd.Series([v for v, _ in res], index=df.index, dtype=object)
    df["kv_reserved_from"] = [w for _, w in res]
    df["working_memory_bytes"] = pd.Series([v for v, _ in work], index=df.index, dtype=object)
    df["working_memory_basis"] = [w for _, w in work]
    return df
