"""The reference engine's KV blocks per layer group as the context grows, beside hand counts;
for a latent-attention (MLA) checkpoint, its measured bytes per token beside the latent formula
and the dense-equivalent K/V.

    PYTHONPATH=. .venv/bin/python scripts/reference_kv_groups.py CHECKPOINT [--block 16] [--lens 64,128,...]

For each length n: one sequence, a prompt of n tokens prefilled and one decode step (n + 1
tokens with K/V); then kv_cache_info()'s per-group rows (extra["kv_groups"]). The hand counts:
a full group holds ceil((n + 1) / block) blocks; a windowed group (window W) holds the blocks
from the one with position visible_from(n + 1, W) = n + 2 - W (the next query's first key) to
the one with position n, at most ceil(W / block) + 1. Bytes = blocks x the group's bytes per
block (its layers x 2 x KV heads x head_dim x element bytes x block). Prints a Markdown table;
exit 1 if a measured count differs from the hand count.
"""

from __future__ import annotations

import argparse
import math
import sys

from adapters.base import ModelSpec
from adapters.reference.engine import ReferenceEngine


def hand_blocks(n_tokens: int, window: int | None, block: int) -> int:
    last = (n_tokens - 1) // block
    if window is None:
        return last + 1
    return last - max(0, n_tokens + 1 - window) // block + 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--lens", default="64,128,256,512,1024,2048")
    args = ap.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    e = ReferenceEngine()
    e.load(ModelSpec(path=args.checkpoint, name="m", dtype="float32", max_model_len=max(lens) + 8, threads=2),
           {"block_size": args.block, "prefix_caching": False})
    bad = 0
    if e.core.model.cfg.mla is not None:
        return latent_table(e, lens)
    print("| context (tokens with K/V) | group | layers | blocks held | hand count | bound | bytes held | "
          "bytes if every layer were full |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        for n in lens:
            e.prefill([[3 + (i * 7) % 1000 for i in range(n)]])
            e.decode(1)
            tokens = n + 1
            rows = e.kv_cache_info().extra["kv_groups"]
            for r in rows:
                want = hand_blocks(tokens, r["window"], args.block)
                bound = "-" if r["window"] is None else str(math.ceil(r["window"] / args.block) + 1)
                full = -(-tokens // args.block) * r["bytes_per_block"]
                bad += r["blocks_in_use"] != want
                print(f"| {tokens} | {r['kind']} | {len(r['layers'])} | {r['blocks_in_use']} | {want} | {bound} | "
                      f"{r['blocks_in_use'] * r['bytes_per_block']:,} | {full:,} |")
            e.release()
    finally:
        e.close()
    return 1 if bad else 0


def latent_table(e: ReferenceEngine, lens: list[int]) -> int:
    """(kv_lora_rank + qk_rope_head_dim) x element bytes x layers, measured from the pool."""
    cfg = e.core.model.cfg
    m = cfg.mla
    formula = cfg.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 4  # float32
    print("| tokens with K/V | blocks | pool bytes held (blocks x block x B/token) | measured B/token | "
          "formula layers x (rank + rope) x 4 | dense K/V B/token (layers x heads x (qk + v dims) x 4) |")
    print("|---|---|---|---|---|---|")
    bad = 0
    try:
        for n in lens:
            e.prefill([[3 + (i * 7) % 1000 for i in range(n)]])
            e.decode(1)
            info = e.kv_cache_info()
            held = info.blocks_in_use * info.bytes_per_block
            bad += info.bytes_per_token != formula or info.bytes_per_block != formula * info.block_size
            print(f"| {n + 1} | {info.blocks_in_use} | {held:,} | {info.bytes_per_token} | {formula} | "
                  f"{info.extra['latent']['dense_equivalent_bytes_per_token']} |")
            e.release()
    finally:
        e.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
