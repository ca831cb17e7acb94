"""Who owns which block of the KV pool, and which blocks hold a prefix worth reusing.

Every block has a reference count: the number of sequences whose block table lists it. A block
with no owner is either *free* (nothing worth keeping) or *evictable*: it still holds a full
block of some earlier sequence, registered in the prefix cache under a chained hash

    hash(block i) = H(hash(block i - 1), token ids of block i)

so equal hashes mean equal prefixes (and the stored token ids guard against a collision). A new
sequence looks its prompt up block by block and shares the blocks it finds (their reference
count goes up); it computes only the rest. Evictable blocks are reused, least recently
released first, only when no free block is left.

With a second tier (`tier`, kv_tiers.py) an evicted block is copied there first, and a prompt's
block that the pool lost but the second tier holds is a hit too: reloaded at admission.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


def chain_hash(parent: bytes | None, tokens: tuple[int, ...]) -> bytes:
    """The identity of a full block: its tokens and, through `parent`, every token before it."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class Hits(list):
    """match_prefix's answer with a second tier: per leading block of the prompt, the pool block
    holding it, or None where only the second tier holds it; `hashes` and `tokens` their chained
    hashes and token ids (what admit() reloads by)."""

    hashes: list[bytes]
    tokens: list[tuple[int, ...]]


@dataclass
class Reloaded:
    block: int
    reloaded: bool  # reloaded from the second tier (else a first-tier hit)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set while the block is registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # its tokens, compared on every hit (collision guard)


@dataclass
class BlockStats:
    peak_used: int = 0
    prefix_queries: int = 0  # full prompt blocks looked up
    prefix_hits: int = 0  # of which found in the cache
    evictions: int = 0


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    prefix_caching: bool
    stats: BlockStats = field(default_factory=BlockStats)
    tier: Any = None  # kv_tiers.SecondTier: where evicted cached blocks go (None: they are dropped)

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        # a stack: the most recently freed block is reused first (its memory is warm, and blocks
        # never used stay untouched; see KVPool.prepare)
        self.free: list[int] = list(reversed(range(self.num_blocks)))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self.cached: dict[bytes, int] = {}  # chained hash -> block id

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits(self, num_tokens: int) -> bool:
        """Whether one sequence of `num_tokens` tokens can ever be held."""
        return self.blocks_for(num_tokens) <= self.num_blocks

    # ---- prefix cache -------------------------------------------------------------------
    def match_prefix(self, tokens: list[int], max_tokens: int, root: bytes | None = None) -> list[int]:
        """Cached blocks holding the longest prefix of `tokens` (whole blocks, at most
        `max_tokens` tokens), their hash chain started from `root` (a LoRA adapter's: blocks
        computed with one adapter are another K/V than the base model's). Only looks; `admit`
        takes them."""
        if not self.prefix_caching:
            return []
        bs, found, parent = self.block_size, [], root
        hashes, seen = [], []  # with a second tier: each hit's identity, for admit() to reload by
        for i in range(max_tokens // bs):
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            parent = chain_hash(parent, block_tokens)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != block_tokens:
                if self.tier is None or not self.tier.holds(parent, block_tokens):
                    break
                block_id = None  # in the second tier: admit() reloads it
            found.append(block_id)
            hashes.append(parent)
            seen.append(block_tokens)
        if self.tier is not None:
            found = Hits(found)
            found.hashes, found.tokens = hashes, seen
        return found

    def can_admit(self, hits: list[int], num_tokens: int) -> bool:
        """Whether a sequence sharing `hits` can get blocks for its first `num_tokens` tokens.
        Hit blocks that sit in the evictable list stop being available to others; a second-tier
        hit (None) needs a block to be reloaded into."""
        pooled = [b for b in hits if b is not None]
        revived = sum(1 for b in pooled if self.blocks[b].ref_count == 0)
        return self.blocks_for(num_tokens) - len(pooled) <= self.num_free - revived

    def admit(self, seq, hits: list[int], num_prompt_blocks: int) -> None:
        """Give `seq` the shared blocks `hits`, reloading second-tier hits into blocks of their own
        (kv_tiers.py; one that fails its check ends the hits there: the rest is recomputed); count
        the lookup."""
        for b in hits:
            if b is None:
                continue
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.evictable[b]
            block.ref_count += 1
        seq.num_reloaded = 0
        if None in hits:
            hits = self._reload(hits)
            seq.num_reloaded = sum(1 for h in hits if h.reloaded) * self.block_size
            hits = [h.block for h in hits]
        seq.block_table = list(hits)
        seq.block_hashes = [self.blocks[b].hash for b in hits]
        seq.num_computed = len(hits) * self.block_size
        seq.num_cached = seq.num_computed
        if self.prefix_caching:
            self.stats.prefix_queries += num_prompt_blocks
            self.stats.prefix_hits += len(hits)
        self._note_peak()

    def _reload(self, hits: Hits) -> list[Reloaded]:
        """Second-tier hits (None in `hits`; admit() holds the first-tier ones already) read back
        and checked, every one before any pool block is taken (a take may evict and offload
        another block), then each put into a block of its own and registered in the prefix cache
        again, in order. At the first that fails its check, the rest of the hits are let go: the
        sequence recomputes from there."""
        fetched: dict[int, Any] = {}
        end = len(hits)
        for i, b in enumerate(hits):
            if b is None:
                data = self.tier.fetch(hits.hashes[i])
                if data is None:
                    end = i
                    break
                fetched[i] = data
        for later in hits[end:]:
            if later is not None:
                self._release(later)
        out: list[Reloaded] = []
        for i, b in enumerate(hits[:end]):
            if b is not None:
                out.append(Reloaded(b, False))
                continue
            new = self._take()
            self.tier.place(new, fetched[i])
            block = self.blocks[new]
            block.hash, block.token_ids = hits.hashes[i], hits.tokens[i]
            self.cached[block.hash] = new
            out.append(Reloaded(new, True))
        return out

    def register_full_blocks(self, seq) -> None:
        """Publish the blocks of `seq` that are full and computed, so later prompts can share them."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        while len(seq.block_hashes) < seq.num_computed // bs:
            i = len(seq.block_hashes)
            tokens = tuple(seq.tokens[i * bs:(i + 1) * bs])
            h = chain_hash(seq.block_hashes[-1] if i else seq.hash_root, tokens)
            if h not in self.cached:  # else an identical block is already registered: keep that one
                block = self.blocks[seq.block_table[i]]
                block.hash, block.token_ids = h, tokens
                self.cached[h] = block.block_id
            seq.block_hashes.append(h)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
        self.cached.clear()
        self.free.extend(self.evictable)
        self.evictable.clear()
        if self.tier is not None:
            self.tier.clear()

    # ---- allocation ---------------------------------------------------------------------
    def grow(self, seq, num_tokens: int) -> bool:
        """Make `seq`'s block table cover `num_tokens` slots. False (and nothing taken) when
        there are not enough free blocks."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.num_free:
            return False
        for _ in range(need):
            seq.block_table.append(self._take())
        self._note_peak()
        return True

    def shrink(self, seq, num_tokens: int) -> None:
        """Give back the blocks of `seq`'s table past its first `num_tokens` slots: after a
        speculative step, the slots of rejected draft tokens (and of room not drafted into). A
        block past the computed tokens is never registered in the prefix cache, so it goes
        straight back to the free list."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free_sequence(self, seq) -> None:
        """Drop `seq`'s references. Its last blocks are released first, so that they are also
        evicted first: a prefix's head is shared more often than its tail."""
        for b in reversed(seq.block_table):
            self._release(b)
        seq.block_table, seq.block_hashes = [], []

    def _release(self, b: int) -> None:
        """Drop one reference to block `b`; at none, a cached block becomes evictable (kept for
        a later prefix hit) and any other block free."""
        block = self.blocks[b]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {b} released more often than taken"
        if block.ref_count == 0:
            if block.hash is not None:
                self.evictable[b] = None
            else:
                self.free.append(b)

    def _take(self) -> int:
        if self.free:
            b = self.free.pop()
        else:  # no free block left: evict the least recently released cached one
            b, _ = self.evictable.popitem(last=False)
            block = self.blocks[b]
            if self.tier is not None:  # to the second tier first, under the same identity
                self.tier.offload(block.hash, block.token_ids, b)
            if self.cached.get(block.hash) == b:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
            self.stats.evictions += 1
        self.blocks[b].ref_count = 1
        return b

    def _note_peak(self) -> None:
        self.stats.peak_used = max(self.stats.peak_used, self.num_used)
