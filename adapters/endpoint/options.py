"""Engine options of an endpoint (`engine_options.<endpoint>.<name>`) and how each shipped
server kind takes them: flags appended to the launch command (vLLM, SGLang, infer-bench-serve)
or a YAML file passed with `--extra_llm_api_options` (trtllm-serve's `kv_cache_config`).

Options (null or absent: the server's own default, nothing is passed):
  kv_dtype                KV-cache storage dtype (auto | fp8 | ...: what the kind accepts)
  block_size              tokens per KV block (vLLM --block-size, SGLang --page-size,
                          trtllm kv_cache_config.tokens_per_block, infer-bench block_size)
  prefix_caching          true | false
  kv_cache_bytes          the KV pool in bytes (vLLM --kv-cache-memory-bytes; trtllm
                          kv_cache_config.max_tokens = bytes / the model's KV bytes per token)
  max_num_seqs            most sequences in one batch
  max_num_batched_tokens  most tokens in one step
  kv_cache, kv_layout     only `on` / `paged`: no cache or a contiguous layout cannot be asked
                          of a server over HTTP
Only a launched server can take options: an attached one runs with what it was started with
(`endpoints.<name>.attached_options` says what that was), and points that need other values
are skipped with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from adapters.base import is_pos_int

STANDARD_ENDPOINT_OPTIONS = ("kv_dtype", "block_size", "prefix_caching", "kv_cache_bytes", "max_num_seqs",
                             "max_num_batched_tokens", "kv_cache", "kv_layout")
_INTS = ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens")

_KV_ALIASES = {"bf16": "bfloat16", "fp16": "float16"}
KV_DTYPES: dict[str, tuple[str, ...]] = {
    "vllm": ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"),
    "sglang": ("auto", "fp8_e5m2", "fp8_e4m3"),
    "trtllm": ("auto", "fp8"),
    "infer-bench": ("auto", "int8", "fp8"),
    "generic": ("auto",),
}
# which options each kind can be launched with (beyond these: a problem)
SUPPORTED: dict[str, tuple[str, ...]] = {
    "vllm": ("kv_dtype", "block_size", "prefix_caching", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens"),
    "sglang": ("kv_dtype", "block_size", "prefix_caching", "max_num_seqs", "max_num_batched_tokens"),
    "trtllm": ("kv_dtype", "block_size", "prefix_caching", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens"),
    "infer-bench": ("kv_dtype", "block_size", "prefix_caching", "kv_cache_bytes", "max_num_seqs",
                    "max_num_batched_tokens"),
    "generic": (),
}
PREFIX_CACHE_KINDS = ("vllm", "sglang", "trtllm", "infer-bench")


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


def option_problems(endpoint: str, kind: str, options: dict[str, Any], device: str = "cpu",
                    attached: dict[str, Any] | None = None, url: str | None = None) -> list[str]:
    """Problems with `engine_options.<endpoint>` for this kind; for an attached server
    (`attached` is its declared options), every option that differs from what it runs with."""
    p = f"engine_options.{endpoint}."
    problems: list[str] = []
    for k, v in options.items():
        if k not in STANDARD_ENDPOINT_OPTIONS:
            problems.append(f"{p}{k}: unknown option. Known options: {', '.join(STANDARD_ENDPOINT_OPTIONS)}.")
    if options.get("kv_cache") not in (None, "on", True):
        problems.append(f"{p}kv_cache={options['kv_cache']}: a server cannot be asked over HTTP to run without "
                        "a KV cache (only `on`).")
    if options.get("kv_layout") not in (None, "paged"):
        problems.append(f"{p}kv_layout={options['kv_layout']}: a server cannot be asked over HTTP for a "
                        "contiguous KV layout (only `paged`).")
    if options.get("prefix_caching") is not None and not isinstance(options["prefix_caching"], bool):
        problems.append(f"{p}prefix_caching={options['prefix_caching']}: use true or false.")
    for k in _INTS:
        if options.get(k) is not None and not is_pos_int(options[k]):
            problems.append(f"{p}{k}={options[k]}: must be a positive integer (or null).")
    if problems:
        return problems
    asked = given(options)
    if attached is not None:  # an attached server: it runs with what it was started with
        declared = given(attached)
        for k, v in asked.items():
            have = declared.get(k)
            same = (kv_dtype_name(v) == kv_dtype_name(have)) if k == "kv_dtype" else v == have
            if not same:
                problems.append(f"{p}{k}={v}: endpoint {endpoint} is attached ({url}) and cannot be restarted "
                                f"with other options; it runs with {k}={have if have is not None else 'its default'} "
                                f"(endpoints.{endpoint}.attached_options). Give endpoints.{endpoint}.launch to let "
                                "the harness start the server with each point's options.")
        return problems
    unsupported = [k for k in asked if k not in SUPPORTED[kind]]
    for k in unsupported:
        how = ("put the server's own flags into the launch template" if kind == "generic"
               else "set it with the server's own flag in the launch template")
        problems.append(f"{p}{k}: the harness does not know how to give {k} to a kind={kind} server; {how}.")
    if "kv_dtype" in asked and kv_dtype_name(asked["kv_dtype"]) not in KV_DTYPES[kind]:
        problems.append(f"{p}kv_dtype={asked['kv_dtype']}: a kind={kind} server takes one of "
                        f"{', '.join(KV_DTYPES[kind])}.")
    if kind == "vllm" and not str(device).startswith("cuda") and asked.get("block_size", 32) % 32:
        problems.append(f"{p}block_size={asked['block_size']}: vLLM on CPU needs a multiple of 32 "
                        "(its CPU attention backend); use 32, 64 or 128.")
    if kind == "trtllm" and "block_size" in asked and asked["block_size"] & (asked["block_size"] - 1):
        problems.append(f"{p}block_size={asked['block_size']}: trtllm-serve's tokens_per_block must be a power "
                        "of two (e.g. 32 or 64).")
    return problems


@dataclass
class LaunchExtras:
    """What a kind's options add to a launch: arguments, environment, files to write first."""

    args: list[str] = field(default_factory=list)
    env: dict[str, str | None] = field(default_factory=dict)  # None: remove the variable
    files: dict[str, str] = field(default_factory=dict)  # path -> text


def _flag(b: bool) -> str:
    return "true" if b else "false"


def launch_extras(kind: str, options: dict[str, Any], options_file: str,
                  kv_bytes_per_token: int | None = None) -> LaunchExtras:
    """The arguments (and files) that give `options` to a kind's server. Pure: unit-tested."""
    o = given(options)
    out = LaunchExtras()
    if kind == "vllm":
        if "kv_dtype" in o:
            out.args += ["--kv-cache-dtype", kv_dtype_name(o["kv_dtype"])]
        if "block_size" in o:
            out.args += ["--block-size", str(o["block_size"])]
        if "prefix_caching" in o:
            out.args.append("--enable-prefix-caching" if o["prefix_caching"] else "--no-enable-prefix-caching")
        if "kv_cache_bytes" in o:
            out.args += ["--kv-cache-memory-bytes", str(o["kv_cache_bytes"])]
            out.env["VLLM_CPU_KVCACHE_SPACE"] = None  # it would override the byte count on CPU
        if "max_num_seqs" in o:
            out.args += ["--max-num-seqs", str(o["max_num_seqs"])]
        if "max_num_batched_tokens" in o:
            out.args += ["--max-num-batched-tokens", str(o["max_num_batched_tokens"])]
    elif kind == "sglang":
        if "kv_dtype" in o:
            out.args += ["--kv-cache-dtype", kv_dtype_name(o["kv_dtype"])]
        if "block_size" in o:
            out.args += ["--page-size", str(o["block_size"])]
        if o.get("prefix_caching") is False:
            out.args.append("--disable-radix-cache")
        if "max_num_seqs" in o:
            out.args += ["--max-running-requests", str(o["max_num_seqs"])]
        if "max_num_batched_tokens" in o:
            out.args += ["--chunked-prefill-size", str(o["max_num_batched_tokens"])]
    elif kind == "trtllm":
        kv: dict[str, Any] = {}
        if "kv_dtype" in o:
            kv["dtype"] = kv_dtype_name(o["kv_dtype"])
        if "block_size" in o:
            kv["tokens_per_block"] = int(o["block_size"])
        if "prefix_caching" in o:
            kv["enable_block_reuse"] = bool(o["prefix_caching"])
        if "kv_cache_bytes" in o:
            if not kv_bytes_per_token:
                raise ValueError("kv_cache_bytes for trtllm-serve needs the model's KV bytes per token "
                                 "(config.json of the model)")
            kv["max_tokens"] = int(o["kv_cache_bytes"]) // int(kv_bytes_per_token)
        if "max_num_seqs" in o:
            out.args += ["--max_batch_size", str(o["max_num_seqs"])]
        if "max_num_batched_tokens" in o:
            out.args += ["--max_num_tokens", str(o["max_num_batched_tokens"])]
        if kv:
            lines = ["kv_cache_config:"] + [f"  {k}: {_flag(v) if isinstance(v, bool) else v}" for k, v in kv.items()]
            out.files[options_file] = "\n".join(lines) + "\n"
            out.args += ["--extra_llm_api_options", options_file]
    elif kind == "infer-bench":
        for k in ("kv_dtype", "block_size", "prefix_caching", "kv_cache_bytes", "max_num_seqs",
                  "max_num_batched_tokens"):
            if k in o:
                v = o[k]
                out.args.append(f"engine_options.{k}={_flag(v) if isinstance(v, bool) else v}")
    return out
