"""Attention through the block table, for one step's flat batch of chunks: the plain-PyTorch
path, which holds the reference semantics (the tests' oracle; kernels_cuda.py computes the same
with fused kernels).

The step's tokens arrive flat ([T, heads, head_dim]), decode chunks first. Per layer:

1. the new tokens' K/V are written into their slots of the pool (all chunks at once);
2. decode chunks (one new token after a cached context) are attended together: their blocks are
   gathered from the pool head by head, giving [kv_heads, B, n * block_size, head_dim] (each
   sequence's keys one run of rows), and an additive mask hides each sequence's unused tail
   (`decode_attention`): one batched product over (KV head, sequence) pairs;
3. prefill chunks attend causally: a chunk that starts at position 0 to its own fresh K/V
   (equal-length chunks are batched), a chunk after a cached prefix (a prefix-cache hit, or the
   next piece of a chunked prefill) to its whole context gathered from the pool.

All of it is two batched matrix products around a float32 softmax. Grouped-query attention
needs no copies of K/V per query head: the G query heads that share a KV head are laid out as
G times as many query rows. Prefill scores are computed a slice of query rows at a time (at
most `score_budget` of them), small enough to stay in a CPU's caches; on this project's 2-core
CPU that took half the time of torch's fused CPU attention kernel for 16 x 256 tokens of the
`small` preset (10 vs 20 ms per layer).

Without a KV cache (kv_cache=none) there is no pool: every chunk is a fresh prefill.

A sliding-window layer (`window` W) lets the query at position p see the keys j with
visible_from(p, W) = p - W + 1 <= j <= p (transformers' convention). Its decode gathers only the
blocks of each sequence's window (at most ceil(W / block) + 1), and every mask hides the keys
before the window; the blocks before it may already be back in the pool (layer_groups.py), their
table entries pointing at the zeroed null block.

Attention sinks (gpt-oss): a learned logit per query head, `sinks[layer][h]`, joins each row's
softmax as one more column whose value is zero: p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i)).
The probabilities of a row then add up to less than 1, so a head can attend to nothing. Only this
plain path computes them (`softmax_with_sink`); the engine uses it for a model with sinks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.reference.kv_cache import KVPool

SCORE_BUDGET = 1 << 20  # float32 attention scores computed at once on a CPU (4 MiB)


def visible_from(pos: int, window: int | None) -> int:
    """The first key position the query at `pos` sees: p - W + 1 in a window of W, else 0."""
    return max(0, pos - window + 1) if window else 0


def is_decode(start: int, end: int) -> bool:
    return end - start == 1 and start > 0


def softmax_with_sink(s: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of float32 scores `s` with one more logit per row, `sink`
    (broadcastable to s[..., :1]), whose probability is dropped: exp(s_j - m) / (exp(sink - m) +
    sum_i exp(s_i - m)), m the row's largest logit, sink included. A row whose keys are all
    masked (-inf) gets zeros."""
    m = torch.maximum(s.amax(dim=-1, keepdim=True), sink)
    e = (s - m).exp_()
    return e.div_(e.sum(dim=-1, keepdim=True).add_((sink - m).exp()))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, rows: int,
           sink: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v for grouped queries.

    q [..., kv_heads, G * rows, d] (the G query heads of a KV head, `rows` positions each);
    k, v [..., kv_heads, keys, d]; mask: additive float32, broadcastable to
    [..., kv_heads, G, rows, keys]; sink: None, or float32 [heads] (softmax_with_sink).
    Returns [..., kv_heads, G * rows, d]."""
    s = torch.matmul(q, k.transpose(-1, -2))
    s = s.view(*s.shape[:-2], -1, rows, s.shape[-1]).float().mul_(q.shape[-1] ** -0.5).add_(mask)
    if sink is None:
        p = s.softmax(dim=-1).to(q.dtype)
    else:  # head h = kv head * G + g
        p = softmax_with_sink(s, sink.view(q.shape[-3], -1, 1, 1)).to(q.dtype)
    return torch.matmul(p.view(*q.shape[:-1], -1), v)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     sink: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per sequence against its gathered context.

    q [B, heads, d]; k, v [kv_heads, B, L, d] (pool.gather); mask: additive float32 [B, L] (-inf
    past each sequence's length); sink: None, or float32 [heads] (softmax_with_sink). Returns
    [B, heads * d]. The G query heads of a KV head are its G rows: scores [kv_heads, B, G, L] in
    one batched product."""
    kv_heads, b, _, d = k.shape
    heads = q.shape[1]
    qg = q.view(b, kv_heads, heads // kv_heads, d).transpose(0, 1)  # [kv_heads, B, G, d]
    s = torch.matmul(qg, k.transpose(-1, -2)).float().mul_(d ** -0.5).add_(mask[None, :, None, :])
    if sink is None:
        p = s.softmax(dim=-1).to(q.dtype)
    else:
        p = softmax_with_sink(s, sink.view(kv_heads, 1, -1, 1)).to(q.dtype)
    return torch.matmul(p, v).transpose(0, 1).reshape(b, heads * d)


def length_mask(lens: torch.Tensor, keys: int) -> torch.Tensor:
    """[B, keys] additive float32: 0 for the first lens[b] keys of row b, -inf after."""
    pos = torch.arange(keys, device=lens.device)
    return torch.zeros(lens.shape[0], keys, device=lens.device).masked_fill_(pos >= lens[:, None], float("-inf"))


def causal_mask(first_pos: int, rows: int, keys: int, device: torch.device,
                window: int | None = None) -> torch.Tensor:
    """[rows, keys]: 0 where key j <= query position first_pos + r (and, in a window, j >=
    visible_from(first_pos + r)), else -inf."""
    pos = torch.arange(first_pos, first_pos + rows, device=device)[:, None]
    j = torch.arange(keys, device=device)
    hidden = j > pos
    if window:
        first = torch.tensor([visible_from(p, window) for p in range(first_pos, first_pos + rows)], device=device)
        hidden |= j < first[:, None]
    return torch.zeros(rows, keys, device=device).masked_fill_(hidden, float("-inf"))


def padded_tables(tables: list[list[int]], width: int) -> list[list[int]]:
    """Block tables cut or padded to `width` entries; short ones repeat their own first block
    (masked out, but finite)."""
    return [(t := table[:width]) + t[:1] * (width - len(t)) for table in tables]


@dataclass
class PrefillGroup:
    """Prefill chunks attended together: `count` chunks of tokens [start, end) lying end to end
    from `offset` in the flat batch. `table` ([1, n] block table) is None for fresh chunks
    (start 0: their own K/V); `slices` are (first row, end row, mask) query-row slices."""

    offset: int
    count: int
    start: int
    end: int
    table: torch.Tensor | None
    slices: list[tuple[int, int, torch.Tensor]]


class StepAttention:
    """Built once per step by the runner (indices, masks, the plan of prefill slices); the model
    calls it once per layer. Subclasses (kernels_cuda.py) replace `decode` and `prefill`."""

    def __init__(self, pool: KVPool | None, chunks: list, num_heads: int, device: torch.device,
                 score_budget: int = SCORE_BUDGET, window: int | None = None,
                 sinks: list[torch.Tensor | None] | None = None):
        """`sinks`: per layer (as `layer` counts), None or the layer's float32 [heads] sink logits."""
        self.pool, self.num_heads, self.score_budget, self.window = pool, num_heads, score_budget, window
        self.sinks = sinks
        bs = pool.block_size if pool else 0
        spans = [(c.seq, c.start, c.end) for c in chunks]
        self.num_decode = sum(1 for _, s, e in spans if pool is not None and is_decode(s, e))
        if pool is not None:  # where this step's new K/V go
            blocks, offsets = [], []
            for seq, start, end in spans:
                table = seq.block_table
                blocks.extend(table[p // bs] for p in range(start, end))
                offsets.extend(p % bs for p in range(start, end))
            pool.prepare(set(blocks))
            self.rows = pool.rows(torch.tensor(blocks, device=device), torch.tensor(offsets, device=device))
        if self.num_decode:  # block tables of the decode chunks, padded to the longest
            dec = spans[:self.num_decode]
            self._gather_plan = None  # the plain decode's rows and mask, made on first use
            if window:
                self._plan_window_decode(dec, device)
        if self.num_decode and not window:
            self.decode_len = max(end for _, _, end in dec)
            width = -(-self.decode_len // bs)
            self.decode_tables = torch.tensor(padded_tables([seq.block_table for seq, _, _ in dec], width),
                                              dtype=torch.long, device=device)
            self.decode_lens = torch.tensor([end for _, _, end in dec], device=device)
        self.prefill_groups = self._plan_prefills(spans[self.num_decode:], device)

    def _plan_window_decode(self, dec: list, device: torch.device) -> None:
        """Each decode chunk's window: its blocks from the one holding visible_from(end - 1) to
        the last, padded to the widest; the mask hides the keys before the window and after the end."""
        bs = self.pool.block_size
        firsts = [visible_from(end - 1, self.window) for _, _, end in dec]
        tables = [seq.block_table[f // bs:-(-end // bs)] for (seq, _, end), f in zip(dec, firsts)]
        width = max(map(len, tables))
        self.decode_tables = torch.tensor(padded_tables(tables, width), dtype=torch.long, device=device)
        base = [f // bs * bs for f in firsts]  # the position of each table's first slot
        self.decode_len = width * bs
        self.decode_lens = torch.tensor([end - b for (_, _, end), b in zip(dec, base)], device=device)
        lo = torch.tensor([f - b for f, b in zip(firsts, base)], device=device)
        mask = length_mask(self.decode_lens, self.decode_len)
        mask.masked_fill_(torch.arange(self.decode_len, device=device)[None, :] < lo[:, None], float("-inf"))
        self._gather_plan = self.pool.block_rows(self.decode_tables), mask

    def _plan_prefills(self, spans: list, device: torch.device) -> list[PrefillGroup]:
        heads, groups, offset, i = self.num_heads, [], self.num_decode, 0
        budget = self.score_budget
        masks: dict[tuple[int, int, int], torch.Tensor] = {}
        while i < len(spans):
            seq, start, end = spans[i]
            n = end - start
            table = None
            if start > 0:
                table = torch.tensor([seq.block_table[:-(-end // self.pool.block_size)]], device=device)
            rows = max(1, min(n, budget // (heads * end)))
            count = 1  # fresh chunks of the same length go together, while the budget allows
            if start == 0 and rows == n:
                limit = max(1, budget // (heads * n * n))
                while (count < limit and i + count < len(spans) and spans[i + count][1] == 0
                       and spans[i + count][2] == n):
                    count += 1
            slices = []
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                key = (start + r0, r1 - r0, start + r1)
                if key not in masks:
                    masks[key] = causal_mask(*key, device, self.window)
                slices.append((r0, r1, masks[key]))
            groups.append(PrefillGroup(offset, count, start, end, table, slices))
            offset += count * n
            i += count
        return groups

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] -> [T, heads * d]."""
        if self.pool is not None:
            self.pool.write(layer, self.rows, k, v)
        t, heads, d = q.shape
        if self.num_decode == t:  # decode chunks only
            return self.decode(layer, q)
        out = torch.empty(t, heads * d, dtype=q.dtype, device=q.device)  # every row is written below
        if self.num_decode:
            out[:self.num_decode] = self.decode(layer, q[:self.num_decode])
        for group in self.prefill_groups:
            self.prefill(layer, group, q, k, v, out)
        return out

    def decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """[B, heads, d] decode queries -> [B, heads * d]."""
        if self._gather_plan is None:  # the same for every layer of the step
            rows = self.pool.block_rows(self.decode_tables)
            keys = self.decode_tables.shape[1] * self.pool.block_size if self.decode_tables.shape[1] > 1 else self.decode_len
            self._gather_plan = rows, length_mask(self.decode_lens, keys)
        rows, mask = self._gather_plan
        kc, vc = self.pool.gather(layer, self.decode_tables, self.decode_len, rows)
        if self.sinks is not None:
            return decode_attention(q, kc, vc, mask, self.sinks[layer])
        return decode_attention(q, kc, vc, mask)

    def prefill(self, layer: int, g: PrefillGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor) -> None:
        """Write the group's attention output into its rows of `out`."""
        n, heads, d = g.end - g.start, q.shape[1], q.shape[2]
        kv_heads = k.shape[1]
        span = slice(g.offset, g.offset + g.count * n)  # these chunks' tokens in the flat batch
        qs = q[span].view(g.count, n, heads, d)
        if g.table is None:  # fresh: the chunk's own K/V, [count, kv_heads, n, d]
            ks = k[span].view(g.count, n, kv_heads, d).transpose(1, 2).contiguous()
            vs = v[span].view(g.count, n, kv_heads, d).transpose(1, 2).contiguous()
        else:  # after a cached prefix: the whole context from the pool, [1, kv_heads, end, d]
            ks, vs = self.pool.read(layer, g.table, g.end)
        dest = out[span].view(g.count, n, heads * d)
        gq = heads // kv_heads
        sink = None if self.sinks is None else self.sinks[layer]
        for r0, r1, mask in g.slices:  # query rows r0..r1 see keys up to their own position
            r, keys = r1 - r0, g.start + r1
            qr = qs[:, r0:r1].permute(0, 2, 1, 3).reshape(g.count, kv_heads, gq * r, d)
            o = attend(qr, ks[:, :, :keys], vs[:, :, :keys], mask, r, sink)
            dest[:, r0:r1] = o.view(g.count, heads, r, d).transpose(1, 2).reshape(g.count, r, heads * d)
