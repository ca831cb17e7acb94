"""Serving under load: requests arrive over time and go through each engine's `serve()`.

One point per request rate. Arrivals are Poisson (exponential gaps) or gamma with shape
`burstiness` (< 1 burstier, > 1 more regular; the mean rate is kept), or all at once for
rate `inf`. Input/output lengths come from a distribution (workloads/lengths.py) or a dataset
file (workloads/datasets.py). Every request's clock starts at its scheduled arrival, so
queueing inside the engine counts (METRICS.md): above capacity, TTFT grows with the queue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from adapters.base import Engine, Request, now_ns
from harness.core.metrics import SLO, serving_metrics
from harness.core.schema import spec
from workloads.base import Point, RunContext, Workload, collect, kv_memory_fields
from workloads.lengths import LengthDist, parse_length
from workloads.prompts import seed_for


@dataclass
class ServingConfig:
    name: str = spec("serving")
    request_rates: list[float] = spec([math.inf], gt=0, nonempty=True,
                                      help="requests per second, one point each; inf = all at once")
    num_requests: int = spec(32, ge=1, help="requests per point")
    arrival: str = spec("poisson", choices=("poisson", "gamma"), help="arrival process")
    burstiness: float = spec(1.0, gt=0, help="gamma shape (1.0 = Poisson); lower is burstier")
    input_len: Any = spec(128, help="tokens: a number, or {dist: uniform|normal|lognormal, ...}")
    output_len: Any = spec(32, help="tokens: a number, or {dist: ..., ...}")
    dataset: str | None = spec(None, help="JSONL (trtllm-bench format) or ShareGPT JSON file; overrides lengths")
    dataset_format: str = spec("auto", choices=("auto", "jsonl", "sharegpt"))
    slo_ttft_s: float | None = spec(None, gt=0, help="goodput SLO on time to first token")
    slo_tpot_s: float | None = spec(None, gt=0, help="goodput SLO on time per output token")
    slo_e2el_s: float | None = spec(None, gt=0, help="goodput SLO on end-to-end latency")
    warmup_requests: int = spec(2, ge=1, help="requests served before measuring each point")
    max_len: int | None = spec(None, ge=2, help="dataset requests longer than this (prompt+output) are dropped")


def arrival_times(n: int, rate: float, arrival: str, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Scheduled arrival offsets in seconds, the first at 0."""
    if math.isinf(rate):
        return [0.0] * n
    if arrival == "poisson" or burstiness == 1.0:
        gaps = rng.exponential(1.0 / rate, size=n)
    else:
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    t = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    return [float(x) for x in t]


class Serving(Workload):
    name = "serving"
    config_cls = ServingConfig
    reset_prefix_cache = True
    summary_columns = [
        ("request_rate", "rate/s", "g"), ("completed", "done", "d"), ("request_throughput", "req/s", ".2f"),
        ("output_tok_s", "out tok/s", ".1f"), ("ttft_s", "TTFT p50 ms", "ms"), ("ttft_s_p99", "TTFT p99 ms", "ms"),
        ("tpot_s", "TPOT p50 ms", "ms"), ("itl_s", "ITL p50 ms", "ms"), ("e2el_s", "E2EL p50 ms", "ms"),
        ("goodput_req_s", "goodput/s", ".2f"), ("failed_requests", "failed", "d"),
    ]

    def _lengths(self, cfg: ServingConfig) -> tuple[LengthDist, LengthDist]:
        i, _ = parse_length(cfg.input_len, "workload.input_len")
        o, _ = parse_length(cfg.output_len, "workload.output_len")
        return i, o  # type: ignore[return-value]

    def check(self, cfg: ServingConfig, shape: Any) -> list[str]:
        problems = []
        _, p1 = parse_length(cfg.input_len, "workload.input_len")
        _, p2 = parse_length(cfg.output_len, "workload.output_len")
        problems += p1 + p2
        if cfg.dataset:
            from harness.core.errors import UserError
            from workloads.datasets import read_dataset
            try:
                read_dataset(cfg.dataset, cfg.dataset_format)
            except UserError as e:
                problems += e.problems
        return problems or super().check(cfg, shape)

    def max_model_len(self, cfg: ServingConfig) -> int:
        if cfg.dataset:  # lengths are known only once the dataset is tokenised in the engine's process
            return cfg.max_len or 0
        i, o = self._lengths(cfg)
        if i is None or o is None:
            return 0
        return i.bounds()[1] + o.bounds()[1]

    def plan(self, cfg: ServingConfig) -> list[Point]:
        return [Point(self.name, {"request_rate": r, "num_requests": cfg.num_requests}) for r in cfg.request_rates]

    def requests(self, cfg: ServingConfig, ctx: RunContext, rate: float, key: str) -> list[Request]:
        rng = np.random.default_rng(seed_for(ctx.seed, key))
        n = cfg.num_requests
        if cfg.dataset:
            from workloads.datasets import read_dataset, tokenize_entries
            pairs = tokenize_entries(read_dataset(cfg.dataset, cfg.dataset_format), ctx.model_path,
                                     ctx.shape.vocab_size)
            limit = cfg.max_len or ctx.max_model_len or ctx.shape.max_position_embeddings
            pairs = [(p, o) for p, o in pairs if len(p) + o <= limit]
            if not pairs:
                raise ValueError(f"no dataset request fits in {limit} tokens (workload.max_len)")
            pick = rng.integers(0, len(pairs), size=n)
            prompts, outs = [pairs[i][0] for i in pick], [pairs[i][1] for i in pick]
        else:
            idist, odist = self._lengths(cfg)
            in_lens, outs = idist.sample(n, rng), odist.sample(n, rng)
            prompts = [ctx.prompts(1, s, f"{key}/prompt{i}")[0] for i, s in enumerate(in_lens)]
        times = arrival_times(n, rate, cfg.arrival, cfg.burstiness, rng)
        return [Request(f"r{i}", prompts[i], outs[i], times[i]) for i in range(n)]

    def run_point(self, engine: Engine, point: Point, ctx: RunContext) -> dict[str, Any]:
        cfg: ServingConfig = ctx.extra["workload_cfg"]
        rate = point.params["request_rate"]
        warm = self.requests(cfg, ctx, math.inf, f"{point.key}/warmup")[: cfg.warmup_requests]
        for _ in engine.serve(warm, now_ns()):
            pass
        reqs = self.requests(cfg, ctx, rate, point.key)
        sampler = ctx.sampler().start()
        start = now_ns() + 5_000_000  # the schedule starts 5 ms from now
        traces = collect(reqs, start, engine.serve(reqs, start))
        mem = sampler.stop()
        slo = SLO(cfg.slo_ttft_s, cfg.slo_tpot_s, cfg.slo_e2el_s)
        row = serving_metrics(traces, slo, {r.request_id: r.max_new_tokens for r in reqs})
        if not row["completed"]:
            raise RuntimeError(f"no request of the point completed: {row['failed_request_reasons']}")
        info = engine.kv_cache_info()
        row.update(request_rate=rate, arrival=cfg.arrival, burstiness=cfg.burstiness,
                   slo={"ttft_s": cfg.slo_ttft_s, "tpot_s": cfg.slo_tpot_s, "e2el_s": cfg.slo_e2el_s},
                   kv_info=info.to_dict(), measured_output_tokens=row["total_output_tokens"], **mem.row_fields(),
                   **kv_memory_fields(info, peak=True))
        return row
