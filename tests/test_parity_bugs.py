"""Parity fails an engine with a realistic bug and passes an honest one, in bfloat16 and float16,
on the random presets. The broken engines are real engines given a realistic fault, each named as such:
- a RoPE theta off by 1 % (the checkpoint's config says 1.01 x rope_theta: the engine rotates by
  the wrong angles, an error that grows with the position);
- a missing bias (a model with attention biases, loaded with the biases dropped);
- a KV block read from the wrong offset (the reference engine with its block table shifted).
The baseline is the honest reference engine; transformers is the honest second engine."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapters.base import ModelSpec
from adapters.hf import HFEngine
from adapters.reference.engine import ReferenceEngine
from harness.checkpoint import ensure_checkpoint
from harness.core.parity import compare_scores, verdict
from harness.core.presets import load_preset
from workloads.parity import PROMPT_LENS, greedy_tokens
from workloads.prompts import synthetic_prompts

from plugins.broken_engines import ShiftedBlockReads

pytestmark = pytest.mark.slow


def copy_with(ckpt: Path, dest: Path, config=None, tensors=None) -> Path:
    shutil.copytree(ckpt, dest)
    if config:
        cfg = json.loads((dest / "config.json").read_text())
        config(cfg)
        (dest / "config.json").write_text(json.dumps(cfg))
    if tensors:
        t = load_file(str(dest / "model.safetensors"))
        tensors(t)
        save_file(t, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def rope_theta_off_by_1_percent(cfg: dict) -> None:
    cfg["rope_theta"] = cfg.get("rope_theta", 10000.0) * 1.01
    if isinstance(cfg.get("rope_parameters"), dict):
        cfg["rope_parameters"]["rope_theta"] = cfg["rope_theta"]


def biases_dropped(t: dict) -> None:
    for k in t:
        if k.endswith(".bias"):
            t[k] = torch.zeros_like(t[k])


def parity(engine_cls, path: Path, dtype: str, prompts, teacher=None):
    e = engine_cls()
    e.load(ModelSpec(path=str(path), name="m", dtype=dtype, max_model_len=max(map(len, prompts)) + 40, threads=2), {})
    try:
        greedy = greedy_tokens(e, prompts, 32)
        t = teacher or greedy
        scores = e.score([p + x for p, x in zip(prompts, t)], [len(p) for p in prompts], 8)
    finally:
        e.close()
    return greedy, [{"top_ids": s.top_ids, "top_logprobs": s.top_logprobs, "target_logprobs": s.target_logprobs}
                    for s in scores]


@pytest.fixture(scope="session")
def reference_baseline():
    """parity(ReferenceEngine, path, dtype, prompts) - the honest baseline several tests compare
    against - run once per checkpoint, dtype and prompts in a session and shared (the reference
    engine gives the same tokens and scores for the same inputs)."""
    done: dict = {}

    def get(path: Path, dtype: str, prompts):
        key = (str(path), dtype, json.dumps(prompts))
        if key not in done:
            done[key] = parity(ReferenceEngine, path, dtype, prompts)
        return done[key]
    return get


def check(base, scores, dtype):
    fields = compare_scores(base, scores, dtype)
    return fields, verdict(fields, dtype)[1]


@pytest.fixture(scope="module")
def small(model_cache):
    return ensure_checkpoint(load_preset("small"), model_cache)


@pytest.fixture(scope="module")
def tiny_with_bias(model_cache):
    return ensure_checkpoint(dataclasses.replace(load_preset("tiny"), name="tiny-bias", attention_bias=True), model_cache)


def prompts_for(shape_vocab: int):
    return [synthetic_prompts(1, n, 0, shape_vocab, (0, 1, 2), 0, f"parity/{i}")[0]
            for i, n in enumerate(PROMPT_LENS)]


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.heavy)])  # CI: bf16
def test_rope_theta_off_by_1_percent_fails_and_transformers_passes(small, tmp_path, dtype, reference_baseline):
    prompts = prompts_for(load_preset("small").vocab_size)
    broken = copy_with(small, tmp_path / "rope", config=rope_theta_off_by_1_percent)
    greedy, base = reference_baseline(small, dtype, prompts)
    _, honest = parity(HFEngine, small, dtype, prompts, teacher=greedy)
    fields, why = check(base, honest, dtype)
    assert why is None, (dtype, fields)
    _, bad = parity(ReferenceEngine, broken, dtype, prompts, teacher=greedy)
    fields, why = check(base, bad, dtype)
    assert why is not None, (dtype, fields)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_missing_bias_fails(tiny_with_bias, tmp_path, dtype):
    prompts = prompts_for(load_preset("tiny").vocab_size)
    broken = copy_with(tiny_with_bias, tmp_path / "nobias", tensors=biases_dropped)
    greedy, base = parity(ReferenceEngine, tiny_with_bias, dtype, prompts)
    _, honest = parity(HFEngine, tiny_with_bias, dtype, prompts, teacher=greedy)
    assert check(base, honest, dtype)[1] is None
    _, bad = parity(HFEngine, broken, dtype, prompts, teacher=greedy)
    fields, why = check(base, bad, dtype)
    assert why is not None and fields["parity_top1_agreement"] < 0.5, fields


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.heavy)])  # CI: bf16
def test_a_kv_block_read_from_the_wrong_offset_fails(small, dtype, reference_baseline):
    prompts = prompts_for(load_preset("small").vocab_size)
    chunked = {"max_num_batched_tokens": 64}  # later chunks read their context back from the pool
    greedy, base = reference_baseline(small, dtype, prompts)
    honest_engine = type("ChunkedReference", (ReferenceEngine,), {"load": lambda self, m, o: ReferenceEngine.load(
        self, m, {**o, **chunked})})
    _, honest = parity(honest_engine, small, dtype, prompts, teacher=greedy)
    assert check(base, honest, dtype)[1] is None  # chunked and whole prefill agree
    broken_engine = type("ChunkedShifted", (ShiftedBlockReads,), {"load": lambda self, m, o: ShiftedBlockReads.load(
        self, m, {**o, **chunked})})
    _, bad = parity(broken_engine, small, dtype, prompts, teacher=greedy)
    fields, why = check(base, bad, dtype)
    assert why is not None, fields
