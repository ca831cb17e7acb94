"""The sweep: batch sizes x prompt lengths at a fixed output length, prefill and decode timed
apart (docs/metrics.md, "Offline (batch) metrics").

For every point: `warmup` iterations, then repeats until both `min_repeats` iterations and
`min_duration_s` seconds of measurement are reached (MLPerf LoadGen's rule), at most
`max_repeats`. Every iteration draws fresh prompts (so no prefix cache can help a repeat).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from adapters.base import Engine, now_ns
from harness.core.kvcalc import estimate, kv_dtype_of
from harness.core.schema import spec
from harness.core.stats import summarize
from workloads.base import MEMORY_COLUMNS, Point, RunContext, Workload, kv_memory_fields, memory_note


@dataclass
class SweepConfig:
    name: str = spec("sweep", help="workload name")
    batch_sizes: list[int] = spec([1, 4], ge=1, nonempty=True, help="sequences per batch")
    prompt_lens: list[int] = spec([64, 256], ge=1, nonempty=True, help="prompt tokens per sequence")
    output_len: int = spec(32, ge=1, help="output tokens per sequence (1 from prefill + output_len-1 decode steps)")
    warmup: int = spec(2, ge=1, help="warm-up iterations per point before measuring (never 0)")
    min_repeats: int = spec(3, ge=1, help="measured iterations per point, at least")
    min_duration_s: float = spec(1.0, ge=0, help="seconds of measurement per point, at least")
    max_repeats: int = spec(100, ge=1, help="measured iterations per point, at most")


@dataclass
class Iteration:
    prefill_s: float
    step_s: list[float]
    total_s: float  # measured wall time, prefill start to last step end


def run_iteration(engine: Engine, prompts: list[list[int]], output_len: int) -> tuple[Iteration, Any]:
    """Prefill + (output_len - 1) decode steps. Returns the timings and the engine's KV info
    taken before the sequences are released."""
    t0 = now_ns()
    pre = engine.prefill(prompts, max_new_tokens=output_len)
    dec = engine.decode(output_len - 1) if output_len > 1 else None
    t1 = now_ns()
    steps = dec.step_latencies_s if dec else []
    if dec and any(len(row) != len(prompts) for row in dec.tokens):
        raise RuntimeError("engine returned a decode step without one token per sequence")
    kv = engine.kv_cache_info()
    engine.release()
    return Iteration(pre.latency_s, steps, (t1 - t0) / 1e9), kv


def offline_metrics(its: list[Iteration], batch: int, prompt_len: int, output_len: int) -> dict[str, Any]:
    """Row fields for the prefill/decode split, from the measured iterations."""
    prefill = [i.prefill_s for i in its]
    steps = [s for i in its for s in i.step_s]
    e2e = [i.prefill_s + sum(i.step_s) for i in its]
    measured = [i.total_s for i in its]
    p, d, e = summarize(prefill), summarize(steps), summarize(e2e)
    out: dict[str, Any] = {
        "repeats": len(its),
        "prefill_latency_s": p["p50"], "prefill_latency_s_p90": p["p90"], "prefill_latency_s_p99": p["p99"],
        "prefill_latency_s_mean": p["mean"], "prefill_latency_s_std": p["std"],
        "prefill_tok_s": batch * prompt_len / p["p50"] if p["p50"] else None,
        "decode_step_latency_s": d["p50"], "decode_step_latency_s_p90": d["p90"],
        "decode_step_latency_s_p99": d["p99"], "decode_step_latency_s_mean": d["mean"],
        "decode_step_latency_s_std": d["std"], "decode_steps": d["count"],
        "decode_tok_s": batch / d["p50"] if d["p50"] else None,
        "e2e_latency_s": e["p50"], "e2e_latency_s_p90": e["p90"],
        "output_tok_s": batch * output_len / e["p50"] if e["p50"] else None,
        # how far prefill + sum(steps) is from the measured wall time (harness overhead between steps)
        "e2e_unaccounted_frac": (sum(measured) - sum(e2e)) / sum(measured) if sum(measured) else None,
        "prefill_latency_s_samples": prefill,
        "e2e_latency_s_samples": e2e,
        "decode_step_latency_s_samples": steps,
    }
    return out


def kv_fields(kv: Any, shape: Any, dtype: str, batch: int, stored_tokens: int) -> dict[str, Any]:
    """The engine's own KV report (reserved pool apart from what the batch uses) beside the
    estimator's figure for what the batch stores."""
    kv_dtype = kv_dtype_of(dtype, kv.kv_dtype)
    est = estimate(shape, stored_tokens, batch, kv_dtype)
    # the most KV the batch held (an engine whose sequences end with their last token, as vLLM's
    # do when asked for exactly that many, holds none once decode is over)
    return {**kv_memory_fields(kv, peak=True), "kv_est_bytes": est.total_bytes, "kv_est_bytes_per_token": est.bytes_per_token,
            "kv_info": kv.to_dict()}


def repeat_until(run, cfg: Any) -> list:
    """Call `run(i)` for i = 0, 1, ... until min_repeats and min_duration_s are both reached
    (or max_repeats). Returns the results."""
    out = []
    t0 = time.perf_counter()
    while len(out) < cfg.max_repeats:
        out.append(run(len(out)))
        if len(out) >= cfg.min_repeats and time.perf_counter() - t0 >= cfg.min_duration_s:
            break
    return out


class Sweep(Workload):
    name = "sweep"
    compared_metrics = ("prefill_latency_s", "decode_step_latency_s", "output_tok_s", "peak_memory_bytes")
    config_cls = SweepConfig
    roofline = True
    summary_columns = [
        ("batch_size", "batch", "d"), ("prompt_len", "prompt", "d"), ("output_len", "out", "d"),
        ("prefill_latency_s", "prefill ms", "ms"), ("prefill_tok_s", "prefill tok/s", ".0f"),
        ("decode_step_latency_s", "step ms", "ms"), ("decode_tok_s", "decode tok/s", ".0f"),
        ("output_tok_s", "out tok/s", ".1f"), *MEMORY_COLUMNS,
    ]

    def plan(self, cfg: SweepConfig) -> list[Point]:
        return [Point(self.name, {"batch_size": b, "prompt_len": s, "output_len": cfg.output_len})
                for s in sorted(set(cfg.prompt_lens)) for b in sorted(set(cfg.batch_sizes))]

    def max_model_len(self, cfg: SweepConfig) -> int:
        return max(cfg.prompt_lens) + cfg.output_len

    def max_prefill_batch(self, cfg: SweepConfig) -> tuple[int, int]:
        return max(cfg.batch_sizes), max(cfg.batch_sizes) * max(cfg.prompt_lens)

    def post_summary(self, rows: list[dict[str, Any]]) -> str:
        return memory_note(rows)

    def finalize_row(self, row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """Output throughput's interval from end-to-end latency's (its reciprocal, scaled)."""
        ci, b, o = row.get("e2e_latency_s_ci"), row.get("batch_size"), row.get("output_len")
        row["output_tok_s_ci"] = [b * o / ci[1], b * o / ci[0]] if ci and b and o else None

    def run_point(self, engine: Engine, point: Point, ctx: RunContext, cfg: SweepConfig,
                  inputs: dict[str, Any] | None = None) -> dict[str, Any]:
        b, s, o = point.params["batch_size"], point.params["prompt_len"], point.params["output_len"]
        for i in range(cfg.warmup):
            run_iteration(engine, ctx.prompts(b, s, f"{point.key}/warmup{i}"), o)
        sampler = ctx.sampler().start()
        kv_last = []

        def once(i: int) -> Iteration:
            it, kv = run_iteration(engine, ctx.prompts(b, s, f"{point.key}/{i}"), o)
            kv_last[:] = [kv]
            return it

        its = repeat_until(once, cfg)
        mem = sampler.stop()
        row = offline_metrics(its, b, s, o)
        row.update(kv_fields(kv_last[0], ctx.shape, ctx.dtype, b, s + o - 1))
        row.update(mem.row_fields(), warmup=cfg.warmup, measured_output_tokens=len(its) * b * o)
        return row
