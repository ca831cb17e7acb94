"""Decode steps replayed from CUDA graphs.

A decode step of a LLaMA-8B-shaped model launches about a thousand small kernels; at batch 1
the GPU then waits on the CPU for half the step. A CUDA graph records the step's kernels once
and replays them with one launch. A graph has fixed shapes and addresses, so (as vLLM does):

- one graph per *bucket* of batch sizes (`BUCKETS`); a step of b sequences replays the smallest
  bucket >= b, and its extra rows are padding: they write their K/V into a scratch block of the
  pool (never handed to a sequence) and attend to one slot of it, and their outputs are dropped;
- the inputs live in static buffers that every graph reads: `meta` (token id, position, the new
  token's block and offset, context length, one row each) and `tables`, the block tables as a
  [largest bucket, W] tensor (W = blocks of max_model_len; entries past a sequence's blocks are
  never read by the Triton kernel and are valid, masked block ids for the PyTorch one);
- a step copies its inputs into them (two host-to-device copies), replays, and reads the
  tokens (and logits) from static outputs.

Steps the graphs cannot take (prefill chunks, a scored sequence, more sequences than the
largest bucket, a context longer than W blocks) run eagerly. The bookkeeping here is plain
PyTorch and device-agnostic: `backend` records and replays (CudaGraphBackend on a GPU; the
tests use a stand-in that re-runs the recorded function on a CPU).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import torch

from adapters.reference.attention import is_decode, padded_tables
from adapters.reference.kv_cache import KVPool

BUCKETS = (1, 2, 4) + tuple(range(8, 65, 8)) + tuple(range(80, 257, 16))
MAX_GRAPH_BATCH = BUCKETS[-1]
META = 5  # rows of `meta`: token id, position, block of the new token, its offset, context length


def buckets_up_to(max_batch: int) -> tuple[int, ...]:
    """The buckets a run needs: those below max_batch, and max_batch itself (capped)."""
    top = max(1, min(max_batch, MAX_GRAPH_BATCH))
    return tuple(b for b in BUCKETS if b < top) + (top,)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds n sequences, or None."""
    return next((b for b in buckets if b >= n), None)


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], None]) -> Any: ...
    def replay(self, handle: Any) -> None: ...


class CudaGraphBackend:
    """torch.cuda.CUDAGraph, every graph in one shared memory pool (as vLLM does)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.mempool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up: kernels compile, cuBLAS settles on algorithms
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            fn()
        return graph

    def replay(self, handle: torch.cuda.CUDAGraph) -> None:
        handle.replay()


class GraphDecodeAttention:
    """The model's `attend(layer, q, k, v)` for a graphed decode step: static rows, tables and
    lengths; no host work at all."""

    def __init__(self, pool: KVPool, rows: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 decode_fn: Callable[..., torch.Tensor]):
        self.pool, self.rows, self.tables, self.lens, self.decode_fn = pool, rows, tables, lens, decode_fn

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.write(layer, self.rows, k, v)
        return self.decode_fn(q, self.pool, layer, self.tables, self.lens)


class DecodeGraphs:
    def __init__(self, model, pool: KVPool, decode_fn: Callable[..., torch.Tensor], max_batch: int,
                 max_len: int, backend: GraphBackend):
        self.model, self.pool, self.decode_fn, self.backend = model, pool, decode_fn, backend
        self.buckets = buckets_up_to(max_batch)
        self.width = -(-max_len // pool.block_size)
        top, dev = self.buckets[-1], model.device
        self.scratch = pool.scratch_block
        self.meta = torch.zeros(META, top, dtype=torch.long, device=dev)
        self.meta[2] = self.scratch
        self.meta[4] = 1
        self.tables = torch.full((top, self.width), self.scratch, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(top, dtype=torch.long, device=dev)
        self.logits = torch.zeros(top, model.cfg.vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict[int, Any] = {}
        self.replays: Counter[int] = Counter()  # bucket -> steps replayed
        self.padded_rows = 0  # rows of padding replayed, in all

    def capture(self) -> None:
        """Record one graph per bucket, the largest first (the smaller ones reuse its memory)."""
        with torch.inference_mode():
            for b in reversed(self.buckets):
                self.graphs[b] = self.backend.capture(partial(self._forward, b))

    def _forward(self, b: int) -> None:
        """The step the graph of bucket b records: reads the static inputs, writes the outputs."""
        ids, positions, blocks, offsets, lens = self.meta[:, :b]
        attend = GraphDecodeAttention(self.pool, self.pool.rows(blocks, offsets), self.tables[:b], lens,
                                      self.decode_fn)
        logits = self.model.forward(ids, positions, attend, None)  # every row samples
        self.logits[:b].copy_(logits)
        self.tokens[:b].copy_(logits.argmax(dim=-1))

    def fits(self, chunks: list) -> bool:
        """Whether this step can be replayed: decode chunks only, none scored, few enough, and
        every context within the static tables."""
        return (0 < len(chunks) <= self.buckets[-1]
                and all(is_decode(c.start, c.end) and c.seq.score_from is None
                        and c.end <= self.width * self.pool.block_size for c in chunks))

    def run(self, chunks: list) -> tuple[list[int], torch.Tensor]:
        """Replay the step of these decode chunks: (their tokens, their float32 logits [b, vocab]
        on the device, valid until the next replay)."""
        b = len(chunks)
        bucket = bucket_for(b, self.buckets)
        bs = self.pool.block_size
        cols, blocks = [], []
        for c in chunks:
            seq, p = c.seq, c.start  # the new token's position
            blocks.append(seq.block_table[p // bs])
            cols.append((seq.tokens[p], p, blocks[-1], p % bs, c.end))
        cols += [(0, 0, self.scratch, 0, 1)] * (bucket - b)  # padding: scratch slot, one key
        n = max(-(-c.end // bs) for c in chunks)
        self.pool.prepare(set(blocks))  # a no-op on a GPU (its pool is zeroed at allocation)
        self.meta[:, :bucket].copy_(torch.tensor(list(zip(*cols)), dtype=torch.long))
        self.tables[:b, :n].copy_(torch.tensor(padded_tables([c.seq.block_table for c in chunks], n),
                                               dtype=torch.long))
        self.backend.replay(self.graphs[bucket])
        self.replays[bucket] += 1
        self.padded_rows += bucket - b
        return self.tokens[:b].tolist(), self.logits[:b]

    def stats(self) -> dict[str, Any]:
        return {"buckets": list(self.buckets), "captured": sorted(self.graphs),
                "replays": dict(sorted(self.replays.items())), "padded_rows": self.padded_rows}
