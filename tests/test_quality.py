"""The quality workload: teacher-forced perplexity, agreement and KL against the float32 reference
engine, per KV dtype (workloads/quality.py, harness/core/quality.py), and its report section.
The end-to-end runs use a seconds-trained checkpoint (tests/test_train.py's smoke size)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.core.presets import load_preset, shape_from_hf_config
from harness.core.quality import compare, median_margin, perplexity
from harness.core.schema import check
from workloads.quality import Quality, QualityConfig

REPO = Path(__file__).resolve().parent.parent


def scores(rows: list[list[tuple[int, float]]], targets: list[float]) -> dict[str, Any]:
    """One window's scores from (id, log p) lists per position."""
    return {"top_ids": [[i for i, _ in r] for r in rows], "top_logprobs": [[lp for _, lp in r] for r in rows],
            "target_logprobs": targets}


def test_perplexity_and_long_context_split() -> None:
    s = scores([[(1, math.log(0.5)), (2, math.log(0.25))]] * 4, [math.log(0.5)] * 3 + [math.log(0.25)])
    assert perplexity([s]) == pytest.approx(math.exp((3 * math.log(2) + math.log(4)) / 4))
    # positions are numbered from 1 (the first scored one): long_from=4 keeps the last only
    assert perplexity([s], 1, 4) == pytest.approx(4.0)
    assert perplexity([]) is None
    assert median_margin([s]) == pytest.approx(math.log(2))


def test_compare_agreement_and_kl() -> None:
    p = [(7, math.log(0.6)), (8, math.log(0.3)), (9, math.log(0.05))]
    base = scores([p, p, p, p], [math.log(0.6)] * 4)
    same = compare([base], [base], 1, 3)
    assert same["quality_top1_agreement"] == 1.0 and same["quality_mean_kl"] == pytest.approx(0, abs=1e-12)
    assert same["quality_positions"] == 4 and same["quality_long_positions"] == 2
    flipped = [(8, math.log(0.6)), (7, math.log(0.3)), (9, math.log(0.05))]
    eng = scores([p, p, p, flipped], [math.log(0.6)] * 4)       # the last (long-context) position flips
    c = compare([base], [eng], 1, 3)
    assert c["quality_top1_agreement"] == 0.75 and c["quality_top1_agreement_long"] == 0.5
    # KL(P||Q) of the flipped position over {7, 8, 9, other}: P = (.6, .3, .05, .05), Q = (.3, .6, .05, .05)
    kl = 0.6 * math.log(2) + 0.3 * math.log(0.5)
    assert c["quality_mean_kl"] == pytest.approx(kl / 4) and c["quality_mean_kl_long"] == pytest.approx(kl / 2)
    with pytest.raises(ValueError, match="windows"):
        compare([base], [base, base])


def test_check_needs_a_trained_model_and_a_decode_that_fits() -> None:
    wl = Quality()
    cfg, problems = check(QualityConfig, {"name": "quality"}, "workload")
    assert cfg is not None and not problems
    assert any("model=tiny-trained" in p for p in wl.check(cfg, load_preset("tiny")))
    assert wl.check(cfg, load_preset("tiny-trained")) == []
    bad, _ = check(QualityConfig, {"name": "quality", "decode_batch": 8, "decode_prompt_len": 64, "chunk": 256,
                                   "long_from": 600}, "workload")
    problems = wl.check(bad, load_preset("tiny-trained"))
    assert any("workload.long_from=600" in p for p in problems)
    assert any("workload.chunk=256" in p for p in problems)


# ---- end to end, on a checkpoint trained for seconds ---------------------------------------

QUICK = ["workload=quality", "workload.windows=3", "workload.window_len=64", "workload.long_from=40",
         "workload.chunk=32", "workload.decode_batch=2", "workload.decode_prompt_len=16", "workload.decode_steps=4",
         "parity=false", "roofline=false", "quiet=true"]


def run(ckpt: Path, out: Path, cache: Path, *args: str) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "harness.cli", "engines=[reference,hf]", "model=local", f"model.path={ckpt}",
           *QUICK, *args, f"hydra.run.dir={out}"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "INFER_BENCH_CACHE": str(cache)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def quality_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from test_train import smoke_train
    base = tmp_path_factory.mktemp("quality")
    ckpt = base / "ckpt"
    smoke_train(ckpt)
    cache = base / "cache"
    fp32 = run(ckpt, base / "fp32", cache, "dtype=float32")
    bf16 = run(ckpt, base / "bf16", cache, "dtype=bfloat16")
    return {"ckpt": ckpt, "fp32": fp32, "bf16": bf16, "dirs": (base / "fp32", base / "bf16")}


def by(rows: list[dict[str, Any]], engine: str, kv: str) -> dict[str, Any]:
    return next(r for r in rows if r["workload"] == "quality" and r["engine"] == engine and r["point"]["kv_dtype"] == kv)


@pytest.mark.slow
def test_quality_rows_float32(quality_runs: dict[str, Any]) -> None:
    rows = quality_runs["fp32"]
    ref = by(rows, "reference", "auto")
    assert ref["status"] == "ok" and ref["kv_dtype"] == "fp32" and ref["quality_baseline"].startswith("reference float32")
    assert ref["quality_top1_agreement"] == 1.0 and ref["quality_mean_kl"] == pytest.approx(0, abs=1e-12)
    assert 1 < ref["quality_perplexity"] < 512 and ref["quality_long_positions"] == 3 * (64 - 40)
    assert "quality_scores" not in ref                              # kept out of the results file
    shape = shape_from_hf_config(quality_runs["ckpt"])
    assert ref["kv_bytes_per_token"] == 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * 4
    assert ref["output_tok_s"] > 0
    hf = by(rows, "hf", "auto")                                     # an honest engine in float32
    assert hf["quality_top1_agreement"] == 1.0 and hf["quality_mean_kl"] < 1e-6
    assert abs(hf["quality_delta_perplexity"]) < 1e-3
    for kv in ("int8", "fp8"):
        q = by(rows, "reference", kv)
        # the scored positions after the first chunk read their context back from the quantised cache
        assert q["status"] == "ok" and q["kv_dtype"] == kv and q["quality_mean_kl"] > 1e-9, kv
        assert q["kv_bytes_per_token"] < ref["kv_bytes_per_token"] / 2
        skipped = by(rows, "hf", kv)
        assert skipped["status"] == "skipped" and "cannot store the KV cache" in skipped["error"]
    # fp8 (3 mantissa bits) loses more than int8 with its per-token scales
    assert by(rows, "reference", "fp8")["quality_mean_kl"] > by(rows, "reference", "int8")["quality_mean_kl"]


@pytest.mark.slow
def test_quality_bfloat16_compares_with_the_float32_baseline(quality_runs: dict[str, Any]) -> None:
    fp32, bf16 = quality_runs["fp32"], quality_runs["bf16"]
    for engine in ("reference", "hf"):
        r = by(bf16, engine, "auto")
        assert r["status"] == "ok" and r["kv_dtype"] == "bf16"
        assert r["quality_baseline"] == "reference float32 kv auto"
        assert r["quality_mean_kl"] > by(fp32, "hf", "auto")["quality_mean_kl"]   # bf16 rounding shows
        assert r["quality_baseline_perplexity"] == pytest.approx(by(fp32, "reference", "auto")["quality_perplexity"])


@pytest.mark.slow
def test_quality_without_a_baseline_says_so(quality_runs: dict[str, Any], tmp_path: Path) -> None:
    rows = run(quality_runs["ckpt"], tmp_path / "run", tmp_path / "empty-cache", "dtype=bfloat16",
               "engines=[hf]", "workload.kv_dtypes=[auto]")
    r = by(rows, "hf", "auto")
    assert r["status"] == "ok" and r["quality_baseline"] is None and "dtype=float32" in r["quality_note"]
    assert r["quality_perplexity"] > 1 and r.get("quality_top1_agreement") is None


@pytest.mark.slow
def test_quality_section_in_the_report(quality_runs: dict[str, Any]) -> None:
    from reports.data import load_report_data
    from reports.sections.quality import quality_frame
    data = load_report_data([str(d) for d in quality_runs["dirs"]])
    df = quality_frame(data.rows)
    ok = df[df["status"] == "ok"]
    assert set(zip(ok["engine"], ok["dtype"], ok["kv_dtype"])) >= {
        ("reference", "float32", "fp32"), ("reference", "float32", "int8"), ("reference", "bfloat16", "fp8"),
        ("hf", "bfloat16", "bf16")}
    assert (df["status"] == "skipped").sum() == 4                  # hf: no int8 / fp8 cache, in both runs
    ref = ok[(ok["engine"] == "reference") & (ok["dtype"] == "float32") & (ok["kv_dtype"] == "fp32")]
    assert float(ref["delta_perplexity"].iloc[0]) == pytest.approx(0, abs=1e-9)


@pytest.mark.slow
@pytest.mark.browser
def test_quality_section_draws_in_chromium(driver: Any, quality_runs: dict[str, Any], tmp_path: Path) -> None:
    from reports import browser, write_report
    from test_report_browser import console_errors, drawn_figures, table
    report = write_report([str(d) for d in quality_runs["dirs"]], tmp_path / "quality-report.html")
    browser.open_report(driver, report)
    assert console_errors(driver) == []
    sections = driver.execute_script("return Array.from(document.querySelectorAll('section')).map(s => s.id)")
    assert "quality" in sections
    figs = {f["name"]: f for f in drawn_figures(driver)}
    assert figs["quality"]["plotted"] and figs["quality"]["drawn"] > 0
    t = table(driver, "quality-values")
    assert t is not None and "Δ perplexity vs fp32" in t["headers"]
    ok_rows = [r for r in quality_runs["fp32"] + quality_runs["bf16"]
               if r["workload"] == "quality" and r["status"] == "ok"]
    assert len([r for r in t["rows"] if not r[-1]["text"].startswith("skipped")]) == len(ok_rows)
    ppl_col = t["headers"].index("perplexity")
    shown = sorted(float(r[ppl_col]["value"]) for r in t["rows"] if r[ppl_col]["value"] is not None)
    assert shown == pytest.approx(sorted(r["quality_perplexity"] for r in ok_rows))
