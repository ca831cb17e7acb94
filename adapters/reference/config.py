"""The reference engine's options (`engine_options.reference.<name>`): one dataclass of
harness.core.schema.spec() fields with their defaults, ranges and help, checked by
harness.core.schema.check (adapters.base.Engine.check_options). conf/engine/reference.yaml is
generated from it (`python -m adapters.engine_yaml`)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, fields
from typing import Any

from adapters.base import lora_adapter_problems
from harness.core.schema import spec
from harness.core.sizes import parse_size

KV_CACHE_MODES = ("on", "none")
KV_LAYOUTS = ("paged", "contiguous")
KV_DTYPES = ("auto", "int8", "fp8")
KERNELS = ("auto", "plain")
MLA_FORMS = ("expand", "absorb")
# speculative decoding (speculative.py): what the engine runs, and the methods of STANDARD_OPTIONS it refuses
SPECULATIVE_METHODS = ("ngram", "draft")
NO_HEADS = ("eagle", "mtp")
OFFLOAD_MEDIA = ("auto", "disk", "host")  # the second KV tier's medium (kv_tiers.py)
CPU_DEFAULT_KV_BYTES = 1 << 30  # 1 GiB: the pool on CPU when kv_cache_bytes is null (at most)


@dataclass
class EngineConfig:
    """Our own paged-KV engine (adapters/reference/): its options, each with its type, default,
    range and meaning (checked by harness.core.schema.check)."""

    block_size: int = spec(16, ge=1, le=4096, tune=[8, 16, 32, 64], help="tokens per KV block (paged layout)")
    kv_cache: str = spec("on", choices=KV_CACHE_MODES,
                         help="on | none (no KV cache: every step recomputes every sequence whole)")
    kv_layout: str = spec("paged", choices=KV_LAYOUTS,
                          help="paged | contiguous (each sequence reserves max_model_len slots up front)")
    kv_dtype: str = spec("auto", choices=KV_DTYPES, tune=list(KV_DTYPES),
                         help="auto (the model's dtype) | int8 (per-token, per-head scales) | fp8 (e4m3)")
    prefix_caching: bool = spec(True, help="share full blocks of common prefixes (paged layout only)")
    kv_cache_bytes: int | None = spec(None, ge=1, help=(
        "KV pool size in bytes; null: on CPU min(1 GiB, max_num_seqs x max_model_len tokens, at least one "
        "such sequence), on CUDA see gpu_memory_utilization"))
    gpu_memory_utilization: float = spec(0.9, gt=0, le=1, help=(
        "CUDA, kv_cache_bytes null: the engine may fill this share of the device's TOTAL memory; the pool "
        "gets it minus what is in use after the weights (by anyone) minus an activation reserve "
        "(vLLM's meaning)"))
    max_num_seqs: int = spec(256, ge=1, tune=[4, 8, 16, 32, 64, 128, 256], help="most sequences running at once")
    max_num_batched_tokens: int = spec(8192, ge=1, tune=[512, 1024, 2048, 4096, 8192], help=(
        "token budget of one step; longer prompts are prefilled in chunks"))
    num_threads: int | None = spec(None, ge=1, help=(
        "torch CPU threads; null: the run's share of threads, else torch's default"))
    kernels: str = spec("auto", choices=KERNELS, help=(
        "auto: the device's fast paths (oneDNN on CPU; SDPA, Triton, CUDA graphs on CUDA) | plain: the "
        "plain-PyTorch reference path only"))
    cuda_graphs: bool = spec(True, help="CUDA with kernels=auto: decode steps replayed from CUDA graphs")
    mla_attention: str = spec("absorb", choices=MLA_FORMS, help=(
        "latent-attention (MLA) models' decode: expand (up-project every cached latent through kv_b each step) | "
        "absorb (kv_b folded into the query and the output: attention reads the latents as stored; 1.6-6x faster "
        "decode on tiny-deepseek-v3, docs/reference-engine.md)"))
    speculative_method: str = spec("none", choices=("none",) + SPECULATIVE_METHODS + NO_HEADS, help=(
        "speculative decoding, greedy verification of k drafted tokens in one target pass: none | ngram (prompt "
        "lookup over the sequence's own tokens) | draft (a smaller model, draft_model); eagle and mtp are refused "
        "(no such heads here)"))
    num_speculative_tokens: int = spec(4, ge=1, le=64, help="k: tokens proposed per sequence per speculative step")
    draft_model: str | None = spec(None, help=(
        "speculative_method=draft: the draft's checkpoint directory (same tokenizer and vocabulary as the target; "
        "the harness resolves a preset name to its directory)"))
    prompt_lookup_min: int = spec(2, ge=1, help="speculative_method=ngram: the shortest n-gram matched")
    prompt_lookup_max: int = spec(4, ge=1, help=(
        "speculative_method=ngram: the longest n-gram matched (the longest match wins; of its occurrences, the "
        "earliest, as vLLM and transformers choose)"))
    # a second KV tier behind the pool (kv_tiers.py; docs/reference-engine.md, "KV tiers")
    kv_offload: bool = spec(False, help=(
        "evicted prefix-cache blocks go to a second tier (disk on CPU, pinned host memory on CUDA) and are "
        "reloaded on a later hit instead of prefilled again; LRU, as the pool"))
    kv_offload_bytes: int | None = spec(None, ge=1, help="the second tier's capacity in bytes; null: twice the KV pool")
    kv_offload_medium: str = spec("auto", choices=OFFLOAD_MEDIA, help=(
        "auto (disk on CPU, host on CUDA) | disk (an unlinked slab file in kv_offload_dir) | host (host memory, "
        "pinned on CUDA)"))
    kv_offload_dir: str | None = spec(None, help=(
        "medium disk: the directory of the tier's slab file (local disk); null: the system's temp directory"))
    # LoRA adapters (adapters.base.STANDARD_OPTIONS; lora.py): slots of stacked adapter weights
    lora_adapters: list[Any] | None = spec(None, help=(
        "LoRA adapters [{name, path, rank}]: each request names its own; a batch mixes them (lora.py)"))
    max_loras: int | None = spec(None, ge=1, help="adapter slots: adapters resident at once; null: every adapter")
    max_lora_rank: int | None = spec(None, ge=1, help="the slots' rank: no adapter may exceed it; null: the largest")
    max_cpu_loras: int | None = spec(None, ge=1, help=(
        "accepted and recorded: every adapter is read into host memory at load"))
    step_delay_frac: float = spec(0.0, ge=0, le=10, help=(
        "a deliberate handicap for calibrating regression gates: each step busy-waits this fraction of its "
        "own CPU time on a CPU (its wall time on an accelerator): 0.25 is 25 % more work; 0: off"))

    @staticmethod
    def normalize(raw: dict[str, Any]) -> dict[str, Any]:
        """What YAML and the command line read differently from what was meant: a bare `on` is
        true, `kv_cache_bytes=2e9` a float; sizes may carry their unit (`kv_offload_bytes=1GiB`)."""
        out = dict(raw)
        if out.get("kv_cache") is True:
            out["kv_cache"] = "on"
        for k in ("kv_cache_bytes", "kv_offload_bytes"):  # 2e9, or a size with its unit: 512MiB, 1GiB
            v = out.get(k)
            if isinstance(v, (float, str)) and parse_size(v) is not None:
                out[k] = parse_size(v)
        return out

    @property
    def use_cache(self) -> bool:
        return self.kv_cache == "on"

    @property
    def contiguous(self) -> bool:
        return self.kv_layout == "contiguous"

    @property
    def speculative(self) -> bool:
        return self.speculative_method != "none"

    @property
    def use_prefix_cache(self) -> bool:
        """Prefix sharing needs a paged cache: contiguous regions and no cache have nothing to share."""
        return self.prefix_caching and self.use_cache and not self.contiguous


OPTIONS = tuple(f.name for f in fields(EngineConfig))


def cross_field_problems(cfg: EngineConfig) -> list[str]:
    """What no single field's spec can say: combinations that contradict each other."""
    problems = []
    if cfg.kv_cache == "none" and cfg.kv_dtype != "auto":
        problems.append("engine_options.reference.kv_dtype: a quantised cache needs kv_cache=on "
                        "(with kv_cache=none nothing is stored). Drop kv_dtype or set kv_cache=on.")
    return problems + speculative_problems(cfg) + offload_problems(cfg) + lora_problems(cfg)


def lora_problems(cfg: EngineConfig) -> list[str]:
    """LoRA adapters: each {name, path, rank}, within max_lora_rank, and not with speculative decoding."""
    opt = "engine_options.reference"
    out = lora_adapter_problems(f"{opt}.", cfg.lora_adapters, cfg.max_lora_rank)
    if cfg.lora_adapters and cfg.speculative:
        out.append(f"{opt}.lora_adapters with speculative_method={cfg.speculative_method}: the reference engine does "
                   "not speculate with adapters; measure one or the other.")
    return out


def offload_problems(cfg: EngineConfig) -> list[str]:
    """A second KV tier holds blocks evicted from the prefix cache: it needs the cache (paged, on)
    and, on disk, a directory it can write."""
    if not cfg.kv_offload:
        return []
    opt = "engine_options.reference"
    if not cfg.use_prefix_cache:
        why = ("prefix_caching=false" if cfg.use_cache and not cfg.contiguous else
               "kv_cache=none" if not cfg.use_cache else "kv_layout=contiguous")
        return [f"{opt}.kv_offload=true with {why}: a second KV tier holds blocks evicted from the prefix cache and "
                f"is read only by prefix hits. Turn prefix caching on (paged layout), or set {opt}.kv_offload=false."]
    why = directory_problem(cfg.kv_offload_dir) if cfg.kv_offload_medium != "host" else None
    return [why] if why else []


def speculative_problems(cfg: EngineConfig) -> list[str]:
    """Speculative decoding's options among themselves (the draft's files: speculative.check_draft)."""
    opt = "engine_options.reference"
    method = cfg.speculative_method
    if method in NO_HEADS:
        return [f"{opt}.speculative_method={method}: the reference engine has no {method.upper()} heads. "
                "Use speculative_method=ngram or draft (or an engine that has them, e.g. vllm)."]
    if method == "none":
        return []
    problems = []
    if not cfg.use_cache:  # nothing to verify against, nothing to roll back
        problems.append(f"{opt}.speculative_method={method}: speculation verifies drafts against the KV cache; "
                        "with kv_cache=none there is none. Set kv_cache=on or speculative_method=none.")
    if method == "ngram" and cfg.prompt_lookup_min > cfg.prompt_lookup_max:
        problems.append(f"{opt}.prompt_lookup_min={cfg.prompt_lookup_min} exceeds prompt_lookup_max="
                        f"{cfg.prompt_lookup_max}. Give prompt_lookup_min <= prompt_lookup_max.")
    if method == "draft" and not cfg.draft_model:
        problems.append(f"{opt}.draft_model: speculative_method=draft needs a draft checkpoint. Give "
                        f"{opt}.draft_model=DIR (a model with the target's tokenizer) or use speculative_method=ngram.")
    return problems


def directory_problem(directory: str | None) -> str | None:
    """Why `directory` cannot hold the disk tier's slab file (None: it can, or it is the default)."""
    if directory is None:
        return None
    path = os.path.expanduser(directory)
    if not os.path.isdir(path):
        return (f"engine_options.reference.kv_offload_dir={directory}: not a directory. Give an existing, writable "
                "directory on local disk (or null for the system's temp directory).")
    try:
        fd, probe = tempfile.mkstemp(prefix="infer-bench-kv-tier-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return (f"engine_options.reference.kv_offload_dir={directory}: cannot write there ({e.strerror}). Give a "
                "writable directory on local disk (or null for the system's temp directory).")
    return None
