"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over a paged *latent* cache.

Per token and layer the model computes (model.Model._mla_inputs)

    latent = [ RMSNorm(c) , RoPE(k_rot) ]      c: kv_lora_rank values, k_rot: qk_rope_head_dim values
    (c, k_rot) = split_latent(kv_a_proj_with_mqa(x))

and only that vector is cached: (kv_lora_rank + qk_rope_head_dim) x element bytes per token and
layer, for all heads together (dense K/V would keep heads x (qk_nope + qk_rope + v_head_dim)).
Attention *decompresses* what it reads: kv_b_proj(c) gives each head's k_nope and v; a head's
key is [k_nope, k_rot] (k_rot shared by every head), its query [q_nope, RoPE(q_rot)]; the scale
is 1 / sqrt(qk_nope + qk_rope).

Decode has two forms (engine option `mla_attention`), equal in exact arithmetic:
- `expand`: as above, every step up-projects every cached latent of the sequence through kv_b
  (rank x heads x (qk_nope + v) multiply-adds per cached token and layer);
- `absorb`: kv_b's key half W_uk [heads, qk_nope, rank] is folded into the query and its value
  half W_uv [heads, v, rank] into the output, so attention reads the latents as they are
  stored: q_lat = q_nope W_uk (per head), score = q_lat . c + q_rot . k_rot, o_lat = sum p c,
  o = o_lat W_uv^T (heads x (rank + rope) x 2 per cached token and layer, plus a fixed
  heads x rank x (qk_nope + v) per query). Prefill always expands (many queries share each
  expanded key: the product is done once per token there, as vLLM does too). Which is faster
  here is measured in docs/reference-engine.md.

DeepSeek's RoPE is interleaved (`rope_interleave`, the default): the rope dims are taken even
ones first, then odd ones (`deinterleave`), which turns it into the halves-rotated RoPE of
model.Model.rotate; queries and keys are permuted alike, so their dot products are DeepSeek's.

`LatentPool` is the paged store: [layers, blocks, block_size, latent] in the model's dtype, or
int8 / fp8 as kv_cache.KVPool stores K and V (int8: one float32 scale per token and layer), one
block table per sequence managed by the ordinary block_manager.BlockManager.
`MLAStepAttention` is a step's attention (write the chunk's latents, then decode chunks
together against their gathered blocks, prefill chunks one by one: fresh ones against their
own latents, ones after a cached context against the pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adapters.reference.attention import causal_mask, is_decode, length_mask, padded_tables
from adapters.reference.kv_cache import STORE_DTYPES, dequantise, quantise


@dataclass(frozen=True)
class MLAConfig:
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None  # None: one q_proj; else q_a_proj -> RMSNorm -> q_b_proj
    rope_interleave: bool
    score_factor: float = 1.0  # YaRN's mscale_all_dim correction of the softmax scale (model.mla_score_factor)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def split_latent(kv: torch.Tensor, rank: int, rope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_a_proj_with_mqa's output [..., rank + rope] -> (c [..., rank], k_rot [..., rope]):
    the compressed part first, the rope part last."""
    return kv[..., :rank], kv[..., rank:rank + rope]


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d]: the even dims, then the odd ones."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def latent_bytes_per_token(num_layers: int, mla: MLAConfig, dtype: torch.dtype, kv_dtype: str = "auto") -> int:
    """Latent bytes for one token, all layers: (rank + rope) values per layer, as `kv_dtype` stores
    them, plus for int8 one float32 scale per token and layer (the latent is one "head" shared by
    every head, so it has one scale, as kv_cache.bytes_per_token has one per token and KV head)."""
    if kv_dtype == "int8":
        per_layer = mla.latent_dim + 4  # int8 values + one float32 scale
    elif kv_dtype == "fp8":
        per_layer = mla.latent_dim
    else:
        per_layer = mla.latent_dim * torch.empty((), dtype=dtype).element_size()
    return num_layers * per_layer


class LatentPool:
    """The paged latent cache: one pre-allocated tensor [layers, total_blocks, block_size, latent],
    in the model's dtype or quantised as kv_cache.KVPool quantises K and V (`kv_dtype` int8: int8
    values and a float32 scale per token and layer in `scale` [layers, total_blocks, block_size],
    scale = max|latent| / 127 over the token's rank + rope values; fp8: float8 e4m3 in uint8,
    clamped to +-448, no scale). Reads dequantise to the model's dtype."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, mla: MLAConfig,
                 dtype: torch.dtype, device: torch.device, kv_dtype: str = "auto"):
        self.num_blocks, self.block_size, self.total_blocks = num_blocks, block_size, num_blocks
        self.kv_dtype, self.model_dtype = kv_dtype, dtype
        store = STORE_DTYPES.get(kv_dtype, dtype)
        self.latent = torch.zeros(num_layers, num_blocks, block_size, mla.latent_dim, dtype=store, device=device)
        self.scale = None
        if kv_dtype == "int8":
            self.scale = torch.zeros(num_layers, num_blocks, block_size, dtype=torch.float32, device=device)
        self.bytes_per_token = latent_bytes_per_token(num_layers, mla, dtype, kv_dtype)
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.latent, self.scale) if t is not None)
        assert self.nbytes == self.bytes_per_token * num_blocks * block_size

    def rows(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return blocks * self.block_size + offsets

    def write(self, layer: int, rows: torch.Tensor, latent: torch.Tensor) -> None:
        q, s = quantise(latent, self.kv_dtype)
        self.latent[layer].view(-1, self.latent.shape[-1]).index_copy_(0, rows, q)
        if self.scale is not None:
            self.scale[layer].view(-1).index_copy_(0, rows, s)

    def gather(self, layer: int, tables: torch.Tensor) -> torch.Tensor:
        """[B, n] block tables -> [B, n * block_size, latent] in the model's dtype."""
        b, n = tables.shape
        ids = tables.reshape(-1)
        x = self.latent[layer].index_select(0, ids)
        s = None if self.scale is None else self.scale[layer].index_select(0, ids)
        return dequantise(x, s, self.kv_dtype, self.model_dtype).view(b, n * self.block_size, -1)


class MLAStepAttention:
    """One step's latent attention; the model calls it per layer with the queries [T, heads,
    qk_head_dim] and the new latents [T, latent]. `kv_b[layer]` is the layer's kv_b_proj."""

    def __init__(self, pool: LatentPool | None, chunks: list, num_heads: int, device: torch.device,
                 kv_b: list, mla: MLAConfig, form: str = "absorb"):
        self.pool, self.kv_b, self.mla, self.heads, self.form = pool, kv_b, mla, num_heads, form
        self.scale = mla.qk_head_dim ** -0.5 * mla.score_factor
        spans = [(c.seq, c.start, c.end) for c in chunks]
        self.num_decode = sum(1 for _, s, e in spans if pool is not None and is_decode(s, e))
        if pool is not None:
            bs = pool.block_size
            blocks, offsets = [], []
            for seq, start, end in spans:
                blocks.extend(seq.block_table[p // bs] for p in range(start, end))
                offsets.extend(p % bs for p in range(start, end))
            self.rows = pool.rows(torch.tensor(blocks, device=device), torch.tensor(offsets, device=device))
        if self.num_decode:
            dec = spans[:self.num_decode]
            longest = max(end for _, _, end in dec)
            width = -(-longest // pool.block_size)
            self.decode_tables = torch.tensor(padded_tables([s.block_table for s, _, _ in dec], width),
                                              dtype=torch.long, device=device)
            self.decode_mask = length_mask(torch.tensor([end for _, _, end in dec], device=device),
                                           width * pool.block_size)
        self.prefills = []  # (offset in the flat batch, start, end, table or None, causal mask)
        offset = self.num_decode
        for seq, start, end in spans[self.num_decode:]:
            table = None
            if start > 0:
                table = torch.tensor([seq.block_table[:-(-end // pool.block_size)]], device=device)
            self.prefills.append((offset, start, end, table, causal_mask(start, end - start, end, device)))
            offset += end - start

    def expand(self, layer: int, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., L, latent] -> keys [..., L, heads, qk_head_dim] and values [..., L, heads, v_head_dim]."""
        m = self.mla
        c, k_rot = latent[..., :m.kv_lora_rank], latent[..., m.kv_lora_rank:]
        kv = self.kv_b[layer](c.reshape(-1, m.kv_lora_rank)).view(*c.shape[:-1], self.heads, -1)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.unsqueeze(-2).expand(*k_rot.shape[:-1], self.heads, m.qk_rope_head_dim)], dim=-1)
        return k, v

    def absorbed_decode(self, layer: int, q: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The absorbed form (module docstring): q [B, heads, qk_head_dim], latent [B, L, rank + rope]
        as stored, mask [B, L] -> [B, heads * v_head_dim]."""
        m = self.mla
        w = self.kv_b[layer].weight.view(self.heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk, w_uv = w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]  # [H, nope, rank], [H, v, rank]
        q_nope, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c, k_rot = latent[..., :m.kv_lora_rank], latent[..., m.kv_lora_rank:]
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
        s = torch.einsum("bhr,blr->bhl", q_lat, c) + torch.einsum("bhd,bld->bhl", q_rot, k_rot)
        p = s.float().mul_(self.scale).add_(mask[:, None]).softmax(dim=-1).to(q.dtype)
        o_lat = torch.einsum("bhl,blr->bhr", p, c)
        return torch.einsum("bhr,hvr->bhv", o_lat, w_uv).reshape(q.shape[0], -1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, R, H, dq], k [B, L, H, dq], v [B, L, H, dv], mask [B or 1, R, L] -> [B, R, H * dv]."""
        s = torch.einsum("brhd,blhd->bhrl", q, k).float().mul_(self.scale).add_(mask[:, None])
        p = s.softmax(dim=-1).to(q.dtype)
        o = torch.einsum("bhrl,blhd->brhd", p, v)
        return o.reshape(*o.shape[:2], -1)

    def __call__(self, layer: int, q: torch.Tensor, latent: torch.Tensor, _unused=None) -> torch.Tensor:
        if self.pool is not None:
            self.pool.write(layer, self.rows, latent)
        t = q.shape[0]
        out = torch.empty(t, self.heads * self.mla.v_head_dim, dtype=q.dtype, device=q.device)
        if self.num_decode and self.form == "absorb":
            out[:self.num_decode] = self.absorbed_decode(layer, q[:self.num_decode],
                                                         self.pool.gather(layer, self.decode_tables), self.decode_mask)
        elif self.num_decode:
            k, v = self.expand(layer, self.pool.gather(layer, self.decode_tables))
            out[:self.num_decode] = self.attend(q[:self.num_decode, None], k, v, self.decode_mask[:, None])[:, 0]
        for offset, start, end, table, mask in self.prefills:
            n = end - start
            ctx = latent[offset:offset + n][None] if table is None else self.pool.gather(layer, table)[:, :end]
            k, v = self.expand(layer, ctx)
            out[offset:offset + n] = self.attend(q[offset:offset + n][None], k, v, mask[None])[0]
        return out


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """DeepSeek's q_a_layernorm and kv_a_layernorm (their eps is the class default, 1e-6)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
