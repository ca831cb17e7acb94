"""The report's newer sections on FAKE rows (tests/test_report_fakes.py): resources and their
warning, same/different machines, memory reserved vs used, parity's teacher-forced
table, HTTP endpoints, capacity and energy, and pages of partial data.
Each test states what the page must show for known rows."""

from __future__ import annotations

import copy
import html as htmllib
import json
import math
import re
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from reports.data import frame, load_report_data
from reports.render import render_report
from reports.sections.capacity import capacity_frame, pareto_frame
from reports.sections.common import kv_reserved, working_memory
from reports.sections.endpoints import auth_text, flags_frame, telemetry_frame
from reports.sections.energy import energy_frame
from reports.sections.memory import memory_engines_frame
from reports.sections.parity_section import parity_frame, verdict
from reports.sections.resources import core_ranges, resource_differences
from reports.sections.serving_load import serving_frame
from test_report_fakes import (FAKE_ENV, FAKE_POOL, capacity_rows, http_serving_rows, parity_rows_teacher_forced,
                               serving_load_rows, status_row, sweep_rows, write_results)

PAYLOAD = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'


def page(tmp_path: Path, rows: list[dict[str, Any]], baseline: list[dict[str, Any]] | None = None,
         env: dict[str, Any] | None = FAKE_ENV, base_env: dict[str, Any] | None = FAKE_ENV, name: str = "cur") -> str:
    write_results(tmp_path / name, rows, env=env)
    if baseline is not None:
        write_results(tmp_path / f"{name}-base", baseline, env=base_env)
    return render_report(load_report_data([tmp_path / name], [tmp_path / f"{name}-base"] if baseline is not None else None))


def section_ids(html: str) -> list[str]:
    return re.findall(r'<section id="([a-z-]+)"', html)


def notes(html: str, name: str) -> list[str]:
    """The text of every note named `name` (data-note)."""
    return [htmllib.unescape(t) for t in re.findall(rf'<p class="note[^"]*" data-note="{name}"[^>]*>(.*?)</p>', html, re.S)]


def table_rows(html: str, name: str) -> list[list[str]]:
    m = re.search(rf'<table data-table="{name}"[^>]*>(.*?)</table>', html, re.S)
    if not m:
        return []
    body = m.group(1).split("<tbody>")[1]
    return [[htmllib.unescape(re.sub(r"<[^>]+>", "", c)).replace("★", "").strip()
             for c in re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)] for tr in re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)]


def table_headers(html: str, name: str) -> list[str]:
    m = re.search(rf'<table data-table="{name}"[^>]*>(.*?)</thead>', html, re.S)
    return [htmllib.unescape(h) for h in re.findall(r"<th scope=\"col\">(.*?)</th>", m.group(1))] if m else []


def figures(html: str, name: str) -> list[dict[str, Any]]:
    return [json.loads(s) for s in re.findall(
        rf'<figure class="figure" data-figure="{name}">.*?<script type="application/json" class="fig-data"[^>]*>(.*?)</script>',
        html, re.S)]


def by_header(html: str, name: str) -> list[dict[str, str]]:
    heads = table_headers(html, name)
    return [dict(zip(heads, r)) for r in table_rows(html, name)]


# ---- resources -------------------------------------------------------------------------------

def test_core_ranges() -> None:
    assert core_ranges([0, 1, 2, 3, 8]) == "0-3, 8 (5 cores)"
    assert core_ranges([5]) == "5 (1 core)"
    assert core_ranges(None) == "–"


def test_resource_warning_appears_exactly_when_threads_differ(tmp_path: Path) -> None:
    same = sweep_rows({"hf": 1.0, "reference": 1.0}, batches=(1,), prompts=(16,))
    html = page(tmp_path, same, name="same")
    assert notes(html, "resources-differ") == []
    res = by_header(html, "resources")
    assert [r["engine"] for r in res] == ["hf", "reference"]
    assert {r["compute threads"] for r in res} == {"2"} and {r["CPU cores (affinity)"] for r in res} == {"0-1 (2 cores)"}
    assert res[0]["worker interpreter"] == "/fake/venv/bin/python"
    assert "engine hf-0.0-fake" in res[0]["versions in the worker"]
    assert res[0]["launched by"] == "the harness's interpreter"

    fewer = copy.deepcopy(same)
    for r in fewer:
        if r["engine"] == "reference":
            r["compute_threads"] = 1
            r["engine_options"] = {"reserve_scheduler_core": True}
    html = page(tmp_path, fewer, name="fewer")
    [warning] = notes(html, "resources-differ")
    assert warning.startswith("WARNING") and "compute threads: hf 2; reference 1" in warning
    assert "reserve_scheduler_core" in warning                        # the reason, from the row
    assert "CPU cores" not in warning and "device" not in warning     # only what differs


@pytest.mark.parametrize("field,value,label", [("cpu_affinity", [2, 3], "CPU cores"), ("device", "cuda:0", "device")])
def test_resource_warning_names_cores_and_device(field: str, value: Any, label: str) -> None:
    rows = sweep_rows({"hf": 1.0, "reference": 1.0}, batches=(1,), prompts=(16,))
    assert resource_differences(frame(rows)) == []
    for r in rows:
        if r["engine"] == "hf":
            r[field] = value
    [(got, per)] = resource_differences(frame(rows))
    assert got == label and set(per) == {"hf", "reference"}


def test_http_endpoints_and_older_rows_raise_no_resource_warning(tmp_path: Path) -> None:
    rows = sweep_rows({"hf": 1.0}, batches=(1,), prompts=(16,)) + http_serving_rows(compute_threads=None,
                                                                                     cpu_affinity=[7])
    assert resource_differences(frame(rows)) == []          # the server's resources are its own
    html = page(tmp_path, sweep_rows({"hf": 1.0, "reference": 1.0}, batches=(1,), prompts=(16,), legacy=True))
    assert notes(html, "resources-differ") == [] and 'data-table="resources"' in html   # device is still recorded


def test_tls_off_is_stated_in_the_header_for_every_such_endpoint(tmp_path: Path) -> None:
    html = page(tmp_path, http_serving_rows(tls_verify=True), name="on")
    assert notes(html, "tls-off") == []
    rows = http_serving_rows(tls_verify=False) + http_serving_rows(engine="sglang-http", tls_verify=False,
                                                                   endpoint_url="https://10.0.0.2:30000/v1")
    html = page(tmp_path, rows, name="off")
    [warning] = notes(html, "tls-off")
    assert "vllm-http (http://127.0.0.1:8000/v1)" in warning and "sglang-http (https://10.0.0.2:30000/v1)" in warning
    assert html.index('<section id="run"') < html.index('data-note="tls-off"') < html.index('data-facts="run-facts"')


# ---- different machines ----------------------------------------------------------------------

def test_baseline_says_same_or_different_machines(tmp_path: Path) -> None:
    base = sweep_rows({"hf": 1.0}, batches=(1,), prompts=(16,))
    cur = sweep_rows({"hf": 1.1}, batches=(1,), prompts=(16,))
    html = page(tmp_path, cur, base, name="same")
    assert notes(html, "same-machine") and not notes(html, "different-machines")
    other = {**FAKE_ENV, "cpu": {**FAKE_ENV["cpu"], "model": "Other CPU"}, "gpus": [{"name": "NVIDIA H200"}]}
    html = page(tmp_path, cur, base, base_env=other, name="diff")
    [text] = notes(html, "different-machines")
    assert "different machines" in text
    assert "cpu model: baseline Other CPU, current Fake CPU" in text and "GPUs: baseline NVIDIA H200, current none" in text
    assert not notes(html, "same-machine")
    assert "different machines: cpu model" in htmllib.unescape(html)       # the header's baseline facts too
    html = page(tmp_path, cur, base, base_env=None, name="unknown")
    assert notes(html, "machine-unknown") and not notes(html, "same-machine") and not notes(html, "different-machines")


# ---- memory: reserved and used apart ---------------------------------------------------------

def test_reserved_pool_resolution_new_and_older_rows() -> None:
    new_ref, new_hf = (r for r in frame(sweep_rows({"reference": 1.0, "hf": 1.0}, batches=(1,), prompts=(16,)))
                       .to_dict("records"))
    assert kv_reserved(new_ref) == (FAKE_POOL, "kv_reserved_bytes")
    assert kv_reserved(new_hf)[0] is None
    old_ref, old_hf = (r for r in frame(sweep_rows({"reference": 1.0, "hf": 1.0}, batches=(1,), prompts=(16,),
                                                   legacy=True)).to_dict("records"))
    assert kv_reserved(old_ref)[0] == old_ref["kv_cache_bytes"] == FAKE_POOL   # a block pool: kv_info.num_blocks
    assert kv_reserved(old_hf)[0] is None                                       # transformers' live cache
    # a row that records kv_reserved_bytes as null reserved nothing, whatever else it carries
    nulled = frame(sweep_rows({"reference": 1.0}, batches=(1,), prompts=(16,), legacy=True, kv_reserved_bytes=None))
    assert kv_reserved(nulled.to_dict("records")[0])[0] is None


def test_working_memory_compares_like_with_like() -> None:
    used, peak = 3 * 2**20, 900 * 2**20
    gpu = {"peak_memory_bytes": peak, "kv_reserved_bytes": FAKE_POOL, "kv_used_bytes": used, "memory_source": "nvml"}
    assert working_memory(gpu)[0] == peak - FAKE_POOL + used
    cpu = {**gpu, "memory_source": "psutil-rss"}        # RSS counts a pool only as far as it was written
    assert working_memory(cpu)[0] == peak
    none = {**gpu, "kv_reserved_bytes": None}
    assert working_memory(none)[0] == peak
    assert working_memory({**gpu, "peak_memory_bytes": FAKE_POOL // 2})[0] is None


def test_memory_table_labels_the_reserved_pool_and_stars_working_memory(tmp_path: Path) -> None:
    rows = sweep_rows({"hf": 1.0, "reference": 1.0}, batches=(1,), prompts=(16,))
    for r in rows:          # a GPU: the reference engine's pool is inside its NVML peak
        r["memory_source"] = "nvml"
        if r["engine"] == "reference":
            r["peak_memory_bytes"] += FAKE_POOL
    html = page(tmp_path, rows)
    eng = {r["engine"]: r for r in by_header(html, "memory-engines")}
    assert "KV reserved up front MiB" in table_headers(html, "memory-engines")
    assert eng["reference"]["KV reserved up front MiB"] == "64.00" and eng["hf"]["KV reserved up front MiB"] == "–"
    ref = [r for r in rows if r["engine"] == "reference"][0]
    hf = [r for r in rows if r["engine"] == "hf"][0]
    expected = (ref["peak_memory_bytes"] - FAKE_POOL + ref["kv_used_bytes"]) / 2**20
    assert float(eng["reference"]["working memory MiB"]) == pytest.approx(expected, rel=1e-3)
    assert eng["reference"]["process peak MiB"] != eng["reference"]["working memory MiB"]
    [note] = [n for n in re.findall(r'<p class="note">(.*?)</p>', html, re.S) if "reserved up front by" in n]
    assert "reference" in note and "working memory = process peak − KV reserved up front + KV in use" in htmllib.unescape(note)
    # the summary's headline compares working memory (★), not process peaks holding a pool
    head = re.search(r'<table data-table="summary-engines">.*?</table>', html, re.S).group(0)
    heads = table_headers(html, "summary-engines")
    cells = [re.findall(r"<td([^>]*)>", tr) for tr in re.findall(r"<tr>(.*?)</tr>", head.split("<tbody>")[1], re.S)]
    col = heads.index("largest working memory MiB")
    peak_col = heads.index("largest process peak MiB")
    assert any("best" in c[col] for c in cells) and not any("best" in c[peak_col] for c in cells)
    assert hf["peak_memory_bytes"] < ref["peak_memory_bytes"]   # raw, the pool would make hf look 'better'


def test_memory_engines_frame_per_workload_and_older_rows() -> None:
    rows = frame(sweep_rows({"hf": 1.0, "reference": 1.0}, batches=(1, 2), prompts=(16,), legacy=True))
    m = memory_engines_frame(rows).set_index("series")
    assert m.loc["reference", "kv_reserved"] == FAKE_POOL and pd.isna(m.loc["hf", "kv_reserved"])
    assert m.loc["hf", "peak_memory_bytes"] == max(r for r in rows.loc[rows["engine"] == "hf", "peak_memory_bytes"])


# ---- parity ----------------------------------------------------------------------------------

def test_parity_table_thresholds_and_verdicts(tmp_path: Path) -> None:
    rows = parity_rows_teacher_forced()
    df = parity_frame(frame(rows))
    verdicts = {r["engine"]: verdict(r) for r in df.to_dict("records")}
    assert verdicts["reference"][0] == "baseline" and verdicts["hf"][0] == "pass"
    assert verdicts["vllm"] == ("fail", rows[2]["error"])
    assert verdicts["trtllm"] == ("greedy only", rows[3]["parity_note"])
    html = page(tmp_path, rows)
    t = {r["engine"]: r for r in by_header(html, "parity-values")}
    assert t["hf"]["max |Δ log p| vs threshold"] == "0.0002 ≤ 0.001"
    assert t["hf"]["top-1 agreement vs threshold"] == "100.0% ≥ 100.0% of 40"
    assert t["vllm"]["mean KL vs threshold"] == "2e-05 (threshold ≤ 1e-06)"
    assert t["vllm"]["verdict"] == "fail" and t["vllm"]["reason"] == rows[2]["error"]
    assert t["hf"]["greedy agreement"] == "42.0%" and t["hf"]["first divergence (step)"] == "3"
    assert t["reference"]["first divergence (step)"] == "none" and t["hf"]["compared with"] == "reference"
    # a row marked ok whose metric is past its threshold is not passed
    bad = dict(rows[1], parity_mean_kl=1.0)
    assert verdict(bad)[0] == "fail" and "mean KL" in verdict(bad)[1]


# ---- HTTP endpoints --------------------------------------------------------------------------

def test_flags_appear_exactly_when_counts_differ_or_requests_fail(tmp_path: Path) -> None:
    assert flags_frame(frame(http_serving_rows())).empty
    html = page(tmp_path, http_serving_rows(), name="clean")
    assert 'data-table="http-flags"' not in html and notes(html, "http-no-flags")
    rows = http_serving_rows(server_tokens=(400, 398), client_tokens=(400, 400))
    f = flags_frame(frame(rows))
    assert list(f["point"]) == ["rate 8.0"] and bool(f["mismatch"].iloc[0]) and f["failed_requests"].iloc[0] == 0
    rows = http_serving_rows(failed=(3, 0))
    f = flags_frame(frame(rows))
    assert list(f["point"]) == ["rate 2.0"] and not f["mismatch"].iloc[0]
    html = page(tmp_path, rows, name="failed")
    [row] = by_header(html, "http-flags")
    assert row["failed requests"] == "3" and row["why they failed"] == "HTTP 503 Service Unavailable: 3"
    [warning] = notes(html, "http-flags")
    assert "completed requests only" in warning


def test_server_identity_never_shows_a_key(tmp_path: Path) -> None:
    assert auth_text("none") == "none"
    assert auth_text({"method": "env", "variable": "VLLM_API_KEY"}) == "API key from environment variable VLLM_API_KEY"
    assert auth_text({"method": "file", "path": "/run/secrets/key"}) == "API key from file /run/secrets/key"
    rows = http_serving_rows(auth={"method": "env", "variable": "MY_KEY", "key": "sk-live-SECRET", "value": "SECRET2"})
    html = page(tmp_path, rows)
    assert "SECRET" not in html
    [ident] = by_header(html, "http-servers")
    assert ident["server version"] == "0.11.0-fake" and ident["model"] == "/models/tiny"
    assert ident["launch command"] == "vllm serve /models/tiny --port 8000" and ident["TLS verified"] == "yes"
    assert ident["authentication"] == "API key from environment variable MY_KEY" and ident["transport"] == "http"
    attached = by_header(page(tmp_path, http_serving_rows(launch_command=None), name="att"), "http-servers")[0]
    assert attached["launch command"] == "attached (not launched by the harness)"


def test_telemetry_figure_plots_the_servers_series(tmp_path: Path) -> None:
    rows = http_serving_rows() + http_serving_rows(engine="sglang-http")
    tl = telemetry_frame(frame(rows))
    assert set(tl["kind"]) == {"kv", "running", "waiting"}           # the prefix-cache counter is left out
    html = page(tmp_path, rows)
    [fig] = figures(html, "http-telemetry")
    first_point = [t for t in fig["data"] if t.get("visible") is not False]
    assert {t["name"] for t in first_point} == {f"{e} · {k}" for e in ("vllm-http", "sglang-http")
                                                for k in ("KV-cache usage", "running", "waiting")}
    kv = next(t for t in first_point if t["name"] == "vllm-http · KV-cache usage")
    src = rows[0]["server_metrics"]["vllm:kv_cache_usage_perc"]
    assert kv["x"] == [t for t, _ in src] and kv["y"] == pytest.approx([v * 100 for _, v in src])
    waiting = next(t for t in first_point if t["name"] == "sglang-http · waiting")
    assert waiting["y"] == [v for _, v in rows[0]["server_metrics"]["vllm:num_requests_waiting"]]
    assert len(fig["layout"]["updatemenus"][0]["buttons"]) == 2      # one per point
    assert "http-telemetry" not in page(tmp_path, http_serving_rows(with_metrics=False), name="nometrics")


# ---- capacity --------------------------------------------------------------------------------

def test_pareto_figure_is_the_rows_numbers(tmp_path: Path) -> None:
    rows = (serving_load_rows({"hf": 1.0, "reference": 1.5}, mode="closed", loads=(1, 2, 4, 8, 16))
            + capacity_rows("hf") + http_serving_rows())
    html = page(tmp_path, rows)
    [fig] = figures(html, "capacity-pareto")
    traces = {t["name"]: t for t in fig["data"]}
    assert set(traces) == {"hf · concurrency sweep", "hf · capacity probes (concurrency)", "reference", "vllm-http"}
    for name, engine, workload in (("hf · concurrency sweep", "hf", "serving"), ("reference", "reference", "serving"),
                                   ("hf · capacity probes (concurrency)", "hf", "capacity"),
                                   ("vllm-http", "vllm-http", "serving")):
        src = [r for r in rows if r["engine"] == engine and r["workload"] == workload and not r["point"].get("result")]
        src.sort(key=lambda r: r.get("concurrency") or r.get("request_rate"))
        t = traces[name]
        assert t["x"] == [r["per_user_tok_s"] for r in src] and t["y"] == [r["output_tok_s"] for r in src]
        sat = [r.get("saturated") is True for r in src]
        assert [s == "x" for s in t["marker"]["symbol"]] == sat      # saturated points marked, only those
    assert traces["reference"]["text"] == ["c=1", "c=2", "c=4", "c=8", "c=16"]
    assert traces["vllm-http"]["text"] == ["2 req/s", "8 req/s"]


def test_one_pareto_figure_per_model_and_older_rows(tmp_path: Path) -> None:
    rows = (serving_load_rows({"hf": 1.0}, loads=(1, 4)) + serving_load_rows({"hf": 1.0}, loads=(1, 4), model="small"))
    html = page(tmp_path, rows)
    figs = figures(html, "capacity-pareto")
    assert [f["layout"]["title"]["text"].split(":")[0] for f in figs] == ["tiny", "small"]
    older = serving_load_rows({"hf": 1.0}, loads=(1, 4))
    for r in older:
        for k in ("per_user_tok_s", "load_mode", "saturated"):
            del r[k]
    pf = pareto_frame(frame(older))
    assert list(pf["per_user_tok_s"]) == [1 / r["tpot_s"] for r in older] and pf["per_user_derived"].all()


def test_capacity_table_states_slos_bracket_and_probes(tmp_path: Path) -> None:
    rows = capacity_rows("hf") + capacity_rows("reference", search="rate", capacity=None,
                                               probes=((1, False, False), (2, False, True)),
                                               slo={"ttft_p99_s": 0.2, "tpot_p99_s": None, "e2el_p99_s": 4.0})
    cap = capacity_frame(frame(rows)).set_index("series")
    assert cap.loc["hf", "capacity"] == 8 and cap.loc["hf", "probes"] == 4 and cap.loc["hf", "probes_met"] == 2
    html = page(tmp_path, rows)
    t = {r["engine"]: r for r in by_header(html, "capacity")}
    assert t["hf"]["capacity"] == "8 concurrent" and t["hf"]["bracket [meets, misses]"] == "[8, 12] concurrent"
    assert t["hf"]["SLOs it was found under"] == "TTFT p99 ≤ 500.0 ms · TPOT p99 ≤ 50.00 ms · E2EL p99 unset"
    assert t["hf"]["probes"] == "4 (2 met the SLOs, 1 saturated)" and t["hf"]["resolution"] == "1"
    assert t["reference"]["search"] == "request rate"
    assert t["reference"]["capacity"] == "not found: every probe missed the SLOs (lowest 1 req/s)"
    assert t["reference"]["SLOs it was found under"] == "TTFT p99 ≤ 200.0 ms · TPOT p99 unset · E2EL p99 ≤ 4,000 ms"
    unbounded = capacity_rows("hf", capacity=32, probes=((8, True, False), (32, True, False)))
    assert capacity_frame(frame(unbounded))["capacity_text"].iloc[0] == "≥ 32 concurrent (every probe met the SLOs)"
    noted = capacity_rows("hf", capacity=None, probes=((1, False, False),))
    noted[-1]["capacity_note"] = "no probed load met the SLOs"
    assert capacity_frame(frame(noted))["capacity_text"].iloc[0] == "not found: no probed load met the SLOs"
    failed = capacity_rows("hf", status="failed", error="engine crashed")
    t = by_header(page(tmp_path, failed, name="failed"), "capacity")
    assert t[0]["capacity"] == "failed" and t[0]["error"] == "engine crashed"


def test_closed_loop_serving_plots_against_concurrency() -> None:
    df = serving_frame(frame(serving_load_rows({"hf": 1.0}, mode="closed", loads=(1, 4, 16))
                             + serving_load_rows({"hf": 1.0}, mode="open", loads=(2.0,))))
    closed = df[df["load_mode"] == "closed"]
    assert list(closed["rate_x"]) == [1, 4, 16] and list(closed["rate_label"]) == ["1", "4", "16"]
    assert list(closed["saturated_text"]) == ["no", "no", "yes"]
    assert list(df.loc[df["load_mode"] == "open", "rate_label"]) == ["2"]


# ---- energy ----------------------------------------------------------------------------------

def test_energy_per_token_and_why_absent(tmp_path: Path) -> None:
    rows = serving_load_rows({"hf": 1.0, "reference": 1.0}, loads=(1, 4))
    for i, r in enumerate(rows):
        if r["engine"] == "hf":
            r.update(energy_j=10.0 + i, joules_per_output_token=0.01 * (i + 1), output_tokens_per_joule=100 / (i + 1),
                     energy_source="nvml", energy_note=None)
        else:
            r.update(energy_j=None, joules_per_output_token=None, energy_note="RAPL is not readable here")
    e = energy_frame(frame(rows))
    assert list(e["series"]) == ["hf", "hf"] and list(e["joules_per_output_token"]) == [0.01, 0.02]
    html = page(tmp_path, rows)
    t = by_header(html, "energy")
    assert [r["J per output token"] for r in t] == ["0.01", "0.02"] and {r["source"] for r in t} == {"nvml"}
    [why] = notes(html, "energy-absent")
    assert "reference (2 rows): RAPL is not readable here" in why
    assert "energy" not in section_ids(page(tmp_path, serving_load_rows({"hf": 1.0}), name="none"))


# ---- partial data and safety -----------------------------------------------------------------

@pytest.mark.parametrize("rows,expect", [
    (lambda: capacity_rows("hf"), ["run", "capacity", "definitions"]),
    (lambda: http_serving_rows(), ["run", "serving", "capacity", "http-endpoints", "definitions"]),
    (lambda: parity_rows_teacher_forced(), ["run", "summary", "parity", "definitions"]),
    (lambda: sweep_rows({"hf": 1.0, "reference": 1.0}, batches=(1,), prompts=(16,), legacy=True),
     ["run", "summary", "prefill", "decode", "memory", "definitions"]),
    (lambda: [status_row("vllm", "unavailable", "no vllm")], ["run", "summary", "definitions"]),
])
def test_partial_data_renders_only_what_it_has(tmp_path: Path, rows, expect) -> None:
    assert section_ids(page(tmp_path, rows())) == expect


def test_new_row_strings_are_escaped(tmp_path: Path) -> None:
    rows = (http_serving_rows(server_version=PAYLOAD, launch_command=PAYLOAD, server_model=PAYLOAD, tls_verify=False,
                              endpoint_url=PAYLOAD, itl_chunking=PAYLOAD, server_tokens=(1, 2),
                              auth={"method": "env", "variable": PAYLOAD})
            + capacity_rows("hf", slo_violations=[PAYLOAD])
            + [r | {"parity_note": PAYLOAD, "error": PAYLOAD} for r in parity_rows_teacher_forced()]
            + [r | {"energy_note": PAYLOAD, "worker_python": PAYLOAD, "memory_scope": PAYLOAD}
               for r in sweep_rows({"hf": 1.0}, batches=(1,), prompts=(16,))])
    for r in rows:
        if r.get("server_metrics"):
            r["server_metrics"] = {PAYLOAD + "kv_cache_usage_perc": r["server_metrics"]["vllm:kv_cache_usage_perc"]}
    rows[0]["failed_requests"] = 1
    rows[0]["failed_request_reasons"] = {PAYLOAD: 1}
    html = page(tmp_path, rows)
    assert "<script>window.__pwned" not in html and "<img src=x" not in html
    assert html.count("&lt;script&gt;window.__pwned=1&lt;/script&gt;") >= 8
    for spec in re.findall(r'class="fig-data"[^>]*>(.*?)</script>', html, re.S):
        assert "<" not in spec and ">" not in spec


def test_fake_pareto_rows_are_consistent() -> None:
    """The FAKE load rows: device throughput is per-user speed × the requests served at once."""
    for r in serving_load_rows({"hf": 1.0}, mode="closed", loads=(1, 2, 4, 8, 16)):
        assert r["output_tok_s"] == pytest.approx(r["per_user_tok_s"] * min(r["concurrency"], 8) * 0.9)
        assert math.isclose(r["per_user_tok_s"], 1 / r["tpot_s"])
    assert pd.DataFrame(capacity_rows("hf"))["workload"].eq("capacity").all()


def test_new_figures_have_axis_titles_and_engine_colours(tmp_path: Path) -> None:
    from reports.data import ENGINE_COLOURS
    rows = (serving_load_rows({"hf": 1.0, "reference": 1.5}, mode="closed", loads=(1, 4, 16))
            + capacity_rows("hf") + http_serving_rows(engine="reference"))
    html = page(tmp_path, rows)
    specs = figures(html, "capacity-pareto") + figures(html, "http-telemetry") + figures(html, "serving-closed-ttft")
    assert len(specs) == 3
    for spec in specs:
        axes = {k: v for k, v in spec["layout"].items() if re.fullmatch(r"[xy]axis\d*", k)}
        titled = [k for k, v in axes.items() if (v.get("title") or {}).get("text")]
        assert any(k.startswith("x") for k in titled) and any(k.startswith("y") for k in titled)
        for t in spec["data"]:
            engine = t["name"].split(" ")[0]
            assert t["line"]["color"] == ENGINE_COLOURS[engine], t["name"]


# ---- the load generator's own distortion (client_limited) ------------------------------------

def test_client_limited_serving_points_have_their_column_and_note(tmp_path: Path) -> None:
    rows = (serving_load_rows({"vllm-http": 1.0}, loads=(1.0, 4.0, 16.0), client_limited_at=(16.0,))
            + serving_load_rows({"hf": 1.0}, loads=(1.0, 4.0)))       # in-process: no client, no verdict
    html = page(tmp_path, rows)
    t = {(r["engine"], r["rate req/s"]): r for r in by_header(html, "serving-values")}
    assert {k: r["client-limited"] for k, r in t.items()} == {
        ("vllm-http", "1"): "no", ("vllm-http", "4"): "no", ("vllm-http", "16"): "yes", ("hf", "1"): "–", ("hf", "4"): "–"}
    src = {(r["engine"], f"{r['request_rate']:g}"): r for r in rows}
    for k, r in t.items():
        if k[0] == "hf":
            assert r["send lag p99 ms"] == r["client CPU % of a core"] == "–"
        else:
            assert float(r["send lag p99 ms"]) == pytest.approx(src[k]["send_lag_s_p99"] * 1e3, rel=1e-3)
            assert float(r["client CPU % of a core"]) == pytest.approx(src[k]["client_cpu_frac"] * 100, rel=1e-3)
    [note] = notes(html, "serving-client-limited")
    assert "vllm-http at 16 req/s (" in note and "hf at" not in note and "at 1 req/s" not in note
    assert "at 4" not in note and ", 4" not in note
    assert "loop lag 13.5 ms > 5.0 ms" in note and "workload.client_processes" in note
    # a page where the client kept up everywhere: the column says so, no note
    kept_up = page(tmp_path, serving_load_rows({"vllm-http": 1.0}, loads=(1.0, 4.0), client_limited_at=()), name="ok")
    assert {r["client-limited"] for r in by_header(kept_up, "serving-values")} == {"no"}
    assert not notes(kept_up, "serving-client-limited")
    # in-process engines only: no client columns at all
    heads = table_headers(page(tmp_path, serving_load_rows({"hf": 1.0}), name="inproc"), "serving-values")
    assert "saturated" in heads and not {"client-limited", "send lag p99 ms", "client CPU % of a core"} & set(heads)


def test_client_limited_probes_are_marked_and_never_capacity(tmp_path: Path) -> None:
    probes = ((4, True, False, False), (16, False, False, True), (8, True, False, False), (12, False, False, False))
    rows = capacity_rows("vllm-http", probes=probes) + capacity_rows("hf")
    cap = capacity_frame(frame(rows)).set_index("series")
    assert cap.loc["vllm-http", "client_limited"] == [16.0] and cap.loc["hf", "client_limited"] == []
    html = page(tmp_path, rows)
    t = {r["engine"]: r for r in by_header(html, "capacity")}
    assert t["vllm-http"]["probes"] == "4 (2 met the SLOs, 0 saturated, 1 client-limited)"
    assert t["hf"]["probes"] == "4 (2 met the SLOs, 1 saturated)"
    [note] = notes(html, "capacity-client-limited")
    assert "vllm-http (concurrency) at 16 concurrent." in note and "hf (" not in note
    assert "never as the engine's capacity" in note and "workload.client_processes" in note
    [fig] = figures(html, "capacity-pareto")
    traces = {t["name"]: t for t in fig["data"]}
    probe_rows = sorted((r for r in rows if r["engine"] == "vllm-http" and not r["point"].get("result")),
                        key=lambda r: r["concurrency"])
    marker = traces["vllm-http"]["marker"]
    assert [s == "cross" for s in marker["symbol"]] == [r["client_limited"] for r in probe_rows]
    hf_probes = sorted((r for r in rows if r["engine"] == "hf" and not r["point"].get("result")),
                       key=lambda r: r["concurrency"])
    assert [s == "x" for s in traces["hf"]["marker"]["symbol"]] == [r["saturated"] for r in hf_probes]
    assert "cross" not in traces["hf"]["marker"]["symbol"] and "Orange ✚: client-limited" in html
    values = {(r["engine"], r["load"]): r["client-limited"] for r in by_header(html, "capacity-pareto-values")}
    assert values[("vllm-http", "c=16")] == "yes" and values[("vllm-http", "c=8")] == "no" and values[("hf", "c=16")] == "–"
    # a conclusion written without capacity_client_limited: its probe rows say which loads
    older = copy.deepcopy(rows)
    del older[4]["capacity_client_limited"]
    assert capacity_frame(frame(older)).set_index("series").loc["vllm-http", "client_limited"] == [16.0]
    # no client-limited probe: no note, and the probes cell as before
    clean = page(tmp_path, capacity_rows("vllm-http", probes=[p[:3] + (False,) for p in probes]), name="clean")
    assert not notes(clean, "capacity-client-limited")
    assert by_header(clean, "capacity")[0]["probes"] == "4 (2 met the SLOs, 0 saturated)"


def test_client_fields_are_defined_where_rows_carry_them(tmp_path: Path) -> None:
    html = page(tmp_path, serving_load_rows({"vllm-http": 1.0}, loads=(1.0,), client_limited_at=()))
    defined = dict(table_rows(html, "definitions-client"))
    assert {"send lag", "loop lag", "client CPU", "achieved rate", "client-limited"} <= set(defined)
    assert "workload.client_processes" in defined["client-limited"]
    assert not table_rows(page(tmp_path, serving_load_rows({"hf": 1.0}), name="inproc"), "definitions-client")


def test_replayed_traces_plot_at_their_mean_rate_not_all_at_once(tmp_path: Path) -> None:
    rows = (serving_load_rows({"vllm-http": 1.0}, mode="trace", loads=(2.0, 8.0), client_limited_at=(8.0,))
            + serving_load_rows({"vllm-http": 1.0}, loads=(1.0, 4.0), client_limited_at=()))
    df = serving_frame(frame(rows))
    trace = df[df["load_mode"] == "trace"]
    assert list(trace["rate_x"]) == [2.0, 8.0] and list(trace["rate_label"]) == ["2", "8"]
    html = page(tmp_path, rows)
    assert figures(html, "serving-trace-ttft") and figures(html, "serving-ttft")
    assert [r["trace req/s"] for r in by_header(html, "serving-trace-values")] == ["2", "8"]
    assert [r["rate req/s"] for r in by_header(html, "serving-values")] == ["1", "4"]
    assert "all at once" not in html
    [note] = notes(html, "serving-client-limited")
    assert "vllm-http at 8 req/s (trace) (" in note
    [fig] = figures(html, "capacity-pareto")
    traces = {t["name"]: t for t in fig["data"]}
    assert traces["vllm-http · trace replay"]["text"] == ["trace 2 req/s", "trace 8 req/s"]
    assert traces["vllm-http · request rate sweep"]["text"] == ["1 req/s", "4 req/s"]
    assert traces["vllm-http · trace replay"]["marker"]["symbol"][1] == "cross"


def test_a_capacity_not_found_keeps_its_column_narrow(tmp_path: Path) -> None:
    # a conclusion without a capacity holds NaN in the frame: its long reason was drawn as a
    # right-aligned number cell and pushed the other engines' capacities out of view
    missed = capacity_rows("vllm-http", probes=((1, False, False),), capacity=None)
    missed[-1]["capacity_note"] = "no probed load met the SLOs; the load generator did not keep up at 1"
    rows = missed + capacity_rows("hf")
    html = page(tmp_path, rows)
    t = {r["engine"]: r for r in by_header(html, "capacity")}
    assert t["vllm-http"]["capacity"] == "not found: no probed load met the SLOs"
    assert 'title="not found: no probed load met the SLOs; the load generator did not keep up at 1"' in html
    assert t["hf"]["capacity"].startswith("8")
