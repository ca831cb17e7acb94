"""Prefix sharing: R requests share a system prompt of P tokens, each with its own suffix.

For each (P, R) and prefix caching on/off (for every engine that has a prefix cache; engines
without one run "off" only): the first request is served alone — it computes the shared
prefix, and with caching on leaves it in the cache — then the other R - 1 arrive at once. The
row reports TTFT of the first request, TTFT of the others (median, p90, all samples), the
throughput of the batch, the prefix-cache hit rate the engine reports for the R - 1 requests,
and KV blocks in use. The prefix cache is emptied before each point.

`kv_tiers` (workloads/kv_tiers.py): with caching on, points with the engine's pool alone (off), at
its default size (full) and with a second tier of each given capacity; the row gets the share of
the R - 1 requests' prompt tokens each tier supplied and the second tier's counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapters.base import Capabilities, Engine, Request, now_ns
from harness.core.metrics import serving_metrics
from harness.core.schema import spec
from workloads.base import Point, RunContext, Workload, collect, kv_memory_fields
from workloads.kv_tiers import tier_fields, tier_modes, tier_overrides, tier_param, tier_problems, tier_unsupported


@dataclass
class PrefixSharingConfig:
    name: str = spec("prefix_sharing")
    prefix_lens: list[int] = spec([256, 1024], ge=1, nonempty=True, help="shared prefix tokens (P)")
    num_requests: list[int] = spec([16], ge=2, nonempty=True, help="requests sharing it (R)")
    suffix_len: int = spec(32, ge=1, help="distinct tokens after the prefix, per request")
    output_len: int = spec(16, ge=1, help="output tokens per request")
    prefix_caching: list[bool] = spec([True, False], nonempty=True, help="modes to compare")
    kv_tiers: list[Any] = spec(["off"], nonempty=True, help=(
        "KV tiers, with caching on: off (the pool alone), full (the engine's default pool: the bound), or a size "
        "(a second tier of that capacity: 256MiB, 1GiB, 5e8); workloads/kv_tiers.py"))
    kv_tiers_full_bytes: Any = spec(None, help=(
        "the kv_tiers=full point's KV pool (kv_cache_bytes: bytes or a size, 512MiB); null: the engine's default "
        "pool"))


def _hits(engine: Engine) -> tuple[int | None, int | None]:
    info = engine.kv_cache_info()
    return info.prefix_cache_hits, info.prefix_cache_queries


class PrefixSharing(Workload):
    name = "prefix_sharing"
    compared_metrics = ("ttft_s",)
    config_cls = PrefixSharingConfig
    reset_prefix_cache = True
    summary_columns = [
        ("prefix_caching", "caching", "s"), ("prefix_len", "prefix", "d"), ("num_requests", "R", "d"),
        ("ttft_first_s", "TTFT 1st ms", "ms"), ("ttft_s", "TTFT rest p50 ms", "ms"),
        ("ttft_s_p90", "p90 ms", "ms"), ("prefix_hit_rate", "hit rate", ".3f"),
        ("output_tok_s", "out tok/s", ".1f"), ("kv_blocks_peak", "peak blocks", "d"),
        ("kv_tiers_label", "tiers", "s"), ("hit_rate_tier2", "tier-2 hit", ".3f"),
    ]

    def plan(self, cfg: PrefixSharingConfig) -> list[Point]:
        return [Point(self.name, {"prefix_caching": c, "prefix_len": p, "num_requests": r,
                                  "suffix_len": cfg.suffix_len, "output_len": cfg.output_len, **tier_param(t, cfg.kv_tiers_full_bytes)})
                for c in dict.fromkeys(cfg.prefix_caching) for t in tier_modes(cfg.kv_tiers, c)
                for p in sorted(set(cfg.prefix_lens)) for r in sorted(set(cfg.num_requests))]

    def check(self, cfg: PrefixSharingConfig, shape: Any) -> list[str]:
        return tier_problems(cfg.kv_tiers, cfg.prefix_caching, full_bytes=cfg.kv_tiers_full_bytes) \
            or super().check(cfg, shape)

    def max_model_len(self, cfg: PrefixSharingConfig) -> int:
        return max(cfg.prefix_lens) + cfg.suffix_len + cfg.output_len

    def unsupported(self, point: Point, caps: Capabilities) -> str | None:
        if point.params["prefix_caching"] and not caps.prefix_caching:
            return "the engine has no prefix cache"
        return tier_unsupported(point, caps)

    def engine_overrides(self, point: Point, caps: Capabilities) -> dict[str, Any]:
        out = {"prefix_caching": bool(point.params["prefix_caching"])} if caps.prefix_caching else {}
        return {**out, **tier_overrides(point, caps)}

    def run_point(self, engine: Engine, point: Point, ctx: RunContext, cfg: PrefixSharingConfig,
                  inputs: dict[str, Any] | None = None) -> dict[str, Any]:
        p, r = point.params["prefix_len"], point.params["num_requests"]
        s, o = point.params["suffix_len"], point.params["output_len"]
        # warm up the engine on unrelated prompts, then forget them
        warm = [Request(f"w{i}", ctx.prompts(1, p + s, f"{point.key}/warm{i}")[0], 2) for i in range(2)]
        for _ in engine.serve(warm, now_ns()):
            pass
        engine.reset_prefix_cache()
        tiers0 = engine.kv_cache_info().extra.get("kv_tiers")
        prefix = ctx.prompts(1, p, f"{point.key}/prefix")[0]
        suffixes = ctx.prompts(r, s, f"{point.key}/suffixes")
        reqs = [Request(f"q{i}", prefix + suffixes[i], o, 0.0) for i in range(r)]
        sampler = ctx.sampler().start()
        t0 = now_ns()
        first = collect(reqs[:1], t0, engine.serve(reqs[:1], t0))
        hits0, queries0 = _hits(engine)
        t1 = now_ns()
        rest = collect(reqs[1:], t1, engine.serve(reqs[1:], t1))
        info = engine.kv_cache_info()
        per_request = [{"ok": not tr.error and tr.n_out > 0, "prompt_tokens": tr.prompt_len,
                        "cached_tokens": tr.cached_tokens, "reloaded_tokens": tr.reloaded_tokens} for tr in rest]
        mem = sampler.stop()
        row = serving_metrics(rest)
        hit_rate = None
        if info.prefix_cache_hits is not None and info.prefix_cache_queries and hits0 is not None:
            dq = info.prefix_cache_queries - (queries0 or 0)
            hit_rate = (info.prefix_cache_hits - hits0) / dq if dq else None
        row.update(
            prefix_caching=bool(point.params["prefix_caching"]), prefix_len=p, num_requests=r,
            suffix_len=s, output_len=o, ttft_first_s=first[0].ttft_s, e2el_first_s=first[0].e2el_s,
            prefix_hit_rate=hit_rate, prefix_cache_hits=info.prefix_cache_hits,
            prefix_cache_queries=info.prefix_cache_queries,
            kv_blocks_in_use=info.blocks_in_use, kv_blocks_peak=info.blocks_peak,
            kv_info=info.to_dict(), measured_output_tokens=row["total_output_tokens"], **mem.row_fields(),
            **kv_memory_fields(info, peak=True),
        )
        row.update(tier_fields(point, per_request, tiers0, info.extra.get("kv_tiers"), info, ctx))
        return row
