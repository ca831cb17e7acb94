"""vLLM (in-process, its own interpreter) on each tiny family: its KV cache groups, read through the
adapter's introspection, equal the estimator per layer group - bytes per token, the blocks each
group holds (a sliding window's freed blocks, a hybrid's enlarged attention blocks), a latent's
576 bytes per layer, a linear layer's state - for the same lengths. One engine start per family."""

from __future__ import annotations

import importlib.util

import pytest

from adapters.base import ModelSpec

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not in this environment: make test runs these under vLLM's own (.venv-vllm/bin/python -m pytest)"),
]

FAMILIES = ("tiny-gemma3", "tiny-gpt-oss", "tiny-deepseek-v3", "tiny-qwen3-next", "tiny-qwen3-moe")
PROMPTS = [[10 + i for i in range(100)], [500 + i for i in range(40)]]
STEPS = 5


@pytest.mark.parametrize("name", FAMILIES)
def test_vllm_kv_groups_equal_the_estimate(family_ckpts, name):
    from adapters.vllm.engine import VLLMEngine
    from harness.core.presets import load_preset
    from workloads.kv_memory import group_comparison

    shape = load_preset(name)
    e = VLLMEngine()
    opts = VLLMEngine.options_for({"block_size": 32, "prefix_caching": False})
    opts["cpu_kvcache_space_gib"] = 1
    e.load(ModelSpec(path=str(family_ckpts[name]), name=name, dtype="bfloat16", max_model_len=512, threads=2), opts)
    try:
        e.prefill(PROMPTS, max_new_tokens=STEPS + 2)
        dec = e.decode(STEPS)
        assert [s.num_tokens for s in dec.steps] == [2] * STEPS
        info = e.kv_cache_info()
        lens = [len(p) + STEPS for p in PROMPTS]
        assert sorted(info.extra["computed_tokens"].values()) == sorted(lens)
        rows = group_comparison(shape, info.kv_dtype, "bfloat16", info, lens)
    finally:
        e.close()
    assert sum(r["engine_layers"] for r in rows) == shape.num_hidden_layers
    for r in rows:
        assert r["match"] is True, r
    kinds = {r["kind"] for r in rows}
    assert kinds == set(shape.layer_kinds())
    if name == "tiny-deepseek-v3":  # one latent of 512 + 64 per token and layer, no K/V doubling
        assert rows[0]["engine_bytes_per_token"] == 4 * (512 + 64) * 2
    if name == "tiny-gemma3":  # 105 tokens, window 64, blocks of 32: the first block is freed
        sliding = next(r for r in rows if r["kind"] == "sliding")
        assert sliding["engine_blocks"] == (4 - 1) + 2
