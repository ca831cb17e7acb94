"""One engine step: the scheduled chunks in, one greedy token per finished chunk out (among the
tokens its grammar allows, for a request with a constraint: grammar.py) (and, for
sequences being scored, the logits of every scored position). A verify chunk (speculative
decoding: the newest token, then the draft tokens) gives the greedy token at each of its
1 + len(draft) last positions, from the same one pass.

A step of decode chunks only goes to the CUDA graphs when there are some (cuda_graphs.py);
everything else runs eagerly through the model with the attention the kernels chose."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from adapters.reference.attention import StepAttention, is_decode
from adapters.reference.grammar import mask_rows
from adapters.reference.kv_cache import KVPool
from adapters.reference.model import Model
from adapters.reference.scheduler import Chunk


@dataclass
class Sampled:
    chunk: Chunk
    token: int  # the greedy token after the chunk's last position
    logits: Any = None  # [vocab] float32 on the CPU, when asked for
    # a verify chunk: the greedy token after its newest token and after each draft token
    # (`token` is the last); speculative.accept_length compares the draft with them
    greedy: list[int] | None = None
    # what the sequence got from this step (llm_engine.run_step): [token], or the accepted draft
    # tokens and the target's own next one
    emitted: list[int] = field(default_factory=list)


@dataclass
class Scored:
    """Float32 logits [len(positions), vocab] of one chunk's scored positions (on the device)."""

    chunk: Chunk
    positions: range
    logits: torch.Tensor


@dataclass
class StepOutput:
    sampled: list[Sampled]
    scored: list[Scored] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: Model, pool: KVPool | None, attention=StepAttention, graphs=None, greedy=None,
                 lora=None):
        """`attention(pool, chunks, num_heads, device)` builds a step's attention (kernels.py);
        `graphs`: a cuda_graphs.DecodeGraphs, or None; `greedy(logits) -> list of row argmaxes`: the
        device's (kernels.py), else torch.argmax; `lora`: the LoRA slots (lora.Slots), or None."""
        self.model, self.pool, self.attention, self.graphs = model, pool, attention, graphs
        self.lora = lora
        self.greedy = greedy or (lambda logits: logits.argmax(dim=-1).tolist())
        self.device = model.device

    def _attention_chunks(self, chunks: list[Chunk]) -> list[Chunk]:
        """The chunks as attention sees them. A verify chunk (the newest token and the draft
        tokens, positions T - 1 .. T - 1 + m) is m + 1 decode queries on the sequence's block
        table, the one at position p attending to the keys 0 .. p: all the step's K/V are written
        before any query attends, so the queries after the first see the draft tokens' K/V. They
        run with the decode queries of the step, through the decode kernels (on a CPU the fused
        paged kernel), in one batch."""
        if self.pool is None or not any(c.seq.draft for c in chunks):
            return chunks
        out = []
        for c in chunks:
            if c.seq.draft:
                out.extend(Chunk(c.seq, p, p + 1) for p in range(c.start, c.end))
            else:
                out.append(c)
        return out

    def run(self, chunks: list[Chunk], keep_logits: bool = False) -> StepOutput:
        constrained = any(c.seq.grammar is not None for c in chunks)
        adapters = any(c.seq.lora_slot is not None for c in chunks)
        if self.graphs is not None and not constrained and not adapters and self.graphs.fits(chunks):
            tokens, logits = self.graphs.run(chunks)
            rows = logits.cpu() if keep_logits else [None] * len(tokens)
            return StepOutput([Sampled(c, tok, row) for c, tok, row in zip(chunks, tokens, rows)])
        # decode chunks first: attention takes them as one batch at the front; a verify chunk's
        # positions go there too, as one decode query each (below)
        chunks = sorted(chunks, key=lambda c: not (self.pool is not None and (is_decode(c.start, c.end)
                                                                             or bool(c.seq.draft))))
        ids, positions, rows = [], [], []  # rows: flat indices whose logits the step keeps
        kept: list[tuple[Chunk, range, int]] = []  # chunk, its kept positions, their first logits row
        for c in chunks:
            base = len(ids) - c.start
            ids.extend(c.token_ids)
            positions.extend(range(c.start, c.end))
            keep = c.logit_positions
            if keep:
                kept.append((c, keep, len(rows)))
                rows.extend(base + p for p in keep)
        if max(positions) >= self.model.rope_len:
            raise ValueError(f"a sequence reached position {max(positions)}, past the model's "
                             f"{self.model.rope_len} positions (max_position_embeddings).")
        dev = self.device
        attend = self.attention(self.pool, self._attention_chunks(chunks), self.model.cfg.num_heads, dev)
        # LoRA: each token's row of the mask picks its sequence's adapter slot (lora.py)
        mask = self.lora.mask([c.seq.lora_slot for c in chunks for _ in range(c.end - c.start)]) \
            if adapters else None
        with torch.inference_mode():
            logits = self.model.forward(torch.tensor(ids, dtype=torch.long, device=dev),
                                        torch.tensor(positions, dtype=torch.long, device=dev),
                                        attend, torch.tensor(rows, dtype=torch.long, device=dev), self.lora, mask)
            # each sampling chunk's last row; a verify chunk's last 1 + len(draft) rows
            sampling = [(c, first + len(keep) - 1 - len(c.seq.draft)) for c, keep, first in kept if c.samples]
            sample_rows = [r for c, r0 in sampling for r in range(r0, r0 + 1 + len(c.seq.draft))]
            # a decode step samples every row, in order: no copy (a constrained step masks a copy)
            every = not constrained and sample_rows == list(range(logits.shape[0]))
            sample_logits = logits if every else logits[sample_rows]
            if constrained:  # structured output: only what each request's grammar allows (no drafts then)
                mask_rows(sample_logits, [(i, c.seq.grammar) for i, (c, _) in enumerate(sampling)
                                          if c.seq.grammar is not None])
            tokens = self.greedy(sample_logits)  # a host copy: the step has finished
        out = StepOutput([])
        if len(tokens) == len(sampling):  # no drafts: one token per chunk
            cpu_rows = sample_logits.cpu() if keep_logits else [None] * len(tokens)
            out.sampled = [Sampled(c, tok, row) for (c, _), tok, row in zip(sampling, tokens, cpu_rows)]
        else:
            assert not keep_logits, "a verify chunk's logits are not kept"
            i = 0
            for c, _ in sampling:
                n = 1 + len(c.seq.draft)
                greedy = tokens[i:i + n]
                out.sampled.append(Sampled(c, greedy[-1], None, greedy if c.seq.draft else None))
                i += n
        out.scored = [Scored(c, keep, logits[first:first + len(keep)]) for c, keep, first in kept
                      if c.seq.score_from is not None]
        return out
