"""The break-even of a second KV tier, per model (docs/metrics.md, "KV tiers"): what reloading a
history token from the reference engine's second tier costs against prefilling it again, at a
given history length, both measured on this machine.

    PYTHONPATH=. .venv/bin/python scripts/kv_tier_breakeven.py [--models tiny:num_key_value_heads=8,tiny,...]
        [--lens 256,1024] [--rounds 5] [--medium disk] [--dtype float32]

A model is a preset name, optionally with shape overrides after a colon (`tiny:num_key_value_heads=8`:
the tiny preset with as many KV heads as query heads, a dense multi-head-attention variant); its
checkpoint is materialised in the model cache as the harness does (random weights).

For each model and history length H, one engine (prefix caching on, a second tier on `medium`,
a first-tier pool of ceil((H + 64) / block) blocks) and `rounds` rounds of, in this order:
  computed  the prefix cache reset (the tier too), a prompt A of H + 1 tokens served for one token:
            TTFT with nothing cached (H + 1 tokens prefilled);
  pooled    A again: its H // block full blocks are first-tier hits, the rest prefilled;
  evict     a prompt B that needs every block of the pool: A's blocks go to the second tier;
  reloaded  A again: the same blocks are second-tier hits (checked: every one), read back and
            placed, the rest prefilled as for `pooled`.
Per round, from the medians over the rounds:
  prefill cost per token  (TTFT computed - TTFT pooled) / cached tokens: what recomputing one
                          history token costs at history length H (the step's fixed cost and the
                          tail's prefill cancel out);
  reload cost per token   the estimator's KV bytes per token (harness.core.kvcalc, all layer
                          groups: a latent model's latent) / the tier's measured read bandwidth
                          (bytes read / seconds the engine spent reading and placing them, its own
                          counters); beside it the end-to-end (TTFT reloaded - TTFT pooled) /
                          reloaded tokens;
  break-even              reload / prefill: below 1, reloading a token is cheaper than recomputing it.
Beside the estimator's bytes per token, the dense-equivalent K/V (kvcalc.dense_bytes_per_token: what
the same model would cache without latent compression): a latent model's advantage per token.
The tier's write bandwidth (offloads, while B ran) is printed too. Prints a Markdown table.
Timings: run under `/work/tools/cpu bench` on the shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from adapters.base import ModelSpec, Request, TokenEvent, now_ns
from adapters.reference.engine import ReferenceEngine
from harness.checkpoint import ensure_checkpoint
from harness.core.kvcalc import dense_bytes_per_token, estimate, kv_dtype_of
from harness.core.paths import model_cache_dir
from harness.core.presets import load_preset
from harness.core.shapes import ModelShape

BLOCK = 16


def model_of(spec: str) -> tuple[str, ModelShape]:
    """`preset[:field=value,...]` -> (label, shape)."""
    name, _, over = spec.partition(":")
    shape = load_preset(name)
    if not over:
        return name, shape
    fields: dict[str, Any] = {}
    for kv in over.split(";"):
        k, _, v = kv.partition("=")
        fields[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
    shape = ModelShape(**{**shape.to_dict(), **fields}).check("model")
    return f"{name} ({', '.join(f'{k}={v}' for k, v in fields.items())})", shape


def family(shape: ModelShape) -> str:
    if getattr(shape, "kv_lora_rank", None):
        return "latent (MLA)"
    if shape.num_key_value_heads == shape.num_attention_heads:
        return "dense MHA"
    return f"GQA {shape.num_attention_heads}/{shape.num_key_value_heads}"


def ttft(e: ReferenceEngine, rid: str, ids: list[int]) -> tuple[float, TokenEvent]:
    start = now_ns()
    for ev in e.serve([Request(rid, ids, 1)], start):
        if isinstance(ev, TokenEvent) and ev.index == 0:
            first = ev
    return (first.time_ns - start) / 1e9, first


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def measure(label: str, shape: ModelShape, ckpt: str, h: int, rounds: int, medium: str, dtype: str,
            threads: int | None) -> dict[str, Any]:
    pool_blocks = -(-(h + 64) // BLOCK)
    pool_tokens = pool_blocks * BLOCK
    est = estimate(shape, 1, 1, kv_dtype_of(dtype))
    bpt = sum(g.bytes_per_token for g in est.groups if g.kind != "linear")
    a = prompt(h + 1, 1, shape.vocab_size)
    b = prompt(pool_tokens - 8, 2, shape.vocab_size)
    hit_blocks = h // BLOCK
    with tempfile.TemporaryDirectory(prefix="kv-tier-breakeven-") as tmp:
        e = ReferenceEngine()
        e.load(ModelSpec(ckpt, label, dtype, max_model_len=pool_tokens, threads=threads),
               {"block_size": BLOCK, "kv_cache_bytes": pool_blocks * BLOCK * bpt, "kv_offload": True,
                "kv_offload_medium": medium, "kv_offload_dir": tmp})
        try:
            slot_bytes = e.kv_cache_info().extra["kv_tiers"]["slot_bytes"]
            if slot_bytes != BLOCK * bpt:
                raise SystemExit(f"{label}: the engine's block is {slot_bytes} bytes, the estimator says "
                                 f"{BLOCK * bpt} ({BLOCK} x {bpt}): not the same KV")
            ttft(e, "warm-a", prompt(h + 1, 3, shape.vocab_size))  # first-use costs out of the way
            ttft(e, "warm-b", prompt(pool_tokens - 8, 4, shape.vocab_size))
            got: dict[str, list[float]] = {k: [] for k in ("computed", "pooled", "reloaded", "read_bw", "write_bw",
                                                             "read_s_per_token")}
            for r in range(rounds):
                e.reset_prefix_cache()
                t_c, ev = ttft(e, f"a{r}", a)
                assert ev.cached_tokens == 0, ev
                t_p, ev = ttft(e, f"p{r}", a)
                assert ev.cached_tokens == hit_blocks * BLOCK and ev.reloaded_tokens == 0, ev
                ttft(e, f"b{r}", b)
                t0 = e.kv_cache_info().extra["kv_tiers"]
                t_r, ev = ttft(e, f"r{r}", a)
                t1 = e.kv_cache_info().extra["kv_tiers"]
                if ev.reloaded_tokens != hit_blocks * BLOCK:
                    raise SystemExit(f"{label} H={h}: {ev.reloaded_tokens} tokens reloaded, not {hit_blocks * BLOCK}: "
                                     f"the pool did not evict A whole ({t1})")
                read_s = t1["read_time_s"] - t0["read_time_s"]
                read_b = t1["bytes_read"] - t0["bytes_read"]
                got["computed"].append(t_c)
                got["pooled"].append(t_p)
                got["reloaded"].append(t_r)
                got["read_bw"].append(read_b / read_s)
                got["read_s_per_token"].append(read_s / (hit_blocks * BLOCK))
                got["write_bw"].append(t0["bytes_written"] / t0["write_time_s"])
            medium_desc = e.kv_cache_info().extra["kv_tiers"]["medium"]
        finally:
            e.close()
    m = {k: statistics.median(v) for k, v in got.items()}
    cached = hit_blocks * BLOCK
    prefill = (m["computed"] - m["pooled"]) / cached
    reload = bpt / m["read_bw"]
    return {"model": label, "family": family(shape), "h": h, "bpt": bpt, "groups": est.groups,
            "dense_bpt": dense_bytes_per_token(shape, kv_dtype_of(dtype)), "medium": medium_desc.split(" in /")[0],
            **m, "prefill_s_per_token": prefill, "reload_s_per_token": reload,
            "reload_e2e_s_per_token": (m["reloaded"] - m["pooled"]) / cached,
            "ratio": reload / prefill if prefill > 0 else float("nan"),
            "spread": {k: (min(v), max(v)) for k, v in got.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny:num_key_value_heads=8,tiny,tiny-deepseek-v3,small")
    ap.add_argument("--lens", default="256,1024")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--medium", default="disk", choices=["disk", "host"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    rows = []
    for spec in args.models.split(","):
        label, shape = model_of(spec)
        ckpt = str(ensure_checkpoint(shape, model_cache_dir(None)))
        for h in (int(x) for x in args.lens.split(",")):
            t = time.perf_counter()
            rows.append(measure(label, shape, ckpt, h, args.rounds, args.medium, args.dtype, args.threads))
            print(f"# {label} H={h}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    print(f"medium: {rows[0]['medium']}; dtype {args.dtype}; block {BLOCK}; medians of {args.rounds} rounds\n")
    print("| model | family | KV bytes/token (estimator) | dense-equivalent K/V bytes/token | history H | tier read GB/s | tier write GB/s | "
          "reload µs/token | reload µs/token end to end | prefill µs/token at H | reload / prefill | "
          "TTFT computed / pooled / reloaded ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['family']} | {r['bpt']:,} | {r['dense_bpt']:,} | {r['h']} | {r['read_bw'] / 1e9:.2f} | "
              f"{r['write_bw'] / 1e9:.2f} | {r['reload_s_per_token'] * 1e6:.2f} | {r['reload_e2e_s_per_token'] * 1e6:.2f} | "
              f"{r['prefill_s_per_token'] * 1e6:.1f} | {r['ratio']:.3f} | "
              f"{r['computed'] * 1e3:.1f} / {r['pooled'] * 1e3:.1f} / {r['reloaded'] * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
