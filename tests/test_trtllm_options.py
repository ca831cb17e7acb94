"""The TensorRT-LLM adapter's own logic that needs no TensorRT-LLM: option checks, the mapping's
behaviour, the availability reasons, the YAML defaults. (The argument names are checked against
TensorRT-LLM's own definitions in tests/test_trtllm_gpu.py, where it is installed.)"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import yaml

import adapters.trtllm.engine as trt_engine
from adapters.base import ModelSpec
from adapters.trtllm.engine import TRTLLMEngine
from adapters.trtllm.options import (
    OPTIONS, TRTLLMOptions, end_id_of, kv_cache_config_kwargs, llm_kwargs, python_problem, sampling_kwargs,
    unavailable_text,
)

REPO = Path(__file__).resolve().parent.parent
GPU = ModelSpec(path="/m", name="tiny", dtype="bfloat16", device="cuda", max_model_len=2048)


def test_yaml_lists_every_option_with_the_adapter_default():
    conf = yaml.safe_load((REPO / "conf/engine/trtllm.yaml").read_text())
    assert conf == asdict(TRTLLMOptions())
    assert list(OPTIONS) == list(conf) == list(TRTLLMEngine.capabilities().options)


def test_nulls_leave_tensorrt_llms_defaults_in_place():
    kw = llm_kwargs(GPU, {})
    assert "max_batch_size" not in kw and "max_num_tokens" not in kw and "scheduler_config" not in kw
    assert "cuda_graph_config" not in kw  # TensorRT-LLM's default CUDA graphs stay on
    assert "max_tokens" not in kv_cache_config_kwargs({})
    assert kw["max_seq_len"] == GPU.max_model_len and kw["dtype"] == GPU.dtype
    assert kw["enable_iter_perf_stats"] is True  # the KV blocks and iteration latencies come from there


def test_user_options_reach_tensorrt_llm_under_its_names():
    opts = {"max_batch_size": 64, "max_num_tokens": 4096, "tensor_parallel_size": 2, "free_gpu_memory_fraction": 0.5,
            "kv_cache_max_tokens": 100000, "enable_block_reuse": False, "tokens_per_block": 64,
            "kv_cache_dtype": "fp8", "enable_chunked_prefill": True, "cuda_graphs": False,
            "disable_overlap_scheduler": True, "capacity_scheduler_policy": "MAX_UTILIZATION"}
    kw = llm_kwargs(GPU, opts)
    assert kw["max_batch_size"] == 64 and kw["max_num_tokens"] == 4096 and kw["tensor_parallel_size"] == 2
    assert kw["enable_chunked_prefill"] is True and kw["disable_overlap_scheduler"] is True
    assert "cuda_graph_config" in kw and kw["cuda_graph_config"] is None
    assert kw["scheduler_config"] == "MAX_UTILIZATION"
    kv = kw["kv_cache_config"]
    assert kv["free_gpu_memory_fraction"] == 0.5 and kv["enable_block_reuse"] is False
    assert kv["tokens_per_block"] == 64 and kv["dtype"] == "fp8" and kv["max_tokens"] == 100000


def test_sampling_is_greedy_forced_length_with_perf_metrics():
    kw = sampling_kwargs(17, 2)
    assert kw["max_tokens"] == 17 and kw["temperature"] == 0.0 and kw["ignore_eos"] is True
    assert kw["return_perf_metrics"] is True and kw["end_id"] == kw["pad_id"] == 2


def test_end_id_comes_from_the_checkpoint(tmp_path, tiny_ckpt):
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [7, 8]}))
    assert end_id_of(str(tmp_path)) == 7
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 5}))
    assert end_id_of(str(tmp_path)) == 5
    assert end_id_of(str(tmp_path / "missing")) == -1


def test_unavailable_reasons_say_which_and_how_to_fix():
    assert unavailable_text(True, 1, (3, 12)) is None
    missing = unavailable_text(False, 1, (3, 12))
    assert "not installed" in missing and "pypi.nvidia.com" in missing and "engine_options.trtllm.python" in missing
    assert "separate environment" in missing
    broken = unavailable_text(True, 1, (3, 12), "ImportError: libmpi.so.40: cannot open shared object file")
    assert "does not import" in broken and "libmpi.so.40" in broken and "pypi.nvidia.com" in broken
    no_gpu = unavailable_text(True, 0, (3, 12))
    assert no_gpu.startswith("no CUDA device") and "pypi.nvidia.com" not in no_gpu
    assert "no NVIDIA driver" in unavailable_text(True, None, (3, 12))


def test_python_versions_without_tensorrt_llm_wheels_are_named():
    assert python_problem((3, 10)) is None and python_problem((3, 12)) is None
    assert "3.11" in python_problem((3, 11)) and "3.10 or 3.12" in python_problem((3, 11))
    assert "Python 3.11" in unavailable_text(True, 1, (3, 11))


def test_the_import_probe_runs_only_after_the_cheap_checks(monkeypatch):
    calls = []
    monkeypatch.setattr(trt_engine, "import_probe", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(trt_engine, "cuda_device_count", lambda: None)
    assert "no CUDA device" in TRTLLMEngine.unavailable_reason() and calls == []


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
    assert any("capacity_scheduler_policy=FIFO" in p for p in _problems({"capacity_scheduler_policy": "FIFO"}))
    assert _problems({"capacity_scheduler_policy": "MAX_UTILIZATION"}) == []
    assert any("unknown option" in p for p in _problems({"block_size": 32}))
    cpu = ModelSpec(path="/m", name="tiny", dtype="bfloat16", device="cpu")
    assert any("NVIDIA GPUs" in p for p in _problems({}, cpu))


def test_capabilities():
    caps = TRTLLMEngine.capabilities({})
    assert caps.devices == ("cuda",) and "float32" not in caps.dtypes and caps.paged and caps.continuous_batching
    assert caps.prefix_caching and not TRTLLMEngine.capabilities({"enable_block_reuse": False}).prefix_caching
    assert "fp8" in caps.kv_dtypes and caps.scores


def test_importing_the_adapter_does_not_import_tensorrt_llm():
    import subprocess
    import sys
    code = "import sys, adapters.trtllm.engine; print('tensorrt_llm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_engine_clock_steps_need_every_iteration_and_one_token_per_iteration():
    from adapters.trtllm.timing import (
        admission_checked, admission_problem, decode_steps_from_iterations, iteration_mapping_holds,
    )
    # iterations 1 and 2 took 2 ms and 3 ms: two steps chained from the anchor
    steps = decode_steps_from_iterations({1: 2.0, 2: 3.0}, first_iter=0, k0=1, steps=2, anchor_ns=100, num_tokens=3)
    assert [(s.start_ns, s.end_ns, s.num_tokens) for s in steps] == [(100, 2_000_100, 3), (2_000_100, 5_000_100, 3)]
    assert decode_steps_from_iterations({1: 2.0}, 0, 1, 2, 100, 3) is None  # iteration 2 not reported
    assert iteration_mapping_holds(5, [(1, 5), (3, 7)])  # one token per iteration from iteration 5
    assert not iteration_mapping_holds(5, [(1, 5), (3, 8)])  # paused one iteration
    assert not iteration_mapping_holds(None, [(1, 5)])
    assert admission_problem([3, 3, 3], "") is None and admission_checked([3, 3, 3])
    assert admission_problem([3, None], "") is None and not admission_checked([3, None])  # unknown: not checked
    assert "3..4" in admission_problem([3, 4, 3], "hint")
