"""One engine step: the scheduled chunks in, one greedy token per finished chunk out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from adapters.reference.attention import StepAttention, is_decode
from adapters.reference.kv_cache import KVPool
from adapters.reference.model import Model
from adapters.reference.scheduler import Chunk


@dataclass
class Sampled:
    chunk: Chunk
    token: int
    logits: Any = None  # [vocab] float32 on the CPU, when asked for


class ModelRunner:
    def __init__(self, model: Model, pool: KVPool | None):
        self.model, self.pool = model, pool
        self.device = model.device

    def run(self, chunks: list[Chunk], keep_logits: bool = False) -> list[Sampled]:
        # decode chunks first: attention takes them as one batch at the front
        chunks = sorted(chunks, key=lambda c: not (self.pool is not None and is_decode(c.start, c.end)))
        ids, positions, last = [], [], []
        for c in chunks:
            ids.extend(c.seq.tokens[c.start:c.end])
            positions.extend(range(c.start, c.end))
            if c.samples:
                last.append(len(ids) - 1)
        if max(positions) >= self.model.rope_len:
            raise ValueError(f"a sequence reached position {max(positions)}, past the model's "
                             f"{self.model.rope_len} positions (max_position_embeddings).")
        dev = self.device
        attend = StepAttention(self.pool, chunks, self.model.cfg.num_heads, dev)
        with torch.inference_mode():
            logits = self.model.forward(torch.tensor(ids, dtype=torch.long, device=dev),
                                        torch.tensor(positions, dtype=torch.long, device=dev),
                                        attend, torch.tensor(last, dtype=torch.long, device=dev))
            tokens = logits.argmax(dim=-1).tolist()  # a host copy: the step has finished
        rows = logits.cpu() if keep_logits else [None] * len(tokens)
        sampling = [c for c in chunks if c.samples]
        return [Sampled(c, tok, row) for c, tok, row in zip(sampling, tokens, rows)]
