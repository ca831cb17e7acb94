"""CUDA fast path: the same attention as attention.py, in a few big kernels.

    prefill  torch's scaled_dot_product_attention (flash / cuDNN / memory-efficient backends):
             fresh chunks of equal length batched, is_causal; a chunk after a cached prefix
             attends to its context gathered from the pool, with a lower-right causal mask.
             No slicing of query rows (that is for a CPU's caches): one call per group.
    decode   a paged kernel that reads K/V through the block table (triton_paged_attention.py);
             where Triton is missing or its probe fails, `paged_decode_torch` (gather + the plain
             batched matmul), which is also the kernel's reference semantics.
    graphs   decode steps replayed from CUDA graphs (cuda_graphs.py), when cuda_graphs=true.

Everything is chosen once at load by `select`, which runs each candidate on a tiny input and
compares it with the plain path before trusting it; the choice and any reason for a fallback
go to LoadInfo.details["kernels"].
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from adapters.reference.attention import PrefillGroup, StepAttention, decode_attention, length_mask
from adapters.reference.config import EngineConfig
from adapters.reference.kv_cache import KVPool
from adapters.reference.model import Linear

DecodeFn = Callable[[torch.Tensor, KVPool, int, torch.Tensor, torch.Tensor], torch.Tensor]


# ---- decode: the reference semantics and the kernel ---------------------------------------

def paged_decode_torch(q: torch.Tensor, pool: KVPool, layer: int, tables: torch.Tensor,
                       lens: torch.Tensor) -> torch.Tensor:
    """Decode attention driven by block tables, in plain PyTorch: q [B, heads, d], tables [B, W]
    (entries past a sequence's blocks: any valid block id), lens [B] -> [B, heads * d]. Gathers
    the W blocks of every table (a CUDA graph needs fixed shapes, so all W) and masks past lens."""
    tables = tables.long()
    kc, vc = pool.gather(layer, tables, tables.shape[1] * pool.block_size)
    return decode_attention(q, kc, vc, length_mask(lens, kc.shape[2]))


def paged_decode_triton(q: torch.Tensor, pool: KVPool, layer: int, tables: torch.Tensor,
                        lens: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """The same through the Triton kernel: nothing is gathered."""
    from adapters.reference import triton_paged_attention as tpa  # imports triton: only when used

    mode = {"auto": 0, "int8": 1, "fp8": 2}[pool.kv_dtype]
    if splits is None:  # a fixed choice per (batch, table width): graph-capturable
        splits = tpa.num_splits(q.shape[0], pool.kv_heads, tables.shape[1] * pool.block_size)
    return tpa.paged_decode(q, pool.k[layer], pool.v[layer], tables, lens,
                            None if pool.k_scale is None else pool.k_scale[layer],
                            None if pool.v_scale is None else pool.v_scale[layer], kv_mode=mode, splits=splits)


# ---- prefill through SDPA -----------------------------------------------------------------

def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, native_gqa: bool) -> torch.Tensor:
    """q [N, heads, n, d], k/v [N, kv_heads, keys, d]; causal when mask is None (n == keys), else
    a boolean mask [n, keys] (True: attend). Grouped queries natively where the backend can,
    else K/V repeated per query head."""
    g = q.shape[1] // k.shape[1]
    if g > 1 and not (native_gqa and mask is None):
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        g = 1
    kwargs = {"enable_gqa": True} if g > 1 else {}
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)


def lower_right_causal(start: int, rows: int, keys: int, device: torch.device) -> torch.Tensor:
    """[rows, keys] boolean: query row r (position start + r) sees keys 0 .. start + r."""
    return torch.arange(keys, device=device)[None, :] <= torch.arange(start, start + rows, device=device)[:, None]


class CudaStepAttention(StepAttention):
    """attention.StepAttention with fused kernels: SDPA prefill, a paged decode kernel."""

    def __init__(self, pool: KVPool | None, chunks: list, num_heads: int, device: torch.device,
                 decode_fn: DecodeFn = paged_decode_torch, native_gqa: bool = False):
        self.decode_fn, self.native_gqa = decode_fn, native_gqa
        super().__init__(pool, chunks, num_heads, device)

    def _plan_prefills(self, spans: list, device: torch.device) -> list[PrefillGroup]:
        """Fresh chunks of equal length go together, however many; no row slices."""
        groups, offset, i = [], self.num_decode, 0
        while i < len(spans):
            seq, start, end = spans[i]
            n, table, count = end - start, None, 1
            if start > 0:
                table = torch.tensor([seq.block_table[:-(-end // self.pool.block_size)]], device=device)
            else:
                while i + count < len(spans) and spans[i + count][1] == 0 and spans[i + count][2] == n:
                    count += 1
            groups.append(PrefillGroup(offset, count, start, end, table, []))
            offset += count * n
            i += count
        return groups

    def decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return self.decode_fn(q, self.pool, layer, self.decode_tables, self.decode_lens)

    def prefill(self, layer: int, g: PrefillGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor) -> None:
        n, heads, d = g.end - g.start, q.shape[1], q.shape[2]
        kv_heads = k.shape[1]
        span = slice(g.offset, g.offset + g.count * n)
        qs = q[span].view(g.count, n, heads, d).transpose(1, 2)
        if g.table is None:
            ks = k[span].view(g.count, n, kv_heads, d).transpose(1, 2)
            vs = v[span].view(g.count, n, kv_heads, d).transpose(1, 2)
            o = sdpa(qs, ks, vs, None, self.native_gqa)
        else:
            ks, vs = self.pool.read(layer, g.table, g.end)  # [1, kv_heads, end, d]
            o = sdpa(qs, ks, vs, lower_right_causal(g.start, n, g.end, q.device), self.native_gqa)
        out[span] = o.transpose(1, 2).reshape(g.count * n, heads * d)


# ---- selection at load ---------------------------------------------------------------------

def _probe_native_gqa(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a fused SDPA backend takes grouped queries (enable_gqa) for this dtype."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q = torch.randn(1, 4, 8, 64, device=device, dtype=dtype)
        k = torch.randn(1, 2, 8, 64, device=device, dtype=dtype)
        fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        with sdpa_kernel(fused):
            F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        return True
    except (RuntimeError, ImportError, TypeError):
        return False


def probe_decode_kernel(device: torch.device, dtype: torch.dtype, kv_dtype: str) -> str | None:
    """None when the Triton decode kernel runs here and agrees with paged_decode_torch; else why
    not (Triton missing, no compiler for this GPU, a wrong result)."""
    try:
        import triton  # noqa: F401 (only whether it is there)
    except ImportError:
        return "triton is not installed"
    try:
        g = torch.Generator(device=device).manual_seed(0)
        pool = KVPool(1, 6, 16, 2, 64, kv_dtype, dtype, device)
        rows = pool.rows(torch.arange(6, device=device).repeat_interleave(16), torch.arange(16, device=device).repeat(6))
        kv = torch.randn(96, 2, 64, generator=g, device=device, dtype=dtype)
        pool.write(0, rows, kv, kv.flip(0))
        q = torch.randn(3, 8, 64, generator=g, device=device, dtype=dtype)
        tables = torch.tensor([[5, 0, 3, 1], [2, 4, 4, 4], [1, 2, 3, 4]], device=device, dtype=torch.int32)
        lens = torch.tensor([60, 17, 64], device=device, dtype=torch.int32)
        want = paged_decode_torch(q, pool, 0, tables, lens).float()
        got = paged_decode_triton(q, pool, 0, tables, lens, splits=2).float()
    except Exception as e:  # any failure to build or run the kernel means: use the fallback
        return f"the Triton decode kernel failed here ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
    err = ((got - want).abs().max() / want.abs().max()).item()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    if not err < tol:
        return f"the Triton decode kernel disagrees with the PyTorch one (relative error {err:.2e})"
    return None


def select(device: torch.device, dtype: torch.dtype, cfg: EngineConfig) -> dict:
    """The fields of kernels.Kernels for this GPU (probed)."""
    native_gqa = _probe_native_gqa(device, dtype)
    why = probe_decode_kernel(device, dtype, cfg.kv_dtype) if cfg.use_cache else "no KV cache"
    decode_fn = paged_decode_triton if why is None else paged_decode_torch
    details = {"kernels": "cuda", "linear": "torch (cuBLAS)",
               "prefill_attention": f"sdpa ({'native GQA' if native_gqa else 'K/V repeated per query head'})",
               "decode_attention": "triton paged" if why is None else "torch paged (gather + matmul)",
               "cuda_graphs": bool(cfg.cuda_graphs and cfg.use_cache)}
    if why:
        details["decode_fallback_reason"] = why
    attention = partial(CudaStepAttention, decode_fn=decode_fn, native_gqa=native_gqa)
    return {"name": "cuda", "make_linear": Linear, "rows": None, "attention": attention,
            "decode_graphs": details["cuda_graphs"], "decode_fn": decode_fn, "details": details}
