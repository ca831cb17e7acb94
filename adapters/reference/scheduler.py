"""Continuous batching: which tokens of which sequences the next step computes.

A sequence is a list of tokens (prompt, then outputs) of which the first `num_computed` have
their K/V in the cache. Each step computes a *chunk* of the rest: the whole prompt (prefill), a
piece of a long prompt (chunked prefill), or the one newest token (decode). When a chunk reaches
the end of the sequence, the step samples the next token.

Each step (`schedule`):
  1. running sequences first, in admission order, each one chunk, while the token budget
     (`max_num_batched_tokens`) lasts. A sequence that needs a block when none is free takes
     one from the most recently admitted running sequence, which is *preempted*: its blocks
     are freed and it goes back to the front of the waiting queue, to be recomputed later
     (prompt and outputs so far, in one prefill).
  2. then waiting sequences, first come first served, while the budget lasts, fewer than
     `max_num_seqs` run, and the pool has the blocks for their first chunk (after the prefix
     cache has supplied what it can).
A sequence stops being scheduled when it reaches `stop_len` tokens. `serve()` then finishes it
(its blocks are freed at once); `prefill()`/`decode()` raise `stop_len` by one per step.

Speculative decoding (speculative.py; `lookahead` = k): a running sequence that is decoding
(only its newest token lacks K/V) is budgeted 1 + k tokens, fewer when it needs fewer more
tokens, and its blocks grow to cover them. Its chunk is the one decode token with
`draft_room` slots after it; the proposer then fills `seq.draft` (at most `draft_room`
tokens) and the chunk grows by as many: a *verify* chunk, computed like a prefill chunk after a
cached context. What the target rejects gives its slots back after the step (llm_engine).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from adapters.reference.block_manager import BlockManager


@dataclass
class Sequence:
    seq_id: int
    tokens: list[int]
    stop_len: int  # not scheduled once it has this many tokens
    prompt_len: int = 0
    num_computed: int = 0  # tokens whose K/V are cached (or, without a cache, computed this step)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its leading full blocks
    request_id: str | None = None
    num_cached: int = 0  # prompt tokens the prefix cache supplied at its (last) admission
    num_reloaded: int = 0  # of those, the ones reloaded from a second KV tier (kv_tiers.py)
    logits: Any = None  # logits of its last sampled token, when asked for
    # speculative decoding: the proposed tokens this step verifies (after `tokens`; never part of
    # them: the accepted ones are appended after the target's pass), and the proposer's own state
    # of this sequence (an n-gram index, the draft model's sequence)
    draft: list[int] = field(default_factory=list)
    spec: Any = None
    # score(): the logits of every position from this one on are kept (teacher-forced scores);
    # the prefix cache may supply only the blocks before it. None: only sampled rows.
    score_from: int | None = None
    # structured output: the request's grammar matcher (grammar.py), masking what it may sample
    grammar: Any = None
    # LoRA (lora.py): the adapter that serves it (None: the base model), and its slot while it runs
    adapter: str | None = None
    lora_slot: int | None = None

    @property
    def hash_root(self) -> bytes | None:
        """Where its blocks' hash chain starts: nothing for the base model, the adapter's name for
        an adapter's sequence (its K/V differ from the base model's for the same tokens)."""
        return None if self.adapter is None else hashlib.blake2b(b"lora:" + self.adapter.encode(), digest_size=16).digest()

    def __post_init__(self) -> None:
        self.prompt_len = self.prompt_len or len(self.tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def wants_step(self) -> bool:
        return self.num_tokens < self.stop_len

    @property
    def num_outputs(self) -> int:
        return self.num_tokens - self.prompt_len


@dataclass
class Chunk:
    """Tokens [start, end) of `seq`, computed in this step."""

    seq: Sequence
    start: int
    end: int
    draft_room: int = 0  # slots budgeted after `end` for draft tokens (speculative decoding)

    @property
    def samples(self) -> bool:
        return self.end == self.seq.num_tokens + len(self.seq.draft)

    @property
    def token_ids(self) -> list[int]:
        """The chunk's input tokens: the sequence's, then its draft tokens (a verify chunk)."""
        tokens, n = self.seq.tokens, self.seq.num_tokens
        if self.end <= n:
            return tokens[self.start:self.end]
        return tokens[self.start:] + self.seq.draft[:self.end - n]

    @property
    def logit_positions(self) -> range:
        """Positions whose logits the step keeps: the sampled last one (a verify chunk: its
        last 1 + len(draft), one prediction per draft token and one after them), and for a
        scored sequence every position from `score_from` on."""
        first = self.end - 1 - len(self.seq.draft) if self.samples else self.end
        if self.seq.score_from is not None:
            first = min(first, max(self.start, self.seq.score_from))
        return range(first, self.end)


class PoolTooSmall(RuntimeError):
    pass


class Scheduler:
    def __init__(self, blocks: BlockManager | None, max_num_seqs: int, max_num_batched_tokens: int,
                 lookahead: int = 0, on_release: Callable[[Sequence], None] | None = None, lora: Any = None):
        """`lookahead`: draft tokens budgeted per decoding sequence (speculative decoding's k);
        `on_release(seq)`: called when a sequence's blocks go (finished, released or preempted);
        `lora`: the LoRA slots (lora.Slots) an adapter's sequence needs one of to be admitted."""
        self.blocks = blocks  # None: no KV cache (every step recomputes every sequence whole)
        self.lora = lora
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.lookahead, self.on_release = lookahead, on_release
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return any(s.wants_step for s in self.running) or any(s.wants_step for s in self.waiting)

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence (done, or released): its blocks go back at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.blocks:
            self.blocks.free_sequence(seq)
        if self.on_release is not None:
            self.on_release(seq)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if self.blocks:
            self.blocks.free_sequence(seq)
        if self.on_release is not None:
            self.on_release(seq)
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> list[Chunk]:
        chunks: list[Chunk] = []
        budget = self.budget
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq not in self.running or not seq.wants_step:
                continue  # preempted just now, or done for this step
            room = self._draft_room(seq)
            n = self._chunk_len(seq, seq.num_computed, budget, first=not chunks, extra=room)
            if n == 0:
                break
            if not self._make_room(seq, seq.num_computed + n, chunks):
                continue  # it preempted itself
            room = min(room, n - 1)  # the budget may leave less room for drafts
            chunks.append(Chunk(seq, seq.num_computed, seq.num_computed + n - room, room))
            budget -= n
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if not seq.wants_step:
                continue  # preempted after its token of this step: it waits for the next step
            hits: list[int] = []
            if self.blocks:
                # prefix cache: whole blocks only, and never the last token (its logits are needed),
                # nor a scored position
                limit = seq.num_tokens - 1 if seq.score_from is None else min(seq.num_tokens - 1, seq.score_from)
                hits = self.blocks.match_prefix(seq.tokens, limit, seq.hash_root)
            start = len(hits) * self.blocks.block_size if self.blocks else 0
            n = self._chunk_len(seq, start, budget, first=not chunks)
            if n > 0 and not self._lora_slot(seq):
                continue  # every LoRA slot serves running sequences: it waits, later ones may run
            if n == 0 or (self.blocks and not self.blocks.can_admit(hits, start + n)):
                if not chunks and not any(s.wants_step for s in self.running):
                    if self._preempt_idle():  # a fixed batch: make room, try again
                        return self.schedule()
                    raise PoolTooSmall(
                        "the KV pool cannot hold the sequences of this batch at once, nor one more "
                        f"token of any of them ({self.blocks.num_free if self.blocks else 0} blocks free); "
                        "raise engine_options.reference.kv_cache_bytes or use smaller batches.")
                break
            self.waiting.remove(seq)
            end = start + n
            if self.blocks:
                self.blocks.admit(seq, hits, (seq.num_tokens - 1) // self.blocks.block_size)
                start = seq.num_computed  # fewer where a second-tier block failed its check: recomputed
                self.blocks.grow(seq, end)
            self.running.append(seq)
            chunks.append(Chunk(seq, start, end))
            budget -= n
        if not chunks:  # a safety net: a step that schedules nothing would repeat forever
            raise PoolTooSmall(f"no sequence could be scheduled ({len(self.running)} running, "
                               f"{len(self.waiting)} waiting, max_num_seqs={self.max_num_seqs}).")
        return chunks

    def _lora_slot(self, seq: Sequence) -> bool:
        """A LoRA slot for an adapter's sequence (its adapter loaded into a free slot, or into the
        least recently used one no running sequence uses: lora.Slots.acquire); False when every slot
        serves running sequences. The base model's sequences need none."""
        if seq.adapter is None:
            return True
        if self.lora is None:
            raise ValueError(f"a request names adapter {seq.adapter} but no LoRA adapter is loaded "
                             "(engine_options.reference.lora_adapters)")
        seq.lora_slot = self.lora.acquire(seq.adapter, {s.lora_slot for s in self.running if s.lora_slot is not None})
        return seq.lora_slot is not None

    def _draft_room(self, seq: Sequence) -> int:
        """Draft tokens a running sequence may verify this step: up to `lookahead` while it is
        decoding (only its newest token lacks K/V; never while scored), and no more than it needs
        beyond the step's own token (a step then emits at most what `stop_len` allows)."""
        if not self.lookahead or seq.num_computed != seq.num_tokens - 1 or seq.score_from is not None:
            return 0
        return max(0, min(self.lookahead, seq.stop_len - seq.num_tokens - 1))

    def _chunk_len(self, seq: Sequence, start: int, budget: int, first: bool, extra: int = 0) -> int:
        """How many of `seq`'s remaining tokens (plus `extra` draft slots) fit in `budget`.
        Without a cache a sequence cannot be split (nothing would keep the first part): it goes
        whole, or alone."""
        remaining = seq.num_tokens - start + extra
        if self.blocks is None:
            return remaining if remaining <= budget or first else 0
        return min(remaining, budget)

    def _make_room(self, seq: Sequence, num_tokens: int, chunks: list[Chunk]) -> bool:
        """Blocks for `num_tokens` of `seq`, preempting the most recently admitted sequences
        not yet scheduled in this step. False if `seq` itself had to go."""
        if self.blocks is None:
            return True
        if not self.blocks.fits(num_tokens):  # it would preempt itself forever
            raise PoolTooSmall(
                f"a sequence of {num_tokens} tokens needs more than the KV pool's {self.blocks.num_blocks} "
                "blocks; raise engine_options.reference.kv_cache_bytes or shorten the sequences.")
        scheduled = {id(c.seq) for c in chunks}
        while not self.blocks.grow(seq, num_tokens):
            victims = [s for s in self.running if id(s) not in scheduled]
            victim = victims[-1]  # `seq` itself is among them, so there is always one
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt_idle(self) -> bool:
        """Free the blocks of a sequence that holds some but wants no step now (a fixed batch
        whose other sequences still need this step's token)."""
        idle = [s for s in self.running if not s.wants_step]
        if not idle:
            return False
        self.preempt(idle[-1])
        return True
