"""The load generator against a server whose timing is known exactly (tests/fake_timed_server.py,
a protocol fake in its own process): TTFT, ITL and E2EL as the harness measures them, against the
truth the server was told to produce. Timing claims (the ceiling) live in
scripts/loadgen_ceiling.py; these tests check correctness with margins wide enough for a busy
2-core machine."""

from __future__ import annotations

import pytest

from adapters.base import ModelSpec, Request, now_ns
from adapters.endpoint import check_endpoint, endpoint_engine_class
from fake_timed_server import running
from harness.core.metrics import serving_metrics
from workloads.base import collect

SPEC = ModelSpec(path="/nonexistent", name="fake", dtype="float32", device="cpu", max_model_len=4096)


def engine_at(url: str):
    cfg, problems = check_endpoint("timed", {"kind": "vllm", "url": url, "request_timeout_s": 30})
    assert not problems, problems
    eng = endpoint_engine_class("timed", cfg)()
    eng.load(SPEC, {})
    return eng


@pytest.fixture(scope="module")
def timed_20ms():
    """Truth: first token 50 ms after the request reaches the server, then one token every 20 ms."""
    with running(gap_ms=20, first_ms=50) as url:
        eng = engine_at(url)
        yield eng
        eng.close()


def test_serve_measures_ttft_itl_e2el_as_the_server_paced_them(timed_20ms):
    reqs = [Request(f"r{i}", [5] * 16, 20, arrival_s=0.05 * i) for i in range(4)]
    start = now_ns() + 5_000_000
    row = serving_metrics(collect(reqs, start, timed_20ms.serve(reqs, start)), None, {r.request_id: 20 for r in reqs})
    assert row["completed"] == 4
    # the server cannot answer sooner than it was told to; the client may add a little
    assert 0.050 <= row["ttft_s"] < 0.050 + 0.015, row["ttft_s"]
    assert abs(row["itl_s"] - 0.020) < 0.002, row["itl_s"]
    assert 0.050 + 19 * 0.020 <= row["e2el_s"] < 0.050 + 19 * 0.020 + 0.025, row["e2el_s"]
    assert abs(row["tpot_s"] - 0.020) < 0.002


def test_tokens_of_one_chunk_share_its_time_and_chunks_keep_the_gap():
    with running(gap_ms=10, first_ms=20, tokens_per_chunk=4) as url:
        eng = engine_at(url)
        try:
            eng.begin_point()
            reqs = [Request("r0", [5] * 8, 16)]
            start = now_ns()
            traces = collect(reqs, start, eng.serve(reqs, start))
            fields = eng.end_point()
        finally:
            eng.close()
    itls = traces[0].itls_s
    assert len(itls) == 15
    # within a chunk: 0 s apart; between chunks: the server's 10 ms
    assert [i for i, g in enumerate(itls) if g > 0.005] == [3, 7, 11]
    assert fields["tokens_per_chunk_max"] == 4 and fields["stream_chunks"] == 4
    assert abs(fields["itl_chunk_s"] - 0.010) < 0.002
