"""A server's Prometheus `/metrics`: which series to keep, and a scraper that samples them
during a point (`{sample name: [[seconds since the point started, value], ...]}`)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# per kind: the sample names kept (counters with their `_total` suffix)
SERIES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:num_requests_running",
             "vllm:num_requests_waiting", "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total",
             "vllm:prefix_cache_queries_total"),
    "infer-bench": ("infer_bench_kv_cache_usage_perc", "infer_bench_num_requests_running",
                    "infer_bench_num_requests_waiting", "infer_bench_num_preemptions_total",
                    "infer_bench_prefix_cache_hits_total", "infer_bench_prefix_cache_queries_total"),
    "sglang": ("sglang:token_usage", "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:cache_hit_rate"),
    "trtllm": (),
}
# any other server: gauges and counters whose names say they are about these
_GENERIC = re.compile(r"(kv_cache|cache_usage|token_usage|num_requests|running|waiting|queue|preempt|prefix_cache)")
# what kv_cache_info() reads, by meaning: kind -> (usage, hits, queries, preemptions, config-info family)
KV_NAMES: dict[str, tuple[str, str, str, str, str]] = {
    "vllm": ("vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
             "vllm:num_preemptions_total", "vllm:cache_config_info"),
    "infer-bench": ("infer_bench_kv_cache_usage_perc", "infer_bench_prefix_cache_hits_total",
                    "infer_bench_prefix_cache_queries_total", "infer_bench_num_preemptions_total",
                    "infer_bench_cache_config_info"),
}


def parse(text: str) -> tuple[dict[str, float], dict[str, dict[str, str]]]:
    """(value of every gauge/counter sample, summed over label sets (averaged for `_perc`);
    labels of every `*_info` family)."""
    values: dict[str, list[float]] = {}
    infos: dict[str, dict[str, str]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type in ("histogram", "summary", "gaugehistogram"):
            continue
        for s in fam.samples:
            if fam.type == "info" or s.name.endswith("_info"):
                infos[fam.name if not s.name.endswith("_info") else s.name] = dict(s.labels)
                continue
            values.setdefault(s.name, []).append(float(s.value))
    out = {k: (sum(v) / len(v) if k.endswith("_perc") else sum(v)) for k, v in values.items()}
    return out, infos


def wanted(kind: str, values: dict[str, float]) -> dict[str, float]:
    names = SERIES.get(kind)
    if names:
        return {k: v for k, v in values.items() if k in names}
    return {k: v for k, v in values.items() if _GENERIC.search(k)}


class Scraper:
    """Samples `fetch()` (the /metrics text) every `interval_s` in a thread until stop()."""

    def __init__(self, fetch: Callable[[], str], kind: str, interval_s: float):
        self.fetch, self.kind, self.interval_s = fetch, kind, interval_s
        self.series: dict[str, list[list[float]]] = {}
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def start(self) -> "Scraper":
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="metrics-scraper", daemon=True)
        self._thread.start()
        return self

    def sample(self) -> None:
        t = time.perf_counter() - self._t0
        try:
            values, _ = parse(self.fetch())
        except Exception as e:  # a scrape that fails is counted, never fatal for the point
            self.errors += 1
            return
        for k, v in wanted(self.kind, values).items():
            self.series.setdefault(k, []).append([round(t, 4), v])

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                break

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.sample()  # the point's end
        return self.series
