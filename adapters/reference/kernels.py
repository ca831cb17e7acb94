"""Which kernels the engine runs, chosen once at load and recorded (LoadInfo.details["kernels"],
kv_cache_info().extra["kernels"]).

    plain  model.Linear + attention.StepAttention: the reference semantics, on any device
    cpu    matrix products on oneDNN-packed weights (kernels_cpu.py), when its probe passes;
           decode attention by a fused C kernel that reads K/V through the block table
           (cpu_decode.py, compiled for this CPU at load), when it builds and agrees with the
           plain path; prefill attention as plain (sliced batched matmuls)
    cuda   SDPA (flash) prefill and a paged decode kernel (Triton, else a PyTorch one) that reads
           K/V through the block table (kernels_cuda.py); decode steps replayed from CUDA graphs
           (cuda_graphs.py); no slicing of long prefills

`engine_options.reference.kernels=plain` forces the plain path (what the tests compare against).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from adapters.reference import cpu_decode, kernels_cpu
from adapters.reference.attention import StepAttention
from adapters.reference.config import EngineConfig
from adapters.reference.model import ROWS, Linear

GPU_SCORE_BUDGET = 1 << 26  # plain path on a GPU: float32 scores per slice (256 MiB), not a CPU's 4 MiB


@dataclass
class Kernels:
    name: str  # plain | cpu | cuda
    make_linear: Callable[..., Any]  # (weight, bias) -> a Linear-like object
    rows: int | None  # slice length of long prefills (None: no slicing)
    attention: Callable[..., StepAttention]  # (pool, chunks, num_heads, device) -> the step's attention
    decode_graphs: bool = False  # replay pure decode steps from CUDA graphs
    decode_fn: Callable[..., Any] | None = None  # CUDA: the paged decode kernel (graphs call it)
    details: dict[str, Any] = field(default_factory=dict)


def select(device: torch.device, dtype: torch.dtype, cfg: EngineConfig) -> Kernels:
    """The kernels for this device, dtype and options (probing what the fast paths need)."""
    if device.type == "cuda":
        if cfg.kernels == "plain":
            return Kernels("plain", Linear, None, partial(StepAttention, score_budget=GPU_SCORE_BUDGET),
                           details={"kernels": "plain", "linear": "torch", "attention": "plain (gather + matmul)"})
        from adapters.reference import kernels_cuda  # CUDA-only code: imported only on a GPU

        return Kernels(**kernels_cuda.select(device, dtype, cfg))
    if cfg.kernels == "plain":
        return Kernels("plain", Linear, ROWS, StepAttention,
                       details={"kernels": "plain", "linear": "torch", "attention": "plain (gather + matmul)"})
    why = kernels_cpu.probe(dtype)
    details = {"kernels": "cpu", "linear": "onednn-packed" if why is None else "torch", "cpu_flags": cpu_flags(),
               "prefill_attention": "plain (sliced batched matmuls)"}
    if why:
        details["linear_fallback_reason"] = why
    attention = StepAttention
    decode = None
    if cfg.use_cache and cfg.kv_dtype == "auto":
        decode, why = cpu_decode.probe(dtype)
    else:
        why = f"kv_dtype={cfg.kv_dtype}" if cfg.use_cache else "no KV cache"
    details["decode_attention"] = "fused C kernel (cpu_decode.py)" if decode else "plain (gather + batched matmul)"
    if why:
        details["decode_fallback_reason"] = why
    if decode is not None:
        attention = partial(CpuStepAttention, decode_fn=decode)
    return Kernels("cpu", kernels_cpu.PackedLinear if details["linear"] == "onednn-packed" else Linear, ROWS,
                   attention, details=details)


class CpuStepAttention(StepAttention):
    """The plain attention with decode chunks handed to the fused kernel."""

    def __init__(self, pool, chunks, num_heads, device, decode_fn):
        super().__init__(pool, chunks, num_heads, device)
        self.decode_fn = decode_fn

    def decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return self.decode_fn(q, self.pool, layer, self.decode_tables, self.decode_lens)


def cpu_flags() -> str:
    """The vector extensions torch reports for this CPU (AMX / AVX-512 / AVX2), for the record."""
    cpu = getattr(torch.backends, "cpu", None)
    isa = cpu.get_cpu_capability() if cpu is not None and hasattr(cpu, "get_cpu_capability") else "unknown"
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return f"{isa}{' + AMX' if amx else ''}"
