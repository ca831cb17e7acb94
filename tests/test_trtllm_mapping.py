"""The TensorRT-LLM adapter's own logic, without TensorRT-LLM: config -> LLM(...), KvCacheConfig(...)
and SamplingParams(...) arguments, option checks, the unavailable reasons, the YAML defaults."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from adapters.base import ModelSpec
from adapters.trtllm import (
    DEFAULTS, OPTIONS, TRTLLM_VERSION_WRITTEN_AGAINST, TRTLLMEngine, end_id_of, kv_cache_config_kwargs,
    llm_kwargs, sampling_kwargs, unavailable_text,
)

REPO = Path(__file__).resolve().parent.parent
GPU = ModelSpec(path="/m", name="tiny", dtype="bfloat16", device="cuda", max_model_len=2048)


def test_yaml_lists_every_option_with_the_adapter_default():
    assert yaml.safe_load((REPO / "conf/engine/trtllm.yaml").read_text()) == DEFAULTS
    assert set(OPTIONS) == set(DEFAULTS)
    assert TRTLLM_VERSION_WRITTEN_AGAINST.startswith("1.")


def test_default_llm_arguments():
    assert llm_kwargs(GPU, {}) == {
        "model": "/m", "skip_tokenizer_init": True, "dtype": "bfloat16", "tensor_parallel_size": 1,
        "max_seq_len": 2048, "enable_chunked_prefill": False, "disable_overlap_scheduler": False,
        "enable_iter_perf_stats": True,
        "kv_cache_config": {"free_gpu_memory_fraction": 0.9, "enable_block_reuse": True,
                            "tokens_per_block": 32, "dtype": "auto"},
    }


def test_every_option_reaches_tensorrt_llm():
    opts = {"max_batch_size": 64, "max_num_tokens": 4096, "tensor_parallel_size": 2,
            "free_gpu_memory_fraction": 0.5, "kv_cache_max_tokens": 100000, "enable_block_reuse": False,
            "tokens_per_block": 64, "kv_cache_dtype": "fp8", "enable_chunked_prefill": True,
            "cuda_graphs": False, "disable_overlap_scheduler": True}
    kw = llm_kwargs(GPU, opts)
    assert kw["max_batch_size"] == 64 and kw["max_num_tokens"] == 4096 and kw["tensor_parallel_size"] == 2
    assert kw["enable_chunked_prefill"] is True and kw["disable_overlap_scheduler"] is True
    assert "cuda_graph_config" in kw and kw["cuda_graph_config"] is None
    assert kw["kv_cache_config"] == kv_cache_config_kwargs(opts) == {
        "free_gpu_memory_fraction": 0.5, "enable_block_reuse": False, "tokens_per_block": 64,
        "dtype": "fp8", "max_tokens": 100000}
    assert "cuda_graph_config" not in llm_kwargs(GPU, {})  # TensorRT-LLM's default graphs stay on


def test_sampling_is_greedy_forced_length_token_ids_with_perf_metrics():
    assert sampling_kwargs(17, 2) == {"max_tokens": 17, "temperature": 0.0, "ignore_eos": True,
                                      "detokenize": False, "return_perf_metrics": True, "end_id": 2, "pad_id": 2}


def test_end_id_comes_from_the_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert end_id_of(str(tmp_path)) == 7
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert end_id_of(str(tmp_path)) == 2
    assert end_id_of(str(tmp_path / "missing")) == -1


def test_unavailable_reasons_say_which():
    assert unavailable_text(True, 1) is None
    missing = unavailable_text(False, 1)
    assert "not installed" in missing and "pip install '.[trtllm]'" in missing and "CUDA" not in missing.split(";")[0][:20]
    no_gpu = unavailable_text(True, 0)
    assert no_gpu.startswith("no CUDA device") and "not installed" not in no_gpu
    assert "no NVIDIA driver" in unavailable_text(True, None)
    both = unavailable_text(False, None)
    assert "not installed" in both and "no CUDA device" in both


def test_reason_here_is_not_none_without_gpu_or_package(monkeypatch):
    import adapters.trtllm as t
    monkeypatch.setattr(t, "_cuda_device_count", lambda: None)
    assert "no CUDA device" in TRTLLMEngine.unavailable_reason()


def test_standard_option_names_map_to_tensorrt_llms():
    assert TRTLLMEngine.options_for({"kv_dtype": "fp8", "prefix_caching": False, "block_size": 64}) == {
        "kv_cache_dtype": "fp8", "enable_block_reuse": False, "tokens_per_block": 64}


def _problems(opts, spec=GPU):
    return TRTLLMEngine.check_options(opts, spec)


def test_option_checks():
    assert _problems({}) == []
    assert any("tokens_per_block=48" in p and "power of two" in p for p in _problems({"tokens_per_block": 48}))
    assert any("kv_cache_dtype=int8" in p for p in _problems({"kv_cache_dtype": "int8"}))
    assert any("free_gpu_memory_fraction" in p for p in _problems({"free_gpu_memory_fraction": 0}))
    assert any("cuda_graphs" in p for p in _problems({"cuda_graphs": "no"}))
    assert any("max_batch_size" in p for p in _problems({"max_batch_size": -1}))
    assert any("unknown option" in p for p in _problems({"block_size": 32}))
    cpu = ModelSpec(path="/m", name="tiny", dtype="bfloat16", device="cpu")
    assert any("NVIDIA GPUs" in p for p in _problems({}, cpu))


def test_capabilities():
    caps = TRTLLMEngine.capabilities({})
    assert caps.devices == ("cuda",) and "float32" not in caps.dtypes and caps.paged and caps.continuous_batching
    assert caps.prefix_caching and not TRTLLMEngine.capabilities({"enable_block_reuse": False}).prefix_caching
    assert "fp8" in caps.kv_dtypes


def test_importing_the_adapter_does_not_import_tensorrt_llm():
    import sys
    assert "tensorrt_llm" not in sys.modules
