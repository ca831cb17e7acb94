"""Attention through the block table, for one step's flat batch of chunks.

The step's tokens arrive flat ([T, heads, head_dim]), decode chunks first. Per layer:

1. the new tokens' K/V are written into their slots of the pool (all chunks at once);
2. decode chunks (one new token after a cached context) are attended together: their blocks
   are gathered from the pool ([B, context, kv_heads, head_dim]) and a mask hides each
   sequence's unused tail. Grouped-query attention without copying K/V per query head: the
   query heads that share a KV head are laid out as that head's G "query rows";
3. prefill chunks that start at position 0 attend to their own fresh K/V (causal); if they all
   have the same length they go in one batched call. A chunk after a cached prefix (a prefix
   cache hit, the next piece of a chunked prefill, a recomputed sequence after preemption is
   not one: it starts at 0) gathers its whole context from the pool and uses an offset causal
   mask.

Without a KV cache (kv_cache=none) there is no pool: every chunk is a fresh prefill.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adapters.reference.kv_cache import KVPool


def is_decode(start: int, end: int) -> bool:
    return end - start == 1 and start > 0


class StepAttention:
    """Built once per step by the runner; the model calls it once per layer."""

    def __init__(self, pool: KVPool | None, chunks: list, num_heads: int, device: torch.device):
        self.pool, self.num_heads = pool, num_heads
        bs = pool.block_size if pool else 0
        spans = [(c.seq, c.start, c.end) for c in chunks]
        self.num_decode = sum(1 for _, s, e in spans if pool is not None and is_decode(s, e))
        if pool is not None:
            slots = []
            for seq, start, end in spans:
                table = seq.block_table
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        # decode group: padded block tables, a mask of each sequence's context
        if self.num_decode:
            dec = spans[:self.num_decode]
            ctx = [end for _, _, end in dec]
            self.decode_len = max(ctx)
            width = -(-self.decode_len // bs)
            tables = [seq.block_table[:width] + [0] * (width - len(seq.block_table[:width])) for seq, _, _ in dec]
            self.decode_tables = torch.tensor(tables, dtype=torch.long, device=device)
            lens = torch.tensor(ctx, dtype=torch.long, device=device)
            self.decode_mask = (torch.arange(self.decode_len, device=device) < lens[:, None])[:, None, None, :]
        # prefill chunks: (offset in the flat batch, start, end, block table or None if fresh)
        self.prefills = []
        offset = self.num_decode
        for seq, start, end in spans[self.num_decode:]:
            table = None
            if start > 0:
                table = torch.tensor([seq.block_table[:-(-end // bs)]], dtype=torch.long, device=device)
            self.prefills.append((offset, start, end, table))
            offset += end - start
        lengths = {end - start for _, start, end, _ in self.prefills}
        self.batched_prefill = (len(self.prefills) > 1 and len(lengths) == 1
                                and all(t is None for *_, t in self.prefills))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[0]
        if self.pool is not None:
            self.pool.write(layer, self.slots, k, v)
        parts = []
        if self.num_decode:
            parts.append(self._decode(layer, q[:self.num_decode]))
        if self.batched_prefill:
            off, length = self.num_decode, self.prefills[0][2]
            n = len(self.prefills)
            parts.append(self._causal(q[off:].view(n, length, *q.shape[1:]),
                                      k[off:].view(n, length, *k.shape[1:]),
                                      v[off:].view(n, length, *v.shape[1:])).reshape(n * length, -1))
        else:
            for off, start, end, table in self.prefills:
                sl = slice(off, off + end - start)
                if table is None:
                    parts.append(self._causal(q[None, sl], k[None, sl], v[None, sl])[0])
                else:
                    parts.append(self._after_prefix(layer, q[sl], start, end, table))
        return parts[0] if len(parts) == 1 else torch.cat(parts).view(t, -1)

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [B, heads, head_dim] -> [B, heads * head_dim], over each sequence's cached context."""
        b, h, d = q.shape
        k, v = self.pool.read(layer, self.decode_tables, self.decode_len)  # [B, L, kv_heads, d]
        kv_heads = k.shape[2]
        qg = q.view(b, kv_heads, h // kv_heads, d)  # query heads grouped by the KV head they use
        out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=self.decode_mask)
        return out.reshape(b, h * d)

    @staticmethod
    def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[B, S, heads, d] fresh tokens attending causally to themselves -> [B, S, heads * d]."""
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)

    def _after_prefix(self, layer: int, q: torch.Tensor, start: int, end: int,
                      table: torch.Tensor) -> torch.Tensor:
        """Tokens [start, end) attending to the cached context [0, start) and to themselves."""
        k, v = self.pool.read(layer, table, end)  # [1, end, kv_heads, d]
        rows = torch.arange(start, end, device=q.device)[:, None]
        mask = torch.arange(end, device=q.device)[None, :] <= rows  # [S, end]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(end - start, -1)
