"""The reference engine against the transformers adapter (the oracle): logits of prefill and of
every decode step within 1e-4 (relative, fp32, tiny preset) in every KV mode, with a cached
prefix, across preemptions and chunked prefills; greedy tokens identical; serve() events."""

from __future__ import annotations

import pytest
import torch

from adapters.base import ModelSpec, Request, now_ns
from adapters.hf import HFEngine
from adapters.reference.engine import ReferenceEngine
from harness.core.kvcalc import bytes_per_token
from harness.core.presets import load_preset

LENGTHS = (5, 17, 33, 40)  # unequal prompt lengths
STEPS = 12
TOL = 1e-4
MAX_LEN = 128


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def make_prompts(lengths, seed=0, vocab=4096):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def spec(tiny_ckpt) -> ModelSpec:
    return ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="float32", max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def hf(spec):
    engine = HFEngine()
    engine.load(spec, {})
    yield engine
    engine.close()


def hf_run(hf, prompts, steps):
    pre = hf.prefill(prompts, return_logits=True)
    dec = hf.decode(steps, return_logits=True)
    hf.release()
    return pre, dec


@pytest.fixture(scope="module")
def oracle(hf):
    return hf_run(hf, make_prompts(LENGTHS), STEPS)


def ref_engine(spec, **options) -> ReferenceEngine:
    engine = ReferenceEngine()
    engine.load(spec, options)
    return engine


def assert_matches(pre, dec, oracle_pre, oracle_dec):
    errors = [rel_err(pre.logits, oracle_pre.logits)]
    errors += [rel_err(a, b) for a, b in zip(dec.logits, oracle_dec.logits)]
    assert len(errors) == len(oracle_dec.logits) + 1
    assert max(errors) < TOL, f"relative logit errors per step: {errors}"
    assert pre.first_tokens == oracle_pre.first_tokens
    assert dec.tokens == oracle_dec.tokens


MODES = {
    "paged": {},
    "paged-block4": {"block_size": 4},
    "contiguous": {"kv_layout": "contiguous"},
    "none": {"kv_cache": "none"},
    "chunked-prefill": {"max_num_batched_tokens": 7, "block_size": 4},
}


@pytest.mark.parametrize("mode", MODES)
def test_logits_match_transformers(spec, oracle, mode):
    engine = ref_engine(spec, **MODES[mode])
    pre = engine.prefill(make_prompts(LENGTHS), return_logits=True)
    dec = engine.decode(STEPS, return_logits=True)
    assert_matches(pre, dec, *oracle)
    engine.close()


def test_logits_match_with_score_slices(spec, oracle, monkeypatch):
    """A tiny score budget: prefill attention in slices of a few query rows, one sequence at a
    time (the path long prompts take)."""
    from adapters.reference import attention
    monkeypatch.setattr(attention, "SCORE_BUDGET", 8 * 4 * 20)
    engine = ref_engine(spec)
    pre = engine.prefill(make_prompts(LENGTHS), return_logits=True)
    dec = engine.decode(STEPS, return_logits=True)
    assert_matches(pre, dec, *oracle)
    engine.close()


def test_pool_garbage_never_leaks(spec, oracle):
    """The pool is allocated uninitialised: fill it with NaN, and nothing of it may reach the
    logits (blocks are zeroed on first use; masked slots must be finite)."""
    for options in ({"block_size": 4}, {"kv_dtype": "int8"}, {"kv_layout": "contiguous"}):
        engine = ref_engine(spec, **options)
        for t in (engine.pool.k, engine.pool.v):
            t.view(torch.uint8).fill_(0xFF)  # NaN in float types, -1 in int8, NaN in fp8
        for t in (engine.pool.k_scale, engine.pool.v_scale):
            if t is not None:
                t.fill_(float("nan"))
        pre = engine.prefill(make_prompts(LENGTHS), return_logits=True)
        dec = engine.decode(STEPS, return_logits=True)
        assert all(torch.isfinite(x).all() for x in [pre.logits] + dec.logits)
        if "kv_dtype" not in options:
            assert_matches(pre, dec, *oracle)
        engine.close()


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_logits_match_across_preemption(spec, oracle, layout):
    """A pool too small for the whole batch: sequences are preempted and recomputed."""
    bpt = bytes_per_token(load_preset("tiny"), "fp32")
    spec = ModelSpec(spec.path, "tiny", "float32", max_model_len=64)  # 40 + 12 tokens at most
    if layout == "paged":  # 24 blocks of 4 tokens: less than the batch needs (~150 tokens)
        options = {"block_size": 4, "kv_cache_bytes": 24 * 4 * bpt}
    else:  # room for two sequences of max_model_len
        options = {"kv_layout": "contiguous", "kv_cache_bytes": 2 * 64 * bpt}
    engine = ref_engine(spec, **options)
    pre = engine.prefill(make_prompts(LENGTHS), return_logits=True)
    dec = engine.decode(STEPS, return_logits=True)
    assert engine.kv_cache_info().preemptions > 0
    assert_matches(pre, dec, *oracle)
    engine.release()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    engine.close()


@pytest.mark.parametrize("block_size", [4, 16])
def test_logits_match_with_cached_prefix(spec, hf, block_size):
    """Prompts that share a prefix with an earlier one: prefill starts after the cached blocks."""
    base = make_prompts([48], seed=1)[0]
    prompts = [base[:40] + [7, 8, 9], base[:33] + [5], base + [11]]
    oracle_pre, oracle_dec = hf_run(hf, prompts, STEPS)
    engine = ref_engine(spec, block_size=block_size)
    engine.prefill([base])
    engine.decode(2)
    engine.release()
    pre = engine.prefill(prompts, return_logits=True)
    dec = engine.decode(STEPS, return_logits=True)
    info = engine.kv_cache_info()
    assert info.prefix_cache_hits >= len(prompts) * (32 // block_size)
    assert_matches(pre, dec, oracle_pre, oracle_dec)
    engine.close()


def test_prefix_cache_off_and_reset(spec):
    base = make_prompts([64], seed=2)[0]
    engine = ref_engine(spec, prefix_caching=False)
    engine.prefill([base]), engine.release()
    engine.prefill([base])
    assert engine.kv_cache_info().prefix_cache_hits is None  # not counted: there is no cache
    engine.close()
    engine = ref_engine(spec)
    engine.prefill([base]), engine.release()
    engine.reset_prefix_cache()
    engine.prefill([base])
    assert engine.kv_cache_info().prefix_cache_hits == 0
    engine.release()
    engine.prefill([base])
    info = engine.kv_cache_info()
    assert info.prefix_cache_hits == 3 and info.prefix_cache_queries == 6  # 63 // 16 blocks, twice
    engine.close()


def test_greedy_tokens_identical_for_64_steps(spec, hf):
    prompts = make_prompts((7, 30), seed=3)
    oracle_pre, oracle_dec = hf.prefill(prompts), hf.decode(64)
    hf.release()
    engine = ref_engine(spec)
    pre, dec = engine.prefill(prompts), engine.decode(64)
    assert pre.first_tokens == oracle_pre.first_tokens
    assert dec.tokens == oracle_dec.tokens
    assert len(dec.steps) == 64 and all(s.num_tokens == 2 for s in dec.steps)
    engine.close()


def test_kv_cache_info_paged_and_contiguous(spec):
    prompts = make_prompts(LENGTHS)
    stored = sum(LENGTHS) + 4 * len(LENGTHS)  # 5 outputs; the newest one is not cached yet
    bpt = bytes_per_token(load_preset("tiny"), "fp32")
    paged = ref_engine(spec, block_size=4)
    paged.prefill(prompts), paged.decode(4)
    info = paged.kv_cache_info()
    assert info.tokens_stored == stored
    assert info.slots_allocated == info.blocks_in_use * 4 == sum(-(-(n + 4) // 4) * 4 for n in LENGTHS)
    assert info.bytes_per_token == bpt and info.bytes_per_block == 4 * bpt
    assert info.pool_bytes == info.num_blocks * info.bytes_per_block
    assert info.blocks_peak >= info.blocks_in_use
    assert info.extra["unused_slots"] == info.slots_allocated - stored
    paged.release()
    assert paged.kv_cache_info().blocks_in_use == 0
    paged.close()
    contiguous = ref_engine(spec, kv_layout="contiguous")
    contiguous.prefill(prompts), contiguous.decode(4)
    info = contiguous.kv_cache_info()
    assert info.block_size is None and info.extra["region_tokens"] == MAX_LEN
    assert info.slots_allocated == len(LENGTHS) * MAX_LEN
    assert info.extra["unused_slots"] == len(LENGTHS) * MAX_LEN - stored
    contiguous.close()
    none = ref_engine(spec, kv_cache="none")
    none.prefill(prompts)
    info = none.kv_cache_info()
    assert info.pool_bytes == 0 and info.tokens_stored == 0
    none.close()


# ---- KV quantisation ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def unquantised(spec):
    engine = ref_engine(spec)
    prompts = make_prompts((20, 48, 64), seed=4)
    pre, dec = engine.prefill(prompts, return_logits=True), engine.decode(64, return_logits=True)
    engine.close()
    return prompts, pre, dec


@pytest.mark.parametrize("kv_dtype,max_err,min_top1", [("int8", 0.03, 0.9), ("fp8", 0.15, 0.7)])
def test_quantised_cache_error_and_agreement(spec, unquantised, kv_dtype, max_err, min_top1, capsys):
    """Over the *same* tokens (the unquantised run's prompt + 64 outputs, fed in chunks of 16 so
    that every chunk after the first reads its context back from the quantised pool): the
    relative error of the final logits, and the teacher-forced top-1 agreement of every output
    position with the unquantised cache (score()). Free-running greedy agreement is printed, not
    asserted: with the presets' sharp attention (checkpoint format 2) one early flip makes the
    rest of a sequence differ, so it measures divergence points more than cache quality."""
    prompts, pre0, dec0 = unquantised
    outputs = [list(t) for t in zip(*([pre0.first_tokens] + dec0.tokens))]
    forced = [p + o[:64] for p, o in zip(prompts, outputs)]
    start = [len(p) + 1 for p in prompts]
    top1 = {}
    for dtype, bound in (("auto", TOL), (kv_dtype, max_err)):
        engine = ref_engine(spec, kv_dtype=dtype, max_num_batched_tokens=16)
        final_err = rel_err(engine.prefill(forced, return_logits=True).logits, dec0.logits[-1])
        top1[dtype] = [ids[0] for s in engine.score(forced, start, 1) for ids in s.top_ids]
        engine.close()
        assert final_err <= bound, (dtype, final_err)
    assert top1["auto"] == [t for o in outputs for t in o[1:64]]  # the unquantised cache reproduces greedy
    agree_tf = sum(a == b for a, b in zip(top1[kv_dtype], top1["auto"])) / len(top1["auto"])
    engine = ref_engine(spec, kv_dtype=kv_dtype)
    pre, dec = engine.prefill(prompts), engine.decode(64)
    agree = [a == b for s, s0 in zip(zip(*([pre.first_tokens] + dec.tokens)), outputs) for a, b in zip(s, s0)]
    with capsys.disabled():
        print(f"\n[kv_dtype={kv_dtype}] final-logit relative error {final_err:.4f}; teacher-forced top-1 "
              f"agreement {agree_tf:.1%}; free-running greedy agreement {sum(agree)}/{len(agree)} tokens "
              f"({sum(agree) / len(agree):.1%})")
    assert engine.kv_cache_info().bytes_per_token == bytes_per_token(load_preset("tiny"), kv_dtype)
    assert agree_tf >= min_top1
    engine.close()


def test_quantised_pool_bytes_match_estimator(spec):
    shape = load_preset("tiny")
    for kv_dtype in ("auto", "int8", "fp8"):
        engine = ref_engine(spec, kv_dtype=kv_dtype, kv_cache_bytes=1 << 20)
        info = engine.kv_cache_info()
        expected = bytes_per_token(shape, "fp32" if kv_dtype == "auto" else kv_dtype)
        assert info.bytes_per_token == expected
        assert info.pool_bytes == info.num_blocks * 16 * expected <= 1 << 20
        assert engine.pool.nbytes == info.pool_bytes
        engine.close()


# ---- serve(): continuous batching --------------------------------------------------------

def test_serve_events_and_arrivals(spec, hf):
    prompts = make_prompts((12, 30, 9, 25), seed=5)
    outs = (6, 3, 8, 1)
    arrivals = (0.0, 0.02, 0.05, 0.08)
    requests = [Request(f"r{i}", p, o, a) for i, (p, o, a) in enumerate(zip(prompts, outs, arrivals))]
    engine = ref_engine(spec, block_size=4)
    start = now_ns()
    events = list(engine.serve(requests, start))
    by_req: dict[str, list] = {}
    for e in events:
        by_req.setdefault(e.request_id, []).append(e)
    for r, p in zip(requests, prompts):
        evs = by_req[r.request_id]
        assert [e.index for e in evs] == list(range(r.max_new_tokens))
        assert [e.finished for e in evs] == [False] * (r.max_new_tokens - 1) + [True]
        assert evs[0].time_ns >= start + r.arrival_s * 1e9  # never before its arrival
        assert all(a.time_ns <= b.time_ns for a, b in zip(evs, evs[1:]))
        oracle_pre, oracle_dec = hf.prefill([p]), hf.decode(r.max_new_tokens - 1)
        hf.release()
        assert [e.token_id for e in evs] == oracle_pre.first_tokens + [row[0] for row in oracle_dec.tokens]
    assert engine.blocks.num_free == engine.blocks.num_blocks  # every block back
    engine.close()


def test_serve_joins_new_requests_while_others_decode(spec):
    """Continuous batching: a request arriving later gets its first token before an earlier,
    long request has finished."""
    prompts = make_prompts((16, 16), seed=6)
    engine = ref_engine(spec)
    list(engine.serve([Request("warm", prompts[0], 2)], now_ns()))
    start = now_ns()
    events = list(engine.serve([Request("long", prompts[0], 100), Request("late", prompts[1], 2, 0.01)], start))
    last_long = max(e.time_ns for e in events if e.request_id == "long")
    first_late = min(e.time_ns for e in events if e.request_id == "late")
    assert first_late < last_long
    assert len(events) == 102
    engine.close()


def test_serve_with_preemption_and_no_cache(spec):
    bpt = bytes_per_token(load_preset("tiny"), "fp32")
    prompts = make_prompts((30, 40, 35), seed=7)
    requests = [Request(f"r{i}", p, 20) for i, p in enumerate(prompts)]
    results = {}
    for name, options in {"paged": {}, "tight": {"block_size": 4, "kv_cache_bytes": 20 * 4 * bpt},
                          "none": {"kv_cache": "none"}}.items():
        engine = ReferenceEngine()
        engine.load(ModelSpec(spec.path, "tiny", "float32", max_model_len=64), options)
        events = list(engine.serve(requests, now_ns()))
        results[name] = sorted((e.request_id, e.index, e.token_id) for e in events)
        if name == "tight":
            assert engine.kv_cache_info().preemptions > 0
        engine.close()
    assert results["paged"] == results["tight"] == results["none"]
    assert len(results["paged"]) == 60
