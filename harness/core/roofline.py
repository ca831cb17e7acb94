"""Roofline: how close each point comes to what the hardware allows (docs/metrics.md, "Roofline").

The machine's ceilings are measured once per (host, device, dtype, threads) and cached:
memory bandwidth from a large tensor copy (bytes read + bytes written per second, best of
several), and matrix-product FLOP/s in the run's dtype (best of several). They are measured in
a short-lived child process so the run's own processes start clean.

Decode is bound by memory bandwidth: a step must read every weight once plus the KV cache of
every live sequence. Prefill is bound by arithmetic: 2 FLOPs per weight per prompt token (the
LM head only for the last token of each sequence) plus causal attention, 2 x layers x heads x
head_dim x S^2 per sequence (QK^T and PV, half of each masked away).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness.core.kvcalc import bytes_per_token, kv_dtype_of
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
    n = 8192 if dev.type == "cuda" else 2048
    a = torch.randn(n, n, device=dev).to(getattr(torch, dtype))
    b = torch.randn(n, n, device=dev).to(getattr(torch, dtype))
    flops = 2 * n**3 / best(lambda: a @ b)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    out.put({"device_name": name, "threads": torch.get_num_threads(), "mem_bw_bytes_s": bw, "matmul_flops": flops})


def measure(device: str, dtype: str) -> Ceilings:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_measure, args=(device, dtype, q))
    p.start()
    res = q.get(timeout=300)
    p.join(30)
    return Ceilings(device=device, dtype=dtype, measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"), **res)


def cached_ceilings(device: str, dtype: str, cache_file: Path) -> Ceilings:
    """The ceilings for this host/device/dtype, measured on first use and cached."""
    from harness.core.env import cpu_model
    key = f"{platform.node()}|{cpu_model()}|{os.cpu_count()}|{device}|{dtype}"
    try:
        data = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        data = {}
    if key in data:
        return Ceilings(**data[key])
    c = measure(device, dtype)
    data[key] = asdict(c)
    from harness.core.results import atomic_write_text
    atomic_write_text(cache_file, json.dumps(data, indent=2))
    return c


def weights_bytes(shape: ModelShape, dtype: str) -> int:
    return shape.num_parameters() * _ELEM[dtype]


def prefill_flops(shape: ModelShape, batch: int, prompt_len: int) -> float:
    head = shape.vocab_size * shape.hidden_size
    embed = shape.vocab_size * shape.hidden_size
    body = shape.num_parameters() - embed - (0 if shape.tie_word_embeddings else head)
    dense = 2 * body * batch * prompt_len + 2 * head * batch
    attn = 2 * shape.num_hidden_layers * shape.num_attention_heads * shape.head_dim * prompt_len**2 * batch
    return float(dense + attn)


def decode_bytes_per_step(shape: ModelShape, dtype: str, kv_dtype: str, batch: int, mean_context: float) -> float:
    return weights_bytes(shape, dtype) + batch * mean_context * bytes_per_token(shape, kv_dtype)


def annotate(row: dict[str, Any], shape: ModelShape, ceil: Ceilings) -> dict[str, Any]:
    """Roofline fields for a sweep row (batch_size, prompt_len, output_len and latencies)."""
    b, s, o, dtype = row.get("batch_size"), row.get("prompt_len"), row.get("output_len"), row.get("dtype")
    if not (b and s and o) or dtype not in _ELEM:
        return {}
    kv_dtype = kv_dtype_of(dtype, (row.get("kv_info") or {}).get("kv_dtype"))
    out: dict[str, Any] = {"roofline_mem_bw_bytes_s": ceil.mem_bw_bytes_s, "roofline_matmul_flops": ceil.matmul_flops}
    if row.get("prefill_latency_s"):
        f = prefill_flops(shape, b, s)
        out["prefill_flops"] = f
        out["prefill_compute_fraction"] = f / row["prefill_latency_s"] / ceil.matmul_flops
    if row.get("decode_step_latency_s") and o > 1:
        mean_ctx = s + o / 2  # decode step i (1 .. o-1) attends to s + i tokens
        by = decode_bytes_per_step(shape, dtype, kv_dtype, b, mean_ctx)
        out["decode_bytes_per_step"] = by
        out["decode_bw_fraction"] = by / row["decode_step_latency_s"] / ceil.mem_bw_bytes_s
    return out
