"""Which kernels the engine runs, chosen once at load and recorded (LoadInfo.details["kernels"],
kv_cache_info().extra["kernels"]).

    plain  model.Linear + attention.StepAttention: the reference semantics, on any device
    cpu    matrix products on oneDNN-packed weights (kernels_cpu.py), when its probe passes;
           bf16/fp16 weights on a CPU whose oneDNN has no kernels for them (AVX2 only): the
           products of 2 rows or more in float32 on packed float32 copies, 1-row products of
           bf16 weights by a C kernel that widens them in registers (cpu_gemv.py, compiled for
           this CPU at load, when it builds and agrees with the float32 product) (WidenedLinear);
           decode attention by a fused C kernel that reads K/V through the block table
           (cpu_decode.py, compiled for this CPU at load), when it builds and agrees with the
           plain path; prefill attention through torch's scaled_dot_product_attention
           (CpuStepAttention); a 1-token decode step on those bf16 1-row products: each plain
           pre-norm layer in one C call (cpu_layer.py), when it builds and agrees with the
           layer's torch operations
    cuda   SDPA (flash) prefill and a paged decode kernel (Triton, else a PyTorch one) that reads
           K/V through the block table (kernels_cuda.py); decode steps replayed from CUDA graphs
           (cuda_graphs.py); no slicing of long prefills

`engine_options.reference.kernels=plain` forces the plain path (what the tests compare against).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from adapters.reference import cpu_amx, cpu_decode, cpu_gemv, cpu_layer, kernels_cpu
from adapters.reference.attention import PrefillGroup, StepAttention
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
    greedy: Callable[..., Any] | None = None  # logits -> each row's argmax (a list); None: torch.argmax
    steps: Any = None  # the RMS norm of bf16 rows (cpu_layer.RowSteps; Model.steps); None: torch's
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
               "cpu_kind": cpu_kind(), "prefill_attention": "sdpa (fresh chunks causal; after a cached prefix, row "
                                                             "slices under a mask)"}
    make_linear = kernels_cpu.PackedLinear if why is None else Linear
    gemv = None  # the bf16 matrix-vector kernel, where the products are widened
    amx = None  # the AMX kernels (cpu_amx.py), on a CPU that has AMX, for bf16
    if why is None and dtype == torch.bfloat16:
        amx, why_amx = cpu_amx.probe()
        if amx is not None:
            make_linear = partial(cpu_amx.AmxLinear, kernel=amx)
            details["linear"] = (f"amx tiles (cpu_amx.py) for products of at most {cpu_amx.MAX_ROWS} rows, "
                                 "onednn-packed for more")
        elif details["cpu_kind"] == "amx":  # the CPU has AMX, but the kernels are not usable here: say why
            details["amx_fallback_reason"] = why_amx
    if why:
        details["linear_fallback_reason"] = why
        # oneDNN works here but has no kernels for this half precision (an AVX2-only CPU): widen
        if dtype in (torch.bfloat16, torch.float16) and kernels_cpu.probe(torch.float32) is None:
            gemv, why_gemv = cpu_gemv.probe(dtype)
            make_linear = partial(kernels_cpu.WidenedLinear, gemv=gemv)
            few = "the C kernel (cpu_gemv.py)" if gemv else "torch"
            details["linear"] = (f"widened: {dtype_name(dtype)} weights for 1-row products by {few}, float32 "
                                 f"oneDNN-packed copies for {kernels_cpu.WIDEN_ROWS} rows or more (kernels_cpu.WidenedLinear)")
            if why_gemv:
                details["gemv_fallback_reason"] = why_gemv
    decode = None
    if cfg.use_cache and cfg.kv_dtype == "auto":
        decode, why = cpu_decode.probe(dtype)
    else:
        why = f"kv_dtype={cfg.kv_dtype}" if cfg.use_cache else "no KV cache"
    details["decode_attention"] = "fused C kernel (cpu_decode.py)" if decode else "plain (gather + batched matmul)"
    if why:
        details["decode_fallback_reason"] = why
    layer_fn = None
    if decode is not None and amx is not None:
        decode = AmxOrFusedDecode(amx, decode)
        details["decode_attention"] = ("amx tiles (cpu_amx.py) where the pool's blocks are a multiple of 16 tokens and "
                                       "head_dim of 32, else the fused C kernel (cpu_decode.py)")
        layer_fn = cpu_amx.AmxDecodeLayer(amx)
        details["decode_layer"] = (f"whole layers of decode steps of 1 to {cpu_amx.MAX_ROWS} sequences in one C call "
                                   "on amx tiles (cpu_amx.py)")
    elif decode is not None and gemv is not None:
        layer_fn, why_layer = cpu_layer.probe(dtype)
        details["decode_layer"] = ("whole layers of 1-token decode steps in one C call (cpu_layer.py)" if layer_fn
                                   else f"per operation ({why_layer})")
    greedy, why = cpu_decode.greedy_probe()
    details["greedy"] = "C kernel (cpu_decode.py)" if greedy else f"torch.argmax ({why})"
    steps = None
    if dtype == torch.bfloat16:
        steps, why = cpu_layer.rows_probe()
        details["rms_norm"] = "C kernel for bf16 rows (cpu_layer.RowSteps)" if steps else f"torch ({why})"
    return Kernels("cpu", make_linear, ROWS, partial(CpuStepAttention, decode_fn=decode, layer_fn=layer_fn),
                   details=details, greedy=greedy, steps=steps)


class AmxOrFusedDecode:
    """Decode attention on the AMX tiles where the pool suits them (cpu_amx.AmxKernels.supports_pool),
    else by the fused C kernel (cpu_decode.PagedDecode); PagedDecode's interface."""

    def __init__(self, amx: cpu_amx.AmxKernels, fused: cpu_decode.PagedDecode):
        self.amx, self.fused = amx, fused

    def __call__(self, q: torch.Tensor, pool, layer: int, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        if self.amx.supports_pool(pool, q.dtype):
            return self.amx.decode(q, pool, layer, tables, lens)
        return self.fused(q, pool, layer, tables, lens)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class CpuStepAttention(StepAttention):
    """The plain attention with two fused kernels:

    - prefill through torch's scaled_dot_product_attention (its CPU kernel tiles the scores with
      an online softmax; grouped queries natively): a group of fresh chunks in one causal call;
      a chunk after a cached prefix one plain row slice at a time, under the slice's mask
      (docs/reference-engine.md, "Prefill at the matrix limit", for what it saved).
    - decode chunks to the fused C kernel (cpu_decode.py), when it built (`decode_fn`).

    A sliding window or attention sinks keep the plain path (the SDPA call has neither).

    A step of one decode token (batch 1) with bf16 weights on the C matrix-vector kernel offers
    the model `decode_layer`: a whole layer in one C call (cpu_layer.py)."""

    _takes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> per layer, cpu_layer.layer_takes

    def __init__(self, pool, chunks, num_heads, device, decode_fn=None, layer_fn=None, **kwargs):
        super().__init__(pool, chunks, num_heads, device, **kwargs)
        self.decode_fn = decode_fn
        self.layer_fn = None
        rows = getattr(layer_fn, "max_rows", 1)  # cpu_layer.DecodeLayer: 1; cpu_amx.AmxDecodeLayer: a batch
        if (layer_fn is not None and decode_fn is not None and len(chunks) == self.num_decode and 0 < self.num_decode <= rows
                and not self.window and self.sinks is None and pool.kv_dtype == "auto"
                and (rows == 1 or pool.block_size % 16 == 0)):
            self.layer_fn, self.length = layer_fn, chunks[0].end
            self.max_len = max(c.end for c in chunks)

    def decode_layer(self, model, i: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """Layer i of this decode step by a fused C kernel: the new x, or None where it does not apply
        (the model then runs the layer op by op)."""
        if self.layer_fn is None:
            return None
        takes = self._takes.get(model)
        if takes is None:
            accept = getattr(self.layer_fn, "takes", cpu_layer.layer_takes)
            takes = self._takes[model] = [accept(model, j) for j in range(len(model.layers))]
        if not takes[i]:
            return None
        if self.layer_fn.max_rows == 1:  # cpu_layer.DecodeLayer: one token
            if not hasattr(self, "position"):  # once a step
                self.position = int(positions[0])
            return self.layer_fn(x, model.layers[i], model.cos[self.position], model.sin[self.position], self.pool.k[i],
                                 self.pool.v[i], self.decode_tables[0], self.length, model.cfg.rms_norm_eps)
        return self.layer_fn(x, model.layers[i], model.cos, model.sin, positions, self.pool.k[i], self.pool.v[i],
                             self.decode_tables, self.decode_lens, self.max_len, model.cfg.rms_norm_eps)

    def decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        if self.decode_fn is None:
            return super().decode(layer, q)
        return self.decode_fn(q, self.pool, layer, self.decode_tables, self.decode_lens)

    def prefill(self, layer: int, g: PrefillGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor) -> None:
        if self.window or self.sinks is not None:
            return super().prefill(layer, g, q, k, v, out)
        n, heads, d = g.end - g.start, q.shape[1], q.shape[2]
        kv_heads = k.shape[1]
        span = slice(g.offset, g.offset + g.count * n)
        qs = q[span].view(g.count, n, heads, d).transpose(1, 2)  # [count, heads, n, d]
        if g.table is None:  # fresh: causal over the chunks' own K/V
            ks = k[span].view(g.count, n, kv_heads, d).transpose(1, 2)
            vs = v[span].view(g.count, n, kv_heads, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=heads != kv_heads)
            out[span] = o.transpose(1, 2).reshape(g.count * n, heads * d)
            return
        ks, vs = self.pool.read(layer, g.table, g.end)  # [1, kv_heads, end, d]
        dest = out[span]
        for r0, r1, mask in g.slices:  # query rows r0..r1 see keys up to their own position
            o = F.scaled_dot_product_attention(qs[:, :, r0:r1], ks[:, :, :g.start + r1], vs[:, :, :g.start + r1],
                                               attn_mask=mask, enable_gqa=heads != kv_heads)
            dest[r0:r1] = o.transpose(1, 2).reshape(r1 - r0, heads * d)


def cpu_kind(flags: set[str] | None = None) -> str:
    """The CPU's kind as the kernels see it, from /proc/cpuinfo's flags: amx (AMX tiles with bf16, and
    AVX-512 bf16), avx512_bf16, avx512 (AVX-512 without bf16 arithmetic), avx2, or other. On x86 the
    kernels are chosen by probing (oneDNN's bf16 products; cpu_amx.probe checks the AMX flags itself);
    this names what was found, for the record (docs/reference-engine.md, "Kernels per CPU kind")."""
    if flags is None:
        from harness.core.env import cpu_flags as proc_flags

        flags = set(proc_flags())
    if {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:
        return "amx"
    if {"avx512f", "avx512_bf16"} <= flags:
        return "avx512_bf16"
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    return "other"


def cpu_flags() -> str:
    """The vector extensions torch reports for this CPU (AMX / AVX-512 / AVX2), for the record."""
    cpu = getattr(torch.backends, "cpu", None)
    isa = cpu.get_cpu_capability() if cpu is not None and hasattr(cpu, "get_cpu_capability") else "unknown"
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return f"{isa}{' + AMX' if amx else ''}"
