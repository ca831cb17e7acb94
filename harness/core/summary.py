"""The short summary table printed at the end of a run (a workload picks its columns)."""

from __future__ import annotations

from typing import Any


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt in ("ms", "mib") and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return str(value)  # not a number (an adapter's bug): shown as it is, the table still printed
    if fmt == "ms":
        return f"{value * 1e3:.2f}"
    if fmt == "mib":
        mib = value / 2**20
        return f"{mib:.0f}" if mib >= 10 or mib == 0 else f"{mib:.2f}"
    if fmt == "d":
        return str(value)
    try:
        return format(value, fmt)
    except (TypeError, ValueError):
        return str(value)


def summary_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """Rows grouped by engine, one line per point; failures and unavailable engines listed
    with their reasons below the table."""
    cols = [("engine", "engine", "s")] + list(columns)
    ok = [r for r in rows if r.get("status") == "ok"]
    body = [[_cell(r.get(f), fmt) for f, _, fmt in cols] for r in ok]
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, (_, h, _) in enumerate(cols)]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, ((_, h, _), w) in enumerate(zip(cols, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for b in body:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(b, widths))))
    if not ok:
        lines.append("(no point finished)")
    skipped: dict[tuple[str, str], int] = {}
    for r in rows:
        err = (r.get("error") or "").splitlines()[0] if r.get("error") else ""
        if r.get("status") == "skipped":  # one line per engine and reason
            skipped[(r["engine"], err)] = skipped.get((r["engine"], err), 0) + 1
        elif r.get("status") != "ok":
            where = " ".join(f"{k}={v}" for k, v in (r.get("point") or {}).items())
            lines.append(f"{r['engine']}: {r['status']}{' at ' + where if where else ''}: {err}")
    for (engine, err), n in skipped.items():
        lines.append(f"{engine}: skipped {n} point{'s' if n > 1 else ''}: {err}")
    return "\n".join(lines)
