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
    fault exactly when vLLM's teacher-forced log-probabilities differ from transformers'; with a
    fault the default load refuses the model with the probe's line. In float32, or, where the
    latent-attention backend vLLM picks on this CPU takes no float32 (AMX_MLA: bfloat16 only), in
    bfloat16 against transformers in bfloat16, with parity's bf16 bound."""
    import torch
    from transformers import AutoModelForCausalLM

    from adapters.base import EngineUnavailable, PointUnsupported
    from adapters.vllm.engine import VLLMEngine
    from harness.core.parity import THRESHOLDS

    path = family_ckpts["tiny-deepseek-v3"]
    seq = [(7 * i + 11) % 4000 + 4 for i in range(48)]
    options = dict(VLLMEngine.options_for({"prefix_caching": False}), run_despite_faults=True)
    dtype, bound = "float32", 1e-2
    e = VLLMEngine()
    try:
        info = e.load(ModelSpec(path=str(path), name="tiny-deepseek-v3", dtype=dtype, max_model_len=256, threads=2),
                      options)
    except PointUnsupported as refused:  # this CPU's latent-attention kernel takes no float32
        assert "dtype=bfloat16" in str(refused), refused
        dtype, bound = "bfloat16", THRESHOLDS["bfloat16"][0]
        e = VLLMEngine()
        info = e.load(ModelSpec(path=str(path), name="tiny-deepseek-v3", dtype=dtype, max_model_len=256, threads=2),
                      options)
    spec = ModelSpec(path=str(path), name="tiny-deepseek-v3", dtype=dtype, max_model_len=256, threads=2)
    try:
        got = e.score([seq], [1], top_k=1)[0].target_logprobs
    finally:
        e.close()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    with torch.no_grad():
        lp = hf(torch.tensor([seq])).logits[0].float().log_softmax(-1)
    want = [float(lp[p - 1, seq[p]]) for p in range(1, len(seq))]
    err = max(abs(a - b) for a, b in zip(got, want))
    faults = info.details["output_faults"]
    print(f"{dtype}: max |delta log p| {err:.3g} against transformers; probe: {faults}")
    assert bool(faults) == (err > bound), (dtype, faults, err)
    if faults:
        with pytest.raises(EngineUnavailable, match="computes this model wrongly.*latent attention"):
            VLLMEngine().load(spec, VLLMEngine.options_for({"prefix_caching": False}))


def test_a_dtype_the_picked_kernel_refuses_is_a_skipped_point_with_the_reason(family_ckpts, monkeypatch):
    """vLLM-CPU takes its AMX latent-attention backend wherever torch reports AMX tiles, and that
    backend takes only bfloat16 (it raised in the middle of a float32 load). With AMX reported
    present (real on a Xeon with AMX, simulated elsewhere at the adapter's boundary: torch's probe,
    which vLLM's selection reads), a float32 load of a latent-attention model is refused before vLLM
    builds anything, with vLLM's own reason and the dtype to ask for; bfloat16 passes the check."""
    import torch

    from adapters.base import PointUnsupported
    from adapters.vllm import introspect
    from adapters.vllm.engine import VLLMEngine
    from adapters.vllm.options import engine_kwargs

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    path = family_ckpts["tiny-deepseek-v3"]
    spec = ModelSpec(path=str(path), name="tiny-deepseek-v3", dtype="float32", max_model_len=256, threads=2)
    with pytest.raises(PointUnsupported) as refused:
        VLLMEngine().load(spec, VLLMEngine.options_for({"prefix_caching": False}))
    why = str(refused.value)
    assert "AMX_MLA" in why and "takes only bfloat16" in why and "dtype=bfloat16" in why, why
    bf16 = ModelSpec(path=str(path), name="tiny-deepseek-v3", dtype="bfloat16", max_model_len=256, threads=2)
    assert introspect.cpu_kernel_refusal(engine_kwargs(bf16, VLLMEngine.options_for({}))) is None
