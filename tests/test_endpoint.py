"""The endpoint engine against the real infer-bench-serve (the reference engine behind HTTP),
launched from the shipped preset: workloads run through it unchanged, its tokens and scores are
the reference engine's own, and options relaunch the server."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from adapters.base import ModelSpec, Request, TokenEvent, now_ns
from adapters.endpoint import check_endpoint, endpoint_engine_class
from adapters.reference.engine import ReferenceEngine
from fake_servers import children, wait_children_gone
from harness.core.paths import REPO_ROOT
from harness.core.presets import load_preset
from workloads.base import Point, RunContext
from workloads.prefix_sharing import PrefixSharing, PrefixSharingConfig
from workloads.serving import Serving, ServingConfig
from workloads.sweep import Sweep, SweepConfig

PRESET = REPO_ROOT / "conf" / "endpoint" / "infer-bench-serve.yaml"
MAX_LEN = 256


def preset_engine(name: str = "ibs", **over):
    raw = {**yaml.safe_load(PRESET.read_text()), **over}
    cfg, problems = check_endpoint(name, raw)
    assert not problems, problems
    return endpoint_engine_class(name, cfg)


def spec(path: Path, run_dir: Path | None = None) -> ModelSpec:
    return ModelSpec(str(path), "tiny", "float32", "cpu", MAX_LEN, run_dir=str(run_dir) if run_dir else None)


@pytest.fixture(scope="module")
def leftovers():
    before = children()
    yield
    assert not wait_children_gone(before), "a server outlived its test module"


@pytest.fixture(scope="module")
def served(tiny_ckpt, tmp_path_factory, leftovers):
    """One launched infer-bench-serve for the module."""
    run_dir = tmp_path_factory.mktemp("run")
    eng = preset_engine()()
    eng.load(spec(tiny_ckpt, run_dir), {})
    yield eng, run_dir
    eng.close()


@pytest.fixture(scope="module")
def inproc(tiny_ckpt):
    eng = ReferenceEngine()
    eng.load(spec(tiny_ckpt), {})
    yield eng
    eng.close()


def ctx_for(ckpt: Path) -> RunContext:
    return RunContext(shape=load_preset("tiny"), dtype="float32", device="cpu", model_path=str(ckpt),
                      max_model_len=MAX_LEN, memory_sample_hz=0)


def greedy(engine, prompts, n):
    pre = engine.prefill(prompts, max_new_tokens=n)
    dec = engine.decode(n - 1)
    engine.release()
    return [[pre.first_tokens[b]] + [s[b] for s in dec.tokens] for b in range(len(prompts))]


def test_greedy_tokens_over_http_are_the_in_process_engines(served, inproc):
    eng, _ = served
    prompts = [[5 + i, 40, 300 + i, 7] * (i + 2) for i in range(3)]
    assert greedy(eng, prompts, 12) == greedy(inproc, prompts, 12)
    events = list(eng.serve([Request(f"r{i}", p, 12, 0.0) for i, p in enumerate(prompts)], now_ns()))
    by_req = {f"r{i}": [e.token_id for e in events if isinstance(e, TokenEvent) and e.request_id == f"r{i}"]
              for i in range(3)}
    assert list(by_req.values()) == greedy(inproc, prompts, 12)


@pytest.mark.alone  # TPOT > 0 needs a client that reads each token as it comes: on a busy machine a
# starved client reads a request's later tokens in one go, all stamped at once (TPOT 0; seen under xdist)
def test_serving_workload_runs_unchanged_and_rows_carry_the_servers_identity(served, tiny_ckpt):
    eng, run_dir = served
    cfg = ServingConfig(request_rates=[20.0], num_requests=6, input_len=24, output_len=8, warmup_requests=1)
    eng.begin_point()
    row = Serving().run_point(eng, Point("serving", {"request_rate": 20.0, "num_requests": 6}), ctx_for(tiny_ckpt),
                              cfg)
    fields = eng.end_point()
    assert row["completed"] == 6 and row["total_output_tokens"] == 48
    assert row["ttft_s"] > 0 and row["tpot_s"] > 0 and row["e2el_s"] >= row["ttft_s"]
    assert fields["transport"] == "http" and fields["server_version"].startswith("infer-bench-serve")
    assert fields["server_model"] == "tiny" and "harness.serve" in fields["launch_command"]
    assert fields["output_tokens_server"] == fields["output_tokens_client"] == 56  # warm-up included
    assert fields["token_count_mismatch"] is False and fields["failed_requests"] == 0
    assert fields["token_count_source"] == "token_ids" and fields["input_tokens_server"] == 7 * 24
    assert fields["auth"] == "none" and fields["tls_verify"] is True
    assert "infer_bench_kv_cache_usage_perc" in fields["server_metrics"]
    log = (run_dir / "logs" / "ibs.log").read_text()
    assert "[server] infer-bench-serve: tiny (reference engine" in log


def test_sweep_workload_runs_unchanged(served, tiny_ckpt):
    eng, _ = served
    cfg = SweepConfig(batch_sizes=[2], prompt_lens=[16], output_len=4, warmup=1, min_repeats=2, min_duration_s=0)
    eng.begin_point()
    row = Sweep().run_point(eng, Point("sweep", {"batch_size": 2, "prompt_len": 16, "output_len": 4}),
                            ctx_for(tiny_ckpt), cfg)
    fields = eng.end_point()
    assert row["repeats"] == 2 and row["decode_steps"] == 6 and row["prefill_latency_s"] > 0
    info = eng.kv_cache_info()  # from the server's /metrics
    assert info.pool_bytes == info.num_blocks * info.bytes_per_block and info.pool_bytes > 0
    assert all(x >= 0 for x in row["decode_step_latency_s_samples"])
    assert fields["failed_requests"] == 0 and fields["requests_sent"] == 6


def test_scores_over_http_are_the_in_process_engines(served, inproc):
    eng, _ = served
    seqs = [[5, 9, 200, 31, 77, 1000, 12], [8, 8, 8, 9]]
    over_http = eng.score(seqs, [1, 2], 3)
    local = inproc.score(seqs, [1, 2], 3)
    for a, b in zip(over_http, local):
        assert a.top_ids == b.top_ids
        assert max(abs(x - y) for x, y in zip(a.target_logprobs, b.target_logprobs)) < 1e-5
        assert all(math.isclose(x, y, abs_tol=1e-5) for xs, ys in zip(a.top_logprobs, b.top_logprobs)
                   for x, y in zip(xs, ys))


@pytest.mark.slow
def test_options_relaunch_the_server_and_prefix_sharing_sees_its_cache(tiny_ckpt, tmp_path, leftovers):
    cls = preset_engine("ibs2")
    wl, cfg = PrefixSharing(), PrefixSharingConfig(prefix_lens=[64], num_requests=[4], suffix_len=8, output_len=4)
    eng = cls()
    rates = {}
    try:
        for caching in (True, False):
            point = Point("prefix_sharing", {"prefix_caching": caching, "prefix_len": 64, "num_requests": 4,
                                             "suffix_len": 8, "output_len": 4})
            options = cls.options_for(wl.engine_overrides(point, cls.capabilities({})))
            assert cls.check_options({**options, "block_size": 32}, spec(tiny_ckpt)) == []
            eng.load(spec(tiny_ckpt, tmp_path), {**options, "block_size": 32})
            eng.reset_prefix_cache()
            eng.begin_point()
            row = wl.run_point(eng, point, ctx_for(tiny_ckpt), cfg)
            fields = eng.end_point()
            assert eng.kv_cache_info().block_size == 32
            assert "engine_options.block_size=32" in fields["launch_command"]
            assert fields["prefix_cache_reset"] == "yes"
            rates[caching] = row["prefix_hit_rate"]
    finally:
        eng.close()
    assert rates[True] > 0.5 and not rates[False]
