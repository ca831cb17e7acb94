"""Real-browser tests of the report: headless Chromium (Debian's chromium + chromedriver) driven
by selenium. A small real run's report must load without console errors, draw every expected
figure and show the results file's numbers in its summary; a page of FAKE rows exercises every
section; a results file carrying script/HTML payloads must run nothing. Screenshots go to
test-artifacts/ (git-ignored)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.core.cost import Price
from reports import browser, write_report
from reports.blocks import fmt_num
from test_report_fakes import (FAKE_ENV, reasoning_rows, structured_rows, capacity_rows, conversation_rows, conversation_tier_rows, http_serving_rows,
                               other_workload_rows, priced,
                               parity_rows_teacher_forced, serving_load_rows, status_row, sweep_rows, write_results)

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts"
MS, MIB = 1e3, 1 / 2**20
# the summary table's columns: header -> (row field, display scale); written here, not imported,
# so a wrong column in the report fails this test
SUMMARY_FIELDS = {
    "prefill latency ms [95% CI]": ("prefill_latency_s", MS),
    "prefill tok/s [95% CI]": ("prefill_tok_s", 1),
    "decode step ms [95% CI]": ("decode_step_latency_s", MS),
    "decode tok/s [95% CI]": ("decode_tok_s", 1),
    "end-to-end ms [95% CI]": ("e2e_latency_s", MS),
    "output tok/s [95% CI]": ("output_tok_s", 1),
    "process peak MiB": ("peak_memory_bytes", MIB),
    "repeats": ("repeats", 1),
}
# script, an event handler, and the tags Plotly itself renders in figure text (bold, links)
PAYLOAD = ('<script>window.__pwned = "script"; document.title = "pwned"</script>'
           '<img src=x onerror="window.__pwned = \'img\'; document.title = \'pwned\'">'
           '<b>bold</b><a href="javascript:window.__pwned=\'link\'">link</a>')


def console_errors(driver: Any) -> list[dict[str, Any]]:
    return [e for e in driver.get_log("browser") if e.get("level") in ("SEVERE", "ERROR")]


def drawn_figures(driver: Any) -> list[dict[str, Any]]:
    """Every Plotly figure on the page: its name, trace count and drawn SVG traces."""
    return driver.execute_script("""
        return Array.from(document.querySelectorAll('figure[data-figure]')).map(f => {
            const el = f.querySelector('.js-plotly-plot');
            return {name: f.dataset.figure, plotted: !!el,
                    traces: el && el.data ? el.data.length : 0,
                    drawn: el ? el.querySelectorAll('.scatterlayer .trace, .barlayer .trace, .heatmaplayer .hm').length : 0};
        });""")


def table(driver: Any, name: str) -> dict[str, Any]:
    return driver.execute_script("""
        const t = document.querySelector('table[data-table="' + arguments[0] + '"]');
        if (!t) return null;
        return {headers: Array.from(t.querySelectorAll('thead th')).map(th => th.textContent.trim()),
                rows: Array.from(t.querySelectorAll('tbody tr')).map(tr => Array.from(tr.cells).map(td =>
                    ({text: td.textContent.trim(), value: td.dataset.value === undefined ? null : td.dataset.value})))};
        """, name)


def save_screenshots(driver: Any, stem: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    driver.set_window_size(1400, 1000)
    driver.execute_script("window.scrollTo(0, 0)")
    driver.save_screenshot(str(ARTIFACTS / f"{stem}-top.png"))
    height = driver.execute_script("return document.body.scrollHeight")
    driver.set_window_size(1400, min(int(height) + 40, 16000))
    driver.save_screenshot(str(ARTIFACTS / f"{stem}-full.png"))
    driver.set_window_size(1400, 1000)


# ---- a small real run ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("report-run") / "run"
    cmd = [sys.executable, "-m", "harness.cli", "engines=[hf]", "workload.batch_sizes=[1,2]",
           "workload.prompt_lens=[16,32]", "workload.output_len=4", "workload.warmup=1",
           "workload.min_repeats=3", "workload.min_duration_s=0", f"model_cache_dir={model_cache}",
           f"hydra.run.dir={out}"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out, p.stdout


def test_real_run_report_in_chromium(driver: Any, real_run: tuple[Path, str]) -> None:
    run, stdout = real_run
    report = run / "report.html"
    assert f"report: {report}" in stdout          # the run ends by printing the report's path
    rows = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines() if line.strip()]
    sweep = [r for r in rows if r["workload"] == "sweep" and r["status"] == "ok"]
    assert len(sweep) == 4

    browser.open_report(driver, report)
    assert console_errors(driver) == []
    figs = drawn_figures(driver)
    names = [f["name"] for f in figs]
    expected = ["prefill-latency", "prefill-throughput", "decode-latency", "decode-throughput",
                "decode-heatmap", "memory-peak", "memory-kv", "memory-timeline"]
    if any(r.get("decode_bw_fraction") is not None for r in rows):
        expected.append("roofline-decode")
    if any(r.get("prefill_compute_fraction") is not None for r in rows):
        expected.append("roofline-prefill")
    if any(r["workload"] == "parity" and r.get("agreement") is not None for r in rows):
        expected.append("parity")
    assert [n for n in names if n in expected] == expected      # every expected figure, in page order
    for f in figs:
        assert f["plotted"] and f["traces"] > 0 and f["drawn"] > 0, f
    sections = driver.execute_script("return Array.from(document.querySelectorAll('section')).map(s => s.id)")
    assert sections[:5] == ["run", "summary", "prefill", "decode", "memory"] and sections[-1] == "definitions"

    summary = table(driver, "summary-points")
    assert summary is not None and summary["headers"][:2] == ["point", "engine"]
    assert len(summary["rows"]) == len(sweep)
    by_key = {(cells[0]["text"], cells[1]["text"]): cells for cells in summary["rows"]}
    for r in sweep:
        label = f"batch {r['batch_size']} · prompt {r['prompt_len']} · out {r['output_len']}"
        cells = by_key[(label, r["engine"])]
        for header, cell in zip(summary["headers"], cells):
            if header not in SUMMARY_FIELDS:
                continue
            field, scale = SUMMARY_FIELDS[header]
            assert float(cell["value"]) == r[field], (header, cell, r[field])
            shown = r[field] if scale == 1 else r[field] * scale
            assert cell["text"].lstrip("★ ").startswith(fmt_num(shown)), (header, cell["text"])
    facts = driver.execute_script("return document.querySelector('[data-facts=\"run-facts\"]').innerText")
    env = json.loads((run / "environment.json").read_text())
    assert env["git"]["commit"] and env["git"]["commit"] in facts
    save_screenshots(driver, "report-real-run")


# ---- every section, from FAKE rows -----------------------------------------------------------

def test_every_section_draws_in_chromium(driver: Any, tmp_path: Path) -> None:
    rows = (sweep_rows({"hf": 1.0, "reference": 1.6}, decode_bw_fraction=0.3, prefill_compute_fraction=0.2)
            + other_workload_rows() + conversation_rows()
            + serving_load_rows({"hf": 1.0, "reference": 1.5}, mode="closed", loads=(1, 2, 4, 8, 16))
            + priced(capacity_rows("hf") + capacity_rows("reference", speed=1.5, capacity=12,
                                                         probes=((4, True, False), (16, False, True), (12, True, False))),
                     Price(0.05, "core", "USD", "user: cost.price_per_core_hour"))
            + http_serving_rows(server_tokens=(400, 398), failed=(0, 2), tls_verify=False)
            + [r for r in parity_rows_teacher_forced() if r["engine"] != "reference"]
            + [status_row("vllm", "unavailable", "vllm is not installed"),
               status_row("hf", "failed", "out of memory", point={"batch_size": 64})])
    for r in rows:
        if r["engine"] == "reference" and r["workload"] == "sweep":
            r["compute_threads"] = 1                   # engines got different resources: warned
        if r["workload"] == "serving" and r.get("load_mode") == "closed":
            r.update(energy_j=5.0, joules_per_output_token=0.01, output_tokens_per_joule=100.0, energy_source="rapl")
    write_results(tmp_path / "cur", rows)
    other_machine = {**FAKE_ENV, "cpu": {**FAKE_ENV["cpu"], "model": "Other CPU"}}
    write_results(tmp_path / "base", sweep_rows({"hf": 1.2, "reference": 1.5}), env=other_machine)
    report = write_report([tmp_path / "cur"], tmp_path / "fake-report.html", baseline=[tmp_path / "base"])
    browser.open_report(driver, report)
    assert console_errors(driver) == []
    sections = driver.execute_script("return Array.from(document.querySelectorAll('section')).map(s => s.id)")
    assert sections == ["run", "summary", "baseline", "prefill", "decode", "memory", "kv-ablation", "prefix-sharing",
                        "conversation", "serving", "capacity", "cost", "http-endpoints", "energy", "kv-fragmentation",
                        "roofline", "parity", "definitions"]
    figs = drawn_figures(driver)
    assert len(figs) >= 25
    for f in figs:
        assert f["plotted"] and f["traces"] > 0 and f["drawn"] > 0, f
    names = {f["name"] for f in figs}
    assert {"capacity-pareto", "capacity-cost-pareto", "http-telemetry", "serving-closed-ttft", "parity", "conversation-ttft",
            "conversation-hit-rate", "conversation-kinds"} <= names
    conv = table(driver, "conversation-values")
    assert len(conv["rows"]) == 2 * 2 * 2 * 4  # engines x pools x caching x turns
    kinds = table(driver, "conversation-kind-values")  # per turn kind: an agent's user and tool-result turns
    assert len(kinds["rows"]) == 2 * 2 * 2 * 2  # engines x pools x caching x kinds
    head = kinds["headers"]
    by_kind: dict[str, list] = {}
    for r in kinds["rows"]:
        by_kind.setdefault(r[head.index("turn kind")]["text"], []).append(r)
    assert set(by_kind) == {"user turn", "tool-result turn"}
    assert {float(r[head.index("reusable %")]["value"]) for r in by_kind["tool-result turn"]} == {0.8}
    assert {float(r[head.index("growth per turn")]["value"]) for r in by_kind["user turn"]} == {120.0}
    failures = table(driver, "failures")
    assert [c[1]["text"] for c in failures["rows"]] == ["failed", "unavailable", "failed"]   # parity (vllm) first
    regressions = driver.execute_script("return document.querySelectorAll('table[data-table=\"comparison\"] tr.bad').length")
    assert regressions > 0                           # hf got slower than its baseline: highlighted
    # the warnings are on the page, visible, in the order: resources, TLS (header), machines (baseline)
    alerts = driver.execute_script("""
        return Array.from(document.querySelectorAll('[role=alert]')).map(e => [e.dataset.note, e.offsetHeight > 0,
                                                                              e.innerText]);""")
    assert [a[0] for a in alerts] == ["resources-differ", "tls-off", "different-machines", "http-flags"]
    assert all(a[1] for a in alerts) and "compute threads: hf 2; reference 1 / 2" in alerts[0][2]
    capacity = table(driver, "capacity")
    assert [r[0]["text"] for r in capacity["rows"]] == ["hf", "reference"]
    assert [r[2]["text"] for r in capacity["rows"]] == ["8 concurrent", "12 concurrent"]
    # the cost at the capacity, in the capacity table; the price and every priced probe in the cost section
    assert all(r[-3]["text"].endswith(" USD") for r in capacity["rows"]), capacity["rows"]
    prices = table(driver, "cost-prices")
    assert [r[1]["text"] for r in prices["rows"]] == ["2 cores × 0.05 USD/core-hour = 0.1 USD/h"] * 2
    assert len(table(driver, "cost")["rows"]) == 4 + 3
    # the memory timeline's and the server telemetry's selectors switch the point shown
    switched = driver.execute_script("""
        const el = document.querySelector('figure[data-figure="memory-timeline"] .js-plotly-plot');
        const before = el.layout.title.text;
        return Plotly.update(el, {visible: el.data.map((t, i) => i >= el.data.length - 2)},
                             {'title.text': 'switched'}).then(() => [before, el.layout.title.text]);""")
    assert switched[1] == "switched" and switched[0].startswith("Memory timeline: batch 4")
    telemetry = driver.execute_script("""
        const el = document.querySelector('figure[data-figure="http-telemetry"] .js-plotly-plot');
        const b = el.layout.updatemenus[0].buttons[1];
        return Plotly.update(el, b.args[0], b.args[1]).then(() => [el.layout.title.text,
            el.data.filter(t => t.visible !== false).length, el.data.length]);""")
    assert telemetry[0] == "Server telemetry: serving · rate 8.0" and telemetry[1] * 2 == telemetry[2]
    save_screenshots(driver, "report-fake-all-sections")


# ---- injection -------------------------------------------------------------------------------

def test_payloads_in_results_run_nothing(driver: Any, tmp_path: Path) -> None:
    rows = (sweep_rows({"hf": 1.0}, batches=(1, 2), prompts=(16,), model=PAYLOAD, run_id="j0",
                        engine_options={"o": PAYLOAD})
            + sweep_rows({"hf": 1.0}, batches=(1, 2), prompts=(16,), model=PAYLOAD, run_id="j1",
                        engine_options={"o": "plain"})
            + sweep_rows({"eng" + PAYLOAD: 1.2}, batches=(1, 2), prompts=(16,))
            + [status_row("hf", "failed", "RuntimeError: " + PAYLOAD, point={"batch_size": 8, "note": PAYLOAD}),
               status_row("vllm" + PAYLOAD, "unavailable", PAYLOAD)])
    env = {"hostname": PAYLOAD, "argv": ["infer-bench", PAYLOAD], "git": {"commit": PAYLOAD}}
    write_results(tmp_path / "evil", rows, env=env, config=f"model:\n  name: '{PAYLOAD}'\n")
    report = write_report([tmp_path / "evil"], tmp_path / "evil.html")
    browser.open_report(driver, report)
    assert driver.execute_script("return window.__pwned === undefined")
    assert driver.title != "pwned" and "<script>" in driver.title    # the title shows the text
    assert console_errors(driver) == []                             # an <img src=x> would have logged
    assert driver.execute_script("return document.querySelectorAll('img').length") == 0
    n_fig = driver.execute_script("return document.querySelectorAll('script.fig-data').length")
    assert driver.execute_script("return document.querySelectorAll('script').length") == n_fig + 2
    text = driver.execute_script("return document.body.innerText")
    assert "RuntimeError: " + PAYLOAD in text                       # the error is shown, as text
    pres = driver.execute_script(
        "return Array.from(document.querySelectorAll('details.pre pre')).map(p => p.textContent).join('\\n')")
    assert ("name: '" + PAYLOAD + "'") in pres and json.dumps(PAYLOAD) in pres   # config, environment.json
    legend = driver.execute_script(
        "return Array.from(document.querySelectorAll('.legendtext')).map(e => e.textContent).join('\\n')")
    assert "eng" + PAYLOAD in legend and "o=" + PAYLOAD in legend   # Plotly shows the names as text
    for f in drawn_figures(driver):
        assert f["drawn"] > 0, f
    assert driver.execute_script("return window.__pwned === undefined")
    save_screenshots(driver, "report-injection")


def test_the_kv_tier_panel_draws_in_chromium(driver: Any, tmp_path: Path) -> None:
    """A conversation run with kv_tiers off, full and a second tier: the section draws the eviction
    curve of each mode beside the reusable share, the hits stacked by tier (one panel per mode:
    three segments per turn), and the values table with TTFT beside recompute and the bound."""
    write_results(tmp_path / "cur", conversation_tier_rows())
    report = write_report([tmp_path / "cur"], tmp_path / "tiers.html")
    browser.open_report(driver, report)
    assert console_errors(driver) == []
    figs = {f["name"]: f for f in drawn_figures(driver)}
    curve, stacked = figs["conversation-tiers"], figs["conversation-tier-hits"]
    assert curve["traces"] == 4 and curve["drawn"] == 4  # three modes and the reusable share
    assert stacked["traces"] == 3 * 3 and stacked["drawn"] > 0  # tier 1, tier 2, miss in each mode's panel
    names = driver.execute_script("""
        const el = document.querySelector('figure[data-figure="conversation-tier-hits"] .js-plotly-plot');
        return [el.layout.barmode, el.data.filter(t => t.showlegend !== false).map(t => t.name)];""")
    assert names == ["stack", ["tier-1 hit (the pool)", "tier-2 hit (reloaded)", "miss (prefilled)"]]
    values = table(driver, "conversation-tier-values")
    assert values["headers"][:3] == ["engine", "tiers", "turn"] and len(values["rows"]) == 3 * 4
    tiered = [r for r in values["rows"] if r[1]["text"] == "+ tier 2 of 64 MiB" and r[2]["text"] == "4"][0]
    head = values["headers"]
    assert float(tiered[head.index("tier-2 hit %")]["value"]) > 0
    assert float(tiered[head.index("TTFT / full pool [95% CI]")]["value"]) > 1


def test_the_structured_output_section_draws_in_chromium(driver: Any, tmp_path: Path) -> None:
    """Structured rows of two engines: the verdicts stacked per kind and share (one panel per
    engine), the values table with every share and the failed row marked, the compile-cost table."""
    write_results(tmp_path / "cur", structured_rows())
    report = write_report([tmp_path / "cur"], tmp_path / "structured.html")
    browser.open_report(driver, report)
    assert console_errors(driver) == []
    assert "structured" in driver.execute_script("return Array.from(document.querySelectorAll('section')).map(s => s.id)")
    figs = {f["name"]: f for f in drawn_figures(driver)}
    verdicts = figs["structured-verdicts"]
    assert verdicts["traces"] == 4 * 2 and verdicts["drawn"] > 0  # four verdicts in each engine's panel
    values = table(driver, "structured-values")
    assert len(values["rows"]) == 2 * 2 * 2  # engines x kinds x shares
    head = values["headers"]
    failed = [r for r in values["rows"] if r[head.index("status")]["text"] == "failed"]
    assert len(failed) == 1 and failed[0][head.index("applied")]["text"] == "no"
    marked = driver.execute_script("return document.querySelectorAll('table[data-table=\"structured-values\"] tr.bad').length")
    assert marked == 1
    compile_ = table(driver, "structured-compile")
    assert [r[0]["text"] for r in compile_["rows"]] == ["reference", "vllm"]
    assert float(compile_["rows"][1][3]["value"]) == pytest.approx(1.1)


def test_the_reasoning_section_shows_ttft_beside_ttfo_in_chromium(driver: Any, tmp_path: Path) -> None:
    """Served rows with reasoning: TTFT and TTFO side by side per point, and a point where no
    request answered shows no TTFO (missing, not 0)."""
    write_results(tmp_path / "cur", reasoning_rows())
    report = write_report([tmp_path / "cur"], tmp_path / "reasoning.html")
    browser.open_report(driver, report)
    assert console_errors(driver) == []
    figs = {f["name"]: f for f in drawn_figures(driver)}
    assert figs["reasoning-ttfo"]["traces"] == 1 and figs["reasoning-ttfo"]["drawn"] > 0
    values = table(driver, "reasoning-values")
    head = values["headers"]
    assert head[:5] == ["engine", "point", "TTFT ms", "TTFO ms", "reasoning time ms"]
    answered, silent = values["rows"]
    assert float(answered[head.index("TTFO ms")]["value"]) == pytest.approx(0.13)  # seconds, shown in ms
    assert silent[head.index("TTFO ms")]["text"] == "–" and silent[head.index("requests without answer")]["text"] == "8"
