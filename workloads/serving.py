"""Serving under load: requests arrive over time and go through each engine's `serve()`.

Two kinds of load, each one point per value (both may be given):

- **Open loop** (`request_rates`): requests arrive on a schedule whatever the engine does.
  Arrivals are Poisson (exponential gaps), gamma with shape `burstiness` (< 1 burstier, > 1 more
  regular; the mean rate is kept), `constant` (evenly spaced), or all at once for rate `inf`.
  `max_concurrency` caps the requests in flight (as `vllm bench serve --max-concurrency`): the
  others wait at the client, and their clock still runs from their scheduled arrival.
- **Closed loop** (`concurrency`): N requests are kept in flight; each one that finishes is
  replaced at once by the next (its clock starts then).

`ramp_up_s` ramps either in: the arrival rate grows linearly from 0 over the first ramp_up_s
seconds (open loop), or the N slots start one after another over ramp_up_s (closed loop).

Input/output lengths come from a distribution (workloads/lengths.py) or a dataset file
(workloads/datasets.py). Every request's clock starts at its scheduled arrival, so queueing
inside the engine (and at the client, under a cap) counts (docs/metrics.md). An open-loop point
whose queue grows through the run - time to first token rising with the arrival time by more
than `SATURATION_SLOPE` seconds per second - is over capacity: it stops early, its remaining
requests are cancelled, and the row is marked `saturated`.

Dataset entries are used once each by default, in an order shuffled with the run's seed (and the
point's key: each point has its own order, the same in every run), cycling
only when more requests are asked for than the file holds (`dataset_order`: file | shuffle |
random, the last drawing with replacement); the row says how many distinct entries were sent.

A **trace** (`trace`: Mooncake-style JSONL, workloads/datasets.py) replaces the rates: one point
whose requests arrive at the trace's recorded offsets (times `trace_time_scale`) with its lengths;
requests whose `hash_ids` start alike get prompts that start alike (one block of
`trace_block_size` tokens per hash id), so a prefix cache sees the reuse the trace recorded.

An endpoint engine serves the point with its load generator (`serve_load`, on
`client_processes` client processes); the row then says whether the client kept up - send lag,
loop lag, client CPU, achieved vs scheduled rate - and marks the point `client_limited` when it
did not (docs/metrics.md, "Client distortion"): such a point is the client's measurement, not the
engine's, like a saturated one.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from adapters.base import Capabilities, Engine, ListSource, Request, RequestSource, now_ns
from harness.core.errors import UserError
from harness.core.metrics import SLO, RequestTrace, good_fields, serving_metrics
from harness.core.schema import spec
from workloads import lora
from workloads.base import Collector, Point, RunContext, Workload, kv_memory_fields
from workloads.datasets import FORMATS, read_dataset, read_trace, skips_line, tokenize_requests
from workloads.lengths import LengthDist, parse_length
from workloads.prompts import seed_for

# An open-loop point is saturated when TTFT grows by more than this many seconds per second of
# arrival time (the engine serves less than 1 / (1 + slope) of the offered rate).
SATURATION_SLOPE = 0.25
# ... judged once this many requests (and a quarter of the point's) have their first token
SATURATION_MIN_REQUESTS = 8
# The client did not keep up when its send lag (p99) or its loop lag (p99 of the 2 ms ticks)
# exceeds this, or 5 % of the tightest SLO the point is judged on, or a single loop stall exceeds
# CLIENT_STALL_FACTOR times that, or a client process ran CLIENT_CPU_LIMIT busy.
CLIENT_LAG_LIMIT_S = 0.005
CLIENT_SLO_FRACTION = 0.05
CLIENT_STALL_FACTOR = 10
CLIENT_CPU_LIMIT = 0.9
DATASET_ORDERS = ("file", "shuffle", "random")


@dataclass
class LoadShape:
    """What the requests of a load point look like, and how they arrive (shared by `serving` and
    `capacity`)."""

    num_requests: int = spec(32, ge=1, help="requests per point")
    arrival: str = spec("poisson", choices=("poisson", "gamma", "constant"), help="open-loop arrival process")
    burstiness: float = spec(1.0, gt=0, help="gamma shape (1.0 = Poisson); lower is burstier")
    max_concurrency: int | None = spec(None, ge=1, help="open loop: most requests in flight (the rest wait at the client)")
    ramp_up_s: float = spec(0.0, ge=0, help="seconds over which the rate (open) or the slots (closed) ramp in")
    input_len: Any = spec(128, help="tokens: a number, or {dist: uniform|normal|lognormal, ...}")
    output_len: Any = spec(32, help="tokens: a number, or {dist: ..., ...}")
    dataset: str | None = spec(None, help="JSONL (trtllm-bench format), ShareGPT JSON or chat-format JSONL file, or "
                                          "hf:ORG/NAME[@REV][/FILE] (a Hugging Face Hub dataset); overrides lengths")
    dataset_format: str = spec("auto", choices=FORMATS, help="auto: by the file (a .jsonl file by its first line's "
                                                             "keys: messages -> chat, conversations -> sharegpt)")
    warmup_requests: int = spec(2, ge=1, help="requests served before measuring each point")
    max_len: int | None = spec(None, ge=2, help="dataset requests longer than this (prompt+output) are dropped")
    stop_when_saturated: bool = spec(True, help="stop an open-loop point early once its queue grows")
    dataset_order: str = spec("shuffle", choices=DATASET_ORDERS,
                              help="dataset entries: each once in file order, each once shuffled with the run's "
                                   "seed (both cycle when more requests are asked), or drawn with replacement")
    trace: str | None = spec(None, help="Mooncake-style JSONL trace (timestamp ms, input_length, output_length, "
                                        "hash_ids): one point, requests at the recorded offsets; replaces the rates")
    trace_time_scale: float = spec(1.0, gt=0, help="multiplies the trace's offsets (0.5 replays it twice as fast)")
    trace_block_size: int = spec(512, ge=1, help="prompt tokens per hash id of the trace")
    client_processes: int = spec(1, ge=1, help="endpoint engines: client processes the load is split over, "
                                               "each with its own event loop")
    client_backend: str = spec("local", choices=("local", "ray"),
                               help="where client processes run: this machine, or Ray actors (ray_address)")
    ray_address: str | None = spec(None, help="client_backend=ray: the cluster to join (null: a local instance)")
    client_lag_limit_s: float = spec(CLIENT_LAG_LIMIT_S, gt=0,
                                     help="send-lag p99 or loop-lag p99 above this (or above 5 per cent of the tightest "
                                          "SLO), or one loop stall above 10 times that, marks the point client_limited")
    client_cpu_limit: float = spec(CLIENT_CPU_LIMIT, gt=0, le=1,
                                   help="a client process busy this fraction of a core marks the point client_limited")
    lora: dict[str, Any] | None = spec({}, help="LoRA adapters and how requests are split among them (workloads/lora.py: "
                                                "adapters, num_adapters, split, base_share, weights, zipf_alpha, max_loras, "
                                                "max_lora_rank, max_cpu_loras, check_outputs, swap_cost)")

    def goodput_slo(self) -> SLO:
        return SLO()


@dataclass
class ServingConfig(LoadShape):
    name: str = spec("serving")
    request_rates: list[float] = spec([math.inf], gt=0,
                                      help="open loop: requests per second, one point each; inf = all at once")
    concurrency: list[int] | None = spec(None, ge=1, help="closed loop: requests kept in flight, one point each")
    slo_ttft_s: float | None = spec(None, gt=0, help="goodput SLO on time to first token")
    slo_tpot_s: float | None = spec(None, gt=0, help="goodput SLO on time per output token")
    slo_e2el_s: float | None = spec(None, gt=0, help="goodput SLO on end-to-end latency")

    def goodput_slo(self) -> SLO:
        return SLO(self.slo_ttft_s, self.slo_tpot_s, self.slo_e2el_s)


def arrival_times(n: int, rate: float, arrival: str, burstiness: float, rng: np.random.Generator,
                  ramp_up_s: float = 0.0) -> list[float]:
    """Scheduled arrival offsets in seconds, the first at 0. With a ramp-up the rate grows
    linearly from 0 to `rate` over `ramp_up_s` (the arrivals of a steady process at `rate`,
    mapped through the inverse of the ramped cumulative rate)."""
    if math.isinf(rate):
        return [0.0] * n
    if arrival == "constant":
        gaps = np.full(n, 1.0 / rate)
    elif arrival == "poisson" or burstiness == 1.0:
        gaps = rng.exponential(1.0 / rate, size=n)
    else:
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    t = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    if ramp_up_s > 0:  # cumulative rate R(s) = rate s^2 / (2 T) for s < T, rate (s - T/2) after
        steady = t * rate  # expected arrivals so far
        half = rate * ramp_up_s / 2
        t = np.where(steady < half, np.sqrt(2 * ramp_up_s * steady / rate), steady / rate + ramp_up_s / 2)
    return [float(x) for x in t]


class ClosedLoopSource(RequestSource):
    """Closed loop: `concurrency` requests in flight; when one finishes the next is due at once
    (its scheduled arrival is that moment). With `ramp_up_s` the slots start one after another."""

    def __init__(self, requests: list[Request], start_ns: int, concurrency: int, ramp_up_s: float = 0.0):
        self.start_ns = start_ns
        self.pending = list(requests)
        self.ready: list[tuple[int, Request]] = []
        for i in range(min(concurrency, len(self.pending))):
            self._schedule(start_ns + int(ramp_up_s * 1e9 * i / max(concurrency, 1)))

    def _schedule(self, at_ns: int) -> None:
        if self.pending:
            r = self.pending.pop(0)
            r.arrival_s = (at_ns - self.start_ns) / 1e9  # its clock starts when its slot frees
            self.ready.append((at_ns, r))
            self.ready.sort(key=lambda x: x[0])

    def due(self, now_ns: int) -> list[Request]:
        out = [r for at, r in self.ready if at <= now_ns]
        self.ready = [(at, r) for at, r in self.ready if at > now_ns]
        return out

    def next_due_ns(self) -> int | None:
        return self.ready[0][0] if self.ready else None

    def exhausted(self) -> bool:
        return not self.pending and not self.ready

    def finished(self, request_id: str, time_ns: int) -> None:
        self._schedule(time_ns)


def client_limited(client: dict[str, Any], slo: SLO, lag_limit_s: float = CLIENT_LAG_LIMIT_S,
                   cpu_limit: float = CLIENT_CPU_LIMIT) -> list[str]:
    """Why the load generator did not keep up during a point (empty: it did): its send lag p99 or
    loop lag p99 above the limit (or above 5 % of the tightest SLO), one loop stall above
    CLIENT_STALL_FACTOR times that, or a client process near a full core. The loop lag is judged on
    its p99 over time (adapters.endpoint.loadgen.lag_samples), so one short stall (a collection, a
    page fault) does not void a point whose client kept up the rest of the time; a starved client
    is late much of the time and still fails."""
    bounds = [b for b in (slo.ttft_s, slo.tpot_s, slo.e2el_s) if b]
    limit = min([lag_limit_s] + [CLIENT_SLO_FRACTION * b for b in bounds])
    why = []
    for key, what, bound in (("send_lag_s_p99", "send lag p99", limit), ("loop_lag_s_p99", "loop lag p99", limit),
                             ("loop_lag_s_max", "a loop stall of", CLIENT_STALL_FACTOR * limit)):
        v = client.get(key)
        if v is not None and v > bound:
            why.append(f"{what} {v * 1e3:.1f} ms > {bound * 1e3:.1f} ms")
    cpu = client.get("client_cpu_frac")
    if cpu is not None and cpu >= cpu_limit:
        why.append(f"a client process used {cpu:.0%} of a core")
    return why


def saturated(arrivals_s: list[float], ttfts_s: list[float], total: int) -> bool:
    """The queue grows through the run: TTFT rises with arrival time faster than SATURATION_SLOPE."""
    if len(ttfts_s) < max(SATURATION_MIN_REQUESTS, total // 4) or len(set(arrivals_s)) < 2:
        return False
    slope = float(np.polyfit(np.asarray(arrivals_s), np.asarray(ttfts_s), 1)[0])
    return slope > SATURATION_SLOPE


class Serving(Workload):
    name = "serving"
    compared_metrics = ("ttft_s", "tpot_s", "itl_s", "e2el_s")
    config_cls = ServingConfig
    reset_prefix_cache = True
    summary_columns = [
        ("request_rate", "rate/s", "g"), ("concurrency", "conc", "d"), ("completed", "done", "d"),
        ("request_throughput", "req/s", ".2f"), ("output_tok_s", "out tok/s", ".1f"),
        ("per_user_tok_s", "tok/s/user", ".1f"), ("ttft_s", "TTFT p50 ms", "ms"),
        ("ttft_s_p99", "TTFT p99 ms", "ms"), ("tpot_s", "TPOT p50 ms", "ms"), ("itl_s", "ITL p50 ms", "ms"),
        ("e2el_s", "E2EL p50 ms", "ms"), ("goodput_req_s", "goodput/s", ".2f"), ("failed_requests", "failed", "d"),
        ("saturated", "saturated", "s"), ("client_limited", "client lim", "s"),
    ]

    def post_summary(self, rows: list[dict[str, Any]]) -> str:
        mine = [r for r in rows if r.get("workload") == self.name]
        skips = [line for line in dict.fromkeys(skips_line(r) for r in mine) if line][:1]  # one file, one line
        return "\n".join(t for t in (client_limited_note(rows), *skips, *lora.summary_lines(mine)) if t)

    def _lengths(self, cfg: LoadShape) -> tuple[LengthDist, LengthDist]:
        i, _ = parse_length(cfg.input_len, "workload.input_len")
        o, _ = parse_length(cfg.output_len, "workload.output_len")
        return i, o  # type: ignore[return-value]

    def check(self, cfg: LoadShape, shape: Any) -> list[str]:
        problems = []
        _, p1 = parse_length(cfg.input_len, "workload.input_len")
        _, p2 = parse_length(cfg.output_len, "workload.output_len")
        problems += p1 + p2
        if cfg.dataset:
            try:
                read_dataset(cfg.dataset, cfg.dataset_format)
            except UserError as e:
                problems += e.problems
        if cfg.client_backend == "ray":
            if importlib.util.find_spec("ray") is None:
                problems.append("workload.client_backend=ray: Ray is not installed here. pip install 'ray>=2.9' "
                                "(or infer-bench[ray]), or use client_backend=local.")
        if cfg.trace:
            try:
                read_trace(cfg.trace)
            except UserError as e:
                problems += e.problems
        problems += lora.problems(cfg.lora, shape, self.name)
        return problems or super().check(cfg, shape)

    def max_model_len(self, cfg: LoadShape) -> int:
        if cfg.trace:
            try:
                return max(e.input_length + e.output_length for e in read_trace(cfg.trace))
            except Exception:
                return 0  # check() names the problem
        if cfg.dataset:  # lengths are known only once the dataset is tokenised in the engine's process
            return cfg.max_len or 0
        i, o = self._lengths(cfg)
        if i is None or o is None:
            return 0
        return i.bounds()[1] + o.bounds()[1]

    def plan(self, cfg: ServingConfig) -> list[Point]:
        traffic = lora.point_params(cfg.lora)
        if cfg.trace:
            return [Point(self.name, {"trace": cfg.trace, "trace_time_scale": cfg.trace_time_scale, **traffic})]
        points = [Point(self.name, {"request_rate": r, "num_requests": cfg.num_requests, **traffic})
                  for r in cfg.request_rates]
        points += [Point(self.name, {"concurrency": c, "num_requests": cfg.num_requests, **traffic})
                   for c in cfg.concurrency or []]
        if traffic and lora.typed(cfg.lora).swap_cost:  # one adapter first, then N in round robin at max_loras=1
            points += [Point(self.name, {"concurrency": 1, "num_requests": cfg.num_requests,
                                         **lora.swap_params(cfg.lora, n)})
                       for n in [1] + sorted(set(lora.typed(cfg.lora).swap_cost))]
        return points

    def unsupported(self, point: Point, caps: Capabilities) -> str | None:
        return lora.unsupported(point.params.get("lora"), caps)

    def engine_overrides(self, point: Point, caps: Capabilities) -> dict[str, Any]:
        return lora.overrides(point.params.get("lora"))

    def finalize_row(self, row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        lora.finalize(row, rows)

    def requests(self, cfg: LoadShape, ctx: RunContext, rate: float, key: str,
                 n: int | None = None) -> list[Request]:
        rng = np.random.default_rng(seed_for(ctx.seed, key))
        self.entry_of: dict[str, int] = {}  # request id -> dataset entry
        self.dataset_fields: dict[str, Any] = {}  # the dataset file and what reading it skipped
        if cfg.trace:
            return self.trace_requests(cfg, ctx, key, n)
        n = cfg.num_requests if n is None else n
        messages: list[Any] = [None] * n
        if cfg.dataset:
            entries = read_dataset(cfg.dataset, cfg.dataset_format)
            pairs = tokenize_requests(entries, ctx.model_path, ctx.shape.vocab_size, entries.skipped)
            limit = cfg.max_len or ctx.max_model_len or ctx.shape.max_position_embeddings
            fits = [p for p in pairs if len(p.prompt_ids) + p.output_tokens <= limit]
            if len(fits) < len(pairs):
                entries.skipped["request: longer than workload.max_len"] += len(pairs) - len(fits)
            if not fits:
                raise ValueError(f"no dataset request fits in {limit} tokens (workload.max_len)")
            pick = dataset_picks(len(fits), n, cfg.dataset_order, rng)
            prompts, outs = [fits[i].prompt_ids for i in pick], [fits[i].output_tokens for i in pick]
            messages = [fits[i].messages for i in pick]
            self.entry_of = {f"r{i}": int(e) for i, e in enumerate(pick)}
            self.dataset_entries = len(fits)
            self.dataset_fields = {"dataset": cfg.dataset, "dataset_format": entries.format,
                                   "dataset_conversations": entries.read if entries.format != "jsonl" else None,
                                   "dataset_skipped": dict(sorted(entries.skipped.items())),
                                   "dataset_merged": entries.merged}
        else:
            idist, odist = self._lengths(cfg)
            in_lens, outs = idist.sample(n, rng), odist.sample(n, rng)
            prompts = [ctx.prompts(1, s, f"{key}/prompt{i}")[0] for i, s in enumerate(in_lens)]
        times = arrival_times(n, rate, cfg.arrival, cfg.burstiness, rng, cfg.ramp_up_s)
        return [Request(f"r{i}", prompts[i], outs[i], times[i], messages=messages[i]) for i in range(n)]

    def trace_requests(self, cfg: LoadShape, ctx: RunContext, key: str, n: int | None = None) -> list[Request]:
        """The trace's requests (the first n: warm-up, all at once): arrivals at the recorded
        offsets times trace_time_scale; prompt = one block of trace_block_size tokens per hash id
        (the same block for the same id), cut to input_length or filled with tokens of its own."""
        entries = read_trace(cfg.trace)  # type: ignore[arg-type]
        t0 = min(e.timestamp_ms for e in entries)
        blocks: dict[Any, list[int]] = {}
        out = []
        for i, e in enumerate(entries[:n] if n is not None else entries):
            prompt: list[int] = []
            for h in e.hash_ids:
                if len(prompt) >= e.input_length:
                    break
                if h not in blocks:
                    blocks[h] = ctx.prompts(1, cfg.trace_block_size, f"trace-block/{h}")[0]
                prompt += blocks[h]
            prompt = prompt[:e.input_length]
            if len(prompt) < e.input_length:
                prompt += ctx.prompts(1, e.input_length - len(prompt), f"{key}/trace{i}")[0]
            arrival = 0.0 if n is not None else (e.timestamp_ms - t0) / 1000 * cfg.trace_time_scale
            out.append(Request(f"r{i}", prompt, e.output_length, arrival))
        return out

    def measure(self, engine: Engine, cfg: LoadShape, ctx: RunContext, params: dict[str, Any],
                key: str) -> dict[str, Any]:
        """Serve one load point - {"request_rate": r} or {"concurrency": c}, plus num_requests -
        and return its row fields. Used by this workload and by `capacity`'s probes."""
        closed = params.get("concurrency") is not None
        trace = params.get("trace") is not None
        rate = math.inf if closed else params.get("request_rate", math.nan if trace else math.inf)
        point_lora = params.get("lora")
        warm = self.requests(cfg, ctx, math.inf, f"{key}/warmup", n=cfg.warmup_requests)
        for r, a in zip(warm, lora.assignment(point_lora, len(warm), ctx.seed, f"{key}/warmup")):
            r.adapter = a
        for _ in engine.serve(warm, now_ns()):
            pass
        reqs = self.requests(cfg, ctx, rate, key, n=None if trace else params.get("num_requests", cfg.num_requests))
        for r, a in zip(reqs, lora.assignment(point_lora, len(reqs), ctx.seed, key)):  # the same for every engine
            r.adapter = a
        expected = {r.request_id: r.max_new_tokens for r in reqs}
        lora0 = engine.lora_stats() if point_lora else None
        check_saturation = not closed and cfg.stop_when_saturated and not math.isinf(rate)
        slo = cfg.goodput_slo()
        sampler = ctx.sampler().start()
        if engine.load_generator:  # an endpoint: its load generator
            traces, sent, is_saturated, client = self._serve_load(engine, reqs, cfg, params, check_saturation)
        else:
            traces, sent, is_saturated = self._serve_in_process(engine, reqs, cfg, params, check_saturation)
            client = {}
        mem = sampler.stop()
        lora1 = engine.lora_stats() if point_lora else None
        if is_saturated:  # the cancelled requests are not failures of the engine: left out
            traces = [t for t in traces if t.token_times_ns and t.n_out == expected[t.request_id]]
        self.served = (reqs, traces, expected)  # what run_point's LoRA outputs check compares
        row = serving_metrics(traces, slo, expected)
        if not row["completed"] and not is_saturated:
            raise RuntimeError(f"no request of the point completed: {row['failed_request_reasons']}")
        # saturated before any request completed: a row all the same (the load is beyond the
        # engine's capacity here; a capacity search reads it as a miss), its latencies empty
        info = engine.kv_cache_info()
        limited = client_limited(client, slo, cfg.client_lag_limit_s, cfg.client_cpu_limit) if client else []
        row.update(client, client_limited=bool(limited) if client else None, client_limited_reasons=limited or None,
                   offered_rate=offered_rate(reqs, rate, closed, trace))
        if self.entry_of:
            row.update(dataset_order=cfg.dataset_order, dataset_entries=self.dataset_entries,
                       dataset_entries_sent=len({e for rid, e in self.entry_of.items() if rid in sent}),
                       **self.dataset_fields)
        if trace:
            row.update(trace=params["trace"], trace_time_scale=cfg.trace_time_scale, trace_requests=len(reqs))
        if point_lora:
            row.update(lora.traffic_fields(point_lora, reqs, traces, expected, lora0, lora1))
        row.update(load_mode="trace" if trace else "closed" if closed else "open",
                   request_rate=None if closed or trace else rate,
                   concurrency=params.get("concurrency"), max_concurrency=None if closed else cfg.max_concurrency,
                   ramp_up_s=cfg.ramp_up_s, arrival=None if closed else cfg.arrival,
                   burstiness=None if closed else cfg.burstiness, saturated=is_saturated,
                   stopped_early=is_saturated, offered_requests=len(reqs),
                   slo={"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "e2el_s": slo.e2el_s},
                   kv_info=info.to_dict(), measured_output_tokens=row["total_output_tokens"], **mem.row_fields(),
                   **kv_memory_fields(info, peak=True))
        return row

    def _serve_load(self, engine: Engine, reqs: list[Request], cfg: LoadShape, params: dict[str, Any],
                    check_saturation: bool) -> tuple[list[RequestTrace], set[str], bool, dict[str, Any]]:
        """The point through an endpoint's load generator: (traces - the requests it never sent
        as failed ones -, the ids sent, saturated, the client's own fields)."""
        closed = params.get("concurrency") is not None
        is_saturated = False

        def should_stop(firsts: list[tuple[int, int]], start_ns: int) -> bool:
            nonlocal is_saturated
            if check_saturation and saturated([(a - start_ns) / 1e9 for a, _ in firsts],
                                              [(f - a) / 1e9 for a, f in firsts], len(reqs)):
                is_saturated = True
            return is_saturated

        out = engine.serve_load(reqs, closed=closed, concurrency=params.get("concurrency") or 1,
                                max_concurrency=None if closed else cfg.max_concurrency, ramp_up_s=cfg.ramp_up_s,
                                processes=cfg.client_processes, should_stop=should_stop,
                                backend=cfg.client_backend, ray_address=cfg.ray_address)
        traces, start = out["traces"], out["start_ns"]
        sent = {t.request_id for t in traces}
        traces += [RequestTrace(r.request_id, start + round(r.arrival_s * 1e9), len(r.prompt_ids),
                                error="not sent (the point stopped early)") for r in reqs if r.request_id not in sent]
        return traces, sent, is_saturated, out["client"]

    def _serve_in_process(self, engine: Engine, reqs: list[Request], cfg: LoadShape, params: dict[str, Any],
                          check_saturation: bool) -> tuple[list[RequestTrace], set[str], bool]:
        """The point through the engine's own `serve()`, the schedule kept by a request source:
        (traces, the ids sent, saturated)."""
        start = now_ns() + 5_000_000  # the schedule starts 5 ms from now
        source = (ClosedLoopSource(reqs, start, params["concurrency"], cfg.ramp_up_s)
                  if params.get("concurrency") is not None else ListSource(reqs, start, cfg.max_concurrency))
        collector = Collector(reqs, start, source)
        is_saturated = False
        events = engine.serve(source, start)
        try:
            for ev in events:
                if collector.feed(ev) and check_saturation:
                    arrivals, ttfts = collector.first_token_delays()
                    if saturated(arrivals, ttfts, len(reqs)):
                        is_saturated = True
                        break
        finally:
            events.close()  # an engine's serve() cancels what it still runs
        traces = collector.traces()
        return traces, {t.request_id for t in traces if t.token_times_ns or t.error}, is_saturated

    def run_point(self, engine: Engine, point: Point, ctx: RunContext, cfg: ServingConfig,
                  inputs: dict[str, Any] | None = None) -> dict[str, Any]:
        row = self.measure(engine, cfg, ctx, point.params, point.key)
        point_lora = point.params.get("lora")
        if point_lora and not point_lora.get("swap") and lora.typed(cfg.lora).check_outputs:
            check = lora.check_outputs(engine, *self.served, ctx.dtype)
            # only requests equal to their alone outputs are good (none where the check could not verify)
            ids = check.pop("passed_ids")
            passed = set(ids) if check["verdict"] != "unverified" else set()
            row["lora_check"] = check
            reqs, traces, expected = self.served
            done = [t for t in traces if not t.error and t.token_times_ns and t.n_out == expected.get(t.request_id)]
            row.update(good_fields(done, cfg.goodput_slo(), passed, "LoRA outputs check"))
        return row


def offered_rate(reqs: list[Request], rate: float, closed: bool, trace: bool) -> float | None:
    """The rate asked for: for a trace, its requests over their span; none for a closed loop."""
    if trace and len(reqs) > 1:
        span = max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)
        return (len(reqs) - 1) / span if span > 0 else math.inf
    return None if closed else rate


def dataset_picks(entries: int, n: int, order: str, rng: np.random.Generator) -> list[int]:
    """Which dataset entry each of n requests uses: `file` and `shuffle` take every entry once
    (in file order / in an order shuffled by `rng`) and cycle only past the end; `random` draws
    with replacement."""
    if order == "random":
        return [int(i) for i in rng.integers(0, entries, size=n)]
    seq = rng.permutation(entries) if order == "shuffle" else np.arange(entries)
    return [int(seq[i % entries]) for i in range(n)]


def client_limited_note(rows: list[dict[str, Any]]) -> str:
    """A summary line for points the load generator could not keep up with."""
    hit = [r for r in rows if r.get("client_limited")]
    if not hit:
        return ""
    why = "; ".join(sorted({w for r in hit for w in r.get("client_limited_reasons") or []})[:3])
    return (f"client-limited: {len(hit)} point(s) where the load generator did not keep up ({why}); their latencies "
            "include the client's own delays and are not the engine's. Raise workload.client_processes "
            "(docs/metrics.md, \"Client distortion\").")
