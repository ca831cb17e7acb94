"""Reasoning over the streaming client (adapters/endpoint/stream.py, harness/core/metrics.py
reasoning_fields): TTFO, reasoning time and the reasoning and answer counts, against the
known-timing protocol fake (tests/fake_timed_server.py), whose chat streams carry scripted
reasoning and answer chunks at known times and whose /stats says when it wrote each chunk."""

from __future__ import annotations

import json
import urllib.request

import pytest

from adapters.base import ModelSpec, Request
from adapters.endpoint import check_endpoint, endpoint_engine_class
from fake_timed_server import running
from harness.checkpoint import SHIPPED_DIR
from harness.core.metrics import serving_metrics

TRAINED = SHIPPED_DIR / "tiny-trained"  # its tokenizer: chat prompts and the tokenizer's counts
SPEC = ModelSpec(path=str(TRAINED), name="tiny-trained", dtype="float32", device="cpu", max_model_len=4096)
GAP_MS, FIRST_MS, N = 20, 30, 12


def run(url: str, n_requests: int = 3) -> tuple[list, dict, dict]:
    """Requests one at a time (closed loop, concurrency 1) over api=chat: (traces, the row's fields,
    the server's /stats: when it wrote each chunk)."""
    cfg, problems = check_endpoint("timed", {"kind": "vllm", "url": url, "api": "chat", "chat_separator": " ",
                                             "request_timeout_s": 30})
    assert not problems, problems
    eng = endpoint_engine_class("timed", cfg)()
    eng.load(SPEC, {})
    try:
        urllib.request.urlopen(url.removesuffix("/v1") + "/stats").read()  # start the server's record afresh
        reqs = [Request(f"r{i}", [5, 6, 7], N) for i in range(n_requests)]
        out = eng.serve_load(reqs, closed=True, concurrency=1)
        stats = json.loads(urllib.request.urlopen(url.removesuffix("/v1") + "/stats").read())
    finally:
        eng.close()
    return out["traces"], serving_metrics(out["traces"]), stats


@pytest.mark.parametrize("reasoning", [4, 0])
def test_ttfo_is_the_first_answer_chunk_and_the_counts_are_the_servers(reasoning):
    """R reasoning tokens (one a chunk) then N - R answer tokens: TTFO is when the server wrote the
    first answer chunk, to 5 ms; the counts are exact (usage). Without reasoning TTFO = TTFT."""
    with running(gap_ms=GAP_MS, first_ms=FIRST_MS, reasoning_tokens=reasoning) as url:
        traces, row, stats = run(url)
    writes = stats["writes_ns"]
    assert len(writes) == 3 * N  # one token a chunk, requests one after another
    for i, tr in enumerate(traces):
        assert tr.error is None and tr.n_out == N
        first_answer_write = writes[i * N + reasoning]
        assert abs(tr.first_answer_ns - first_answer_write) < 5_000_000, (tr.first_answer_ns - first_answer_write) / 1e6
        if reasoning:
            assert tr.reasoning and tr.reasoning_source == "usage"
            assert (tr.reasoning_tokens, tr.answer_tokens) == (reasoning, N - reasoning)
            assert tr.ttfo_s - tr.ttft_s == pytest.approx(reasoning * GAP_MS / 1000, abs=0.005)
        else:
            assert not tr.reasoning and tr.reasoning_tokens is None
            assert tr.first_answer_ns == tr.token_times_ns[0]  # TTFO = TTFT
    assert row["requests_without_answer"] == 0
    assert row["ttfo_s"] == pytest.approx(row["ttft_s"] + reasoning * GAP_MS / 1000, abs=0.005)
    assert row["tpot_answer_s"] == pytest.approx(GAP_MS / 1000, abs=0.003)  # answer tokens only
    if reasoning:
        assert (row["reasoning_tokens"], row["answer_tokens"]) == (3 * reasoning, 3 * (N - reasoning))
        assert row["reasoning_token_source"] == "usage"


def test_a_reasoning_only_stream_has_no_ttfo_and_counts_by_the_tokenizer_without_usage():
    """Every token is reasoning and the usage says nothing of it: TTFO is null (not 0), the request
    still completes, and the reasoning count is the tokenizer's count of the reasoning text."""
    from transformers import AutoTokenizer
    with running(gap_ms=5, first_ms=5, reasoning_tokens=N, reasoning_field="reasoning_content",
                 reasoning_usage=False) as url:
        traces, row, _ = run(url, n_requests=2)
    text = "".join(f" r{1000 + k}" for k in range(N))
    want = len(AutoTokenizer.from_pretrained(TRAINED)(text, add_special_tokens=False)["input_ids"])
    for tr in traces:
        assert tr.error is None and tr.n_out == N and tr.reasoning
        assert tr.first_answer_ns is None and tr.ttfo_s is None
        assert (tr.reasoning_tokens, tr.reasoning_source) == (want, "tokenizer")
    assert row["completed"] == 2 and row["requests_without_answer"] == 2
    assert row["ttfo_s"] is None and row["ttfo_s_count"] == 0
