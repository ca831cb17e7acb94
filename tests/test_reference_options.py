"""Options of the reference engine, and bad input: each a clear message naming the field."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml

from adapters import engine_names
from adapters.base import ModelSpec
from adapters.reference import kv_cache
from adapters.reference.config import EngineConfig
from adapters.reference.engine import ReferenceEngine
from harness.core.kvcalc import bytes_per_token
from harness.core.presets import load_preset

REPO = Path(__file__).resolve().parent.parent


def spec_for(path, max_model_len=128, name="tiny", device="cpu") -> ModelSpec:
    return ModelSpec(path=str(path), name=name, dtype="float32", device=device, max_model_len=max_model_len)


def test_registered_first():
    assert engine_names()[:2] == ["reference", "hf"]


def test_yaml_lists_every_option_with_its_default():
    with open(REPO / "conf" / "engine" / "reference.yaml") as f:
        assert yaml.safe_load(f) == asdict(EngineConfig())


def test_defaults_and_overrides_parse():
    cfg, problems = ReferenceEngine.typed_options({})
    assert not problems and cfg == EngineConfig()
    cfg, problems = ReferenceEngine.typed_options({"block_size": 32, "kv_cache": True, "kv_layout": "contiguous",
                                   "kv_dtype": "int8", "prefix_caching": False, "kv_cache_bytes": 1e9,
                                   "max_num_seqs": 8, "num_threads": None})
    assert not problems
    assert (cfg.block_size, cfg.kv_cache, cfg.kv_cache_bytes, cfg.max_num_seqs) == (32, "on", 10**9, 8)
    assert cfg.contiguous and not cfg.use_prefix_cache


@pytest.mark.parametrize("options,field", [
    ({"block_size": 0}, "block_size"),
    ({"block_size": -16}, "block_size"),
    ({"block_size": "big"}, "block_size"),
    ({"block_size": 8192}, "block_size"),
    ({"kv_cache": "maybe"}, "kv_cache"),
    ({"kv_layout": "ring"}, "kv_layout"),
    ({"kv_dtype": "fp4"}, "kv_dtype"),
    ({"kv_cache": "none", "kv_dtype": "int8"}, "kv_dtype"),
    ({"prefix_caching": "yes"}, "prefix_caching"),
    ({"kv_cache_bytes": -1}, "kv_cache_bytes"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"kernels": "fast"}, "kernels"),
    ({"cuda_graphs": "yes"}, "cuda_graphs"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": 2.5}, "max_num_batched_tokens"),
    ({"blocksize": 16}, "blocksize"),
])
def test_bad_options_are_named(options, field, tiny_ckpt):
    problems = ReferenceEngine.check_options(options, spec_for(tiny_ckpt))
    assert problems and all(p.startswith("engine_options.reference.") for p in problems)
    assert any(f"engine_options.reference.{field}" in p for p in problems), problems
    with pytest.raises(ValueError, match=f"engine_options.reference.{field}"):
        ReferenceEngine().load(spec_for(tiny_ckpt), options)


def test_budget_too_small_for_one_sequence(tiny_ckpt):
    need = 128 * bytes_per_token(load_preset("tiny"), "fp32")
    options = {"kv_cache_bytes": need - 1}
    problems = ReferenceEngine.check_options(options, spec_for(tiny_ckpt))
    assert len(problems) == 1 and "kv_cache_bytes" in problems[0] and f">= {need}" in problems[0]
    # a preset not materialised yet: the shape comes from the preset itself
    assert ReferenceEngine.check_options(options, spec_for("", name="tiny")) == problems
    with pytest.raises(ValueError, match="max_model_len=128"):
        ReferenceEngine().load(spec_for(tiny_ckpt), options)
    engine = ReferenceEngine()
    engine.load(spec_for(tiny_ckpt), {"kv_cache_bytes": need})  # exactly one sequence fits
    assert engine.kv_cache_info().num_blocks == 128 // 16
    engine.close()
    assert not ReferenceEngine.check_options({"kv_cache_bytes": 1, "kv_cache": "none"}, spec_for(tiny_ckpt))


def test_unsupported_kv_dtype_for_the_device(tiny_ckpt, monkeypatch):
    monkeypatch.setattr(kv_cache, "check_kv_dtype", lambda d, dev: "no fp8 here" if d == "fp8" else None)
    monkeypatch.setattr("adapters.reference.engine.check_kv_dtype", kv_cache.check_kv_dtype)
    monkeypatch.setattr("adapters.reference.llm_engine.check_kv_dtype", kv_cache.check_kv_dtype)
    problems = ReferenceEngine.check_options({"kv_dtype": "fp8"}, spec_for(tiny_ckpt))
    assert problems == ["engine_options.reference.kv_dtype=fp8: no fp8 here. Use kv_dtype=int8 or auto."]
    with pytest.raises(ValueError, match="kv_dtype=fp8: no fp8 here"):
        ReferenceEngine().load(spec_for(tiny_ckpt), {"kv_dtype": "fp8"})


def test_fp8_needs_a_recent_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    why = kv_cache.check_kv_dtype("fp8", torch.device("cuda"))
    assert why and "8.0" in why and "8.9" in why
    assert kv_cache.check_kv_dtype("fp8", torch.device("cpu")) is None
    assert kv_cache.check_kv_dtype("int8", torch.device("cuda")) is None


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["GPTNeoXForCausalLM"]}, "architecture GPTNeoXForCausalLM is not supported"),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64,
      "layer_types": ["chunked_attention", "full_attention"]}, "validate_layer_type"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}}, "rope_type dynamic"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
])
def test_unsupported_checkpoint(tiny_ckpt, tmp_path, change, message):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | change))
    with pytest.raises(ValueError, match=message):
        ReferenceEngine().load(spec_for(ckpt), {})


@pytest.mark.parametrize("arch,extra", [
    ("qwen2", {"tie_word_embeddings": True}),  # q/k/v biases, tied embeddings
    ("llama", {"attention_bias": True}),  # q/k/v and o biases
])
def test_biases_and_tied_embeddings_match_transformers(tmp_path, arch, extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    from adapters.hf import HFEngine

    config = AutoConfig.for_model(arch, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                  max_position_embeddings=256, rope_theta=50000.0, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.normal_(p, std=0.5)  # transformers starts biases at zero: make them matter
    model.save_pretrained(tmp_path)
    spec = spec_for(tmp_path, max_model_len=64, name=f"{arch}-toy")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    hf, ref = HFEngine(), ReferenceEngine()
    hf.load(spec, {}), ref.load(spec, {"block_size": 4})
    a, b = hf.prefill(prompts, return_logits=True), ref.prefill(prompts, return_logits=True)
    da, db = hf.decode(8, return_logits=True), ref.decode(8, return_logits=True)
    layer = ref.model.layers[0]
    assert layer.qkv.bias is not None and (layer.o.bias is not None) == (arch == "llama")
    assert ref.model.tied == (arch == "qwen2")
    for x, y in zip([a.logits] + da.logits, [b.logits] + db.logits):
        assert ((x - y).abs().max() / x.abs().max()).item() < 1e-4
    assert da.tokens == db.tokens
    hf.close(), ref.close()


def test_bad_prompts(tiny_ckpt):
    engine = ReferenceEngine()
    engine.load(spec_for(tiny_ckpt), {})
    with pytest.raises(ValueError, match="empty prompt"):
        engine.prefill([[1, 2], []])
    with pytest.raises(ValueError, match="positions"):
        engine.prefill([[5] * 5000])
    with pytest.raises(RuntimeError, match="before prefill"):
        engine.decode(1)
    engine.close()


@pytest.mark.slow
def test_cli_rejects_bad_option_with_nonzero_exit(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "harness.cli", "engines=[reference]", "model=tiny",
         "engine_options.reference.block_size=0", f"hydra.run.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "engine_options.reference.block_size" in out.stdout + out.stderr


@pytest.mark.slow
def test_harness_runs_reference_engine_end_to_end(tmp_path):
    """The whole path: CLI -> spawned engine process -> sweep points -> results.jsonl."""
    out = subprocess.run(
        [sys.executable, "-m", "harness.cli", "engines=[reference]", "model=tiny",
         "workload.batch_sizes=[1,3]", "workload.prompt_lens=[16]", "workload.output_len=4",
         "workload.min_repeats=1", "workload.min_duration_s=0", "engine_options.reference.block_size=8",
         f"hydra.run.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    sweep = [r for r in rows if r["workload"] == "sweep"]
    assert len(sweep) == 2 and all(r["status"] == "ok" and r["engine"] == "reference" for r in sweep)
    for r in sweep:
        info = r["kv_info"]
        assert info["block_size"] == 8 and info["bytes_per_token"] == r["kv_est_bytes_per_token"]
        assert info["tokens_stored"] == r["batch_size"] * (16 + 4 - 1)


def test_the_calibration_handicap_spins_its_fraction_of_every_step(tiny_ckpt, monkeypatch):
    """step_delay_frac makes every step busy-wait that share of its own CPU time on a CPU (the
    waits recorded, not timed: the ratio of what each step asked for to the CPU time the step
    took before it), whatever wall time the step took (other work on the core)."""
    from adapters.base import ModelSpec
    from adapters.reference import llm_engine as engine_mod
    asked: list[tuple[float, object]] = []
    cpu = iter(range(10**6))
    wall = iter(range(0, 10**8, 7))
    monkeypatch.setattr(engine_mod, "_spin", lambda s, clock=None: asked.append((s, clock)))
    monkeypatch.setattr(engine_mod.time, "thread_time", lambda: float(next(cpu)))  # every read: +1 s of CPU
    monkeypatch.setattr(engine_mod.time, "perf_counter", lambda: float(next(wall)))  # +7 s of wall: preempted
    e = ReferenceEngine()
    e.load(ModelSpec(path=str(tiny_ckpt), name="tiny", max_model_len=128, threads=1), {"step_delay_frac": 0.5})
    asked.clear()
    e.prefill([[5, 6, 7, 8] * 8] * 4)
    e.decode(3)
    e.close()
    # one per step: 0.5 x the 1 s of CPU the fake clock saw, spun on the CPU clock
    assert len(asked) == 4 and all(a == 0.5 and c is engine_mod.time.thread_time for a, c in asked)
    _, problems = ReferenceEngine.typed_options({"step_delay_frac": -1})
    assert problems and "step_delay_frac" in problems[0]
