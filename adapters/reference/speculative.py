"""Speculative decoding: propose k tokens cheaply, verify them in ONE pass of the target model.

A step of a decoding sequence (T tokens, the newest one without K/V yet) normally computes one
token. With speculation (`speculative_method`, k = `num_speculative_tokens`):

  1. propose: a *proposer* guesses the next m <= k tokens d_1 .. d_m (`NgramProposer`: prompt
     lookup in the sequence's own tokens; `DraftModelProposer`: a smaller model run greedily m
     steps);
  2. verify: the target computes the chunk [t_{T-1}, d_1, .., d_m] at positions T-1 .. T-1+m in
     one pass, exactly like a prefill chunk after a cached context (the scheduler budgets and
     the runner computes it; attention reads the context through the block table), and keeps
     the greedy token g_i at each of those m + 1 positions;
  3. accept (`accept_length`, greedy verification): a = the longest prefix with d_i == g_{i-1};
     the sequence gets d_1 .. d_a and then g_a (the target's own token at the first mismatch, or
     the *bonus* token after the last draft token). So a step emits a + 1 tokens, between 1 and
     m + 1, and they are exactly the tokens the target alone would have produced, one at a time.

The K/V the verify pass wrote for positions T-1 .. T-1+a are the target's own (the accepted
draft tokens are the target's tokens); those of the m - a rejected positions are garbage. The
engine (llm_engine.run_step) sets `num_computed` to T + a, so the rejected slots count as empty
(the next step overwrites them), and `BlockManager.shrink` gives back every block past them; the
prefix cache registers only blocks of computed tokens, so never one holding a rejected token.

The counters (adapters/speculative.py `SpecCounter`, as the hf adapter's): one draft per sequence
and step that proposed at least one token; accepted tokens exclude the bonus token, so a step emits
accepted + 1 tokens per draft, and 1 per sequence that did not speculate.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from adapters.reference.block_manager import BlockManager
from adapters.reference.kv_cache import KVPool
from adapters.reference.runner import ModelRunner, Sampled
from adapters.reference.scheduler import Chunk, Sequence
from adapters.speculative import SpecCounter
from harness.core.metrics import common_prefix

OPT = "engine_options.reference"


def accept_length(draft: list[int], greedy: list[int]) -> int:
    """Greedy verification: how many leading draft tokens equal the target's own choices.
    `greedy[i]` is the target's greedy token at the position of `draft[i]` (i.e. after the
    tokens before it)."""
    return common_prefix(draft, greedy)


# ---- n-gram (prompt lookup) -------------------------------------------------------------------

class NgramIndex:
    """Where each n-gram (prompt_lookup_min <= n <= prompt_lookup_max) of one sequence's tokens
    first occurs: n-gram -> the position right after its earliest occurrence. Updated with the
    tokens appended since the last lookup (a few dict operations per token), so a lookup costs
    one dict probe per n, whatever the sequence's length."""

    def __init__(self, n_min: int, n_max: int):
        self.sizes = range(n_max, n_min - 1, -1)  # longest first
        self.after: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at positions < this are in `after`

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """The up to k tokens that followed the earliest earlier occurrence of the longest
        suffix n-gram that occurred before; [] when none did."""
        n_tokens = len(tokens)
        after = self.after
        for end in range(self.indexed + 1, n_tokens + 1):  # index n-grams ending at end - 1
            for n in self.sizes:
                if n <= end:
                    after.setdefault(tuple(tokens[end - n:end]), end)
        self.indexed = n_tokens
        for n in self.sizes:
            if n > n_tokens:
                continue
            pos = after[tuple(tokens[n_tokens - n:])]
            if pos < n_tokens:  # an occurrence before the suffix itself
                return tokens[pos:pos + k]
        return []


class NgramProposer:
    """Prompt lookup over the sequence's own tokens (prompt and output so far): the longest
    suffix n-gram of prompt_lookup_max down to prompt_lookup_min tokens that occurred earlier;
    of its occurrences the earliest (as vLLM's and transformers' prompt lookup choose); it
    proposes the up to k tokens that followed it (fewer when the sequence ends sooner)."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        out = []
        for seq, room in zip(seqs, rooms):
            if seq.spec is None:
                seq.spec = NgramIndex(self.n_min, self.n_max)
            out.append(seq.spec.propose(seq.tokens, room))
        return out

    def verified(self, seq: Sequence) -> None:
        """Nothing to roll back: the index covers the sequence's tokens only."""

    def observe(self, chunks: list[Chunk]) -> None:
        """Nothing to mirror."""

    def release(self, seq: Sequence) -> None:
        """The index stays valid (a preempted sequence keeps its tokens)."""


# ---- draft model ------------------------------------------------------------------------------

class DraftModelProposer:
    """A second, smaller model with the target's tokenizer, run greedily. It has its own KV pool
    (as many blocks of the same size as the target's; on CUDA carved from the same memory
    budget), its own block manager (no prefix cache) and its own runner with the target's
    kernels. Each target sequence has a draft-side `Sequence` (`seq.spec`) whose `num_computed`
    says how far the draft's K/V go.

    - propose: catch up on the target's tokens the draft lacks and propose the first token in
      one pass (a prefill chunk after the draft's cached context, usually 1 or 2 tokens), then
      one decode pass per further token, the sequences of the step batched together;
    - verified: roll back to the accepted length: the draft's K/V of positions < T + a are right
      (its inputs there were the accepted tokens), the rest are dropped and their blocks freed;
    - observe: while the target prefills a prompt, the draft prefills it too in the same step,
      so the first decode step starts from a draft that has the prompt (TTFT pays for it, as in
      vLLM), not the first speculative step.
    A sequence whose draft cannot get blocks does not speculate that step (its draft starts over).
    """

    def __init__(self, model: Any, num_blocks: int, block_size: int, kv_dtype: str, attention: Any):
        c = model.cfg
        self.model = model
        self.pool = KVPool(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, kv_dtype, model.dtype,
                           model.device)
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=False)
        self.runner = ModelRunner(model, self.pool, attention)

    def _draft_seq(self, seq: Sequence) -> Sequence:
        if seq.spec is None:
            seq.spec = Sequence(seq.seq_id, [], stop_len=1 << 62)
        d = seq.spec
        d.num_computed = min(d.num_computed, seq.num_computed)  # never ahead of the target
        del d.tokens[d.num_computed:]  # then the target's tokens it lacks
        d.tokens.extend(seq.tokens[d.num_computed:])
        return d

    def _run(self, chunks: list[Chunk]) -> None:
        """One draft pass; a chunk that reaches its sequence's end appends the greedy token."""
        for s in self.runner.run(chunks).sampled:
            s.chunk.seq.tokens.append(s.token)
        for c in chunks:
            c.seq.num_computed = c.end

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        drafts: list[Sequence | None] = []
        stops: list[int] = []  # the draft's length once it has proposed `room` tokens
        for seq, room in zip(seqs, rooms):
            d = self._draft_seq(seq)
            if self.blocks.grow(d, seq.num_tokens + room - 1):  # the last proposal needs no slot
                drafts.append(d)
                stops.append(seq.num_tokens + room)
            else:  # no room in the draft's pool: no speculation for it this step
                self.release(seq)
                drafts.append(None)
        live = [(d, stop) for d, stop in zip([d for d in drafts if d is not None], stops)]
        chunks = [Chunk(d, d.num_computed, len(d.tokens)) for d, _ in live]  # catch up, propose the first
        while chunks:
            self._run(chunks)
            chunks = [Chunk(d, len(d.tokens) - 1, len(d.tokens)) for d, stop in live if len(d.tokens) < stop]
        return [d.tokens[seq.num_tokens:] if d is not None else [] for seq, d in zip(seqs, drafts)]

    def verified(self, seq: Sequence) -> None:
        d = seq.spec
        if d is not None:
            d.num_computed = min(d.num_computed, seq.num_computed)
            del d.tokens[d.num_computed:]
            self.blocks.shrink(d, d.num_computed)

    def observe(self, chunks: list[Chunk]) -> None:
        """Prefill the draft alongside the target's prefill chunks (not its decode or verify ones)."""
        todo = []
        for c in chunks:
            if not c.draft_room and (c.end - c.start > 1 or c.start == 0):
                d = self._draft_seq(c.seq)
                if d.num_computed < c.end and self.blocks.grow(d, c.end):
                    todo.append(Chunk(d, d.num_computed, c.end))
        if todo:
            self._run(todo)  # chunks short of the draft's tokens: nothing sampled

    def release(self, seq: Sequence) -> None:
        d = seq.spec
        if d is not None:
            self.blocks.free_sequence(d)
            d.num_computed = 0
            del d.tokens[:]


# ---- the draft checkpoint: checked before anything loads ----------------------------------------

def _tokenizer_identity(path: Path) -> tuple[str, Any] | None:
    """What makes a tokenizer: tokenizer.json's model (vocabulary, merges) and added tokens, or
    the sentencepiece file's bytes; None where the directory has neither."""
    tj = path / "tokenizer.json"
    if tj.is_file():
        data = json.loads(tj.read_text())
        return "tokenizer.json", (data.get("model"), data.get("added_tokens"))
    sp = path / "tokenizer.model"
    if sp.is_file():
        return "tokenizer.model", sp.read_bytes()
    return None


def draft_problems(draft: str | None, target_vocab: int | None, target_dir: str | None) -> list[str]:
    """Why `draft` (engine_options.reference.draft_model) cannot draft for this target: not a
    checkpoint directory, another vocabulary size, another tokenizer (compared where both
    directories have one: the target's may not be on disk yet at plan time; load checks again)."""
    from harness.core.presets import shape_from_hf_config  # here: config.json's one reader

    where = f"{OPT}.draft_model={draft}"
    path = Path(draft or "").expanduser()
    if not draft or not (path / "config.json").is_file():
        return [f"{where}: not a checkpoint directory (no config.json there). Give the draft model's "
                "directory (a preset name is resolved to one by the harness), or use speculative_method=ngram."]
    try:
        vocab = shape_from_hf_config(path).vocab_size
    except Exception as e:  # noqa: BLE001 - any unreadable config is the user's to fix
        return [f"{where}: its config.json cannot be read ({e}). Give a Hugging Face checkpoint directory."]
    if target_vocab is not None and vocab != target_vocab:
        return [f"{where}: its vocabulary has {vocab} tokens, the target's {target_vocab}. The draft must share "
                "the target's tokenizer: give a draft trained with it."]
    if target_dir and Path(target_dir).is_dir():
        mine, theirs = _tokenizer_identity(path), _tokenizer_identity(Path(target_dir))
        if mine is not None and theirs is not None and mine != theirs:
            return [f"{where}: its tokenizer ({mine[0]}) differs from the target's ({theirs[0]}), so its token ids "
                    "mean other text. Give a draft that shares the target's tokenizer."]
    return []


# ---- the counters and the wiring --------------------------------------------------------------

class Speculator:
    """The engine's hooks (llm_engine.run_step): `propose` before the target's pass, `accept`
    for each verified chunk after it, `after_step` once the sequences are updated."""

    def __init__(self, proposer: Any, k: int, sync: Any):
        self.proposer, self.k, self.sync = proposer, k, sync
        self.counters = SpecCounter(accepted_per_pos=[0] * k, source="engine")

    def propose(self, chunks: list[Chunk]) -> bool:
        """Fill the drafts of the chunks with room for some; True when any was proposed."""
        wanting = [c for c in chunks if c.draft_room]
        if not wanting:
            return False
        t0 = time.perf_counter()
        drafts = self.proposer.propose([c.seq for c in wanting], [c.draft_room for c in wanting])
        any_draft = False
        for c, draft in zip(wanting, drafts):
            c.seq.draft = draft[:c.draft_room]
            c.end += len(c.seq.draft)
            any_draft = any_draft or bool(draft)
        self.sync()
        self.counters.draft_time_s += time.perf_counter() - t0
        return any_draft

    def accept(self, s: Sampled) -> list[int]:
        """The tokens a verified chunk gives its sequence (the accepted draft tokens, then the
        target's own next token), counted."""
        draft = s.chunk.seq.draft
        a = accept_length(draft, s.greedy)
        self.counters.observe(len(draft), a)
        return draft[:a] + [s.greedy[a]]

    def after_step(self, chunks: list[Chunk]) -> None:
        for c in chunks:
            if c.draft_room:
                self.proposer.verified(c.seq)
        self.proposer.observe(chunks)

    def release(self, seq: Sequence) -> None:
        seq.draft = []
        self.proposer.release(seq)


def load_draft(path: str, target_cfg: Any) -> Any:
    """The draft's ModelConfig, checked against the target's (ValueError naming the option)."""
    from adapters.reference.model import ModelConfig

    problems = draft_problems(path, target_cfg.vocab_size, None)
    if problems:
        raise ValueError(problems[0])
    cfg = ModelConfig.from_dir(path)
    if cfg.windows or cfg.mla is not None or cfg.attention_sinks:
        what = "sliding windows" if cfg.windows else "latent attention" if cfg.mla is not None else "attention sinks"
        raise ValueError(f"{OPT}.draft_model={path}: a draft with {what} is not supported (the draft runs on one "
                         "plain paged pool). Give a dense LLaMA-family draft.")
    return cfg


def draft_bytes_per_token(cfg: Any, kv_dtype: str, dtype: torch.dtype) -> int:
    from adapters.reference.kv_cache import bytes_per_token

    return bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype, dtype)
