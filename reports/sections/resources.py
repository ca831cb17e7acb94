"""Where and on what each engine ran (the run header's resources table), and the warnings the
header raises: engines of one comparison that got different resources (compute threads, CPU
cores, device), and HTTP endpoints whose TLS certificates were not verified.

Not a section itself: `reports.sections.header` shows these blocks first.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import numpy as np
import pandas as pd

from reports.blocks import Block, Cell, Note, Table
from reports.sections.common import column, present

# the fields that make two engines' timings comparable (docs/metrics.md, "Fair comparisons")
RESOURCE_FIELDS = (("compute_threads", "compute threads"), ("cpu_affinity", "CPU cores"), ("device", "device"))


def core_ranges(cores: Any) -> str:
    """[0, 1, 2, 3, 8] -> '0-3, 8 (5 cores)'."""
    if not isinstance(cores, (list, tuple)) or not cores:
        return "–"
    try:
        ids = sorted({int(c) for c in cores})
    except (TypeError, ValueError):
        return ", ".join(map(str, cores))
    parts, start, prev = [], ids[0], ids[0]
    for c in ids[1:] + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        if c is not None:
            start = prev = c
    return f"{', '.join(parts)} ({len(ids)} core{'s' if len(ids) != 1 else ''})"


def _value_key(v: Any) -> str | None:
    """A hashable, comparable form of a resource value (None when absent)."""
    if isinstance(v, (list, tuple)):
        return json.dumps(sorted(v) if all(isinstance(x, (int, float)) for x in v) else list(v))
    if not present(v):
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return str(v)


def _show(field: str, key: str) -> str:
    if field == "cpu_affinity":
        return core_ranges(json.loads(key))
    return key


def is_http(g: pd.DataFrame) -> bool:
    return bool((column(g, "transport") == "http").any())


def thread_reason(g: pd.DataFrame) -> str:
    """Why an engine's thread count is what it is, where its rows say (an engine option or the
    engine's own convention): vLLM-CPU's reserve_scheduler_core keeps one core for its scheduler."""
    reasons: list[str] = []
    for r in g.to_dict("records"):
        opts = r.get("engine_options") if isinstance(r.get("engine_options"), dict) else {}
        info = r.get("engine_info") if isinstance(r.get("engine_info"), dict) else {}
        kv = r.get("kv_info") if isinstance(r.get("kv_info"), dict) else {}
        extra = kv.get("extra") if isinstance(kv.get("extra"), dict) else {}
        if opts.get("reserve_scheduler_core") is True:
            reasons.append("reserve_scheduler_core=true: vLLM's own convention, one core kept for its scheduler")
        for k in ("num_threads", "cpu_threads"):
            if present(opts.get(k)):
                reasons.append(f"{k}={opts[k]} (engine option)")
        policy = info.get("thread_policy") or extra.get("thread_policy")
        if policy and policy not in ("equal", "run"):
            reasons.append(f"thread policy {policy}")
        if isinstance(info.get("threads_note"), str):
            reasons.append(info["threads_note"])
    return "; ".join(dict.fromkeys(reasons))


def resources_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per series: device, CPU cores, compute threads (and why, where the rows say),
    the worker's interpreter and versions, how it was launched, the memory scope, transport.
    Several distinct values of one series (several runs) are joined with ' / '."""
    fields = ("cpu_affinity", "compute_threads", "device", "worker_python", "worker_versions", "worker_launch",
              "memory_scope", "transport")
    recorded = [any(isinstance(r.get(f), (list, dict)) or present(r.get(f)) for f in fields)
                for r in rows.to_dict("records")]
    have = rows[recorded] if len(rows) else rows
    out = []
    for s, g in have.groupby("series", sort=False):
        def distinct(col: str, show=str) -> str:
            vals = []
            for v in column(g, col):
                if isinstance(v, (list, dict)) or present(v):
                    vals.append(show(v))
            return " / ".join(dict.fromkeys(vals)) or "–"

        def versions(v: Any) -> str:
            if not isinstance(v, dict):
                return str(v)
            return ", ".join(f"{k} {v[k]}" for k in ("python", "torch", "engine") if present(v.get(k))) or "–"

        http = is_http(g)
        out.append({
            "engine": g["engine"].iloc[0], "series": s, "http": http,
            "device": distinct("device"),
            "cpu_affinity": distinct("cpu_affinity", core_ranges),
            "compute_threads": distinct("compute_threads", lambda v: str(int(v)) if isinstance(v, float) else str(v)),
            "threads_why": thread_reason(g) or "",
            "worker_python": distinct("worker_python"),
            "worker_versions": distinct("worker_versions", versions),
            "worker_launch": ("OpenAI-compatible HTTP server (see HTTP endpoints)" if http else
                              distinct("worker_launch", lambda v: shlex.join(map(str, v)) if isinstance(v, list)
                                       else str(v))),
            "memory_scope": distinct("memory_scope"),
        })
    df = pd.DataFrame(out)
    if not df.empty:
        # a worker started by the harness's own interpreter has no launch prefix (null)
        df.loc[(df["worker_launch"] == "–") & (df["worker_python"] != "–"), "worker_launch"] = "the harness's interpreter"
    return df


def resource_differences(rows: pd.DataFrame) -> list[tuple[str, dict[str, list[str]]]]:
    """For each resource (compute threads, CPU cores, device) on which the engines of the page
    differ: (label, {series: [its values]}). Only engines the harness ran (HTTP endpoints run
    on the server's own resources) and only rows that record the field."""
    out = []
    for field, label in RESOURCE_FIELDS:
        per: dict[str, list[str]] = {}
        for s, g in rows.groupby("series", sort=False):
            if is_http(g):
                continue
            keys = [k for k in (_value_key(v) for v in column(g, field)) if k is not None]
            if keys:
                per[str(s)] = list(dict.fromkeys(keys))
        if len({k for ks in per.values() for k in ks}) > 1:
            out.append((label, {s: [_show(field, k) for k in ks] for s, ks in per.items()}))
    return out


def resource_warning(rows: pd.DataFrame) -> Note | None:
    diffs = resource_differences(rows)
    if not diffs:
        return None
    reasons = {}
    for s, g in rows.groupby("series", sort=False):
        why = thread_reason(g)
        if why:
            reasons[str(s)] = why
    parts = []
    for label, per in diffs:
        parts.append(f"{label}: " + "; ".join(f"{s} {' / '.join(v)}" for s, v in per.items()))
    text = ("WARNING: the engines compared here did not get the same resources, so their timings are not "
            "a like-for-like comparison. " + ". ".join(parts) + ".")
    involved = {s for _, per in diffs for s in per}
    why = [f"{s}: {reasons[s]}" for s in involved if s in reasons]
    if why:
        text += " Why: " + "; ".join(sorted(why)) + "."
    return Note(text, kind="warning", name="resources-differ")


def tls_warning(rows: pd.DataFrame) -> Note | None:
    """Every HTTP endpoint whose TLS certificate was not verified (verify_tls=false)."""
    if "tls_verify" not in rows.columns:
        return None
    off = rows[rows["tls_verify"].map(lambda v: isinstance(v, (bool, np.bool_)) and not v)]
    if off.empty:
        return None
    where = []
    for s, g in off.groupby("series", sort=False):
        urls = list(dict.fromkeys(str(u) for u in column(g, "endpoint_url").dropna()))
        where.append(f"{s}{' (' + ', '.join(urls) + ')' if urls else ''}")
    return Note("WARNING: TLS certificate verification was OFF (verify_tls=false) for " + "; ".join(where)
                + ": the client did not check who answered.", kind="warning", name="tls-off")


def resource_blocks(rows: pd.DataFrame) -> tuple[list[Block], list[Block]]:
    """(warnings to show first, the resources table)."""
    warnings = [w for w in (resource_warning(rows), tls_warning(rows)) if w is not None]
    df = resources_frame(rows)
    if df.empty:
        return warnings, []
    cols = [("engine", "series"), ("device", "device"), ("CPU cores (affinity)", "cpu_affinity"),
            ("compute threads", "compute_threads"), ("threads set by", "threads_why"),
            ("worker interpreter", "worker_python"), ("versions in the worker", "worker_versions"),
            ("launched by", "worker_launch"), ("memory seen from", "memory_scope")]
    cols = [(h, f) for h, f in cols if f in ("series", "device") or (df[f] != "–").any() and (df[f] != "").any()]
    differing = dict(resource_differences(rows))
    flagged = {(f, s) for f, label in RESOURCE_FIELDS for s in differing.get(label, {})}
    table_rows = [[Cell(str(r[f]), cls=("bad" if (f, r["series"]) in flagged else
                                        "wrap" if f == "threads_why" and r[f] else "")) for _, f in cols]
                  for r in df.to_dict("records")]
    return warnings, [Table([h for h, _ in cols], table_rows,
                            "Resources per engine: where and on what each engine ran, as its rows record it.",
                            "resources")]
