"""Engine options of an endpoint (`engine_options.<endpoint>.<name>`) and how each shipped
server kind takes them: flags appended to the launch command (vLLM, SGLang, infer-bench-serve)
or a YAML file passed with `--extra_llm_api_options` (trtllm-serve). The mapping of each kind is
in its record (adapters/endpoint/kinds.py); docs/engines/servers.md has the tables.

Options (null or absent: the server's own default, nothing is passed):
  kv_dtype                KV-cache storage dtype (auto | fp8 | ...: what the kind accepts)
  block_size              tokens per KV block (vLLM --block-size, SGLang --page-size,
                          trtllm kv_cache_config.tokens_per_block from 1.1 on)
  prefix_caching          true | false
  kv_cache_bytes          the KV pool in bytes (vLLM --kv-cache-memory-bytes; trtllm
                          kv_cache_config.max_tokens = bytes / KV bytes per token at the KV dtype)
  gpu_memory_utilization  the server's memory share, 0 < x <= 1 (vLLM --gpu-memory-utilization,
                          SGLang --mem-fraction-static, trtllm kv_cache_config.free_gpu_memory_fraction)
  tensor_parallel_size    GPUs per model (--tensor-parallel-size, --tp-size, tensor_parallel_size)
  chunked_prefill         true | false
  max_num_seqs            most sequences in one batch
  max_num_batched_tokens  most tokens in one engine step (each server's own meaning: see
                          docs/engines/servers.md)
  kv_cache, kv_layout     only `on` / `paged`: no cache or a contiguous layout cannot be asked
                          of a server over HTTP
  speculative_method      none | ngram | draft | eagle | mtp (speculative decoding; vLLM
                          --speculative-config, SGLang --speculative-algorithm and its siblings,
                          trtllm speculative_config in the options file)
  num_speculative_tokens  k, tokens proposed per step (required with a method)
  draft_model             draft / eagle: the draft model's (or EAGLE head's) directory
  prompt_lookup_min/max   ngram: the shortest / longest n-gram matched (where the server has them)
  kv_offload              true | false: a second KV tier for evicted prefix-cache blocks (vLLM
                          --kv-offloading-size/--kv-offloading-backend native, SGLang
                          --enable-hierarchical-cache, trtllm kv_cache_config.host_cache_size)
  kv_offload_bytes        its capacity in bytes (vLLM in GiB, SGLang --hicache-size in whole
                          gigabytes of 1e9 bytes, trtllm in bytes); required by vLLM and trtllm
  lora_adapters           LoRA adapters [{name, path, rank}] (vLLM --enable-lora --lora-modules NAME=PATH,
                          SGLang --enable-lora --lora-paths NAME=PATH); a request names its adapter in
                          `model` (vLLM) or `lora_path` (SGLang)
  max_loras, max_lora_rank, max_cpu_loras
                          the slots, the largest rank, the adapters kept in host memory (vLLM --max-loras,
                          --max-lora-rank rounded up to one vLLM takes, --max-cpu-loras; SGLang
                          --max-loras-per-batch max_loras + 1 (it counts the base model), --max-lora-rank,
                          --max-loaded-loras)
  server_flags            {flag: value}: the server's own launch flags, as its kind's record
                          declares them (adapters/endpoint/flags.py; workload=tune searches them);
                          a flag and a standard option that set the same thing cannot both be given
Only a launched server can take options: an attached one runs with what it was started with
(`endpoints.<name>.attached_options` says what that was), and points that need other values
are skipped with the reason.
"""

from __future__ import annotations

from typing import Any

import yaml

from adapters.base import is_pos_int, lora_adapter_problems
from adapters.endpoint.flags import flag_args, flag_problems, overridden_standards, set_dotted
from adapters.endpoint.kinds import (
    KINDS, LORA_OPTIONS, SPEC_METHOD_OPTIONS, SPEC_METHODS, SPEC_OPTIONS, TIER_OPTIONS, LaunchContext, LaunchExtras,
    given, kv_dtype_name,
)

STANDARD_ENDPOINT_OPTIONS = ("kv_dtype", "block_size", "prefix_caching", "kv_cache_bytes", "gpu_memory_utilization",
                             "tensor_parallel_size", "chunked_prefill", "max_num_seqs", "max_num_batched_tokens",
                             "kv_cache", "kv_layout") + SPEC_OPTIONS + TIER_OPTIONS + LORA_OPTIONS
_INTS = ("block_size", "kv_cache_bytes", "tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens",
         "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "kv_offload_bytes", "max_loras",
         "max_lora_rank", "max_cpu_loras")
_BOOLS = ("prefix_caching", "chunked_prefill", "kv_offload")
SERVER_FLAGS = "server_flags"  # engine_options.<endpoint>.server_flags: {flag: value}

__all__ = ["SERVER_FLAGS", "STANDARD_ENDPOINT_OPTIONS", "LaunchContext", "LaunchExtras", "given", "kv_dtype_name",
           "launch_extras", "option_problems", "server_flag_problems", "speculation_problems", "with_server_flags"]


def option_problems(endpoint: str, kind: str, options: dict[str, Any], device: str = "cpu",
                    attached: dict[str, Any] | None = None, url: str | None = None,
                    server_version: str | None = None) -> list[str]:
    """Problems with `engine_options.<endpoint>` for this kind; for an attached server
    (`attached` is its declared options), every option that differs from what it runs with."""
    p = f"engine_options.{endpoint}."
    k_ = KINDS[kind]
    problems: list[str] = []
    for k, v in options.items():
        if k not in STANDARD_ENDPOINT_OPTIONS and k != SERVER_FLAGS:
            problems.append(f"{p}{k}: unknown option. Known options: {', '.join(STANDARD_ENDPOINT_OPTIONS)}.")
    if options.get("kv_cache") not in (None, "on", True):
        problems.append(f"{p}kv_cache={options['kv_cache']}: a server cannot be asked over HTTP to run without "
                        "a KV cache (only `on`).")
    if options.get("kv_layout") not in (None, "paged"):
        problems.append(f"{p}kv_layout={options['kv_layout']}: a server cannot be asked over HTTP for a "
                        "contiguous KV layout (only `paged`).")
    for k in _BOOLS:
        if options.get(k) is not None and not isinstance(options[k], bool):
            problems.append(f"{p}{k}={options[k]}: use true or false.")
    for k in _INTS:
        if options.get(k) is not None and not is_pos_int(options[k]):
            problems.append(f"{p}{k}={options[k]}: must be a positive integer (or null).")
    g = options.get("gpu_memory_utilization")
    if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1):
        problems.append(f"{p}gpu_memory_utilization={g}: a fraction of the device's memory, 0 < x <= 1 "
                        "(e.g. 0.9), or null for the server's own.")
    problems += speculation_problems(p, options)
    problems += lora_adapter_problems(p, options.get("lora_adapters"))
    if problems:
        return problems
    flags = options.get(SERVER_FLAGS) or {}
    asked = {k: v for k, v in given(options).items() if k != SERVER_FLAGS}
    if flags and attached is not None:
        return [f"{p}{SERVER_FLAGS}: endpoint {endpoint} is attached ({url}) and cannot be restarted with other "
                f"flags. Give endpoints.{endpoint}.launch (its command, with {{port}}) instead of its url to let the "
                "harness start the server with them."]
    problems += server_flag_problems(endpoint, kind, flags, asked, server_version)
    if attached is not None:  # an attached server: it runs with what it was started with
        declared = given(attached)
        # speculation: none asked is a question too (a server that speculates cannot serve a baseline)
        method, running = options.get("speculative_method") or "none", attached.get("speculative_method") or "none"
        if method != running:
            problems.append(f"{p}speculative_method={method}: endpoint {endpoint} is attached ({url}) and cannot be "
                            f"restarted with other options; it runs with speculative_method={running} "
                            f"(endpoints.{endpoint}.attached_options). Give endpoints.{endpoint}.launch to let the "
                            "harness start the server with each point's speculation.")
        for k, v in asked.items():
            if k == "speculative_method" or (k in SPEC_OPTIONS and method != running):
                continue  # said above
            have = declared.get(k)
            same = (kv_dtype_name(v) == kv_dtype_name(have)) if k == "kv_dtype" else v == have
            if not same:
                problems.append(f"{p}{k}={v}: endpoint {endpoint} is attached ({url}) and cannot be restarted "
                                f"with other options; it runs with {k}={have if have is not None else 'its default'} "
                                f"(endpoints.{endpoint}.attached_options). Give endpoints.{endpoint}.launch to let "
                                "the harness start the server with each point's options.")
        return problems
    for k in asked:
        if k not in k_.options:
            how = ("put the server's own flags into the launch template" if not k_.options
                   else "set it with the server's own flag in the launch template")
            problems.append(f"{p}{k}: the harness does not know how to give {k} to a kind={kind} server; {how}.")
    if "kv_dtype" in asked and kv_dtype_name(asked["kv_dtype"]) not in k_.kv_dtypes:
        problems.append(f"{p}kv_dtype={asked['kv_dtype']}: a kind={kind} server takes one of "
                        f"{', '.join(k_.kv_dtypes)}.")
    if k_.option_checks is not None:
        problems += k_.option_checks(p, asked, str(device), server_version)
    return problems


def speculation_problems(p: str, options: dict[str, Any]) -> list[str]:
    """Problems with speculative decoding's standard options (`p`: engine_options.<endpoint>.): the
    method, k with it, the draft model the draft and eagle methods need, the n-gram windows in
    order. Options a method does not use are ignored (a draft_model beside method ngram)."""
    method = options.get("speculative_method")
    if method is None or method == "none":
        return []
    if method not in SPEC_METHODS:
        return [f"{p}speculative_method={method}: not one of {', '.join(SPEC_METHODS)}."]
    out = []
    uses = SPEC_METHOD_OPTIONS[method]
    if options.get("num_speculative_tokens") is None:
        out.append(f"{p}num_speculative_tokens: speculative_method={method} needs k, the tokens proposed per step "
                   "(a positive integer, e.g. 4).")
    if "draft_model" in uses:
        d = options.get("draft_model")
        if not isinstance(d, str) or not d.strip():
            out.append(f"{p}draft_model: speculative_method={method} needs the draft model's checkpoint directory "
                       f"(got {d!r}).")
    lo, hi = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
    if method == "ngram" and isinstance(lo, int) and isinstance(hi, int) and lo > hi:
        out.append(f"{p}prompt_lookup_min={lo} is more than prompt_lookup_max={hi}: the shortest n-gram matched "
                   "cannot be longer than the longest.")
    return out


def launch_extras(kind: str, options: dict[str, Any], ctx: LaunchContext | str) -> LaunchExtras:
    """The arguments (and files) that give `options` to a kind's server. Pure: unit-tested."""
    if isinstance(ctx, str):
        ctx = LaunchContext(options_file=ctx)
    extras = KINDS[kind].map_options({k: v for k, v in given(options).items() if k != SERVER_FLAGS}, ctx)
    return with_server_flags(kind, options.get(SERVER_FLAGS) or {}, ctx, extras)


def server_flag_problems(endpoint: str, kind: str, flags: Any, asked: dict[str, Any],
                         server_version: str | None = None) -> list[str]:
    """Problems with `engine_options.<endpoint>.server_flags` (a tuning trial's flags come this
    way): flags the kind's record does not declare, values outside the server's bounds, and a flag
    given beside the standard option that sets the same thing (`asked`, the options given)."""
    p = f"engine_options.{endpoint}.{SERVER_FLAGS}"
    if not flags:
        return []
    k_ = KINDS[kind]
    if not k_.flags:
        return [f"{p}: the harness knows no flags of a kind={kind} server; put them into the launch template "
                f"(endpoints.{endpoint}.launch)."]
    problems = flag_problems(k_.flags, flags, p, server_version)
    if problems or not isinstance(flags, dict):
        return problems
    both = sorted(overridden_standards(k_.flags, flags) & set(asked))
    for std in both:
        names = [f.name for f in k_.flags if std in f.standard and flags.get(f.name) is not None]
        problems.append(f"{p}.{names[0]} and engine_options.{endpoint}.{std} set the same thing; give one of them.")
    return problems


def with_server_flags(kind: str, flags: dict[str, Any], ctx: LaunchContext, extras: LaunchExtras) -> LaunchExtras:
    """`extras` with the server's own flags added: arguments after the standard options' (the
    caller leaves out the standard options a flag overrides), YAML keys merged into the options
    file (a flag's value wins over the standard mapping's). Pure: unit-tested."""
    if not flags:
        return extras
    args, keys = flag_args(KINDS[kind].flags, flags)
    out = LaunchExtras(list(extras.args) + args, dict(extras.env), dict(extras.files))
    if keys:
        doc = yaml.safe_load(out.files.get(ctx.options_file) or "") or {}
        for dotted, value in keys.items():
            set_dotted(doc, dotted, value)
        out.files[ctx.options_file] = yaml.safe_dump(doc, sort_keys=False)
        if ctx.options_file not in out.args:
            out.args += ["--extra_llm_api_options", ctx.options_file]
    return out
