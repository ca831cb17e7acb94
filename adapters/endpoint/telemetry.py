"""A server's Prometheus `/metrics`: which series to keep, a scraper that samples them during a
point (`{sample name: [[seconds since the point started, value], ...]}`), and speculative
decoding's counters read by the names of the kind's record (`spec_counts`).

`ServerMetrics` reads one server's text for the engine (adapters/endpoint/engine.py): the KV
cache's state (`kv_cache_info`, with the KV tiers' counters while a second tier runs),
speculative decoding's counters (`spec_decode_stats`), and the scraper of each point. A new
metric a kind exports goes into its record (kinds.py: `Metrics`, `SpecMetrics`, adapters/tiers.py)
and is read here.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from adapters import tiers
from adapters.base import KVCacheInfo, SpecDecodeStats
from adapters.endpoint.kinds import KINDS, Speculation
from adapters.prom_counters import read_counters

# any other server: gauges and counters whose names say they are about these
_GENERIC = re.compile(r"(kv_cache|cache_usage|token_usage|num_requests|running|waiting|queue|preempt|prefix_cache)")


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


def lora_info(text: str, name: str) -> dict[str, str] | None:
    """The labels of gauge `name`'s latest sample (vLLM's vllm:lora_requests_info: one sample per label
    set it was ever given, each set to the time it was last seen); None where it has none."""
    best: tuple[float, dict[str, str]] | None = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and (best is None or s.value > best[0]):
                best = (float(s.value), dict(s.labels))
    return best[1] if best else None


def wanted(kind: str, values: dict[str, float]) -> dict[str, float]:
    """The samples kept of a kind's server (its record's `metrics.series`; others: by their words)."""
    m = KINDS[kind].metrics if kind in KINDS else None
    names = m.series if m is not None else ()
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


def spec_counts(kind: str, text: str, sp: Speculation) -> SpecDecodeStats:
    """Speculative decoding's cumulative counters in a server's Prometheus text, by the names of
    its kind's record (`ServerKind.spec_metrics`), summed over label sets (engines, model names),
    the per-position counter by its position label (0 .. k-1); fields the server lacks derived
    from others where the record says how; `aggregate_only` names what it gives only in aggregate.
    ValueError when a name the record reads is not in the text at all (a server version without
    it): counts that are not there are never taken as zeros. A counter family declared without
    samples yet (a labelled counter before its first increment) counts as zero."""
    m = KINDS[kind].spec_metrics
    if m is None:
        raise ValueError(f"the harness knows no speculative-decoding metrics of a kind={kind} server")

    def position(labels: dict[str, str]) -> int | None:
        pos = labels.get(m.position_label)
        return int(pos) if pos is not None and str(pos).isdigit() else None

    c = read_counters(text, m.per_position, position)
    values, per_pos, there = c.values, c.split, c.there

    needed = m.counters + (m.derived[0] if m.derived else ())
    missing = [n for n in needed if not there(n)]
    if missing:
        raise ValueError(f"the server's metrics have no {', '.join(missing)} (the names the kind={kind} record reads; "
                         "a server version that does not export them?)")
    stats = SpecDecodeStats(
        drafts=round(values.get(m.drafts, 0.0)) if m.drafts else 0,
        draft_tokens=round(values.get(m.draft_tokens, 0.0)) if m.draft_tokens else 0,
        accepted_tokens=round(values.get(m.accepted, 0.0)) if m.accepted else 0,
        accepted_per_pos=[round(per_pos.get(i, 0.0)) for i in range(sp.k)] if m.per_position else [],
        source=m.source, aggregate_only=list(m.aggregate_only))
    if m.derived:
        for field_, v in m.derived[1](values, sp).items():
            setattr(stats, field_, round(v))
    return stats


def spec_aggregates(kind: str, values: dict[str, float]) -> dict[str, float]:
    """The aggregates a kind's server reports about speculation (its record's gauges: a mean
    acceptance length over a window ...), from parsed values (`parse`)."""
    m = KINDS[kind].spec_metrics
    return {g: values[g] for g in (m.gauges if m else ()) if g in values}



def tier_counts(kind: str, text: str) -> dict[str, Any] | None:
    """What a server's KV tiers did, cumulative since it started (adapters.tiers.tier_counts, by its
    kind's record `ServerKind.tier_metrics`); None: the kind has no such record."""
    k = KINDS.get(kind)
    if k is None or k.tier_metrics is None:
        return None
    return tiers.tier_counts(k.tier_metrics, text, k.metrics.path if k.metrics else "/metrics")


class ServerMetrics:
    """The /metrics of one server of kind `kind`: `fetch()` returns its text (raises when it
    cannot), `path` is where it is, `readable()` says whether it is read at all (the server
    answered Prometheus text at load, metrics not false), `redact` hides credentials in errors."""

    def __init__(self, kind: str, fetch: Callable[[], str], path: str, readable: Callable[[], bool],
                 redact: Callable[[str], str]):
        self.kind, self.fetch, self.path, self.readable, self.redact = kind, fetch, path, readable, redact
        self.spec_error: str | None = None  # why spec_decode_stats() could not read the counters
        self.scraper: Scraper | None = None

    def lora_stats(self) -> dict[str, Any]:
        """The LoRA gauges of the server's /metrics, by its kind's record: the slots (max_lora), the
        adapters running and waiting (vLLM's `lora_requests_info` labels, its latest set), the slots in
        use (SGLang); loads and evictions are not exported by either server (None)."""
        m = KINDS[self.kind].metrics
        out: dict[str, Any] = {"loads": None, "evictions": None, "source": self.path}
        if not self.readable() or m is None:
            return {**out, "source": "none (the server has no /metrics, or metrics=false)"}
        try:
            text = self.fetch()
        except Exception as e:
            return {**out, "source": f"/metrics failed: {type(e).__name__}"}
        if m.lora_info:
            latest = lora_info(text, m.lora_info)
            out["gauge"] = m.lora_info
            if latest is not None:
                names = lambda v: [n for n in (v or "").split(",") if n]  # noqa: E731
                out.update(max_loras=_int(latest.get("max_lora")), running=names(latest.get("running_lora_adapters")),
                           waiting=names(latest.get("waiting_lora_adapters")))
        if m.lora_slots_used or m.lora_slots_total:
            values, _ = parse(text)
            out.update(gauge=", ".join(n for n in (m.lora_slots_used, m.lora_slots_total) if n),
                       slots_used=values.get(m.lora_slots_used or ""), max_loras=_int(values.get(m.lora_slots_total or "")))
        return out

    def kv_cache_info(self, offloading: bool) -> KVCacheInfo:
        """What the server's /metrics says of its KV cache (usage, blocks, prefix-cache counters,
        preemptions, the cache config), by its kind's record; `offloading`: it runs a second tier
        (then the tiers' counters too)."""
        if not self.readable():
            return KVCacheInfo(extra={"source": "none (the server has no /metrics, or metrics=false)"})
        try:
            text = self.fetch()
            values, infos = parse(text)
        except Exception as e:
            return KVCacheInfo(extra={"source": f"/metrics failed: {type(e).__name__}"})
        m = KINDS[self.kind].metrics
        extra: dict[str, Any] = {"source": self.path}
        if m is None or m.usage is None:
            extra["metrics"] = wanted(self.kind, values)
            return KVCacheInfo(extra=extra)
        usage, hits, queries, preempt = m.usage, m.hits, m.queries, m.preemptions
        tiers_ = self.tier_counts(text) if offloading else None
        if tiers_ is not None:
            extra["kv_tiers"] = tiers_
        info = infos.get(m.info, {}) if m.info else {}
        num_blocks = _int(info.get("num_gpu_blocks") or info.get("num_blocks"))
        block_size = _int(info.get("block_size"))
        used = values.get(usage)
        extra.update(kv_usage_frac=used, prefix_counts_in=m.prefix_counts_in, cache_config=info or None)
        pool = _int(info.get("kv_cache_memory_bytes") or info.get("pool_bytes"))
        return KVCacheInfo(
            kv_dtype=info.get("cache_dtype") or info.get("kv_dtype") or None, block_size=block_size,
            num_blocks=num_blocks, pool_bytes=pool,
            bytes_per_block=pool // num_blocks if pool and num_blocks else None,
            blocks_in_use=round(used * num_blocks) if used is not None and num_blocks else None,
            prefix_cache_hits=_int(values.get(hits)) if hits else None,
            prefix_cache_queries=_int(values.get(queries)) if queries else None,
            preemptions=_int(values.get(preempt)) if preempt else None, extra=extra)

    def tier_counts(self, text: str) -> dict[str, Any] | None:
        """The server's KV-tier counters in its /metrics `text` (`tier_counts`, by the kind's
        record); None where the kind has none. A text that does not parse says so instead of
        giving numbers."""
        if KINDS[self.kind].tier_metrics is None:
            return None
        try:
            return tier_counts(self.kind, text)
        except ValueError as e:
            return {"source": f"{self.path} unreadable: {type(e).__name__}"}

    def spec_decode_stats(self, sp: Speculation | None) -> SpecDecodeStats | None:
        """The server's speculative-decoding counters since it started (cumulative; the workload
        takes a point's difference) while it speculates as `sp` says, read until two reads 0.1 s
        apart agree (a server may add a step's counts just after its tokens went out). None where
        it does not speculate, or the counters cannot be read (`spec_error` says why)."""
        if sp is None or KINDS[self.kind].spec_metrics is None:
            return None
        if not self.readable():
            self.spec_error = (f"no counters: the server's {self.path} is not read (metrics=false, or it "
                               "did not answer Prometheus text at load)")
            return None
        last: SpecDecodeStats | None = None
        for _ in range(10):
            try:
                now = spec_counts(self.kind, self.fetch(), sp)
            except (httpx.HTTPError, ValueError) as e:
                self.spec_error = f"{self.path}: {self.redact(str(e)) or type(e).__name__}"
                return None
            if now == last:
                break
            last = now
            time.sleep(0.1)
        self.spec_error = None
        return last

    def begin_point(self, interval_s: float) -> None:
        """Scrape the point's time series (every `interval_s`) where the text is read."""
        if self.readable():
            self.scraper = Scraper(self.fetch, self.kind, interval_s).start()

    def end_point(self) -> tuple[dict[str, Any] | None, int]:
        """(the point's series, or None where none was scraped; the scrapes that failed)."""
        if self.scraper is None:
            return None, 0
        series = self.scraper.stop()
        errors = self.scraper.errors
        self.scraper = None
        return series, errors


def _int(v: Any) -> int | None:
    try:
        return int(float(v)) if v is not None else None
    except (TypeError, ValueError):
        return None
