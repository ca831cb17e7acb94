"""TensorRT-LLM options: defaults, checks, and the mapping to `tensorrt_llm.LLM(...)`,
`KvCacheConfig(...)`, `SchedulerConfig(...)` and `SamplingParams(...)` arguments. Pure: nothing
here imports TensorRT-LLM (unit-tested without it).

Options (`engine_options.trtllm.<name>`; types, defaults and ranges in TRTLLMOptions below, from
which conf/engine/trtllm.yaml is generated):
  max_batch_size            most requests in flight (null: TensorRT-LLM's default)
  max_num_tokens            most tokens per iteration (null: TensorRT-LLM's default, 8192); a
                            prefill batch must fit in one iteration
  tensor_parallel_size      GPUs to shard over (default 1)
  free_gpu_memory_fraction  KvCacheConfig: share of free GPU memory for the KV cache (default 0.9)
  kv_cache_max_tokens       KvCacheConfig.max_tokens: cap on KV tokens (null: no cap)
  enable_block_reuse        KvCacheConfig: prefix reuse across requests (default true)
  tokens_per_block          KvCacheConfig: tokens per KV block, a power of two (default 32)
  kv_cache_dtype            KvCacheConfig.dtype: auto | fp8 (default auto = the model's dtype)
  enable_chunked_prefill    default false (TensorRT-LLM's default)
  cuda_graphs               default true (TensorRT-LLM's default CUDA-graph config); false: none
  disable_overlap_scheduler default false (TensorRT-LLM's default)
  capacity_scheduler_policy SchedulerConfig: null (TensorRT-LLM's default, GUARANTEED_NO_EVICT: a
                            request is admitted only when KV for its whole output bound is free)
                            | GUARANTEED_NO_EVICT | MAX_UTILIZATION | STATIC_BATCH
max_seq_len comes from the workload (ModelSpec.max_model_len); the dtype from the run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from adapters.base import ModelSpec, engine_options_or_raise, option_names, parse_engine_options
from harness.core.errors import UserError
from harness.core.presets import shape_from_hf_config
from harness.core.schema import spec

VERSION_CHECKED = "1.2.1"  # the LLM API this adapter was written against (docs/engines/trtllm.md)
PYTHONS = ((3, 10), (3, 12))  # the Python versions TensorRT-LLM 1.2.1's wheels are built for
KV_DTYPES = ("auto", "fp8")
SCHEDULER_POLICIES = ("GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH")


@dataclass
class TRTLLMOptions:
    """TensorRT-LLM through tensorrt_llm.LLM, PyTorch backend (adapters/trtllm/options.py documents
    each option; docs/engines/trtllm.md what was checked). null means "TensorRT-LLM's own default".
    max_seq_len comes from the workload; the dtype from the run (bfloat16 or float16)."""

    max_batch_size: int | None = spec(None, ge=1, tune=[4, 8, 16, 32, 64, 128, 256], help="most requests in flight")
    max_num_tokens: int | None = spec(None, ge=1, tune=[1024, 2048, 4096, 8192, 16384], help="most tokens per iteration (TensorRT-LLM's default: 8192)")
    tensor_parallel_size: int = spec(1, ge=1, help="GPUs to shard over")
    free_gpu_memory_fraction: float = spec(0.9, gt=0, le=1, help=(
        "KvCacheConfig: share of free GPU memory for the KV cache"))
    kv_cache_max_tokens: int | None = spec(None, ge=1, help="KvCacheConfig.max_tokens: cap on KV-cache tokens")
    enable_block_reuse: bool = spec(True, help="KvCacheConfig: prefix reuse across requests")
    tokens_per_block: int = spec(32, ge=2, tune=[16, 32, 64], help="KvCacheConfig: tokens per KV block (a power of two)")
    kv_cache_dtype: str = spec("auto", choices=KV_DTYPES, help="KvCacheConfig.dtype: auto (= model dtype) | fp8")
    enable_chunked_prefill: bool = spec(False, tune=[False, True], help="TensorRT-LLM's default")
    cuda_graphs: bool = spec(True, help="false: cuda_graph_config=None (no CUDA graphs)")
    disable_overlap_scheduler: bool = spec(False, help="TensorRT-LLM's default")
    capacity_scheduler_policy: str | None = spec(None, choices=SCHEDULER_POLICIES, help=(
        "null = TensorRT-LLM's (GUARANTEED_NO_EVICT: KV for a request's whole output bound before "
        "admission) | MAX_UTILIZATION | STATIC_BATCH"))


OPTIONS = option_names(TRTLLMOptions)
INSTALL_HINT = (f"TensorRT-LLM {VERSION_CHECKED} comes from NVIDIA's package index, not PyPI (PyPI's tensorrt-llm "
                "is a stub that downloads from it): in a separate environment with Python 3.10 or 3.12, "
                "CUDA and OpenMPI, run pip install --extra-index-url https://pypi.nvidia.com "
                f"'tensorrt-llm=={VERSION_CHECKED}' (it pins torch>=2.9.1,<=2.10.0a0, transformers==4.57.3, "
                "numpy<2 and needs mpi4py), then point the harness at that interpreter with "
                "engine_options.trtllm.python=PATH")


def typed(options: TRTLLMOptions | dict[str, Any] | None) -> TRTLLMOptions:
    """The options as a TRTLLMOptions (defaults filled in); ValueError naming each bad field."""
    return engine_options_or_raise(TRTLLMOptions, "trtllm", options)


def kv_cache_config_kwargs(options: TRTLLMOptions | dict[str, Any]) -> dict[str, Any]:
    """Fields of `tensorrt_llm.llmapi.KvCacheConfig(...)`."""
    o = typed(options)
    kw: dict[str, Any] = {
        "free_gpu_memory_fraction": float(o.free_gpu_memory_fraction),
        "enable_block_reuse": bool(o.enable_block_reuse),
        "tokens_per_block": int(o.tokens_per_block),
        "dtype": str(o.kv_cache_dtype),
    }
    if o.kv_cache_max_tokens is not None:
        kw["max_tokens"] = int(o.kv_cache_max_tokens)
    return kw


def llm_kwargs(model: ModelSpec, options: TRTLLMOptions | dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `tensorrt_llm.LLM(...)`, with `kv_cache_config` as the dict of its
    fields (load() turns it into a KvCacheConfig), `scheduler_config` as the policy's name (into a
    SchedulerConfig) only when one is set, and `cuda_graph_config` present only when CUDA graphs
    are turned off (then None)."""
    o = typed(options)
    kw: dict[str, Any] = {
        "model": model.path,
        "skip_tokenizer_init": True,
        "dtype": model.dtype,
        "tensor_parallel_size": int(o.tensor_parallel_size),
        "max_seq_len": int(model.max_model_len),
        "enable_chunked_prefill": bool(o.enable_chunked_prefill),
        "disable_overlap_scheduler": bool(o.disable_overlap_scheduler),
        "enable_iter_perf_stats": True,  # iteration stats: KV blocks, iteration latency
        "kv_cache_config": kv_cache_config_kwargs(o),
    }
    for k in ("max_batch_size", "max_num_tokens"):
        if getattr(o, k) is not None:
            kw[k] = int(getattr(o, k))
    if o.capacity_scheduler_policy is not None:
        kw["scheduler_config"] = str(o.capacity_scheduler_policy)
    if not o.cuda_graphs:
        kw["cuda_graph_config"] = None
    return kw


def sampling_kwargs(max_tokens: int, end_id: int) -> dict[str, Any]:
    """Keyword arguments of `tensorrt_llm.SamplingParams(...)`: greedy, forced length, token ids
    only, with the request's perf metrics. Without a tokenizer the LLM API needs an explicit
    end_id (ignore_eos makes it irrelevant to the length)."""
    return {"max_tokens": int(max_tokens), "temperature": 0.0, "ignore_eos": True, "detokenize": False,
            "return_perf_metrics": True, "end_id": int(end_id), "pad_id": int(end_id)}


def python_problem(version: tuple[int, int]) -> str | None:
    """TensorRT-LLM's wheels exist for some Python versions only."""
    if tuple(version[:2]) in PYTHONS:
        return None
    have = ".".join(map(str, version[:2]))
    want = " or ".join(".".join(map(str, v)) for v in PYTHONS)
    return f"Python {have} here; TensorRT-LLM {VERSION_CHECKED} is built for Python {want} only"


def unavailable_text(installed: bool, cuda_devices: int | None, python: tuple[int, int] | None = None,
                     import_error: str | None = None) -> str | None:
    """Why TensorRT-LLM cannot run here (None: it can). `cuda_devices` None: no NVIDIA driver.
    `import_error`: what importing it in a separate process said."""
    reasons = []
    if not installed:
        reasons.append("TensorRT-LLM is not installed")
    elif import_error:
        reasons.append(f"TensorRT-LLM is installed but does not import: {import_error}")
    py = python_problem(python) if python is not None else None
    if py:
        reasons.append(py)
    if not cuda_devices:
        reasons.append("no CUDA device" + ("" if cuda_devices == 0 else " (no NVIDIA driver found)")
                       + ": TensorRT-LLM runs only on NVIDIA GPUs")
    if not reasons:
        return None
    if not installed or import_error or py:
        reasons.append(INSTALL_HINT)
    return "; ".join(reasons)


def end_id_of(model_path: str) -> int:
    """The checkpoint's EOS id (harness.core.presets reads config.json; -1 when it has none)."""
    try:
        eos = shape_from_hf_config(model_path).eos_token_id
    except UserError:
        return -1
    return -1 if eos is None else eos


def check_problems(options: TRTLLMOptions | dict[str, Any], model: ModelSpec) -> list[str]:
    """Problems with the options (harness.core.schema.check against TRTLLMOptions), then what no
    field's spec says, then the device; each names the field and the fix."""
    o, problems = parse_engine_options(TRTLLMOptions, "trtllm", options)
    tpb = o.tokens_per_block
    if not problems and tpb & (tpb - 1):
        problems.append(f"engine_options.trtllm.tokens_per_block={tpb}: TensorRT-LLM needs a power of two "
                        "greater than 1 (e.g. 16, 32, 64).")
    if not str(model.device).startswith("cuda"):
        problems.append(f"device={model.device}: TensorRT-LLM runs only on NVIDIA GPUs (device=cuda).")
    return problems


def this_python() -> tuple[int, int]:
    return sys.version_info[0], sys.version_info[1]
