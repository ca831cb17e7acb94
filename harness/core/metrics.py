"""Online (serving) metrics, exactly as docs/metrics.md defines them.

Per request, with t_a its scheduled arrival and t_1 ... t_N the times of its N output tokens:

    TTFT = t_1 - t_a            E2EL = t_N - t_a
    TPOT = (E2EL - TTFT) / (N - 1), only for N > 1 (one value per request)
    ITL  = every gap t_{k+1} - t_k, pooled over all requests (weighted by token)

Throughputs divide by the duration from the first scheduled arrival to the last completion.
Goodput counts the requests that meet every configured SLO; their tokens are the good tokens
(`good_input_tokens`, `good_output_tokens`) a cost per good million tokens counts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from harness.core.stats import summarize


@dataclass
class RequestTrace:
    request_id: str
    arrival_ns: int  # scheduled arrival: the request's clock starts here
    prompt_len: int
    token_times_ns: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # why the request failed (a server's HTTP error, a stream cut short)
    cached_tokens: int | None = None  # prompt tokens the engine reported taking from its prefix cache
    reloaded_tokens: int | None = None  # of those, the ones reloaded from a second KV tier (kv_offload)
    prompt_ids: list[int] | None = None  # the prompt as the engine took it, where it said (TokenEvent.prompt_ids)
    # reasoning (a server's stream; docs/metrics.md, "Reasoning"): when the first answer or tool-call
    # token arrived (None: no answer came, or the engine cannot tell answer from reasoning), whether
    # the stream carried reasoning, the reasoning and answer token counts and where the counts came
    # from ("usage": the server's completion_tokens_details.reasoning_tokens; "tokenizer")
    first_answer_ns: int | None = None
    reasoning: bool = False
    reasoning_tokens: int | None = None
    answer_tokens: int | None = None
    reasoning_source: str | None = None

    @property
    def ttfo_s(self) -> float | None:
        """Time to the first answer token (TTFO); None without an answer."""
        return (self.first_answer_ns - self.arrival_ns) / 1e9 if self.first_answer_ns is not None else None

    @property
    def answer_times_ns(self) -> list[int]:
        """The times of the tokens from the first answer token on."""
        if self.first_answer_ns is None:
            return []
        return [t for t in self.token_times_ns if t >= self.first_answer_ns]

    @property
    def n_out(self) -> int:
        return len(self.token_times_ns)

    @property
    def ttft_s(self) -> float | None:
        return (self.token_times_ns[0] - self.arrival_ns) / 1e9 if self.token_times_ns else None

    @property
    def e2el_s(self) -> float | None:
        return (self.token_times_ns[-1] - self.arrival_ns) / 1e9 if self.token_times_ns else None

    @property
    def tpot_s(self) -> float | None:
        if self.n_out < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.n_out - 1)  # type: ignore[operator]

    @property
    def itls_s(self) -> list[float]:
        t = self.token_times_ns
        return [(b - a) / 1e9 for a, b in zip(t, t[1:])]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2el_s: float | None = None

    def met(self, tr: RequestTrace) -> bool:
        if not tr.token_times_ns:
            return False
        if self.ttft_s is not None and tr.ttft_s > self.ttft_s:  # type: ignore[operator]
            return False
        if self.tpot_s is not None and tr.tpot_s is not None and tr.tpot_s > self.tpot_s:
            return False
        if self.e2el_s is not None and tr.e2el_s > self.e2el_s:  # type: ignore[operator]
            return False
        return True


def good_fields(done: list[RequestTrace], slo: SLO | None = None, passed: set[str] | None = None,
                verdict: str | None = None) -> dict[str, Any]:
    """The good requests among the completed ones `done` and their tokens (what a cost per good
    million tokens counts, harness.core.cost): those that meet every SLO given and, with a
    correctness check (`verdict` names it), whose id is in `passed`."""
    good = [t for t in done if (slo or SLO()).met(t) and (passed is None or t.request_id in passed)]
    out = {"good_requests": len(good), "good_input_tokens": sum(t.prompt_len for t in good),
           "good_output_tokens": sum(t.n_out for t in good)}
    return {**out, "good_verdict": verdict} if verdict else out


def _stat_fields(name: str, samples: list[float], with_samples: bool = True) -> dict[str, Any]:
    s = summarize(samples)
    out: dict[str, Any] = {f"{name}_{k}": v for k, v in s.items() if k != "count"}
    out[f"{name}_count"] = s["count"]
    out[name] = s["p50"]  # the headline value is the median (its interval: harness.core.bootstrap)
    if with_samples:
        out[f"{name}_samples"] = samples
    return out


def serving_metrics(traces: list[RequestTrace], slo: SLO | None = None,
                    expected_out: dict[str, int] | None = None) -> dict[str, Any]:
    """Row fields for one serving point. A request that failed, or got fewer (or more) tokens
    than it asked for, is counted in `failed_requests` with its reason; every metric is computed
    over the completed requests only (`completed` of `num_requests`)."""
    done, reasons = [], Counter()
    for t in traces:
        want = (expected_out or {}).get(t.request_id)
        if t.error:
            reasons[t.error] += 1
        elif not t.token_times_ns:
            reasons["no token"] += 1
        elif want is not None and t.n_out != want:
            reasons[f"{'fewer' if t.n_out < want else 'more'} tokens than asked"] += 1
        else:
            done.append(t)
    first_arrival = min((t.arrival_ns for t in traces), default=0)  # no traces: a point stopped before any
    last_done = max((t.token_times_ns[-1] for t in done), default=first_arrival)
    duration = (last_done - first_arrival) / 1e9
    ttft = [t.ttft_s for t in done]
    e2el = [t.e2el_s for t in done]
    tpot = [t.tpot_s for t in done if t.tpot_s is not None]
    itl = [g for t in done for g in t.itls_s]
    out_tokens = sum(t.n_out for t in done)
    good_row = good_fields(done, slo)  # the good requests' tokens: what a good token costs (harness.core.cost)
    good = good_row["good_requests"]
    row: dict[str, Any] = {
        "num_requests": len(traces), "completed": len(done), "duration_s": duration,
        "failed_requests": sum(reasons.values()), "failed_request_reasons": dict(reasons),
        "total_input_tokens": sum(t.prompt_len for t in done), "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "output_tok_s": out_tokens / duration if duration > 0 else None,
        "goodput_req_s": good / duration if duration > 0 else None,
        "slo_attained_frac": good / len(traces) if traces else None,
        **good_row,
    }
    for name, samples in (("ttft_s", ttft), ("tpot_s", tpot), ("itl_s", itl), ("e2el_s", e2el)):
        row.update(_stat_fields(name, samples))
    row["per_user_tok_s"] = 1 / row["tpot_s"] if row.get("tpot_s") else None
    if any(t.first_answer_ns is not None or t.reasoning for t in traces):
        row.update(reasoning_fields(done))
    return row


def reasoning_fields(done: list[RequestTrace]) -> dict[str, Any]:
    """TTFO, reasoning time and the answer's own TPOT and ITL over the completed requests, and the
    reasoning and answer token counts (docs/metrics.md, "Reasoning"). TTFO is null for a request
    without an answer (never 0); a stream without reasoning has TTFO = TTFT."""
    with_answer = [t for t in done if t.first_answer_ns is not None]
    row: dict[str, Any] = {"requests_with_reasoning": sum(1 for t in done if t.reasoning),
                           "requests_without_answer": len(done) - len(with_answer)}
    row.update(_stat_fields("ttfo_s", [t.ttfo_s for t in with_answer]))
    row.update(_stat_fields("reasoning_time_s", [t.ttfo_s - t.ttft_s for t in with_answer], with_samples=False))
    ans_tpot, ans_itl = [], []
    for t in with_answer:
        a = t.answer_times_ns
        if len(a) > 1:
            ans_tpot.append((a[-1] - a[0]) / 1e9 / (len(a) - 1))
            ans_itl += [(y - x) / 1e9 for x, y in zip(a, a[1:])]
    row.update(_stat_fields("tpot_answer_s", ans_tpot, with_samples=False))
    row.update(_stat_fields("itl_answer_s", ans_itl, with_samples=False))
    counted = [t for t in done if t.reasoning_tokens is not None]
    row["reasoning_tokens"] = sum(t.reasoning_tokens for t in counted) if counted else None  # type: ignore[misc]
    row["answer_tokens"] = sum(t.answer_tokens or 0 for t in counted) if counted else None
    row["reasoning_token_source"] = ", ".join(sorted({t.reasoning_source for t in counted if t.reasoning_source})) or None
    return row
