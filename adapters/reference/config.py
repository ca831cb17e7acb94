"""The reference engine's options (`engine_options.reference.<name>`), their defaults, and
their validation. conf/engine/reference.yaml lists the same defaults for the command line."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

KV_CACHE_MODES = ("on", "none")
KV_LAYOUTS = ("paged", "contiguous")
KV_DTYPES = ("auto", "int8", "fp8")
KERNELS = ("auto", "plain")
CPU_DEFAULT_KV_BYTES = 1 << 30  # 1 GiB: the pool on CPU when kv_cache_bytes is null (at most)


@dataclass
class EngineConfig:
    block_size: int = 16  # tokens per KV block (paged layout)
    kv_cache: str = "on"  # on | none (no cache: every step recomputes every sequence)
    kv_layout: str = "paged"  # paged | contiguous (each sequence reserves max_model_len slots)
    kv_dtype: str = "auto"  # auto (the model's dtype) | int8 (+ per-token, per-head scales) | fp8 (e4m3)
    prefix_caching: bool = True  # share full blocks of common prefixes (paged layout only)
    kv_cache_bytes: int | None = None  # KV pool size; null: CPU: min(1 GiB, max_num_seqs sequences of
    #   max_model_len), at least one such sequence; CUDA: see gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # CUDA, kv_cache_bytes null: the engine may fill this share of the
    #   device's TOTAL memory (vLLM's meaning): the pool gets it minus what is in use after the weights
    #   (by anyone) minus an activation reserve
    max_num_seqs: int = 256  # most sequences running at once
    max_num_batched_tokens: int = 8192  # token budget of one step (longer prompts are prefilled in chunks)
    num_threads: int | None = None  # torch CPU threads; null: the run's share (ModelSpec.threads), else torch's default
    kernels: str = "auto"  # auto: the device's fast paths (kernels_cpu.py / kernels_cuda.py); plain: the
    #   plain-PyTorch reference path only (attention.py, model.py)
    cuda_graphs: bool = True  # CUDA, kernels=auto: replay decode steps from CUDA graphs (one per batch bucket)
    step_delay_frac: float = 0.0  # a deliberate handicap, for calibrating regression gates: after every
    #   step, busy-wait this fraction of the step's own time (0.25: every step takes 25 % longer). 0: off

    @property
    def use_cache(self) -> bool:
        return self.kv_cache == "on"

    @property
    def contiguous(self) -> bool:
        return self.kv_layout == "contiguous"

    @property
    def use_prefix_cache(self) -> bool:
        """Prefix sharing needs a paged cache: contiguous regions and no cache have nothing to share."""
        return self.prefix_caching and self.use_cache and not self.contiguous


OPTIONS = tuple(f.name for f in fields(EngineConfig))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_options(options: dict[str, Any] | None) -> tuple[EngineConfig, list[str]]:
    """The config for `options` (defaults for what is missing or null) and the problems found,
    each naming `engine_options.reference.<field>` and the fix."""
    options = dict(options or {})
    problems: list[str] = []

    def bad(name: str, fix: str) -> None:
        problems.append(f"engine_options.reference.{name}={options[name]!r}: {fix}")

    for k in options:
        if k not in OPTIONS:
            problems.append(f"engine_options.reference.{k}: unknown option. Known options: {', '.join(OPTIONS)}.")
    cfg = EngineConfig()
    given = {k: v for k, v in options.items() if k in OPTIONS and v is not None}
    for name, allowed in (("kv_cache", KV_CACHE_MODES), ("kv_layout", KV_LAYOUTS), ("kv_dtype", KV_DTYPES),
                          ("kernels", KERNELS)):
        if name in given:
            value = given[name]
            if value is True and name == "kv_cache":  # YAML reads a bare `on` as true
                value = "on"
            if str(value).lower() not in allowed:
                bad(name, f"use one of {' | '.join(allowed)}.")
            else:
                setattr(cfg, name, str(value).lower())
    for name in ("prefix_caching", "cuda_graphs"):
        if name in given:
            if isinstance(given[name], bool):
                setattr(cfg, name, given[name])
            else:
                bad(name, "use true or false.")
    for name, low in (("block_size", 1), ("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("num_threads", 1)):
        if name in given:
            if not _is_int(given[name]) or given[name] < low:
                bad(name, "must be a positive integer.")
            else:
                setattr(cfg, name, given[name])
    if cfg.block_size > 4096:
        bad("block_size", "at most 4096 tokens per block; the default is 16.")
    if "kv_cache_bytes" in given:
        v = given["kv_cache_bytes"]
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not _is_int(v) or v < 1:
            bad("kv_cache_bytes", "must be a positive number of bytes (e.g. 2147483648 for 2 GiB), or null.")
        else:
            cfg.kv_cache_bytes = v
    if "step_delay_frac" in given:
        v = given["step_delay_frac"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 10:
            bad("step_delay_frac", "must be a fraction between 0 and 10 (0.25: every step 25 % slower), or 0.")
        else:
            cfg.step_delay_frac = float(v)
    if "gpu_memory_utilization" in given:
        v = given["gpu_memory_utilization"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            bad("gpu_memory_utilization", "must be a fraction in (0, 1], e.g. 0.9.")
        else:
            cfg.gpu_memory_utilization = float(v)
    if cfg.kv_cache == "none" and given.get("kv_dtype", "auto") != "auto":
        problems.append("engine_options.reference.kv_dtype: a quantised cache needs kv_cache=on "
                        "(with kv_cache=none nothing is stored). Drop kv_dtype or set kv_cache=on.")
    return cfg, problems
