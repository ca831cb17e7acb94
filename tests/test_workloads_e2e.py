"""Every workload, CI-sized, on the tiny preset with the reference and transformers engines
(vLLM too when installed): rows carry their metrics, and every field is documented."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.core.results import read_rows
from tests_support import documented_fields, vllm_available, vllm_python

pytestmark = pytest.mark.slow

CASES = {
    "sweep": ["workload.batch_sizes=[1,2]", "workload.prompt_lens=[16,32]", "workload.output_len=4",
              "workload.min_repeats=2", "workload.min_duration_s=0"],
    "kv_ablation": ["workload.context_lens=[16,64,256]", "workload.decode_steps=3", "workload.min_repeats=2"],
    "prefix_sharing": ["workload.prefix_lens=[64]", "workload.num_requests=[4]", "workload.suffix_len=8",
                       "workload.output_len=3"],
    "serving": ["workload.num_requests=6", "workload.request_rates=[inf,50]", "workload.input_len=16",
                "workload.output_len={dist:uniform,min:2,max:5}", "workload.slo_ttft_s=10"],
    "kv_memory": ["workload.num_sequences=4", "workload.prompt_len={dist:uniform,min:16,max:200}",
                  "workload.output_len=3"],
    "conversation": ["workload.sessions=3", "workload.turns=3", "workload.user_tokens=24", "workload.output_tokens=3"],
}
ENGINES = "[reference,hf,vllm]" if vllm_available() else "[reference,hf]"


@pytest.fixture(scope="module", params=sorted(CASES))
def run(request, tmp_path_factory, tiny_ckpt):
    name = request.param
    out = tmp_path_factory.mktemp(name)
    cmd = [sys.executable, "-m", "harness.cli", f"engines={ENGINES}", "model=local", f"model.path={tiny_ckpt}",
           f"workload={name}", *CASES[name], "quiet=true", "parity=false", f"hydra.run.dir={out}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return name, read_rows(out / "results.jsonl"), r.stdout


def test_rows_have_metrics_and_are_documented(run):
    name, rows, stdout = run
    assert rows and all(r["workload"] == name for r in rows)
    doc = documented_fields()
    for r in rows:
        assert not set(r) - doc, f"{name}: undocumented fields {sorted(set(r) - doc)}"
        assert r["status"] in ("ok", "skipped"), r.get("error")
    ok = [r for r in rows if r["status"] == "ok"]
    assert {"reference", "hf"} <= {r["engine"] for r in ok}
    for r in ok:
        if name == "sweep":
            assert r["prefill_latency_s"] > 0 and r["decode_step_latency_s"] > 0 and r["output_tok_s"] > 0
        elif name == "kv_ablation":
            assert r["decode_step_latency_s"] > 0 and r["mode"] in ("cache", "no_cache")
        elif name == "prefix_sharing":
            assert r["ttft_s"] > 0 and r["ttft_first_s"] > 0
        elif name == "serving":
            assert r["completed"] == 6 and r["ttft_s"] > 0 and r["e2el_s"] >= r["ttft_s"]
            assert r["goodput_req_s"] > 0 and len(r["ttft_s_samples"]) == 6
        elif name == "kv_memory":
            assert r["tokens_stored"] == r["tokens_expected"] and r["slots_allocated"] >= r["tokens_stored"]


def test_workload_specific_expectations(run):
    name, rows, stdout = run
    ok = {(r["engine"], tuple(sorted((k, str(v)) for k, v in r["point"].items()))): r
          for r in rows if r["status"] == "ok"}
    if name == "kv_ablation":
        modes = {(r["engine"], r["mode"]) for r in rows if r["status"] == "ok"}
        assert {("reference", "no_cache"), ("reference", "cache"), ("hf", "no_cache")} <= modes
        assert "slope" in stdout
    if name == "prefix_sharing":
        ref_on = [r for r in rows if r["engine"] == "reference" and r.get("prefix_caching") is True]
        assert ref_on and ref_on[0]["prefix_hit_rate"] > 0.5
        hf_on = [r for r in rows if r["engine"] == "hf" and r["point"]["prefix_caching"] is True]
        assert hf_on[0]["status"] == "skipped" and "no prefix cache" in hf_on[0]["error"]
    if name == "conversation":  # transformers is the no-cache baseline: its caching-on point is skipped
        hf_on = [r for r in rows if r["engine"] == "hf" and r["point"]["prefix_caching"] is True]
        assert hf_on[0]["status"] == "skipped" and "no prefix cache" in hf_on[0]["error"]
        for r in rows:
            if r["status"] == "ok" and r["engine"] != "hf":
                assert r["turns_sent"] == 9 and r["completed"] == 9
                if r["prefix_caching"]:
                    assert r["hit_rate"] == pytest.approx(r["reusable_share"], abs=0.05) and r["reusable_share"] > 0.3
        assert "per turn" in stdout
    if name == "kv_memory":
        for r in rows:
            if r["status"] == "ok" and r["engine"] == "reference":
                assert r["kv_bytes_per_token"] == r["kv_est_bytes_per_token"], r["kv_dtype"]
        ok = [r for r in rows if r["status"] == "ok"]
        assert len({r["tokens_stored"] for r in ok}) == 1  # every variant holds the same sequences
        waste = {(r["kv_layout"], r["point"]["block_size"]): r["kv_waste_frac"] for r in ok
                 if r["engine"] == "reference" and r["kv_dtype"] == "fp32"}
        assert waste[("paged", 16)] < waste[("paged", 32)] < waste[("paged", 128)]  # bigger blocks, more waste
        assert waste[("contiguous", 16)] > waste[("paged", 16)]
    assert ok


@pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (no .venv-vllm, no $INFER_BENCH_VLLM_PYTHON)")
def test_kv_memory_reads_vllms_cache_while_its_sequences_are_live(tmp_path, tiny_ckpt):
    # vLLM frees a sequence with its last token: the point used to read its cache after the last
    # one, and got 0 tokens stored in 0 slots (waste "-")
    cmd = [sys.executable, "-m", "harness.cli", "engines=[vllm]", "model=local", f"model.path={tiny_ckpt}",
           "workload=kv_memory", *CASES["kv_memory"], "workload.kv_dtypes=[auto]", "workload.block_sizes=[32]",
           "workload.layouts=[paged]", "quiet=true", "parity=false", f"hydra.run.dir={tmp_path}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (row,) = read_rows(tmp_path / "results.jsonl")
    assert row["status"] == "ok", row.get("error")
    assert row["tokens_stored"] == row["tokens_expected"] > 0
    # whole blocks of 32 per sequence, the last one partly empty
    slots = sum(-(-(n + row["output_len"] - 1) // 32) * 32 for n in row["prompt_lens"])
    assert row["slots_allocated"] == slots and row["kv_waste_frac"] == pytest.approx(1 - row["tokens_stored"] / slots)


@pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (no .venv-vllm, no $INFER_BENCH_VLLM_PYTHON)")
def test_conversation_reads_vllms_cached_tokens_per_request(tmp_path, tiny_ckpt):
    """vLLM in-process: each turn's cached tokens (RequestOutput.num_cached_tokens) give a hit rate
    equal to the reusable share in vLLM's blocks with caching on, and 0 with it off."""
    cmd = [sys.executable, "-m", "harness.cli", "engines=[vllm]", "model=local", f"model.path={tiny_ckpt}",
           "workload=conversation", "workload.sessions=3", "workload.turns=3", "workload.user_tokens=40",
           "workload.output_tokens=3", "engine_options.vllm.block_size=32", "quiet=true", "parity=false",
           f"hydra.run.dir={tmp_path}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["prefix_caching"]: row for row in read_rows(tmp_path / "results.jsonl")}
    on, off = rows[True], rows[False]
    assert on["block_size"] == 32 and on["reusable_share"] > 0.3
    for t in on["turns"]:
        assert t["hit_rate"] == pytest.approx(t["reusable_share"], abs=0.05), t
    assert off["hit_rate"] == 0
