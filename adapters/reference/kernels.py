"""Which kernels the engine runs, chosen once at load and recorded (LoadInfo.details["kernels"],
kv_cache_info().extra["kernels"]).

    plain  model.Linear + attention.StepAttention: the reference semantics, on any device
    cpu    matrix products on oneDNN-packed weights (kernels_cpu.py), when its probe passes;
           attention as plain (already batched matmuls over head-major blocks)
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

from adapters.reference import kernels_cpu
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
    details = {"kernels": "cpu", "attention": "plain (head-major gather + batched matmul)",
               "linear": "onednn-packed" if why is None else "torch", "cpu_flags": cpu_flags()}
    if why:
        details["linear_fallback_reason"] = why
    return Kernels("cpu", kernels_cpu.PackedLinear if why is None else Linear, ROWS, StepAttention,
                   details=details)


def cpu_flags() -> str:
    """The vector extensions torch reports for this CPU (AMX / AVX-512 / AVX2), for the record."""
    cpu = getattr(torch.backends, "cpu", None)
    isa = cpu.get_cpu_capability() if cpu is not None and hasattr(cpu, "get_cpu_capability") else "unknown"
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return f"{isa}{' + AMX' if amx else ''}"
