"""KV memory: what each engine's KV cache really takes, and how much of it is wasted.

For every KV dtype x block size x layout the engine can run: a batch of `num_sequences`
prompts with lengths from a distribution is prefilled and decoded `output_len - 1` steps;
then the engine's own report (pool bytes, bytes per token, blocks, token slots allocated vs
tokens stored) is set beside the estimator's bytes per token. `kv_waste_frac` is the share of
allocated token slots that hold no token: the last partial block of each sequence for a paged
cache, everything past the sequence for a contiguous one (which reserves max_model_len per
sequence), the left padding for transformers' cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from adapters.base import Capabilities, Engine
from harness.core.kvcalc import (blocks_now, bytes_per_token, held_tokens, kv_dtype_of, layer_bytes_per_token,
                                 layer_groups, state_bytes)
from harness.core.schema import spec
from workloads.base import Point, RunContext, Workload
from workloads.lengths import parse_length
from workloads.prompts import seed_for

LAYOUTS = ("paged", "contiguous")


@dataclass
class KVMemoryConfig:
    name: str = spec("kv_memory")
    kv_dtypes: list[str] = spec(["auto", "int8", "fp8"], nonempty=True, help="auto = the model's dtype")
    block_sizes: list[int] = spec([16, 32, 128], ge=1, nonempty=True,
                                  help="for paged engines (vLLM on CPU takes multiples of 32 only)")
    layouts: list[str] = spec(["paged", "contiguous"], choices=LAYOUTS, nonempty=True)
    num_sequences: int = spec(16, ge=1)
    prompt_len: Any = spec({"dist": "uniform", "min": 64, "max": 2048}, help="prompt length distribution")
    output_len: int = spec(16, ge=1)


class KVMemory(Workload):
    name = "kv_memory"
    compared_metrics = ("kv_bytes_per_token", "kv_waste_frac")
    config_cls = KVMemoryConfig
    summary_columns = [
        ("kv_layout", "layout", "s"), ("kv_dtype", "kv dtype", "s"), ("block_size", "block", "d"),
        ("kv_bytes_per_token", "B/token", "d"), ("kv_est_bytes_per_token", "est B/token", "d"),
        ("kv_pool_bytes", "pool MiB", "mib"), ("tokens_stored", "tokens", "d"),
        ("slots_allocated", "slots", "d"), ("kv_waste_frac", "waste", ".3f"),
    ]

    def post_summary(self, rows: list[dict[str, Any]]) -> str:
        """Per layer group: the estimate beside each engine's figure (bytes per token, blocks held,
        token slots per sequence, state per sequence)."""
        lines = []
        for r in rows:
            for g in r.get("kv_groups") or []:
                cols = []
                for k, label in (("bytes_per_token", "B/token"), ("blocks", "blocks"),
                                 ("tokens_per_sequence", "tokens/seq"), ("state_bytes", "state B/seq")):
                    if f"est_{k}" in g:
                        cols.append(f"{label} {g[f'est_{k}']} est / {g.get(f'engine_{k}')} engine")
                win = f" {g['window']}" if g.get("window") else ""
                ok = {True: "equal", False: "DIFFER", None: "engine reports no groups"}[g.get("match")]
                lines.append(f"kv group  {r['engine']:<9} {r.get('kv_dtype')} block {r.get('block_size')}  "
                             f"{g['kind']}{win} x{g['layers']}: {'; '.join(cols)}  ({ok})")
        return "\n".join(lines)

    def check(self, cfg: KVMemoryConfig, shape: Any) -> list[str]:
        _, problems = parse_length(cfg.prompt_len, "workload.prompt_len")
        bad = [d for d in cfg.kv_dtypes if d != "auto" and d.lower() not in
               ("fp32", "float32", "fp16", "float16", "bf16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8",
                "q8_0", "q4_0")]
        problems += [f"workload.kv_dtypes: unknown KV dtype '{d}'. Use auto, fp8 or int8 (or fp16/bf16/fp32; "
                     "llama.cpp's block types q8_0 and q4_0)." for d in bad]
        return problems or super().check(cfg, shape)

    def max_model_len(self, cfg: KVMemoryConfig) -> int:
        dist, _ = parse_length(cfg.prompt_len, "workload.prompt_len")
        return (dist.bounds()[1] if dist else 0) + cfg.output_len

    def plan(self, cfg: KVMemoryConfig) -> list[Point]:
        smallest = min(cfg.block_sizes)
        return [Point(self.name, {"kv_layout": lay, "kv_dtype": d, "block_size": b, "min_block_size": smallest,
                                  "num_sequences": cfg.num_sequences, "output_len": cfg.output_len})
                for lay in dict.fromkeys(cfg.layouts) for d in dict.fromkeys(cfg.kv_dtypes)
                for b in sorted(set(cfg.block_sizes))
                if lay == "paged" or b == smallest]  # a contiguous cache has no blocks

    def max_prefill_batch(self, cfg: KVMemoryConfig) -> tuple[int, int]:
        dist, _ = parse_length(cfg.prompt_len, "workload.prompt_len")
        return cfg.num_sequences, cfg.num_sequences * (dist.bounds()[1] if dist else 1)

    def unsupported(self, point: Point, caps: Capabilities) -> str | None:
        if point.params["kv_layout"] == "contiguous" and not caps.contiguous_layout:
            return "the engine has no contiguous KV layout option"
        d = point.params["kv_dtype"]
        if d != "auto" and d not in caps.kv_dtypes:
            return f"the engine cannot store the KV cache as {d} (it supports {', '.join(caps.kv_dtypes)})"
        if not caps.paged and point.params["block_size"] != point.params["min_block_size"]:
            return "block size does not apply: the engine's cache is not paged"
        return None

    def engine_overrides(self, point: Point, caps: Capabilities) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if caps.paged:
            out["block_size"] = point.params["block_size"]
        if caps.contiguous_layout:
            out["kv_layout"] = point.params["kv_layout"]
        if point.params["kv_dtype"] != "auto" or len(caps.kv_dtypes) > 1:
            out["kv_dtype"] = point.params["kv_dtype"]
        return out

    def run_point(self, engine: Engine, point: Point, ctx: RunContext, cfg: KVMemoryConfig,
                  inputs: dict[str, Any] | None = None) -> dict[str, Any]:
        dist, _ = parse_length(cfg.prompt_len, "workload.prompt_len")
        # the same sequences for every layout, dtype and block size, so their waste compares directly
        rng = np.random.default_rng(seed_for(ctx.seed, f"{self.name}/lengths"))
        lens = dist.sample(cfg.num_sequences, rng)  # type: ignore[union-attr]
        prompts = [ctx.prompts(1, n, f"{self.name}/p{i}")[0] for i, n in enumerate(lens)]
        # one token more than the point decodes: an engine that frees a sequence with its last token
        # (vLLM) still holds every sequence's blocks when the cache is read below
        pre = engine.prefill(prompts, max_new_tokens=cfg.output_len + 1)
        dec = engine.decode(cfg.output_len - 1) if cfg.output_len > 1 else None
        info = engine.kv_cache_info()
        engine.release()
        stored_expected = sum(lens) + len(lens) * (cfg.output_len - 1)
        kv_dtype = kv_dtype_of(ctx.dtype, info.kv_dtype)
        waste = None
        if info.slots_allocated:
            waste = 1 - (info.tokens_stored or 0) / info.slots_allocated
        layout = point.params["kv_layout"]
        if layout == "paged" and info.block_size is None:
            layout = "padded"  # e.g. transformers: one contiguous cache per batch, left-padded
        return {
            "kv_layout": layout, "kv_dtype": kv_dtype,
            "block_size": info.block_size, "kv_paged": info.block_size is not None,
            "num_sequences": cfg.num_sequences, "prompt_lens": lens, "output_len": cfg.output_len,
            "kv_pool_bytes": info.pool_bytes, "kv_bytes_per_token": info.bytes_per_token,
            "kv_est_bytes_per_token": bytes_per_token(ctx.shape, kv_dtype),
            "tokens_stored": info.tokens_stored, "tokens_expected": stored_expected,
            "slots_allocated": info.slots_allocated, "kv_waste_frac": waste,
            "kv_blocks_in_use": info.blocks_in_use, "kv_num_blocks": info.num_blocks,
            "kv_cache_bytes": info.pool_bytes,
            "prefill_latency_s": pre.latency_s,
            "decode_step_latency_s": float(np.median(dec.step_latencies_s)) if dec else None,
            "kv_groups": group_comparison(ctx.shape, kv_dtype, ctx.dtype, info,
                                          [n + cfg.output_len - 1 for n in lens]),
            "kv_info": info.to_dict(),
        }


def _merge_groups(groups: list[dict[str, Any]]) -> dict[tuple[str, Any], dict[str, Any]]:
    """An engine's groups by (kind, window). vLLM splits layers of one kind into groups of equal
    size (Gemma 3's 4 sliding layers: 2 groups of 2), each with blocks of its own: merged, the
    layers and bytes per token add up, bytes_held = Σ page x layers x blocks, and blocks_per_layer
    is the blocks one layer holds (an integer when every part holds as many)."""
    out: dict[tuple[str, Any], dict[str, Any]] = {}
    for g in groups:
        m = out.setdefault((g["kind"], g.get("window")), {"kind": g["kind"], "window": g.get("window"), "layers": 0,
                                                          "bytes_per_token": 0, "bytes_held": 0, "layer_blocks": 0,
                                                          "state_bytes": 0, "tokens_per_sequence": 0})
        m["layers"] += g.get("layers") or 0
        for k in ("bytes_per_token", "state_bytes"):
            m[k] = None if g.get(k) is None or m[k] is None else m[k] + g[k]
        m["tokens_per_sequence"] = max(m["tokens_per_sequence"], g.get("tokens_per_sequence") or 0)
        for k in ("block_size", "state_dtypes", "free_lag"):
            if g.get(k) is not None:
                m[k] = g[k]
        if g.get("blocks_held") is not None:
            m["paged"] = True
            m["layer_blocks"] += g["blocks_held"] * g["layers"]
            m["bytes_held"] += g["blocks_held"] * g["layers"] * g["page_size_bytes"]
    for m in out.values():
        if m.get("paged") and m["layers"]:
            per_layer = m["layer_blocks"] / m["layers"]
            m["blocks_per_layer"] = int(per_layer) if per_layer.is_integer() else per_layer
    return out


def group_comparison(shape: Any, kv_dtype: str, dtype: str, info: Any, seq_lens: list[int]) -> list[dict[str, Any]]:
    """The estimate beside what the engine reports, per layer group (`kv_groups` rows): bytes per
    cached token over the group's layers; for a paged engine the blocks its sequences hold now
    (each of seq_lens tokens: full and latent layers ceil(L / B), windowed ones from the block of
    their first still-needed token); for a contiguous one the token slots a layer holds per
    sequence (of its longest, padded sequence); for linear layers the state per sequence. `engine_*`
    fields are None where the engine reports no groups."""
    reported = _merge_groups((info.extra or {}).get("groups") or [])
    by_kind = {g["kind"]: g for g in reported.values()}
    out = []
    for kind, window, layers in layer_groups(shape):
        eng = reported.get((kind, window)) or by_kind.get(kind) or {}
        row: dict[str, Any] = {"kind": kind, "window": window, "layers": layers,
                               "est_bytes_per_token": layers * layer_bytes_per_token(shape, kind, kv_dtype),
                               "engine_layers": eng.get("layers"), "engine_bytes_per_token": eng.get("bytes_per_token")}
        if kind == "linear":  # in the dtypes the engine keeps its state in (as the KV dtype, the engine's choice)
            dtypes = eng.get("state_dtypes") or [dtype, dtype]
            row["est_state_bytes"] = layers * state_bytes(shape, dtypes[0], dtypes[-1])
            row["engine_state_bytes"] = eng.get("state_bytes")
            row["state_dtypes"] = dtypes
            row["est_bytes_per_token"] = row["engine_bytes_per_token"] = None
        elif info.block_size:  # the group's own block size (vLLM enlarges a hybrid's attention blocks)
            block = eng.get("block_size") or info.block_size
            # when the engine frees a window's blocks (kvcalc.blocks_now: vLLM's rule unless it says)
            blocks = sum(blocks_now(kind, n, block, window, eng.get("free_lag", 1)) for n in seq_lens)
            row["block_size"] = block
            row["est_blocks"] = blocks
            row["engine_blocks"] = eng.get("blocks_per_layer")
            row["est_bytes_held"] = blocks * block * row["est_bytes_per_token"]
            row["engine_bytes_held"] = eng.get("bytes_held")
        else:
            longest = (by_kind.get("full") or by_kind.get("latent") or {}).get("tokens_per_sequence")
            if longest is None:
                longest = max(seq_lens) if seq_lens else 0
            row["est_tokens_per_sequence"] = held_tokens(kind, longest, window, None)
            row["engine_tokens_per_sequence"] = eng.get("tokens_per_sequence")
        row["match"] = all(row[f"est_{k}"] == row[f"engine_{k}"] for k in ("bytes_per_token", "blocks", "bytes_held",
                                                                            "state_bytes", "tokens_per_sequence")
                           if f"est_{k}" in row) if eng else None
        out.append(row)
    return out
