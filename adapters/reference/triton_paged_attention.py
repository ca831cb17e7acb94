"""Paged decode attention as a Triton kernel: each new token attends to its sequence's context by
reading K/V straight from the pool through the block table; nothing is gathered or copied.

Imported only when it is used (kernels_cuda.py, on a GPU with Triton); `import triton` happens
here. Its semantics are those of the plain path (attention.decode_attention over pool.gather),
which tests/test_reference_kernels.py checks with Triton's interpreter (TRITON_INTERPRET=1) on a
CPU, and scripts/gpu_check.py on a GPU.

The work is split like flash-decoding: one program per (sequence, KV head, split of the
context). A program loads the G query heads that share its KV head as G rows (padded to 16 for
tl.dot), walks its part of the context a tile of TILE tokens at a time (each token's block from
the table, its offset within the block), and keeps an online softmax in float32: running max m,
running sum l, and the weighted sum of values acc. The splits' (m, l, acc) are combined after
a second kernel: out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s, with M = max_s m_s.
Splitting keeps the GPU busy at batch 1 (one sequence, a few KV heads) with long contexts; two
kernels per layer (not a dozen small PyTorch ops) keep a CUDA-graphed decode step short.

Pool layout (kv_cache.py): k[layer] is [kv_heads, total_blocks, block_size, head_dim]: the row
of token (block b, offset o) for head h is (h * total_blocks + b) * block_size + o.
KV_MODE: 0 the model's dtype; 1 int8 with a float32 scale per (head, token); 2 fp8 e4m3 stored
as uint8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    Q, K, V, KS, VS, TABLES, LENS, ACC, M, L,
    stride_qb, stride_qh, total_blocks, stride_table, scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
    TILE: tl.constexpr, KV_MODE: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    num_heads_kv = tl.num_programs(1)
    splits = tl.num_programs(2)  # not a constexpr: one compiled kernel serves every split count
    length = tl.load(LENS + b)
    tiles = tl.cdiv(length, TILE)
    per_split = tl.cdiv(tiles, splits)
    first = split * per_split
    last = tl.minimum(first + per_split, tiles)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    q_ptr = Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :]  # a strided view is fine
    q = tl.load(q_ptr, mask=(offs_g[:, None] < G) & d_ok[None, :], other=0.0)

    m = tl.full([G_PAD], float("-inf"), tl.float32)
    s_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for t in range(first, last):
        pos = t * TILE + tl.arange(0, TILE)
        valid = pos < length
        block = tl.load(TABLES + b * stride_table + pos // BS, mask=valid, other=0)
        row = (h * total_blocks + block) * BS + pos % BS
        kv_mask = valid[:, None] & d_ok[None, :]
        k = tl.load(K + row[:, None] * D + offs_d[None, :], mask=kv_mask, other=0)
        v = tl.load(V + row[:, None] * D + offs_d[None, :], mask=kv_mask, other=0)
        if KV_MODE == 1:
            k = (k.to(tl.float32) * tl.load(KS + row, mask=valid, other=0.0)[:, None]).to(q.dtype)
            v = (v.to(tl.float32) * tl.load(VS + row, mask=valid, other=0.0)[:, None]).to(q.dtype)
        elif KV_MODE == 2:
            k = k.to(tl.float8e4nv, bitcast=True).to(q.dtype)
            v = v.to(tl.float8e4nv, bitcast=True).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        s_sum = s_sum * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new

    out = ((b * num_heads_kv + h) * splits + split) * G_PAD + offs_g  # rows of [B, KV, SPLITS, G_PAD]
    tl.store(M + out, m)
    tl.store(L + out, s_sum)
    tl.store(ACC + out[:, None] * D_PAD + offs_d[None, :], acc)


@triton.jit
def _combine_kernel(ACC, M, L, OUT, splits,
                    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """Merge the splits of one (sequence, KV head): the same online-softmax step, split by split."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_heads_kv = tl.num_programs(1)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    top = tl.full([G_PAD], float("-inf"), tl.float32)
    den = tl.zeros([G_PAD], tl.float32)
    num = tl.zeros([G_PAD, D_PAD], tl.float32)
    for s in range(0, splits):  # split 0 always holds context, so `top` is finite after it
        row = ((b * num_heads_kv + h) * splits + s) * G_PAD + offs_g
        m_s = tl.load(M + row)
        new = tl.maximum(top, m_s)
        old_w = tl.exp(top - new)
        w = tl.exp(m_s - new)
        den = den * old_w + tl.load(L + row) * w
        num = num * old_w[:, None] + tl.load(ACC + row[:, None] * D_PAD + offs_d[None, :]) * w[:, None]
        top = new
    out = num / den[:, None]
    heads = num_heads_kv * G
    dest = OUT + (b * heads + h * G + offs_g)[:, None] * D + offs_d[None, :]
    tl.store(dest, out.to(OUT.dtype.element_ty), mask=(offs_g[:, None] < G) & (offs_d[None, :] < D))


def _pow2(n: int, low: int = 1) -> int:
    return max(low, 1 << (max(n, 1) - 1).bit_length())


def num_splits(batch: int, kv_heads: int, max_len: int, tile: int = 32, target_programs: int = 256) -> int:
    """Context splits per (sequence, head): enough programs to fill a GPU, never more splits
    than tiles of context."""
    want = max(1, target_programs // max(1, batch * kv_heads))
    return max(1, min(want, 64, -(-max_len // tile)))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 kv_mode: int = 0, splits: int = 1, tile: int = 32) -> torch.Tensor:
    """q [B, heads, d]; k_cache, v_cache [kv_heads, total_blocks, block_size, d] (one layer);
    tables [B, W] block ids (int32 or int64); lens [B] context lengths (>= 1); k_scale/v_scale
    [kv_heads, total_blocks, block_size] float32 for int8. Returns [B, heads * d] in q's dtype.
    Shapes and `splits` are fixed per call, so a CUDA graph can capture it."""
    b, heads, d = q.shape
    kv_heads, total_blocks, bs, _ = k_cache.shape
    g = heads // kv_heads
    g_pad, d_pad = _pow2(g, 16), _pow2(d, 16)
    tile = max(16, tile)
    acc = torch.empty(b, kv_heads, splits, g_pad, d_pad, dtype=torch.float32, device=q.device)
    m = torch.empty(b, kv_heads, splits, g_pad, dtype=torch.float32, device=q.device)
    s = torch.empty_like(m)
    ks = k_scale if k_scale is not None else m  # unused unless int8
    vs = v_scale if v_scale is not None else m
    if q.stride(2) != 1:
        q = q.contiguous()
    _paged_decode_kernel[(b, kv_heads, splits)](
        q, k_cache, v_cache, ks, vs, tables, lens, acc, m, s,
        q.stride(0), q.stride(1), total_blocks, tables.stride(0), d ** -0.5,
        G=g, G_PAD=g_pad, D=d, D_PAD=d_pad, BS=bs, TILE=tile, KV_MODE=kv_mode,
        IEEE=q.dtype == torch.float32,
    )
    out = torch.empty(b, heads * d, dtype=q.dtype, device=q.device)
    _combine_kernel[(b, kv_heads)](acc, m, s, out, splits, G=g, G_PAD=g_pad, D=d, D_PAD=d_pad)
    return out
