"""The report's speculative-decoding section (reports/sections/speculative.py): its data
preparation on rows the workload itself wrote while driving FAKE engines (FakeSpecEngine of
tests/test_speculative.py: a deterministic stand-in, not an inference engine; its engines are
named fake-*), and the section in headless Chromium."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from harness.checkpoint import SHIPPED_DIR
from harness.core.bootstrap import add_intervals
from harness.core.presets import load_preset
from harness.core.results import make_row
from reports import write_report
from reports.data import add_series
from reports.sections.speculative import (agreement_frame, content_frame, lossless_frame, position_frame,
                                          speculative_frame, speedup_frame)
from test_report_fakes import FAKE_ENV, write_results
from test_speculative import V, FakeSpecEngine
from workloads.base import Point, RunContext
from workloads.speculative import Speculative, SpeculativeConfig

CFG = SpeculativeConfig(methods=["draft"], num_speculative_tokens=[2, 3], batch_sizes=[1, 4], contents=["code", "random"],
                        prompt_len=16, output_len=12, min_requests=4, rounds=1)


def fake_run_rows(bug_engine: str | None = "fake-b") -> list[dict[str, Any]]:
    """Rows as a run writes them: every planned point of two FAKE engines measured by the workload
    and completed by its finalize_row in plan order. fake-b speculates only at batch 1 (the rest
    skipped, with the reason), and with `bug_engine` its k=3 verifier accepts a wrong token."""
    wl = Speculative()
    ctx = RunContext(shape=load_preset("tiny-trained"), dtype="float32", device="cpu", memory_sample_hz=0,
                     model_path=str(SHIPPED_DIR / "tiny-trained"), token_low=4, token_high=4 + V)
    rows: list[dict[str, Any]] = []
    for engine in ("fake-a", "fake-b"):
        for point in wl.plan(CFG):
            p = point.params
            caps = FakeSpecEngine.capabilities()
            why = wl.unsupported(point, caps) or ("batch > 1: not in this FAKE engine" if engine == "fake-b"
                                                  and p["method"] != "none" and p["batch_size"] > 1 else None)
            base = dict(run_id="fake", timestamp="2026-01-01T00:00:00+00:00", engine=engine, engine_version="0-fake",
                        model="tiny-trained", model_path="/fake", workload="speculative", point=p, point_key=point.key,
                        batch_size=p["batch_size"], prompt_len=p["prompt_len"], output_len=p["output_len"],
                        dtype="float32", device="cpu")
            if why:
                rows.append(make_row(**base, status="skipped", error=why))
                continue
            eng = FakeSpecEngine(p["method"], k=p.get("k") or 2, step_s=0.001,
                                 bug=engine == bug_engine and p.get("k") == 3)
            row = make_row(**base, status="ok", **wl.run_point(eng, Point("speculative", p), ctx, CFG))
            add_intervals(row)
            wl.finalize_row(row, rows)
            rows.append(row)
    return rows


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    return fake_run_rows()


def frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    return add_series(pd.DataFrame(rows))


def test_speedup_frame_is_one_line_per_engine_method_k_over_batch(rows):
    df = speculative_frame(frame(rows))
    sp = speedup_frame(df)
    # fake-a: 2 k x 2 batches x 2 contents; fake-b: only k=2 at batch 1 (its k=3 failed the check)
    assert len(sp) == 2 * 2 * 2 + 2
    assert set(sp["series"]) == {"fake-a · draft k=2", "fake-a · draft k=3", "fake-b · draft k=2"}
    by = {(r["series"], r["content"], r["batch_size"]): r for r in sp.to_dict("records")}
    src = {(r["engine"], r["point"].get("k"), r["point"]["content"], r["point"]["batch_size"]): r for r in rows
           if r["point"]["method"] == "draft" and r["status"] == "ok"}
    for (engine, k, content, b), r in src.items():
        assert by[(f"{engine} · draft k={k}", content, b)]["speedup"] == r["speedup"]


def test_position_and_content_frames_pool_the_counters(rows):
    df = speculative_frame(frame(rows))
    pos = position_frame(df)
    a2 = [r for r in rows if r["engine"] == "fake-a" and r["point"].get("k") == 2 and r["point"]["content"] == "code"]
    drafts = sum(r["spec_drafts"] for r in a2)
    for i in range(2):
        got = pos[(pos["series"] == "fake-a · draft k=2") & (pos["content"] == "code") & (pos["position"] == i + 1)]
        assert got["acceptance"].item() == pytest.approx(sum(r["spec_accepted_per_pos"][i] for r in a2) / drafts)
    cont = content_frame(df)
    c = cont[(cont["series"] == "fake-a · draft k=2") & (cont["content"] == "code")]
    assert c["mean_acceptance_length"].item() == pytest.approx(1 + sum(r["spec_accepted_tokens"] for r in a2) / drafts)
    assert list(dict.fromkeys(cont["content"])) == ["code", "random"]


def test_lossless_frame_names_the_failure(rows):
    lf = lossless_frame(speculative_frame(frame(rows))).set_index(["series", "method"])
    assert lf.loc[("fake-a", "draft k=2"), "verdict"] == "pass" and lf.loc[("fake-a", "draft k=2"), "pass"] == 4
    bad = lf.loc[("fake-b", "draft k=3")]
    assert bad["verdict"] == "fail" and bad["fail"] == 2
    failed = next(r for r in rows if r["engine"] == "fake-b" and r["status"] == "failed")
    assert failed["lossless_detail"] in bad["detail"]
    assert lf.loc[("fake-b", "draft k=2"), "verdict"] == "pass"


def test_a_row_without_its_baseline_is_unverified_in_the_table(rows):
    """A run resumed without its method-none rows: every speculative row is unverified, none passes."""
    redo = [dict(r) for r in rows if r["engine"] == "fake-a" and r["point"]["method"] != "none" and r["status"] == "ok"]
    for r in redo:
        Speculative().finalize_row(r, [])
    lf = lossless_frame(speculative_frame(frame(redo))).set_index(["series", "method"])
    assert set(lf["verdict"]) == {"unverified"} and (lf["pass"] == 0).all()


def test_agreement_frame_compares_batch_1_counts(rows):
    af = agreement_frame(frame(rows))
    k2 = af[af["k"] == 2]
    assert len(k2) == 2 and set(k2["content"]) == {"code", "random"}
    assert all(e == ["fake-a", "fake-b"] for e in k2["engines"])
    assert (k2["identical_share"] == 1.0).all()  # the same FAKE models on both: the same counts
    # fake-b's k=3 rows failed the lossless check: not ok, so not compared
    assert af[af["k"] == 3].empty


@pytest.mark.browser
def test_speculative_section_in_chromium(driver: Any, tmp_path: Path, rows) -> None:
    from reports import browser
    from test_report_browser import console_errors, drawn_figures, save_screenshots, table
    write_results(tmp_path / "run", rows, env=FAKE_ENV)
    report = write_report([tmp_path / "run"], tmp_path / "spec.html")
    browser.open_report(driver, report)
    assert console_errors(driver) == []
    sections = driver.execute_script("return Array.from(document.querySelectorAll('section')).map(s => s.id)")
    assert "speculative" in sections
    figs = {f["name"]: f for f in drawn_figures(driver)}
    for name in ("speculative-speedup", "speculative-positions", "speculative-content"):
        assert figs[name]["plotted"] and figs[name]["drawn"] > 0, figs.get(name)
    values = table(driver, "speculative-values")
    ok = [r for r in rows if r["status"] == "ok" and r["point"]["method"] != "none"]
    assert len(values["rows"]) == len(ok)
    col = values["headers"].index("speed-up [95% CI]")
    shown = sorted(float(r[col]["value"]) for r in values["rows"])
    assert shown == sorted(r["speedup"] for r in ok)
    lossless = table(driver, "speculative-lossless")
    verdicts = {(r[0]["text"], r[1]["text"]): r[2]["text"] for r in lossless["rows"]}
    assert verdicts[("fake-b", "draft k=3")] == "fail" and verdicts[("fake-a", "draft k=2")] == "pass"
    alerts = driver.execute_script("return Array.from(document.querySelectorAll('[role=alert]')).map(e => e.dataset.note)")
    assert "speculative-lossless-failed" in alerts
    agree = table(driver, "speculative-agreement")
    assert agree is not None and {r[5]["text"] for r in agree["rows"]} == {"100%"}
    save_screenshots(driver, "report-speculative")
    assert json.loads((tmp_path / "run" / "results.jsonl").read_text().splitlines()[0])["workload"] == "speculative"
