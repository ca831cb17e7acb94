"""Groups of layers with their own KV blocks: full-attention layers beside sliding-window ones.

A model whose layers do not all attend the same way (Mistral's window on every layer; Qwen3's
or Gemma's alternating `layer_types`) gets one *layer group* per distinct window (None: full
attention), each with its own pool (kv_cache.KVPool over the group's layers only), its own
blocks (a block_manager.BlockManager: reference counts, free list, prefix cache) and, per
sequence, its own block table (`seq.group_tables[g]`). A full group's table grows with the
sequence. A windowed group (window W) needs only the blocks holding the keys that the next
query can see, visible_from(n, W) .. n - 1 (attention.py): after every step the blocks before
them go back to the pool (to the free list, or, when their prefix is registered, to the
evictable list where a later prompt can still find them), and their entries point at the
pool's *null block* (a zeroed scratch block, never handed out; writes of tokens already
outside the window land there and are never read unmasked). So a windowed group holds at most
ceil(W / block) + 1 blocks per sequence between steps, however long the sequence grows. A
prefill chunk takes, for the window, only the blocks from visible_from(end) on when it starts
at position 0 (its queries read the chunk's own K/V), and from visible_from(start) on after a
cached context (its queries read the pool).

Prefix caching across groups: block hashes are the same chained hashes as block_manager's (they
depend on the tokens only); each group registers the blocks it still holds. A hit of L blocks
needs every block 0 .. L - 1 in a full group, and in a windowed group only the blocks from the one
holding visible_from(L * block, W): a shared prefix longer than the window reuses only what the
window needs. The longest L that every group can serve is taken.

`GroupedBlockManager` has block_manager.BlockManager's interface (what the scheduler and the
engine call); `GroupedPool` holds the groups' pools; `GroupedStepAttention` is a step's
attention, one StepAttention per group (windowed groups on the plain path), dispatched by layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from adapters.reference import attention as attn
from adapters.reference.block_manager import BlockManager, BlockStats, chain_hash
from adapters.reference.kv_cache import KVPool, bytes_per_token


@dataclass(frozen=True)
class LayerGroup:
    window: int | None  # None: full attention
    layers: tuple[int, ...]

    @property
    def kind(self) -> str:
        return "full" if self.window is None else f"sliding({self.window})"

    def max_blocks(self, block_size: int) -> int | None:
        """Most blocks a sequence holds between steps (None: it grows with the sequence)."""
        return None if self.window is None else math.ceil(self.window / block_size) + 1


def layer_groups(windows: tuple[int | None, ...]) -> list[LayerGroup]:
    """One group per distinct window, full attention first."""
    order = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    return [LayerGroup(w, tuple(i for i, x in enumerate(windows) if x == w)) for w in order]


def group_blocks(groups: list[LayerGroup], budget: int, bpt: list[int], block_size: int, max_seqs: int,
                 max_batched_tokens: int) -> list[int]:
    """Blocks per group from a pool of `budget` bytes (`bpt`: each group's bytes per token). A
    windowed group gets what max_seqs sequences can hold at once (their windows, plus a step's
    chunks), at most the share it would get as a full group; full groups share the rest, the
    same number of blocks each."""
    bs = block_size
    equal = budget // (sum(bpt) * bs)  # every group the same number of blocks
    if all(g.window is not None for g in groups):
        return [equal] * len(groups)
    n = [0] * len(groups)
    used = 0
    for i, g in enumerate(groups):
        if g.window is not None:
            need = max_seqs * (g.max_blocks(bs) + 1) + math.ceil(max_batched_tokens / bs)
            n[i] = min(equal, need)
            used += n[i] * bpt[i] * bs
    full = [i for i, g in enumerate(groups) if g.window is None]
    each = (budget - used) // (sum(bpt[i] for i in full) * bs)
    for i in full:
        n[i] = each
    return n


class GroupedPool:
    """The groups' KV pools; `pools[g]` holds the layers `groups[g].layers` (in that order)."""

    def __init__(self, groups: list[LayerGroup], num_blocks: list[int], block_size: int, num_kv_heads: int,
                 head_dim: int, kv_dtype: str, model_dtype: torch.dtype, device: torch.device):
        self.groups, self.block_size, self.kv_dtype = groups, block_size, kv_dtype
        self.pools = [KVPool(len(g.layers), n, block_size, num_kv_heads, head_dim, kv_dtype, model_dtype, device,
                             scratch_blocks=1) for g, n in zip(groups, num_blocks)]
        self.where = {layer: (gi, j) for gi, g in enumerate(groups) for j, layer in enumerate(g.layers)}
        self.nbytes = sum(p.nbytes for p in self.pools)
        self.bytes_per_token = sum(p.bytes_per_token for p in self.pools)  # a token inside every window
        self.num_blocks = sum(num_blocks)


@dataclass
class _GroupView:
    """What a group's StepAttention sees of a sequence: its block table in that group."""

    block_table: list[int]


@dataclass
class _GroupChunk:
    seq: _GroupView
    start: int
    end: int


class GroupedStepAttention:
    """One step's attention for a grouped model: a StepAttention per group, over that group's
    pool and tables; windowed groups use the plain path (the fused kernels know no window).
    Without a cache (`pool` None) every group attends fresh chunks with its own mask. `sinks`
    (gpt-oss; per model layer, attention.StepAttention's) go to each group's parts by the group's
    own layer numbers; `full_attention` must then take them (the plain StepAttention does)."""

    def __init__(self, pool: GroupedPool | None, chunks: list, num_heads: int, device: torch.device,
                 groups: list[LayerGroup], full_attention=attn.StepAttention,
                 sinks: list[torch.Tensor | None] | None = None):
        self.parts = []
        for gi, g in enumerate(groups):
            sub = None if pool is None else pool.pools[gi]
            views = chunks if pool is None else [_GroupChunk(_GroupView(c.seq.group_tables[gi]), c.start, c.end)
                                                 for c in chunks]
            extra = {} if sinks is None else {"sinks": [sinks[layer] for layer in g.layers]}
            if g.window is None:
                self.parts.append(full_attention(sub, views, num_heads, device, **extra))
            else:
                self.parts.append(attn.StepAttention(sub, views, num_heads, device, window=g.window, **extra))
        self.where = {layer: (gi, j) for gi, g in enumerate(groups) for j, layer in enumerate(g.layers)}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        gi, j = self.where[layer]
        return self.parts[gi](j, q, k, v)


class GroupHits(list):
    """match_prefix's answer: L block ids (the first group's, or its null entries) with, per group,
    the blocks to share (None where the group does not need one) and the L chained hashes."""

    per_group: list[list[int | None]]
    hashes: list[bytes]


class GroupedBlockManager:
    """block_manager.BlockManager's interface over the layer groups (see the module's text)."""

    def __init__(self, groups: list[LayerGroup], num_blocks: list[int], block_size: int, prefix_caching: bool):
        self.groups, self.block_size, self.prefix_caching = groups, block_size, prefix_caching
        self.managers = [BlockManager(n, block_size, prefix_caching) for n in num_blocks]
        self.null = list(num_blocks)  # each group's null block: its pool's scratch block
        self._stats = BlockStats()

    # ---- counts ------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return sum(m.num_blocks for m in self.managers)

    @property
    def num_free(self) -> int:
        return sum(m.num_free for m in self.managers)

    @property
    def num_used(self) -> int:
        return sum(m.num_used for m in self.managers)

    @property
    def evictable(self) -> list[int]:
        return [b for m in self.managers for b in m.evictable]

    @property
    def stats(self) -> BlockStats:
        self._stats.evictions = sum(m.stats.evictions for m in self.managers)
        return self._stats

    @stats.setter
    def stats(self, value: BlockStats) -> None:
        self._stats = value
        for m in self.managers:
            m.stats = BlockStats(peak_used=m.num_used)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits(self, num_tokens: int) -> bool:
        """Whether one sequence of `num_tokens` can ever be held (each group alone)."""
        return all(len(self._needed(g, 0, num_tokens)) <= m.num_blocks for g, m in zip(self.groups, self.managers))

    def _first_block(self, g: LayerGroup, start: int, end: int) -> int:
        """The first logical block a chunk [start, end) needs in group g (see the module's text)."""
        if g.window is None:
            return 0
        return attn.visible_from(start if start > 0 else end, g.window) // self.block_size

    def _needed(self, g: LayerGroup, start: int, end: int) -> range:
        return range(self._first_block(g, start, end), self.blocks_for(end))

    def _note_peak(self) -> None:
        self._stats.peak_used = max(self._stats.peak_used, self.num_used)

    # ---- prefix cache --------------------------------------------------------------------
    def match_prefix(self, tokens: list[int], max_tokens: int, root: bytes | None = None) -> GroupHits:
        hits = GroupHits()
        hits.per_group, hits.hashes = [[] for _ in self.groups], []
        if not self.prefix_caching:
            return hits
        bs, parent = self.block_size, root
        found: list[list[int | None]] = [[] for _ in self.groups]  # per group, per block: a cached id or None
        hashes = []
        for i in range(max_tokens // bs):
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            parent = chain_hash(parent, block_tokens)
            hashes.append(parent)
            for gi, m in enumerate(self.managers):
                b = m.cached.get(parent)
                found[gi].append(b if b is not None and m.blocks[b].token_ids == block_tokens else None)
        for n in range(len(hashes), 0, -1):  # the longest prefix every group can serve
            starts = [attn.visible_from(n * bs, g.window) // bs if g.window else 0 for g in self.groups]
            if all(all(f[i] is not None for i in range(s, n)) for f, s in zip(found, starts)):
                hits.per_group = [[f[i] if i >= s else None for i in range(n)] for f, s in zip(found, starts)]
                hits.hashes = hashes[:n]
                hits.extend(self.null[0] if b is None else b for b in hits.per_group[0])
                break
        return hits

    def can_admit(self, hits: GroupHits, num_tokens: int) -> bool:
        start = len(hits) * self.block_size
        for gi, (g, m) in enumerate(zip(self.groups, self.managers)):
            shared = [b for b in (hits.per_group[gi] if hits else []) if b is not None]
            revived = sum(1 for b in shared if m.blocks[b].ref_count == 0)
            need = len(self._needed(g, start, num_tokens)) - len(shared)
            if need > m.num_free - revived:
                return False
        return True

    def admit(self, seq, hits: GroupHits, num_prompt_blocks: int) -> None:
        seq.group_tables = []
        for gi, m in enumerate(self.managers):
            table = []
            for b in (hits.per_group[gi] if hits else []):
                if b is None:
                    table.append(self.null[gi])
                    continue
                block = m.blocks[b]
                if block.ref_count == 0:
                    del m.evictable[b]
                block.ref_count += 1
                table.append(b)
            seq.group_tables.append(table)
        seq.block_table = seq.group_tables[0]
        seq.block_hashes = list(hits.hashes) if hits else []
        seq.num_computed = len(hits) * self.block_size
        if self.prefix_caching:
            self._stats.prefix_queries += num_prompt_blocks
            self._stats.prefix_hits += len(hits)
        self._note_peak()

    def register_full_blocks(self, seq) -> None:
        """After a step: publish the full computed blocks each group holds, then give back the
        blocks that left a window."""
        bs = self.block_size
        while self.prefix_caching and len(seq.block_hashes) < seq.num_computed // bs:
            i = len(seq.block_hashes)
            tokens = tuple(seq.tokens[i * bs:(i + 1) * bs])
            h = chain_hash(seq.block_hashes[-1] if i else seq.hash_root, tokens)
            for gi, m in enumerate(self.managers):
                b = seq.group_tables[gi][i] if i < len(seq.group_tables[gi]) else self.null[gi]
                if b != self.null[gi] and h not in m.cached:
                    block = m.blocks[b]
                    block.hash, block.token_ids = h, tokens
                    m.cached[h] = b
            seq.block_hashes.append(h)
        self.trim(seq)

    def trim(self, seq) -> None:
        """Release each windowed group's blocks before the one the next query's window starts in."""
        for gi, (g, m) in enumerate(zip(self.groups, self.managers)):
            if g.window is None or not getattr(seq, "group_tables", None):
                continue
            table = seq.group_tables[gi]
            for i in range(min(len(table), attn.visible_from(seq.num_computed, g.window) // self.block_size)):
                if table[i] != self.null[gi]:
                    m._release(table[i])
                    table[i] = self.null[gi]

    def reset_prefix_cache(self) -> None:
        for m in self.managers:
            m.reset_prefix_cache()

    # ---- allocation ----------------------------------------------------------------------
    def grow(self, seq, num_tokens: int) -> bool:
        if not getattr(seq, "group_tables", None):
            seq.group_tables = [[] for _ in self.groups]
            seq.block_table = seq.group_tables[0]
        plans = []
        for gi, (g, m) in enumerate(zip(self.groups, self.managers)):
            table = seq.group_tables[gi]
            need = self._needed(g, seq.num_computed, num_tokens)
            missing = [i for i in need if i >= len(table) or table[i] == self.null[gi]]
            if len(missing) > m.num_free:
                return False
            plans.append((table, missing, need))
        for gi, (table, missing, need) in enumerate(plans):
            m = self.managers[gi]
            while len(table) < need.stop:
                table.append(self.null[gi])
            for i in missing:
                table[i] = m._take()
        self._note_peak()
        return True

    def shrink(self, seq, num_tokens: int) -> None:
        """BlockManager.shrink in every group: the blocks past the first `num_tokens` slots go back."""
        keep = self.blocks_for(num_tokens)
        for gi, m in enumerate(self.managers):
            table = seq.group_tables[gi]
            while len(table) > keep:
                b = table.pop()
                if b != self.null[gi]:
                    m._release(b)

    def free_sequence(self, seq) -> None:
        for gi, m in enumerate(self.managers):
            for b in reversed(getattr(seq, "group_tables", [[]] * len(self.groups))[gi]):
                if b != self.null[gi]:
                    m._release(b)
        seq.group_tables = [[] for _ in self.groups]
        seq.block_table, seq.block_hashes = seq.group_tables[0], []

    # ---- what kv_cache_info reports --------------------------------------------------------
    def group_rows(self, running: list, pool: GroupedPool) -> list[dict]:
        bs, rows = self.block_size, []
        for gi, (g, m, p) in enumerate(zip(self.groups, self.managers, pool.pools)):
            filled: dict[int, int] = {}
            for seq in running:
                for i, b in enumerate(getattr(seq, "group_tables", [[]] * len(self.groups))[gi]):
                    if b != self.null[gi]:
                        filled[b] = max(filled.get(b, 0), min(bs, max(0, seq.num_computed - i * bs)))
            rows.append({"kind": g.kind, "window": g.window, "layers": list(g.layers),
                         "bytes_per_token": p.bytes_per_token, "bytes_per_block": p.bytes_per_token * bs,
                         "num_blocks": m.num_blocks, "blocks_in_use": m.num_used,
                         "blocks_in_use_bytes": m.num_used * p.bytes_per_token * bs,
                         "max_blocks_per_sequence": g.max_blocks(bs), "tokens_stored": sum(filled.values()),
                         "slots_allocated": m.num_used * bs, "pool_bytes": p.nbytes})
        return rows


def bytes_per_token_of(groups: list[LayerGroup], num_kv_heads: int, head_dim: int, kv_dtype: str,
                       dtype: torch.dtype) -> list[int]:
    return [bytes_per_token(len(g.layers), num_kv_heads, head_dim, kv_dtype, dtype) for g in groups]
