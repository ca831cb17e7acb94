"""llama.cpp in-process (engines=[llamacpp]) against the reference engine, and our GGUF files in llama.cpp
itself: parity in float32, a q/k permutation bug caught, every preset converted and run or refused with
its reason, batches by sequence id, serve(), the tokenizer encodings, the KV cache's size against the
estimator. Needs llama.cpp's environment (`make llamacpp`); skipped, saying so, without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.llamacpp import convert
from harness.checkpoint import SHIPPED_DIR, write_checkpoint
from harness.core.kvcalc import bytes_per_token
from harness.core.presets import ModelShape, load_preset
from harness.core.results import read_rows
from tests_support import LLAMACPP_MISSING, llamacpp_probe, llamacpp_python

pytestmark = pytest.mark.skipif(llamacpp_python() is None, reason=LLAMACPP_MISSING)

TRAINED = SHIPPED_DIR / "tiny-trained"


def cli(args: list[str], cache: Path, run_dir: Path, timeout: float = 900) -> tuple[subprocess.CompletedProcess, list]:
    env = {**os.environ, "INFER_BENCH_CACHE": str(cache)}
    r = subprocess.run([sys.executable, "-m", "harness.cli", "quiet=true", "roofline=false", f"hydra.run.dir={run_dir}",
                        *args], capture_output=True, text=True, env=env, timeout=timeout)
    rows = read_rows(run_dir / "results.jsonl") if (run_dir / "results.jsonl").exists() else []
    return r, rows


@pytest.fixture(scope="module")
def cache(model_cache):
    return model_cache.parent


def parity_row(rows: list, engine: str = "llamacpp") -> dict:
    found = [r for r in rows if r["engine"] == engine and r["workload"] == "parity"]
    assert found, [(r["engine"], r["workload"], r["status"], r.get("error")) for r in rows]
    return found[0]


def test_fp32_logits_and_greedy_tokens_agree_with_the_reference_engine(tmp_path, cache):
    """tiny-trained, f32 GGUF, f32 KV: teacher-forced log-probabilities within the float32 thresholds of
    the trained set, and the greedy tokens equal (parity's verdict fails on any greedy difference in fp32)."""
    r, rows = cli(["engines=[reference,llamacpp]", "model=tiny-trained", "workload=parity", "dtype=float32"], cache,
                  tmp_path / "run")
    row = parity_row(rows)
    print({k: row.get(k) for k in ("status", "parity_max_abs_err", "parity_mean_kl", "parity_top1_agreement",
                                   "parity_greedy_agreement", "parity_thresholds", "error")})
    assert row["status"] == "ok", (row.get("error"), r.stderr[-2000:])
    assert row["parity_max_abs_err"] < 1e-3
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_gguf_without_the_qk_permutation_fails_parity(tmp_path, cache):
    """The same checkpoint written with Hugging Face's q/k row order (the permutation left out): llama.cpp
    loads it and runs, and parity fails it."""
    bad = tmp_path / "unpermuted.gguf"
    rec = convert.write_gguf(TRAINED, bad, "f32", permute=False)
    assert rec["qk_permuted"] is False
    r, rows = cli(["engines=[reference,llamacpp]", "model=tiny-trained", "workload=parity", "dtype=float32",
                   f"engine_options.llamacpp.gguf={bad}"], cache, tmp_path / "run")
    row = parity_row(rows)
    print({k: row.get(k) for k in ("status", "parity_max_abs_err", "parity_mean_kl", "error")})
    assert row["status"] == "failed" and row["parity_max_abs_err"] > 0.1, row.get("error")
    assert r.returncode == 1


def tiny_qwen2(root: Path) -> Path:
    """A tiny Qwen2 (attention biases, rotate-half RoPE in llama.cpp too: no permutation), random weights."""
    shape = ModelShape(**{**load_preset("tiny").to_dict(), "name": "tiny-qwen2", "architecture": "qwen2",
                          "attention_bias": True})
    return write_checkpoint(shape, root / "tiny-qwen2")


CONVERTED = ["tiny", "tiny-qwen3", "tiny-trained-target"]
REFUSED = ["tiny-mixtral", "tiny-gemma3", "tiny-gpt-oss", "tiny-deepseek-v3", "tiny-qwen3-next", "tiny-qwen3-moe"]


@pytest.mark.parametrize("model", ["tiny", "qwen2"] + [pytest.param(m, marks=pytest.mark.heavy) for m in CONVERTED[1:]])
def test_presets_convert_and_pass_parity(tmp_path, cache, model):
    """Each preset of a family the converter writes, and a tiny Qwen2, in float32 against the reference
    engine. tiny-trained-target on prompts of 128 and 512 tokens: on its 2048-token parity prompt llama.cpp's
    float32 log-probabilities drift past the trained set's 1e-3 (docs/engines/llamacpp.md, a finding)."""
    args = [f"model={model}"] if model != "qwen2" else ["model=local", f"model.path={tiny_qwen2(tmp_path)}"]
    if model == "tiny-trained-target":
        args.append("workload.prompt_lens=[128,512]")
    r, rows = cli(["engines=[reference,llamacpp]", "workload=parity", "dtype=float32", *args], cache, tmp_path / "run")
    row = parity_row(rows)
    print(model, {k: row.get(k) for k in ("status", "parity_max_abs_err", "parity_mean_kl", "error")})
    assert row["status"] == "ok", (row.get("error"), r.stderr[-2000:])


@pytest.mark.heavy  # CI time (150 s): the presets' test and the q/k bug run in CI
def test_families_the_converter_lacks_are_unavailable_with_the_reason(tmp_path, cache):
    for model in REFUSED:
        r, rows = cli(["engines=[hf,llamacpp]", f"model={model}", "workload=parity", "parity_tokens=2",
                       "workload.prompt_lens=[8]", "workload.tokens=2"], cache, tmp_path / model)
        found = [x for x in rows if x["engine"] == "llamacpp"]
        assert found, (model, r.returncode, r.stderr[-1500:])
        row = found[0]
        assert row["status"] == "unavailable", row
        assert "GGUF converter" in row["error"] and "lacks" in row["error"], row["error"]


def test_batches_by_sequence_id_and_serve_give_each_prompt_its_own_tokens():
    """Three prompts of different lengths decoded together give each the tokens it gets alone; serve()
    (all due at once, continuous batching by sequence id) gives the same."""
    held = list(range(10, 60))
    prompts = [held[:7], held[5:40], held[20:31]]
    ops = [{"op": "generate", "prompts": prompts, "steps": 6}]
    ops += [{"op": "generate", "prompts": [p], "steps": 6} for p in prompts]
    ops += [{"op": "serve", "prompts": prompts, "max_new_tokens": 7}]
    out = llamacpp_probe({"model": str(TRAINED), "ops": ops, "max_batch_size": 3})
    assert "error" not in out, out.get("error")
    together, *alone, served = out["results"]
    assert together["tokens"] == [a["tokens"][0] for a in alone]
    assert served == together["tokens"]
    assert len(together["steps_s"]) == 6 and all(s > 0 for s in together["steps_s"])
    assert out["load"]["details"]["gguf"]["tokenizer"].startswith("byte-level BPE")


def test_the_tokenizers_as_llama_cpp_reads_them(tiny_ckpt):
    """tiny-trained's BPE: llama.cpp tokenizes held-out text to the ids transformers gives and adds no BOS
    (the checkpoint does not); a WordLevel preset's words tokenize to their ids and detokenize to the words."""
    from tokenizers import Tokenizer
    text = "def parse(self, value):\n    return {'key': value.strip()}  # 42 items\n"
    want = Tokenizer.from_file(str(TRAINED / "tokenizer.json")).encode(text).ids
    out = llamacpp_probe({"model": str(TRAINED), "ops": [
        {"op": "tokenize", "text": text, "add_special": True}, {"op": "detokenize", "ids": want}]})
    assert "error" not in out, out.get("error")
    ids, back = out["results"]
    assert ids == want and back == text
    out = llamacpp_probe({"model": str(tiny_ckpt), "ops": [
        {"op": "tokenize", "text": "w5 w17 w4095", "add_special": False}, {"op": "detokenize", "ids": [5, 17, 4095]}]})
    assert "error" not in out, out.get("error")
    ids, back = out["results"]
    assert ids == [5, 17, 4095] and back.split() == ["w5", "w17", "w4095"]


@pytest.mark.parametrize("kv", ["q8_0", "q4_0", "f16"])
def test_kv_cache_size_llama_cpp_reports_is_the_estimate(kv):
    """The bytes per cached token llama.cpp reports for its KV cache (its log line) against the
    estimator's block formats (q8_0: 34 bytes per 32 values, q4_0: 18): within 5 %."""
    out = llamacpp_probe({"model": str(TRAINED), "options": {"kv_cache_type": kv, "flash_attn": "on"},
                          "ops": [{"op": "kv"}], "max_model_len": 512, "max_batch_size": 2})
    assert "error" not in out, out.get("error")
    (info,) = out["results"]
    est = bytes_per_token(load_preset("tiny-trained"), {"f16": "fp16"}.get(kv, kv))
    print(kv, info["extra"]["llamacpp_kv"]["line"], "estimate", est, "B/token")
    assert info["kv_dtype"] == {"f16": "fp16"}.get(kv, kv)
    assert abs(info["bytes_per_token"] - est) <= 0.05 * est
