"""Roofline: how close each point comes to what the hardware allows (docs/metrics.md, "Roofline").

The machine's ceilings are measured once per (host, device, dtype, threads) and cached:
memory bandwidth from a large tensor copy (bytes read + bytes written per second, best of
several), and matrix-product FLOP/s in the run's dtype (best of several). They are measured in
a short-lived child process so the run's own processes start clean.

Decode is bound by the larger of two times (`decode_roofline_fraction`, `decode_roofline_bound`):
its bytes over the bandwidth and its arithmetic over the matrix peak (a large batch, or a CPU
without half-precision arithmetic, can make the second bind). Its bytes: a step must read every
weight it uses once - for a mixture of experts the experts the batch's tokens are routed to,
expected E x (1 - (1 - k/E)^b) of E per MoE layer for b tokens each choosing k uniformly - plus
the KV cache of every live sequence by layer group (sliding layers their window, linear layers
their fixed state); its arithmetic: 2 FLOPs per active weight per token plus attention over each
token's keys (`decode_flops_per_step`). `decode_bw_fraction` stays the bandwidth's alone. Prefill
is bound by arithmetic: 2 FLOPs per *active* weight per prompt token (the LM head only for the
last token of each sequence) plus attention, 2 x heads x (qk dim + v dim) x the keys each query
sees, summed over positions: S^2/2 for full and latent layers, about S x W for a window W, S x C/2
for chunks C (QK^T and PV; linear layers' recurrences are not counted).
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness.core.errors import UserError
from harness.core.kvcalc import estimate, kv_dtype_of
from harness.core.presets import ModelShape

_ELEM = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Ceilings:
    device: str
    device_name: str
    dtype: str
    threads: int
    mem_bw_bytes_s: float
    matmul_flops: float
    measured_at: str
    method: str = "copy of a 256 MiB (CPU) / 2 GiB (GPU) tensor; square matmul n=2048 (CPU) / 8192 (GPU); best of 5"


def _measure(device: str, dtype: str, out: Any) -> None:
    import torch

    dev = torch.device(device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def best(fn, reps: int = 5) -> float:
        fn()
        sync()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return min(times)

    nbytes = (2 << 30) if dev.type == "cuda" else (256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    bw = 2 * nbytes / best(lambda: dst.copy_(src))
    del src, dst

    def matmul(dt: Any, n: int) -> float:
        a = torch.randn(n, n, device=dev).to(dt)
        b = torch.randn(n, n, device=dev).to(dt)
        return 2 * n**3 / best(lambda: a @ b)

    dt = getattr(torch, dtype)
    n = 8192 if dev.type == "cuda" else 2048
    if dev.type == "cpu":
        n = _cpu_matmul_size(lambda m: 2 * m**3 / matmul(dt, m), n)
    flops = matmul(dt, n)
    how = f"copy of a {nbytes >> 20} MiB tensor; square {dtype} matmul n={n}; best of 5"
    if dev.type == "cpu" and dt != torch.float32:
        # A CPU without arithmetic in this dtype (bf16 or fp16 on an AVX2-only CPU) multiplies
        # it in a generic loop, ~1 GFLOP/s on 2 cores, while an engine can widen the operands
        # to float32 and multiply at float32's peak: the ceiling is the faster of the two.
        f32 = matmul(torch.float32, 2048)
        if f32 > flops:
            how += f" ({flops / 1e9:.1f} GFLOP/s), below float32's n=2048 ({f32 / 1e9:.1f} GFLOP/s): float32's is the ceiling"
            flops = f32
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    out.put({"device_name": name, "threads": torch.get_num_threads(), "mem_bw_bytes_s": bw, "matmul_flops": flops,
             "method": how})


def _cpu_matmul_size(seconds_at: Any, n: int, budget_s: float = 1.0, start: int = 256) -> int:
    """The largest square size up to `n` (halving) whose product should take at most `budget_s`,
    extrapolated (n^3) from one product of `start`: torch's bf16 product on an AVX2-only CPU took
    2.3 s at n=1024 and would take ~20 s at 2048, six times over (the ceilings once ran past their
    300 s limit and the run had no roofline)."""
    t = seconds_at(start)
    while n > start and t * (n / start) ** 3 > budget_s:
        n //= 2
    return n


def measure(device: str, dtype: str, timeout_s: float = 300) -> Ceilings:
    """Measures in a child process; one that has not answered in timeout_s is ended (never left running
    beside the benchmark) and the measurement raises TimeoutError."""
    import queue
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_measure, args=(device, dtype, q))
    p.start()
    try:
        res = q.get(timeout=timeout_s)
        p.join(30)
    except queue.Empty:
        raise TimeoutError(f"the {device} {dtype} ceilings took more than {timeout_s:g} s") from None
    finally:
        if p.is_alive():
            p.kill()
            p.join(10)
    return Ceilings(device=device, dtype=dtype, measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"), **res)


# A cached measurement older than this is taken again. A virtual machine's memory bandwidth moves
# with its neighbours on the host: on the Intel Xeon with AMX (2 cores) the same copy measured 10.8 and
# 22.8 GB/s hours apart, and the reference engine's decode-step products moved between 17 and 25 GB/s
# within an afternoon; a fraction against a ceiling from another hour (or one measured under load) is
# off by as much.
MAX_AGE_S = 3600.0


def _age_s(measured_at: str) -> float | None:
    try:
        return time.time() - time.mktime(time.strptime(measured_at, "%Y-%m-%dT%H:%M:%S"))
    except (TypeError, ValueError, OverflowError):
        return None


def cached_ceilings(device: str, dtype: str, cache_file: Path, max_age_s: float = MAX_AGE_S) -> Ceilings:
    """The ceilings for this host/device/dtype, measured on first use and cached for `max_age_s`
    (MAX_AGE_S): an older entry, or one whose time cannot be read, is measured again."""
    from harness.core.env import cpu_model
    key = f"{platform.node()}|{cpu_model()}|{os.cpu_count()}|{device}|{dtype}"
    try:
        data = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        data = {}
    if key in data:
        age = _age_s(data[key].get("measured_at"))
        if age is not None and 0 <= age <= max_age_s:
            return Ceilings(**data[key])
    c = measure(device, dtype)
    data[key] = asdict(c)
    from harness.core.results import atomic_write_text
    atomic_write_text(cache_file, json.dumps(data, indent=2))
    return c


def weights_bytes(shape: ModelShape, dtype: str) -> int:
    """Every weight, every expert included: what the model holds in memory."""
    return shape.num_parameters() * _ELEM[dtype]


def experts_touched(shape: ModelShape, tokens: int) -> float:
    """Expected distinct routed experts of one MoE layer that `tokens` tokens use, each sent to k
    of E experts uniformly: E x (1 - (1 - k/E)^tokens) (k for one token, E for many)."""
    e, k = shape.num_experts, shape.num_experts_per_tok
    if not e:
        return 0.0
    return e * (1 - (1 - k / e) ** max(tokens, 0))


def decode_weight_bytes(shape: ModelShape, dtype: str, batch: int) -> float:
    """Weights a decode step of `batch` sequences reads: everything but the routed experts and
    the input embedding table, plus the experts its tokens are expected to touch in each MoE
    layer and the table's rows of its `batch` tokens. (Tied embeddings: the LM head reads the
    whole table, counted once. Before 2026-12-05 the whole table was counted untied too, which
    overstated `decode_bw_fraction` by table / step bytes: 49 of 256 MB on the `small` preset.)"""
    per_expert = shape.expert_parameters()
    layers = shape.moe_layer_count()
    shared = shape.active_parameters() - layers * shape.num_experts_per_tok * per_expert  # never routed
    if not shape.tie_word_embeddings:  # the lookup reads one row per token, not the table
        shared -= (shape.vocab_size - min(batch, shape.vocab_size)) * shape.hidden_size
    return (shared + layers * experts_touched(shape, batch) * per_expert) * _ELEM[dtype]


def _attended_keys(kind: str, s: int, window: int | None) -> float:
    """Keys all S queries of a causal prompt see in a layer of this kind, summed."""
    if kind in ("full", "latent") or not window:
        return s * s / 2
    if kind == "sliding":
        w = min(window, s)
        return w * s - w * w / 2
    if kind == "chunked":
        c = min(window, s)
        return s * c / 2
    return 0.0  # linear: no attention over keys


def prefill_flops(shape: ModelShape, batch: int, prompt_len: int) -> float:
    head = shape.vocab_size * shape.hidden_size
    embed = shape.vocab_size * shape.hidden_size
    body = shape.active_parameters() - embed - (0 if shape.tie_word_embeddings else head)
    dense = 2 * body * batch * prompt_len + 2 * head * batch
    attn = sum(per_key * _attended_keys(kind, prompt_len, window) for kind, per_key, window in _attention_layers(shape))
    return float(dense + attn * batch)


def _attention_layers(shape: ModelShape):
    """Per layer: (its kind, FLOPs per query and key: 2 x heads x (qk dim + v dim), its window or
    chunk); latent layers counted expanded."""
    for kind in shape.layer_kinds():
        if kind == "latent":
            dims = (shape.qk_nope_head_dim or 0) + (shape.qk_rope_head_dim or 0) + (shape.v_head_dim or 0)
        else:
            dims = 2 * shape.head_dim
        yield kind, 2 * shape.num_attention_heads * dims, (shape.sliding_window if kind == "sliding"
                                                           else shape.attention_chunk_size)


def _decode_keys(kind: str, context: float, window: int | None) -> float:
    """Keys one decode query sees in a layer of this kind at `context` tokens (its own included)."""
    if kind in ("full", "latent") or not window:
        return context
    if kind == "sliding":
        return min(window, context)
    if kind == "chunked":  # the chunk so far: up to C, C/2 on average once past the first chunk
        return context if context <= window else window / 2
    return 0.0  # linear: no attention over keys


def decode_flops_per_step(shape: ModelShape, batch: int, mean_context: float) -> float:
    """Arithmetic of a decode step of `batch` sequences at `mean_context` tokens: 2 FLOPs per active
    weight per token (each token its own k experts; the LM head on every token; the input
    embedding table is a lookup, no product) plus attention, per layer 2 x heads x (qk dim + v dim)
    x the keys each token sees (full and latent layers its context, a window at most W, chunked
    layers their chunk so far, linear layers none; latent layers counted expanded, as prefill_flops)."""
    embed = shape.vocab_size * shape.hidden_size
    dense = 2 * (shape.active_parameters() - embed + (embed if shape.tie_word_embeddings else 0)) * batch
    attn = sum(per_key * _decode_keys(kind, mean_context, window) for kind, per_key, window in _attention_layers(shape))
    return float(dense + attn * batch)


def decode_roofline(by: float, flops: float, ceil: Ceilings) -> tuple[float, str]:
    """(the step's bound in seconds, which binds): the larger of bytes / bandwidth ("memory") and
    FLOPs / the matrix peak ("compute") measured for the run's dtype (on a CPU without half-precision
    arithmetic, float32's: what an engine computes a bf16 model in there, `_measure`)."""
    memory, compute = by / ceil.mem_bw_bytes_s, flops / ceil.matmul_flops
    return (memory, "memory") if memory >= compute else (compute, "compute")


def decode_bytes_per_step(shape: ModelShape, dtype: str, kv_dtype: str, batch: int, mean_context: float) -> float:
    """Weights the step reads + the KV cache of `batch` sequences at `mean_context` tokens, by
    layer group (exact tokens: full and latent layers the context, windowed ones at most what they
    keep, linear layers their state)."""
    kv = 0.0
    for g in estimate(shape, max(math.ceil(mean_context), 1), batch, kv_dtype, state_dtype=dtype).groups:
        if g.kind == "linear":
            kv += g.total_bytes
        else:
            kv += g.bytes_per_token * min(mean_context, g.tokens_per_sequence) * batch
    return decode_weight_bytes(shape, dtype, batch) + kv


def annotate(row: dict[str, Any], shape: ModelShape, ceil: Ceilings) -> dict[str, Any]:
    """Roofline fields for a sweep row (batch_size, prompt_len, output_len and latencies)."""
    b, s, o, dtype = row.get("batch_size"), row.get("prompt_len"), row.get("output_len"), row.get("dtype")
    if not (b and s and o) or dtype not in _ELEM:
        return {}
    kv_dtype = kv_dtype_of(dtype, (row.get("kv_info") or {}).get("kv_dtype"))
    try:
        total, active = shape.num_parameters(), shape.active_parameters()
    except UserError as e:  # a family whose layout infer-bench does not know: no figure rather than a wrong one
        return {"roofline_note": e.problems[0]}
    out: dict[str, Any] = {"roofline_mem_bw_bytes_s": ceil.mem_bw_bytes_s, "roofline_matmul_flops": ceil.matmul_flops,
                           "model_params_total": total, "model_params_active": active}
    if row.get("prefill_latency_s"):
        f = prefill_flops(shape, b, s)
        out["prefill_flops"] = f
        out["prefill_compute_fraction"] = f / row["prefill_latency_s"] / ceil.matmul_flops
    if row.get("decode_step_latency_s") and o > 1:
        mean_ctx = s + o / 2  # decode step i (1 .. o-1) attends to s + i tokens
        by = decode_bytes_per_step(shape, dtype, kv_dtype, b, mean_ctx)
        flops = decode_flops_per_step(shape, b, mean_ctx)
        bound_s, binds = decode_roofline(by, flops, ceil)
        out["decode_bytes_per_step"] = by
        out["decode_flops_per_step"] = flops
        out["decode_bw_fraction"] = by / row["decode_step_latency_s"] / ceil.mem_bw_bytes_s
        out["decode_roofline_s"] = bound_s
        out["decode_roofline_bound"] = binds
        out["decode_roofline_fraction"] = bound_s / row["decode_step_latency_s"]
    return out
