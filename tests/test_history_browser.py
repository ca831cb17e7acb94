"""The trend page (`infer-bench-history report`) in headless Chromium, as the run report is tested
(tests/test_report_browser.py): a store of synthetic runs (test_history's generator: a 20 % step
at a known commit on one machine, a flat series on another) renders without console errors,
draws one chart per series with every run, the change point as a line between the two commits
with its range, the change-point table newest first, and the machine selector hides the other
machine. A string from the results cannot run as script."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness import history_cli
from harness.core import history as h
from reports import browser
from test_history import MACHINE_A, MACHINE_B, series_runs

pytestmark = pytest.mark.browser


def test_trend_page_draws_series_and_change_points(driver: Any, tmp_path: Path) -> None:
    store = tmp_path / "h.duckdb"
    h.ingest(store, series_runs(tmp_path / "a", [0.010] * 4 + [0.012] * 4, repeats=3, noise=0.02, cpu=MACHINE_A))
    h.ingest(store, series_runs(tmp_path / "b", [0.030] * 5, repeats=2, noise=0.02, cpu=MACHINE_B, seed=4))
    _, changes = h.find_changes(store, ["decode_step_latency_s"])
    assert len(changes) == 1
    page = tmp_path / "trends.html"
    assert history_cli.run(["--store", str(store), "report", "-o", str(page), "--metric", "decode_step_latency_s"]) == 0
    assert "<script src" not in page.read_text()  # self-contained

    browser.open_report(driver, page)
    assert [e for e in driver.get_log("browser") if e.get("level") in ("SEVERE", "ERROR")] == []
    figs = driver.execute_script("""
        return Array.from(document.querySelectorAll('figure[data-figure]')).map(f => {
            const el = f.querySelector('.js-plotly-plot');
            return {machine: f.closest('section').dataset.machine, runs: el.data[0].x.length,
                    shapes: (el.layout.shapes || []).length,
                    drawnShapes: el.querySelectorAll('.shapelayer path').length,
                    annotations: Array.from(el.querySelectorAll('.annotation-text')).map(a => a.textContent),
                    markers: el.querySelectorAll('.scatterlayer .trace .points path').length};
        });""")
    by_machine: dict[str, list[dict]] = {}
    for f in figs:
        by_machine.setdefault(f["machine"], []).append(f)
    a = h.machine_fingerprint({"cpu": MACHINE_A, "memory_total_bytes": 16 * 2**30})[0]
    b = h.machine_fingerprint({"cpu": MACHINE_B, "memory_total_bytes": 16 * 2**30})[0]
    assert sorted(len(v) for v in by_machine.values()) == [1, 1] and set(by_machine) == {a, b}
    step, flat = by_machine[a][0], by_machine[b][0]
    assert step["runs"] == 24 and step["markers"] >= 24
    cp = changes[0]
    assert step["shapes"] == 1 and step["drawnShapes"] >= 1
    assert step["annotations"] == [f"{cp.commit_range} ×{cp.magnitude:.3f}"]
    assert flat["shapes"] == 0 and flat["drawnShapes"] == 0 and flat["runs"] == 10

    rows = driver.execute_script("""
        return Array.from(document.querySelectorAll('table[data-table="change-points"] tbody tr'))
            .map(tr => Array.from(tr.cells).map(td => td.textContent.trim()));""")
    assert len(rows) == 1 and rows[0][0] == cp.commit_range and rows[0][6] == f"{cp.magnitude:.3f}"

    # the machine selector: choosing B hides A's charts and A's change point
    driver.execute_script(f"""const s = document.getElementById('machine'); s.value = '{b}';
                              s.dispatchEvent(new Event('change'));""")
    visible = driver.execute_script("""
        return {sections: Array.from(document.querySelectorAll('section[data-machine]')).filter(s => !s.hidden)
                    .map(s => s.dataset.machine),
                rows: Array.from(document.querySelectorAll('table[data-table="change-points"] tbody tr'))
                    .filter(tr => !tr.hidden).length};""")
    assert visible == {"sections": [b], "rows": 0}
