"""Times from TensorRT-LLM's own metrics (pure: no TensorRT-LLM import; unit-tested).

TensorRT-LLM's executor runs its own loop; tokens reach this process through its response path,
batched per engine iteration and, with the overlap scheduler, about one iteration late. A token's
arrival time is therefore not its forward pass's time. TensorRT-LLM measures both itself:

  per request (`SamplingParams(return_perf_metrics=True)` -> CompletionOutput.request_perf_metrics):
      first_iter / last_iter          the engine iterations the request first and last ran in
      timing_metrics.arrival_time, first_scheduled_time, first_token_time, last_token_time
                                      seconds on the executor's steady clock (C++ steady_clock)
  per iteration (`enable_iter_perf_stats=True` -> LLM.get_stats_async()):
      iter, iterLatencyMS             the iteration's number and duration
      kvCacheStats                    the KV pool's blocks (maxNumBlocks, usedNumBlocks, ...)

The adapter maps the steady clock onto the harness clock with an offset measured at load
(`tensorrt_llm.bindings.steady_clock_now()` read beside `time.perf_counter_ns()`; both are
CLOCK_MONOTONIC on Linux, so the offset is ~0 and is recorded). Which clock each number came
from is recorded in the row (`clock`).
"""

from __future__ import annotations

import json
from typing import Any

from adapters.base import StepTiming

CLOCK_ENGINE = "tensorrt-llm"  # TensorRT-LLM's per-request / per-iteration metrics
CLOCK_ARRIVAL = "arrival"  # the harness clock when a token reached this process


def _seconds(v: Any) -> float | None:
    if v is None:
        return None
    return float(v.total_seconds()) if hasattr(v, "total_seconds") else float(v)


def perf_fields(p: Any) -> dict[str, Any]:
    """A request's RequestPerfMetrics as plain numbers (times: seconds on TensorRT-LLM's steady clock)."""
    out: dict[str, Any] = {}
    for k in ("first_iter", "last_iter", "iter"):
        v = getattr(p, k, None)
        if v is not None:
            out[k] = int(v)
    tm = getattr(p, "timing_metrics", None)
    for k in ("arrival_time", "first_scheduled_time", "first_token_time", "last_token_time"):
        v = _seconds(getattr(tm, k, None))
        if v is not None and v > 0:
            out[k] = v
    km = getattr(p, "kv_cache_metrics", None)
    for k in ("num_total_allocated_blocks", "num_new_allocated_blocks", "num_reused_blocks",
              "num_missed_blocks", "kv_cache_hit_rate"):
        v = getattr(km, k, None)
        if v is not None:
            out[k] = v
    if "first_scheduled_time" in out and "arrival_time" in out:
        out["queue_time_s"] = out["first_scheduled_time"] - out["arrival_time"]
    return out


def admission_problem(first_iters: list[int | None], options_hint: str) -> str | None:
    """A prefill batch must start in ONE engine iteration, else its first tokens mix prefill and
    decode iterations. None when it did (or when TensorRT-LLM did not say: see admission_checked)."""
    known = [i for i in first_iters if i is not None]
    if len(known) < len(first_iters) or len(set(known)) <= 1:
        return None
    return (f"TensorRT-LLM admitted this prefill batch of {len(first_iters)} requests over engine iterations "
            f"{min(known)}..{max(known)} (first_iter per request: {sorted(set(known))}), so its first tokens mix "
            f"prefill and decode iterations and cannot be timed as one prefill. {options_hint}")


def admission_checked(first_iters: list[int | None]) -> bool:
    return bool(first_iters) and all(i is not None for i in first_iters)


def to_harness_ns(seconds: float, offset_ns: int) -> int:
    """A steady-clock time in seconds -> the harness clock (perf_counter_ns)."""
    return int(round(seconds * 1e9)) + int(offset_ns)


def iteration_mapping_holds(first_iter: int | None, seen: list[tuple[int, int | None]]) -> bool:
    """True when each streamed response with n tokens so far reported last_iter = first_iter + n - 1,
    i.e. the request produced one token in every iteration from its first (no pause, no chunking),
    so token k came from iteration first_iter + k. `seen`: (tokens so far, last_iter) per response."""
    if first_iter is None or not seen:
        return False
    return all(last is not None and last == first_iter + n - 1 for n, last in seen)


def decode_steps_from_iterations(latency_ms: dict[int, float], first_iter: int, k0: int, steps: int,
                                 anchor_ns: int, num_tokens: int) -> list[StepTiming] | None:
    """Decode steps from TensorRT-LLM's iteration latencies: token k (0 = the first token) of a batch
    that started in iteration `first_iter` came from iteration first_iter + k; step i (token k0 + i)
    lasts that iteration's iterLatencyMS and starts where the previous step ended, the chain anchored
    at `anchor_ns` (the end of token k0 - 1: the prefill's end for the first decode call). None when
    an iteration's latency is missing."""
    out: list[StepTiming] = []
    t = anchor_ns
    for i in range(steps):
        ms = latency_ms.get(first_iter + k0 + i)
        if ms is None:
            return None
        end = t + int(round(ms * 1e6))
        out.append(StepTiming(t, end, num_tokens))
        t = end
    return out


def steps_from_arrivals(times: list[list[int]], k0: int, steps: int, num_tokens: int) -> list[StepTiming]:
    """Decode steps from token arrivals (the fallback): step i ends when the last sequence's token
    k0 + i arrived and starts where step i - 1 ended. `times[s][k]`: arrival of token k of sequence s."""
    out: list[StepTiming] = []
    prev = max(t[k0 - 1] for t in times)
    for k in range(k0, k0 + steps):
        end = max(t[k] for t in times)
        out.append(StepTiming(prev, end, num_tokens))
        prev = end
    return out


def parse_iteration_stats(snap: Any) -> dict[str, Any] | None:
    """One item of LLM.get_stats_async(): a dict (or its JSON text)."""
    if isinstance(snap, (str, bytes)):
        snap = json.loads(snap)
    return snap if isinstance(snap, dict) else None
