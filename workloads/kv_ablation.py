"""Generation with and without a KV cache, over growing context — the seed chapter's figure.

For each context length N and mode, an N-token prompt is prefilled and `decode_steps` steps
are timed. With a cache a step computes one new token against N cached ones (nearly flat in
N); without one (`kv_cache=none`) every step recomputes the whole sequence, so its cost grows
with N and generating N tokens costs O(N^2). The summary fits a line to each curve.

`kv_dtypes` adds the cache's storage type as an axis of the cached mode (auto = the model's dtype;
int8 / fp8 for the reference engine and vLLM, llama.cpp's block types q8_0 / q4_0): an engine
without a type gets an `unsupported` row for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapters.base import Capabilities, Engine
from harness.core.schema import spec
from harness.core.stats import fit_slope, summarize
from workloads.base import Point, RunContext, Workload
from workloads.sweep import repeat_until

MODES = ("cache", "no_cache")


@dataclass
class KVAblationConfig:
    name: str = spec("kv_ablation")
    context_lens: list[int] = spec([64, 128, 256, 512, 1024, 2048], ge=1, nonempty=True,
                                   help="prompt tokens before the timed decode steps")
    modes: list[str] = spec(list(MODES), choices=MODES, nonempty=True, help="cache and/or no_cache")
    kv_dtypes: list[str] = spec(["auto"], nonempty=True,
                                help="KV storage types of the cached mode: auto (the model's dtype), int8, fp8, "
                                     "q8_0, q4_0 ...")
    batch_size: int = spec(1, ge=1)
    decode_steps: int = spec(8, ge=1, help="timed decode steps per iteration")
    warmup: int = spec(1, ge=1)
    min_repeats: int = spec(2, ge=1)
    min_duration_s: float = spec(0.0, ge=0)
    max_repeats: int = spec(20, ge=1)


class KVAblation(Workload):
    name = "kv_ablation"
    compared_metrics = ("decode_step_latency_s",)
    config_cls = KVAblationConfig
    summary_columns = [
        ("mode", "mode", "s"), ("context_len", "context", "d"), ("batch_size", "batch", "d"),
        ("decode_step_latency_s", "step ms", "ms"), ("decode_step_latency_s_p90", "step p90 ms", "ms"),
        ("prefill_latency_s", "prefill ms", "ms"),
    ]

    def plan(self, cfg: KVAblationConfig) -> list[Point]:
        return [Point(self.name, {"mode": m, "context_len": n, "batch_size": cfg.batch_size,
                                  "decode_steps": cfg.decode_steps, **({"kv_dtype": d} if d != "auto" else {})})
                for m in dict.fromkeys(cfg.modes)
                for d in (dict.fromkeys(cfg.kv_dtypes) if m == "cache" else ["auto"])
                for n in sorted(set(cfg.context_lens))]

    def max_model_len(self, cfg: KVAblationConfig) -> int:
        return max(cfg.context_lens) + cfg.decode_steps + 1

    def max_prefill_batch(self, cfg: KVAblationConfig) -> tuple[int, int]:
        return cfg.batch_size, cfg.batch_size * max(cfg.context_lens)

    def unsupported(self, point: Point, caps: Capabilities) -> str | None:
        if point.params["mode"] == "no_cache" and not caps.no_cache_mode:
            return "the engine cannot generate without a KV cache"
        d = point.params.get("kv_dtype")
        if d is not None and d not in caps.kv_dtypes:
            return f"the engine cannot store the KV cache as {d} (it supports {', '.join(caps.kv_dtypes)})"
        return None

    def engine_overrides(self, point: Point, caps: Capabilities) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if caps.no_cache_mode:
            out["kv_cache"] = "none" if point.params["mode"] == "no_cache" else "on"
        if point.params.get("kv_dtype") is not None or len(caps.kv_dtypes) > 1:
            out["kv_dtype"] = point.params.get("kv_dtype", "auto")
        return out

    def run_point(self, engine: Engine, point: Point, ctx: RunContext, cfg: KVAblationConfig,
                  inputs: dict[str, Any] | None = None) -> dict[str, Any]:
        b, n, steps = point.params["batch_size"], point.params["context_len"], point.params["decode_steps"]

        def once(i: int) -> tuple[float, list[float]]:
            pre = engine.prefill(ctx.prompts(b, n, f"{point.key}/{i}"), max_new_tokens=steps + 1)
            dec = engine.decode(steps)
            engine.release()
            return pre.latency_s, dec.step_latencies_s

        for i in range(cfg.warmup):
            once(-1 - i)
        its = repeat_until(once, cfg)
        step_samples = [s for _, st in its for s in st]
        prefill = [p for p, _ in its]
        d, p = summarize(step_samples), summarize(prefill)
        return {
            "mode": point.params["mode"], "context_len": n, "batch_size": b, "repeats": len(its),
            "kv_dtype": point.params.get("kv_dtype", "auto"),
            "warmup": cfg.warmup,
            "decode_step_latency_s": d["p50"], "decode_step_latency_s_p90": d["p90"],
            "decode_step_latency_s_p99": d["p99"],
            "decode_step_latency_s_samples": step_samples,
            "decode_tok_s": b / d["p50"] if d["p50"] else None,
            "prefill_latency_s": p["p50"], "prefill_latency_s_samples": prefill,
        }

    def post_summary(self, rows: list[dict[str, Any]]) -> str:
        lines = []
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in rows:
            if r.get("status") == "ok" and r.get("workload") == self.name:
                kv = r.get("kv_dtype") or "auto"
                groups.setdefault((r["engine"], r["mode"] + ("" if kv == "auto" else f" {kv}")), []).append(r)
        for (engine, mode), rs in sorted(groups.items()):
            fit = fit_slope([r["context_len"] for r in rs], [r["decode_step_latency_s"] for r in rs])
            if fit:
                lo = min(rs, key=lambda r: r["context_len"])
                hi = max(rs, key=lambda r: r["context_len"])
                growth = hi["decode_step_latency_s"] / lo["decode_step_latency_s"]
                lines.append(f"{engine:<9} {mode:<8} slope {fit[0] * 1e6:9.3f} µs per context token; "
                             f"step at {hi['context_len']} = {growth:.1f} x step at {lo['context_len']}")
        return "\n".join(lines)
