"""Performance history: when a run was made with `history.path` set, links from each of its
points to that point's series on the trend page (docs/history.md). The trend page is written by
`infer-bench-history --store STORE report`, by default next to the store: STORE's directory /
trends.html; the links point there."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from harness.core.history import run_series_anchors
from harness.core.results import read_rows
from reports.blocks import Block, Cell, Note, Table
from reports.data import ReportData, RunInfo
from reports.sections.registry import section

TRENDS_FILE = "trends.html"


def history_path(run: RunInfo) -> str | None:
    """The run's `history.path` setting, from its config.resolved.yaml."""
    if not run.config_text:
        return None
    try:
        cfg = yaml.safe_load(run.config_text)
    except yaml.YAMLError:
        return None
    path = ((cfg or {}).get("history") or {}).get("path") if isinstance(cfg, dict) else None
    return str(path) if path else None


def trends_href(store: str, report_dir: Path, anchor: str) -> str:
    """A relative link from the report to the store's trend page; './' first, so no part of a
    path can read as a URL scheme."""
    page = Path(store).expanduser()
    page = (page if page.is_absolute() else Path.cwd() / page).parent / TRENDS_FILE
    rel = os.path.relpath(page, report_dir.resolve())
    if not rel.startswith((".", "/")):
        rel = "./" + rel
    return f"{rel}#{anchor}"


def links_for(run: RunInfo, store: str) -> list[list[Cell]]:
    rows: list[dict[str, Any]] = [r for r in read_rows(run.results) if isinstance(r, dict)]
    out = []
    for r, metric, anchor in run_series_anchors(run.directory, rows):
        point = r.get("point") if isinstance(r.get("point"), dict) else {}
        label = " ".join(f"{k}={v}" for k, v in point.items()) or str(r.get("point_key"))
        out.append([Cell(str(r.get("engine"))), Cell(f"{r.get('workload')} {label}"), Cell(metric),
                    Cell("trend", href=trends_href(store, run.directory, anchor))])
    return out


@section("history", "History",
         "Each point of this run in the performance history: a link to its series on the trend page.")
def history_links(data: ReportData) -> list[Block]:
    blocks: list[Block] = []
    for run in data.runs:
        store = history_path(run)
        if not store:
            continue
        rows = links_for(run, store)
        if not rows:
            continue
        blocks.append(Note(f"This run is ingested into the history store {store} (history.path). The trend page "
                           f"is written by `infer-bench-history --store {store} report`, next to the store "
                           f"({Path(store).parent / TRENDS_FILE}); run it to see the links' targets.",
                           name="history-store"))
        blocks.append(Table(["engine", "point", "metric", "trend"], rows, name="history-links"))
    return blocks
