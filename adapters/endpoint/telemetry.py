"""A server's Prometheus `/metrics`: which series to keep, and a scraper that samples them
during a point (`{sample name: [[seconds since the point started, value], ...]}`)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from adapters.endpoint.kinds import KINDS

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
