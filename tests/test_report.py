"""The report's data preparation (pandas) per section, loading, the CLI and the rendered page,
on FAKE hand-made rows (tests/test_report_fakes.py). The real-browser tests are in
test_report_browser.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from markupsafe import escape

from harness.core.stats import PERCENTILE_METHOD
from reports import ReportInputError, write_report
from reports.cli import main as report_main
from harness.core.compare import compare as harness_compare
from reports.comparison import compare_rows
from reports.data import ENGINE_COLOURS, engine_colours, frame, load_report_data, load_runs
from reports.render import render_report
from reports.sections.common import inverse_ci, mark_best, point_label, varying_labels
from reports.sections.memory import chosen_points, downsample_max, memory_frame, timeline_frame
from reports.sections.summary import failures_frame, headline_frame, sweep_frame
from reports.sections.sweep import decode_frame, decode_heatmaps, prefill_frame
from reports.sections.kv_ablation_section import kv_ablation_fits, kv_ablation_frame
from reports.sections.kv_fragmentation import kv_memory_frame
from reports.sections.parity_section import parity_frame
from reports.sections.prefix import prefix_sharing_frame
from reports.sections.roofline_section import roofline_frame
from reports.sections.serving_load import cdf_frame, serving_frame, serving_percentiles
from test_report_fakes import FAKE_POOL, other_workload_rows, status_row, sweep_row, sweep_rows, write_results


def section_ids(html: str) -> list[str]:
    return re.findall(r'<section id="([a-z-]+)"', html)


def figure_specs(html: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(r'<script type="application/json" class="fig-data"[^>]*>(.*?)</script>',
                                              html, re.S)]


# ---- loading ---------------------------------------------------------------------------------

def test_load_reports_missing_paths_and_empty_runs(tmp_path: Path) -> None:
    with pytest.raises(ReportInputError, match="no such file"):
        load_runs([tmp_path / "nope.jsonl"])
    (tmp_path / "empty-dir").mkdir()
    with pytest.raises(ReportInputError, match="no results.jsonl"):
        load_runs([tmp_path / "empty-dir"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "results.jsonl").write_text("")
    with pytest.raises(ReportInputError, match="no rows"):
        load_runs([tmp_path / "empty"])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "results.jsonl").write_text("{not json\n{}\n")
    with pytest.raises(ReportInputError, match="not a results file"):
        load_runs([tmp_path / "bad"])


def test_load_multirun_dirs_and_torn_last_line(tmp_path: Path) -> None:
    write_results(tmp_path / "multi" / "0", sweep_rows({"hf": 1.0}, batches=(1,), prompts=(32,)))
    f = write_results(tmp_path / "multi" / "1", sweep_rows({"hf": 1.0}, batches=(2,), prompts=(32,)))
    with open(f, "a") as fh:
        fh.write('{"engine": "hf", "sta')      # a run killed mid-write
    rows, runs = load_runs([tmp_path / "multi", f])   # the same file twice is read once
    assert len(runs) == 2 and len(rows) == 2
    assert sorted(rows["batch_size"]) == [1, 2]
    assert runs[0].environment["hostname"] == "fake-host" and runs[0].config_text == "fake: true\n"


def test_series_tell_apart_engine_options_and_repeated_runs() -> None:
    # a multirun over an engine option: one run (job) per value
    a = sweep_rows({"hf": 1.0}, batches=(1,), prompts=(32,), run_id="job0",
                   engine_options={"attn_implementation": "sdpa", "x": 1})
    b = sweep_rows({"hf": 1.0}, batches=(1,), prompts=(32,), run_id="job1",
                   engine_options={"attn_implementation": "eager", "x": 1})
    df = frame(a + b)
    assert sorted(df["series"]) == ["hf (attn_implementation=eager)", "hf (attn_implementation=sdpa)"]
    # same configuration measured twice by two runs: told apart by run id
    c = sweep_rows({"hf": 1.0}, batches=(1,), prompts=(32,), run_id="r2")
    df = frame(sweep_rows({"hf": 1.0}, batches=(1,), prompts=(32,), run_id="r1") + c)
    assert sorted(df["series"]) == ["hf · run r1", "hf · run r2"]
    # missing options and empty options are the same configuration
    df = frame(sweep_rows({"hf": 1.0}, batches=(1,), prompts=(32,)) + [status_row("hf", "failed", "boom")])
    assert set(df["series"]) == {"hf"}


def test_engine_colours_are_fixed_per_engine() -> None:
    c1 = engine_colours(["hf", "reference", "mystery"])
    c2 = engine_colours(["mystery", "vllm", "hf"])
    assert c1["hf"] == c2["hf"] == ENGINE_COLOURS["hf"]
    assert c1["reference"] == ENGINE_COLOURS["reference"]
    assert len(set(c1.values())) == 3


# ---- summary ---------------------------------------------------------------------------------

def test_sweep_frame_derives_throughput_cis_and_orders_points() -> None:
    df = sweep_frame(frame(sweep_rows({"hf": 1.0, "reference": 2.0}) + other_workload_rows()))
    assert set(df["workload"]) == {"sweep"} and len(df) == 8
    assert list(df["batch_size"].iloc[:2]) == [1, 1] and list(df["series"].iloc[:2]) == ["hf", "reference"]
    r = df.iloc[0]
    lo, hi = r["prefill_latency_s_ci"]
    assert r["prefill_tok_s_ci"] == [r["batch_size"] * r["prompt_len"] / hi, r["batch_size"] * r["prompt_len"] / lo]
    assert r["decode_tok_s_ci"][0] == r["batch_size"] / r["decode_step_latency_s_ci"][1]
    assert r["point_label"] == "batch 1 · prompt 32 · out 8"


def test_inverse_ci_skips_missing() -> None:
    out = inverse_ci(pd.Series([10.0, 10.0, 10.0]), pd.Series([[1.0, 2.0], None, [0.0, 1.0]]))
    assert out.iloc[0] == [5.0, 10.0] and out.iloc[1] is None and out.iloc[2] is None


def test_point_labels() -> None:
    assert point_label({"batch_size": 4, "prompt_len": 128, "output_len": 8}) == "batch 4 · prompt 128 · out 8"
    assert point_label(None) == "–"
    pts = [{"kv_layout": "paged", "block_size": 16, "n": 8}, {"kv_layout": "contiguous", "block_size": 32, "n": 8}]
    assert varying_labels(pts, skip=("kv_layout",)) == ["block_size 16", "block_size 32"]
    assert varying_labels([{"n": 8}, {"n": 8}]) == ["n 8", "n 8"]


def test_mark_best_within_groups() -> None:
    df = pd.DataFrame({"p": ["a", "a", "b", "c", "c"], "lat": [2.0, 1.0, 5.0, 3.0, 3.0],
                       "tok": [10.0, 20.0, 1.0, None, 4.0]})
    best = mark_best(df, {"lat": "lower", "tok": "higher"}, group="p")
    assert list(best["best_lat"]) == [False, True, False, True, True]   # a lone value is not "best"; ties both
    assert list(best["best_tok"]) == [False, True, False, False, False]


def test_headline_takes_the_best_point_per_engine() -> None:
    df = sweep_frame(frame(sweep_rows({"hf": 1.0, "reference": 2.0})))
    head = headline_frame(df)
    assert list(head["series"]) == ["hf", "reference"]
    hf = df[df["series"] == "hf"]
    row = head.iloc[0]
    assert row["decode_tok_s"] == hf["decode_tok_s"].max()
    assert row["decode_step_latency_s"] == hf["decode_step_latency_s"].min()
    assert row["decode_tok_s_at"] == hf.loc[hf["decode_tok_s"].idxmax(), "point_label"]
    assert row["points"] == 4


def test_failures_frame_lists_every_non_ok_row_with_reason() -> None:
    rows = sweep_rows({"hf": 1.0}, batches=(1,), prompts=(32,)) + [
        status_row("vllm", "unavailable", "not installed"),
        status_row("hf", "failed", "OOM", point={"batch_size": 64}),
        status_row("trtllm", "skipped", None)]
    f = failures_frame(frame(rows))
    assert list(f["status"]) == ["unavailable", "failed", "skipped"]
    assert list(f["error"]) == ["not installed", "OOM", "(no reason recorded)"]
    assert f["point"].iloc[1] == "batch 64"


# ---- prefill / decode ------------------------------------------------------------------------

def test_prefill_and_decode_frames() -> None:
    rows = frame(sweep_rows({"hf": 1.0}, batches=(1, 2, 4), prompts=(16, 64)))
    p = prefill_frame(rows)
    assert len(p) == 6 and {"prefill_latency_s_ci", "prefill_tok_s_ci"} <= set(p.columns)
    d = decode_frame(rows)
    assert len(d) == 6 and (d["decode_tok_s"] == d["batch_size"] / d["decode_step_latency_s"]).all()
    z = decode_heatmaps(d)["hf"]
    assert list(z.index) == [1, 2, 4] and list(z.columns) == [16, 64]
    one = d[(d["batch_size"] == 2) & (d["prompt_len"] == 64)]["decode_tok_s"].iloc[0]
    assert z.loc[2, 64] == one
    # nothing to draw without sweep rows
    assert prefill_frame(frame(other_workload_rows())).empty
    assert decode_heatmaps(decode_frame(frame(sweep_rows({"hf": 1.0}, batches=(1,), prompts=(16,))))) == {}


# ---- memory ----------------------------------------------------------------------------------

def test_memory_frame_tokens_and_estimate_ratio() -> None:
    m = memory_frame(frame(sweep_rows({"hf": 1.0, "reference": 1.0}, batches=(2,), prompts=(32,), output=8)))
    assert list(m["kv_tokens"]) == [2 * 39, 2 * 39]
    assert list(m["kv_used_over_est"]) == [1.0, 1.0]
    assert m.loc[m["series"] == "reference", "kv_reserved"].iloc[0] == FAKE_POOL   # the fake pool, reserved up front
    assert m.loc[m["series"] == "hf", "kv_reserved"].iloc[0] is None                # hf holds only its live cache


def test_downsample_keeps_the_peak() -> None:
    tl = [[i / 1000, (i % 97) * 10] for i in range(5000)] + [[5.0, 123456]]
    out = downsample_max(tl, 100)
    assert len(out) == 100 and max(b for _, b in out) == 123456
    assert downsample_max([[0, 1], [1, 2]], 100) == [(0.0, 1.0), (1.0, 2.0)]


def test_timeline_offers_the_largest_point_first() -> None:
    tl = timeline_frame(frame(sweep_rows({"hf": 1.0}, batches=(1, 4), prompts=(32, 128))))
    pts = chosen_points(tl)
    assert len(pts) == 4 and '"batch_size":4' in pts[0] and '"prompt_len":128' in pts[0]


# ---- baseline comparison ---------------------------------------------------------------------

def test_comparison_is_the_regression_checks(tmp_path: Path) -> None:
    base = sweep_rows({"hf": 1.0, "reference": 1.0}, batches=(1,), prompts=(32,))
    cur = sweep_rows({"hf": 0.5, "reference": 1.0}, batches=(1,), prompts=(32,))     # hf twice as slow
    cmp, unmatched_points = compare_rows(frame(base), frame(cur), threshold=0.05)
    expect, _ = harness_compare(base, cur, None, 0.05)
    assert [(c.engine, c.metric, c.ratio, c.ci_low, c.ci_high, c.verdict) for c in expect] == list(
        zip(cmp["engine"], cmp["metric"], cmp["ratio"], cmp["ci_lo"], cmp["ci_hi"], cmp["verdict"]))
    hf = cmp[cmp["engine"] == "hf"].set_index("metric")["verdict"]
    assert hf["decode_step_latency_s"] == "regressed" and hf["output_tok_s"] == "regressed"
    assert hf["peak_memory_bytes"] == "unchanged"
    assert set(cmp.loc[cmp["engine"] == "reference", "verdict"]) == {"unchanged"}
    assert cmp.loc[cmp["metric"] == "decode_step_latency_s", "label"].iloc[0] == "decode step latency"
    assert cmp["point"].iloc[0] == {"batch_size": 1, "prompt_len": 32, "output_len": 8}
    assert unmatched_points == {"baseline_only": [], "current_only": []}


def test_comparison_lists_failures_and_unmatched_points(tmp_path: Path) -> None:
    base = sweep_rows({"hf": 1.0}, batches=(1, 2), prompts=(32,))
    cur = [sweep_row("hf", 1, 32), status_row("hf", "failed", "OOM", point=base[1]["point"],
                                              point_key=base[1]["point_key"], model="tiny", dtype="float32"),
           sweep_row("hf", 4, 32)]
    cmp, unmatched_points = compare_rows(frame(base), frame(cur))
    assert "failed" in set(cmp["verdict"]) and len(unmatched_points["current_only"]) == 1
    write_results(tmp_path / "cur", cur)
    write_results(tmp_path / "base", base)
    html = render_report(load_report_data([tmp_path / "cur"], [tmp_path / "base"]))
    assert '<tr class="bad">' in html and 'data-table="comparison"' in html


# ---- other workloads (planned fields) --------------------------------------------------------

def test_kv_ablation_frame_slowdown() -> None:
    df = kv_ablation_frame(frame(other_workload_rows()))
    hf = df[df["base_series"] == "hf"]
    assert list(hf["mode"].iloc[:3]) == ["cache"] * 3          # cache first: drawn solid
    nc = hf[(hf["mode"] == "no_cache") & (hf["context_len"] == 1024)].iloc[0]
    assert nc["slowdown_vs_cache"] == pytest.approx(16.0)
    assert nc["series"] == "hf · without KV cache"
    fits = kv_ablation_fits(df).set_index(["base_series", "mode_label"])
    # the fake no-cache step grows linearly: 2 ms × context / 64
    assert fits.loc[("hf", "without KV cache"), "slope_s_per_token"] == pytest.approx(2e-3 / 64)
    assert fits.loc[("hf", "with KV cache"), "slope_s_per_token"] == pytest.approx(0, abs=1e-12)
    assert fits.loc[("hf", "without KV cache"), "growth"] == pytest.approx(16.0)


def test_prefix_sharing_frame() -> None:
    df = prefix_sharing_frame(frame(other_workload_rows()))
    assert set(df["caching"]) == {"caching on", "caching off"}
    on = df[(df["base_series"] == "hf") & (df["caching"] == "caching on")]
    assert list(on["prefix_len"]) == [0, 128, 512] and on["ttft_s"].is_monotonic_decreasing


def test_serving_frames() -> None:
    rows = other_workload_rows()
    for r in rows:                      # a rate of infinity (all at once) is stored as null
        if r["workload"] == "serving" and r["request_rate"] == 16.0:
            r["request_rate"] = None
    df = serving_frame(frame(rows))
    assert len(df) == 6
    hf = df[df["series"] == "hf"]
    assert list(hf["rate_label"]) == ["1", "4", "all at once"] and list(hf["rate_x"]) == [1.0, 4.0, 8.0]
    long = serving_percentiles(df, "ttft_s")
    assert len(long) == 18 and set(long["percentile"]) == {"p50", "p90", "p99"}
    cdf = cdf_frame(df)
    for _, g in cdf.groupby(["series", "rate_x"]):
        assert g["value"].is_monotonic_increasing and g["fraction"].iloc[-1] == 1.0
    assert serving_percentiles(df, "nonexistent_s").empty


def test_kv_memory_roofline_parity_frames() -> None:
    rows = frame(other_workload_rows() + sweep_rows({"hf": 1.0}, batches=(1,), prompts=(32,),
                                                     decode_bw_fraction=0.42, decode_roofline_fraction=0.6,
                                                     decode_roofline_bound="compute"))
    km = kv_memory_frame(rows)
    assert km.loc[(km["series"] == "hf") & (km["kv_layout"] == "contiguous"), "waste"].iloc[0] == pytest.approx(1 - 300 / 1024)
    assert set(km["where"]) == {"paged", "contiguous"}        # the layouts' points are otherwise equal
    assert set(km["point_label"]) == {"batch 4 · prompt 64"}
    rf = roofline_frame(rows)
    assert list(rf["decode_bw_fraction"]) == [0.42]
    assert list(rf["decode_roofline_fraction"]) == [0.6] and list(rf["decode_roofline_bound"]) == ["compute"]
    pa = parity_frame(rows)
    assert list(pa["agreement"]) == [1.0, 0.9]
    assert roofline_frame(frame(sweep_rows({"hf": 1.0}))).empty


# ---- the rendered page -----------------------------------------------------------------------

def test_sections_present_only_with_their_data(tmp_path: Path) -> None:
    write_results(tmp_path / "s", sweep_rows({"hf": 1.0}))
    html = render_report(load_report_data([tmp_path / "s"]))
    assert section_ids(html) == ["run", "summary", "prefill", "decode", "memory", "definitions"]
    write_results(tmp_path / "o", other_workload_rows())
    html = render_report(load_report_data([tmp_path / "o"]))
    assert section_ids(html) == ["run", "kv-ablation", "prefix-sharing", "serving", "kv-fragmentation", "parity",
                                 "definitions"]
    assert 'data-table="summary-points"' not in html
    write_results(tmp_path / "u", [status_row("vllm", "unavailable", "not installed")])
    html = render_report(load_report_data([tmp_path / "u"]))
    assert section_ids(html) == ["run", "summary", "definitions"] and "not installed" in html
    assert "plotly" not in html.lower().split("<body>")[0]     # no figures: no Plotly at all


def test_page_is_self_contained_with_plotly_once(tmp_path: Path) -> None:
    write_results(tmp_path / "cur", sweep_rows({"hf": 1.0, "reference": 1.5}))
    write_results(tmp_path / "base", sweep_rows({"hf": 1.2, "reference": 1.5}))
    out = write_report([tmp_path / "cur"], tmp_path / "r.html", baseline=[tmp_path / "base"])
    html = out.read_text()
    assert out == tmp_path / "r.html"
    assert html.count("Plotly.newPlot(") == 1 and html.count("<script>") == 2   # the library once + the boot script
    assert len(re.findall(r"\* plotly\.js v\d", html)) == 1
    page = re.sub(r"<script>.*?</script>", "", html, count=1, flags=re.S)   # the page without the library
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "cdn.plot.ly" not in page and "Content-Security-Policy" in page
    assert section_ids(html)[:4] == ["run", "summary", "baseline", "prefill"]
    assert str(escape(PERCENTILE_METHOD)) in html
    assert 'data-table="comparison"' in html


def test_every_engine_keeps_its_colour_in_every_figure(tmp_path: Path) -> None:
    write_results(tmp_path / "cur", sweep_rows({"reference": 1.0, "hf": 1.5}) + other_workload_rows())
    html = render_report(load_report_data([tmp_path / "cur"]))
    seen: dict[str, set[str]] = {"hf": set(), "reference": set()}
    for spec in figure_specs(html):
        for t in spec["data"]:
            name = t.get("name") or ""
            colour = (t.get("line") or {}).get("color") or (t.get("marker") or {}).get("color")
            for e in seen:
                if name.startswith(e) and isinstance(colour, str):
                    seen[e].add(colour)
    assert seen == {"hf": {ENGINE_COLOURS["hf"]}, "reference": {ENGINE_COLOURS["reference"]}}


def test_every_figure_has_axis_titles(tmp_path: Path) -> None:
    write_results(tmp_path / "cur", sweep_rows({"hf": 1.0}) + other_workload_rows())
    html = render_report(load_report_data([tmp_path / "cur"]))
    specs = figure_specs(html)
    assert len(specs) >= 15
    for spec in specs:
        axes = {k: v for k, v in spec["layout"].items() if re.fullmatch(r"[xy]axis\d*", k)}
        titled = [k for k, v in axes.items() if (v.get("title") or {}).get("text")]
        assert any(k.startswith("x") for k in titled) and any(k.startswith("y") for k in titled), spec["layout"].get("title")


def test_results_strings_are_escaped_in_html_and_figures(tmp_path: Path) -> None:
    evil = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'
    rows = (sweep_rows({"hf": 1.0}, batches=(1, 2), prompts=(32,), model=evil, run_id="j0", engine_options={"attn": evil})
            + sweep_rows({"hf": 1.0}, batches=(1, 2), prompts=(32,), model=evil, run_id="j1", engine_options={"attn": "sdpa"})
            + sweep_rows({"x" + evil: 1.0}, batches=(1, 2), prompts=(32,))   # an engine name, in legends
            + [status_row("hf", "failed", "boom " + evil)])
    write_results(tmp_path / "cur", rows, config=f"model: {evil}\n")
    html = render_report(load_report_data([tmp_path / "cur"]))
    assert "<script>window.__pwned" not in html and "<img src=x" not in html
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in html
    for spec in re.findall(r'class="fig-data"[^>]*>(.*?)</script>', html, re.S):
        assert "<" not in spec and ">" not in spec and "&" not in spec
    # inside figures, Plotly shows entities as characters: the strings are entity-escaped there
    blob = json.dumps(figure_specs(html))
    assert "<script>" not in blob and "&lt;script&gt;" in blob


def test_cli_exit_codes_and_messages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_results(tmp_path / "run", sweep_rows({"hf": 1.0}, batches=(1,), prompts=(32,)))
    assert report_main([str(tmp_path / "run"), "-o", str(tmp_path / "out.html")]) == 0
    assert f"report: {tmp_path / 'out.html'}" in capsys.readouterr().out
    assert report_main([str(tmp_path / "missing"), "-o", str(tmp_path / "x.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("infer-bench-report: error:") and "no such file" in err and "Traceback" not in err
    assert not (tmp_path / "x.html").exists()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "results.jsonl").write_text("\n")
    assert report_main([str(tmp_path / "empty"), "-o", str(tmp_path / "x.html")]) == 2
    assert "no rows" in capsys.readouterr().err
    assert report_main([str(tmp_path / "run"), "--baseline", str(tmp_path / "nope"), "-o", str(tmp_path / "x.html")]) == 2
    assert "baseline" in capsys.readouterr().err
    assert report_main([str(tmp_path / "run"), "--baseline", str(tmp_path / "run"), "--threshold", "150%",
                        "-o", str(tmp_path / "x.html")]) == 2
    assert "--threshold 150%" in capsys.readouterr().err
    assert report_main([str(tmp_path / "run"), "--baseline", str(tmp_path / "run"), "--threshold", "10%",
                        "-o", str(tmp_path / "b.html")]) == 0
    assert "Threshold 10.0%" in (tmp_path / "b.html").read_text()


def test_console_script_exit_code(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "infer-bench-report"
    if not exe.exists():
        pytest.skip("infer-bench-report is not installed (pip install -e .)")
    p = subprocess.run([str(exe), str(tmp_path / "none")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "no such file" in p.stderr


def test_series_ignore_per_point_option_overrides() -> None:
    a = sweep_rows({"hf": 1.0}, batches=(1,), prompts=(32,), run_id="r1", engine_options={"kv_cache": "on"})
    b = sweep_rows({"hf": 1.0}, batches=(2,), prompts=(32,), run_id="r1", engine_options={"kv_cache": "none"})
    c = sweep_rows({"hf": 1.0}, batches=(1,), prompts=(32,), run_id="r2", engine_options={"kv_cache": "on", "t": 2})
    assert set(frame(a + b)["series"]) == {"hf"}            # one run varied it per point
    assert set(frame(a + b + c)["series"]) == {"hf (t=None)", "hf (t=2)"}


def test_header_states_machine_gpus_and_commit() -> None:
    from reports.sections.header import machine_summary
    env = {"hostname": "h", "cpu": {"model": "EPYC", "logical_cores": 16}, "memory_total_bytes": 2**37,
           "gpus": [{"name": "NVIDIA H200", "memory_total_bytes": 141 * 2**30, "driver": "570.1"}],
           "cuda": "13.0", "python": "3.11.7", "packages": {"torch": "2.11"}, "platform": "Linux",
           "git": {"commit": "abc123", "dirty": True}}
    m = machine_summary(env)
    assert "NVIDIA H200 (141.0 GiB, driver 570.1)" in m["machine"] and "CUDA 13.0" in m["machine"]
    assert m["git commit"] == "abc123 (uncommitted changes)" and "torch 2.11" in m["software"]
    assert machine_summary(None) == {}
