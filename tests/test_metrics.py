"""Serving metrics on hand-computed examples, and a fake engine with a known service time.

`FakeFIFOEngine` is a test double of our own (not an inference engine): it serves one request
at a time and stamps tokens on a virtual clock, so every metric has an exact expected value.
"""

from __future__ import annotations

import pytest

from adapters.base import Request, TokenEvent
from harness.core.metrics import SLO, RequestTrace, serving_metrics
from workloads.base import collect

MS = 1_000_000  # ns


def trace(arrival_ms: float, token_ms: list[float], rid: str = "r", prompt_len: int = 10) -> RequestTrace:
    return RequestTrace(rid, int(arrival_ms * MS), prompt_len, [int(t * MS) for t in token_ms])


def test_single_request_by_hand():
    t = trace(100, [150, 170, 200, 210])
    assert t.ttft_s == pytest.approx(0.050)
    assert t.e2el_s == pytest.approx(0.110)
    assert t.tpot_s == pytest.approx((0.110 - 0.050) / 3)
    assert t.itls_s == pytest.approx([0.020, 0.030, 0.010])


def test_tpot_undefined_for_one_token():
    t = trace(0, [40])
    assert t.tpot_s is None and t.itls_s == [] and t.ttft_s == t.e2el_s == pytest.approx(0.04)
    row = serving_metrics([t, trace(0, [10, 30], rid="b")])
    assert row["tpot_s_count"] == 1 and row["tpot_s"] == pytest.approx(0.020)


def test_itl_pooled_by_token_tpot_by_request():
    a = trace(0, [10, 20, 30, 40, 50])  # 4 gaps of 10 ms
    b = trace(0, [10, 110])  # 1 gap of 100 ms
    row = serving_metrics([a, b])
    assert row["itl_s_count"] == 5  # every gap counts once
    assert row["itl_s_mean"] == pytest.approx((4 * 0.010 + 0.100) / 5)
    assert row["tpot_s_mean"] == pytest.approx((0.010 + 0.100) / 2)  # one value per request
    assert row["itl_s"] == pytest.approx(0.010)  # median of pooled gaps


def test_throughput_and_goodput_with_several_slos():
    reqs = [trace(0, [100, 200], "a"), trace(100, [150, 400], "b"), trace(200, [600, 650], "c")]
    # duration: first arrival 0 -> last completion 650 ms
    slo = SLO(ttft_s=0.2, tpot_s=0.2, e2el_s=None)
    row = serving_metrics(reqs, slo)
    assert row["duration_s"] == pytest.approx(0.650)
    assert row["request_throughput"] == pytest.approx(3 / 0.650)
    assert row["output_tok_s"] == pytest.approx(6 / 0.650)
    # a: ttft .1 tpot .1 ok; b: ttft .05 tpot .25 fails tpot; c: ttft .4 fails ttft
    assert row["goodput_req_s"] == pytest.approx(1 / 0.650)
    assert serving_metrics(reqs, SLO(e2el_s=0.3))["goodput_req_s"] == pytest.approx(2 / 0.650)
    assert serving_metrics(reqs)["goodput_req_s"] == row["request_throughput"]


def test_percentiles_linear():
    reqs = [trace(0, [t]) for t in (10, 20, 30, 40)]
    row = serving_metrics(reqs)
    assert row["ttft_s_p90"] == pytest.approx(0.037)  # rank 2.7 between 30 and 40 ms
    assert row["ttft_s_p50"] == pytest.approx(0.025)


class FakeFIFOEngine:
    """Test double: one request at a time, `prefill_ns` for the first token and `step_ns` for
    each next one, on a virtual clock that starts at the request's arrival or when the
    previous request finishes, whichever is later."""

    def __init__(self, prefill_ns: int, step_ns: int):
        self.prefill_ns, self.step_ns = prefill_ns, step_ns

    def serve(self, requests, start_ns):
        free_at = start_ns
        for r in sorted(requests, key=lambda r: r.arrival_s):
            t = max(free_at, start_ns + round(r.arrival_s * 1e9)) + self.prefill_ns
            for i in range(r.max_new_tokens):
                if i:
                    t += self.step_ns
                yield TokenEvent(r.request_id, i, 7, t, finished=i == r.max_new_tokens - 1)
            free_at = t


def test_fake_engine_queueing_counts_from_scheduled_arrival():
    eng = FakeFIFOEngine(prefill_ns=50 * MS, step_ns=10 * MS)
    # three requests arriving every 20 ms, each 4 tokens: service 50 + 3*10 = 80 ms > gap -> a queue
    reqs = [Request(f"r{i}", [5] * 8, 4, 0.020 * i) for i in range(3)]
    traces = collect(reqs, 0, eng.serve(reqs, 0))
    # r0: starts 0, tokens 50,60,70,80; r1 arrives 20 waits until 80: 130..160; r2 arrives 40: 210..240
    assert [t.ttft_s for t in traces] == pytest.approx([0.050, 0.110, 0.170])
    assert [t.e2el_s for t in traces] == pytest.approx([0.080, 0.140, 0.200])
    assert [t.tpot_s for t in traces] == pytest.approx([0.010] * 3)
    row = serving_metrics(traces)
    assert row["itl_s_count"] == 9 and row["itl_s"] == pytest.approx(0.010)
    assert row["duration_s"] == pytest.approx(0.240)
    assert row["ttft_s_mean"] == pytest.approx(0.110)
    # TTFT grows with the queue: each later request waited longer
    assert traces[0].ttft_s < traces[1].ttft_s < traces[2].ttft_s


def test_collect_rejects_out_of_order_tokens():
    reqs = [Request("a", [1], 2)]
    with pytest.raises(RuntimeError):
        collect(reqs, 0, [TokenEvent("a", 1, 5, 10)])


def test_failed_requests_are_counted_and_metrics_use_the_completed_ones():
    from adapters.base import RequestFailed, TokenEvent
    from adapters.base import Request as Req
    reqs = [Req("a", [1, 2], 3, 0.0), Req("b", [1, 2], 3, 0.0), Req("c", [1, 2], 3, 0.0), Req("d", [1], 3, 0.0)]
    events = [TokenEvent("a", i, 7, 1_000_000_000 * (i + 1)) for i in range(3)]
    events += [TokenEvent("b", 0, 7, 500_000_000), RequestFailed("b", "HTTP 500 Internal Server Error", 600_000_000)]
    events += [TokenEvent("c", 0, 7, 2_000_000_000)]  # the stream stopped after one token
    events += [RequestFailed("d", "HTTP 500 Internal Server Error", 100)]
    traces = collect(reqs, 0, events)
    row = serving_metrics(traces, None, {r.request_id: r.max_new_tokens for r in reqs})
    assert row["num_requests"] == 4 and row["completed"] == 1 and row["failed_requests"] == 3
    assert row["failed_request_reasons"] == {"HTTP 500 Internal Server Error": 2, "fewer tokens than asked": 1}
    # every metric from request a alone: TTFT 1 s, E2EL 3 s, TPOT 1 s, throughput 3 tokens in 3 s
    assert row["ttft_s"] == 1.0 and row["e2el_s"] == 3.0 and row["tpot_s"] == 1.0
    assert row["output_tok_s"] == 1.0 and row["per_user_tok_s"] == 1.0
