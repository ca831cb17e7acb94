"""The reference engine's speculative decoding (adapters/reference/speculative.py): n-gram prompt
lookup and a draft model, verified greedily in one target pass over the paged cache.

The target is the shipped trained preset (harness/shipped/tiny-trained) on its held-out code,
so that drafts are accepted often and rejected often. Drafts: tiny-trained itself (everything
accepted) and `half_draft`, tiny-trained cut to its first 2 of 4 layers (a smaller model with the
same tokenizer that agrees with the target only part of the time).

- lossless: the output tokens equal the engine's own without speculation, token for token, for
  ngram and draft, k = 1, 2, 4, batch 1 and 3, in the step API and in serve() (staggered
  arrivals, unequal lengths), fp32, on both kernel sets; every family on n-gram; in bf16 equal
  up to a near tie (the verify pass rounds differently from one-token decode steps);
- the counters agree with the tokens emitted;
- an injected verifier bug changes output tokens, and measured as workload=speculative measures it
  (serve(), finalize_row) makes the row `failed` naming the request and position; rejected slots are given back (blocks in use
  equal those without speculation), nothing leaks after release(), and the prefix cache never
  serves a rejected token's K/V;
- bad options: one problem each, naming the field and the fix.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from adapters.base import ModelSpec, Request, now_ns
from adapters.reference import speculative
from adapters.reference.block_manager import BlockManager
from adapters.reference.engine import ReferenceEngine
from adapters.reference.speculative import NgramIndex
from harness.cli import check_jobs

REPO = Path(__file__).resolve().parent.parent
TRAINED = REPO / "harness" / "shipped" / "tiny-trained"
MAX_LEN = 512
STEPS = 32  # decode steps after the first token
LENGTHS = (200, 160, 240)  # held-out windows where lookups find matches, some accepted, some not


def heldout_prompts(lengths, seed=0):
    """Windows of the trained preset's held-out code (text it never saw in training)."""
    ids = np.load(TRAINED / "heldout.npy")
    rng = random.Random(seed)
    return [ids[(s := rng.randrange(0, len(ids) - n)):s + n].tolist() for n in lengths]


def spec_of(dtype="float32", batch=4) -> ModelSpec:
    return ModelSpec(path=str(TRAINED), name="tiny-trained", dtype=dtype, max_model_len=MAX_LEN,
                     max_batch_size=batch)


@pytest.fixture(scope="module")
def half_draft(tmp_path_factory) -> Path:
    """tiny-trained's first 2 layers (of 4), its embeddings, norm and output matrix: a smaller
    draft with the target's tokenizer."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("half-draft")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TRAINED / f, out / f)
    cfg = json.loads((TRAINED / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (out / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(TRAINED / "model.safetensors"))
    keep = {k: v for k, v in weights.items() if not any(f"layers.{i}." in k for i in (2, 3))}
    save_file(keep, str(out / "model.safetensors"))
    return out


def run_batch(options, prompts, steps=STEPS, dtype="float32", stats=False):
    """(each sequence's output tokens, the DecodeResult, the engine's blocks in use after decode,
    spec_decode_stats) from prefill() + decode(steps); the engine is closed."""
    engine = ReferenceEngine()
    engine.load(spec_of(dtype, len(prompts)), options)
    try:
        pre = engine.prefill(prompts)
        dec = engine.decode(steps)
        outs = [[f] + [dec.tokens[i][b] for i in range(steps)] for b, f in enumerate(pre.first_tokens)]
        used = engine.blocks.num_used
        counters = engine.spec_decode_stats()
        engine.release()
        assert engine.blocks.num_used == 0  # no leak after release()
        draft = engine.core.speculator.proposer if engine.core.speculator else None
        if isinstance(draft, speculative.DraftModelProposer):
            assert draft.blocks.num_used == 0  # the draft's pool too
        return outs, dec, used, counters
    finally:
        engine.close()


_baselines: dict = {}


def baseline(prompts, steps=STEPS, dtype="float32", **options):
    key = (json.dumps(prompts), steps, dtype, json.dumps(options, sort_keys=True))
    if key not in _baselines:
        _baselines[key] = run_batch(options, prompts, steps, dtype)
    return _baselines[key]


def spec_options(method, k, draft=None, **more):
    opts = {"speculative_method": method, "num_speculative_tokens": k, **more}
    if method == "draft":
        opts["draft_model"] = str(draft)
    return opts


# ---- lossless -------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_lossless_step_api(method, k, batch, half_draft):
    prompts = heldout_prompts(LENGTHS[:batch])
    want, *_ = baseline(prompts)
    got, dec, _, stats = run_batch(spec_options(method, k, half_draft), prompts)
    assert got == want
    assert stats.drafts > 0 and stats.accepted_tokens > 0  # it did speculate, and accepted some
    assert stats.accepted_tokens < stats.draft_tokens  # and rejected some: the rejection path ran
    assert len(dec.steps) < STEPS  # fewer target passes than tokens


def test_lossless_serve_continuous_batching(half_draft):
    """serve(): staggered arrivals, unequal prompts and output lengths, sequences accepting
    different numbers of tokens in one step; tokens per request equal those without speculation."""
    prompts = heldout_prompts([120, 64, 200, 33, 150], seed=7)
    new = [30, 9, 41, 1, 25]
    requests = [Request(f"r{i}", p, n, arrival_s=0.01 * i) for i, (p, n) in enumerate(zip(prompts, new))]

    def serve(options):
        engine = ReferenceEngine()
        engine.load(spec_of(batch=1), options)
        events = list(engine.serve(requests, now_ns()))
        assert engine.blocks.num_used == 0
        stats = engine.spec_decode_stats()
        engine.close()
        return events, stats

    plain, _ = serve({})
    for options in (spec_options("ngram", 4), spec_options("draft", 3, half_draft)):
        events, stats = serve(options)
        by_req = {r.request_id: [e for e in events if e.request_id == r.request_id] for r in requests}
        for r, n in zip(requests, new):
            got = by_req[r.request_id]
            assert [e.index for e in got] == list(range(n))  # never more than max_new_tokens
            assert [e.token_id for e in got] == [e.token_id for e in plain if e.request_id == r.request_id]
            assert [e.finished for e in got] == [False] * (n - 1) + [True]
            assert got[0].cached_tokens is not None and all(e.cached_tokens is None for e in got[1:])
        times = [e.time_ns for e in events]
        assert len(set(times)) < len(times)  # some steps gave several tokens, stamped alike
        assert times == sorted(times)
        assert stats.drafts > 0 and 0 < stats.accepted_tokens < stats.draft_tokens


@pytest.fixture(scope="module")
def scorer():
    """Teacher-forced float32 log-probabilities of the target (score()): how close a call was."""
    engine = ReferenceEngine()
    engine.load(spec_of(), {})
    yield engine
    engine.close()


def diverges_only_at_a_near_tie(scorer, prompts, want, got, tol=0.1) -> bool:
    """In bfloat16 the verify pass computes k + 1 positions in one chunk, the plain decode one at a
    time: other kernels and shapes, other rounding. Outputs may then part where the target's two
    best tokens are nearly tied. True when `got` equals `want` up to such a point (the float32
    log-probabilities of the two tokens there within `tol` nats), or throughout."""
    for p, w, g in zip(prompts, want, got):
        j = next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), None)
        if j is None:
            continue
        a, b = scorer.score([p + w[:j + 1], p + g[:j + 1]], [len(p) + j] * 2, top_k=1)
        if abs(a.target_logprobs[0] - b.target_logprobs[0]) > tol:
            return False
    return True


@pytest.mark.parametrize("dtype,kernels", [("float32", "plain"), ("bfloat16", "auto"), ("bfloat16", "plain")])
def test_other_dtypes_and_kernels(dtype, kernels, half_draft, scorer):
    """fp32 on the plain kernels: token for token. bf16: equal, or apart only from a near tie on."""
    prompts = heldout_prompts(LENGTHS[:2])
    want, *_ = baseline(prompts, dtype=dtype, kernels=kernels)
    for method in ("ngram", "draft"):
        got, _, _, stats = run_batch(spec_options(method, 3, half_draft, kernels=kernels), prompts, dtype=dtype)
        if dtype == "float32":
            assert got == want, method
        else:
            assert diverges_only_at_a_near_tie(scorer, prompts, want, got), method
        assert stats.accepted_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"kv_layout": "contiguous"}, {"kv_dtype": "int8"}, {"block_size": 4},
                                     {"max_num_batched_tokens": 40}])
def test_lossless_other_layouts(options, half_draft):
    """A contiguous region, an int8 cache, blocks smaller than k + 1 (a verify chunk spans blocks),
    and a budget that trims the drafts and chunks the prefills."""
    prompts = heldout_prompts([150, 97, 60], seed=5)
    want, *_ = baseline(prompts, **options)
    for method in ("ngram", "draft"):
        got, _, _, _ = run_batch(spec_options(method, 4, half_draft, **options), prompts)
        assert got == want, method


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tiny-gemma3", "tiny-deepseek-v3", "tiny-gpt-oss", "tiny-qwen3-moe"])
def test_lossless_families_ngram(family, family_ckpts):
    """Sliding windows (their blocks given back as the window moves, and now after rejections
    too), latent attention, attention sinks, experts: n-gram speculation on random weights, with
    repetitive prompts so that lookups find something."""
    g = torch.Generator().manual_seed(0)
    prompts = []
    for n in (30, 57):
        motif = torch.randint(4, 200, (7,), generator=g).tolist()
        prompts.append((motif * 10)[:n])
    spec = ModelSpec(path=str(family_ckpts[family]), name=family, dtype="float32", max_model_len=256, max_batch_size=2)

    def run(options):
        engine = ReferenceEngine()
        engine.load(spec, options)
        pre = engine.prefill(prompts)
        dec = engine.decode(40)
        used, stats = engine.blocks.num_used, engine.spec_decode_stats()
        engine.release()
        assert engine.blocks.num_used == 0
        engine.close()
        return [[f] + [dec.tokens[i][b] for i in range(40)] for b, f in enumerate(pre.first_tokens)], used, stats

    want, used, _ = run({"block_size": 4})  # blocks smaller than a verify chunk
    got, used_spec, stats = run({"block_size": 4, **spec_options("ngram", 3)})
    assert got == want
    assert used_spec == used
    assert stats.drafts > 0


# ---- the counters -----------------------------------------------------------------------------------

@pytest.mark.parametrize("method,k", [("ngram", 4), ("draft", 3)])
def test_counters_agree_with_the_tokens_emitted(method, k, half_draft):
    prompts = heldout_prompts([150, 97, 211], seed=11)
    _, dec, _, s = run_batch(spec_options(method, k, half_draft), prompts)
    pairs = sum(1 for step in dec.emitted for e in step if e > 0)  # (step, sequence) that got tokens
    # each verified draft gives accepted + 1 tokens; a sequence that did not speculate gets 1
    assert sum(map(sum, dec.emitted)) == len(prompts) * STEPS == s.accepted_tokens + pairs
    assert [t.num_tokens for t in dec.steps] == [sum(step) for step in dec.emitted]
    assert s.drafts <= pairs and s.draft_tokens <= k * s.drafts
    assert len(s.accepted_per_pos) == k and sum(s.accepted_per_pos) == s.accepted_tokens
    assert all(a >= b for a, b in zip(s.accepted_per_pos, s.accepted_per_pos[1:]))  # position i needs i - 1
    assert s.accepted_per_pos[0] <= s.drafts and s.accepted_tokens <= s.draft_tokens
    assert max(max(step) for step in dec.emitted) <= k + 1
    assert s.draft_time_s > 0 and s.verify_time_s > 0


def test_draft_equal_to_target_accepts_everything():
    prompts = heldout_prompts([150, 97], seed=2)
    want, *_ = baseline(prompts)
    got, dec, _, s = run_batch(spec_options("draft", 4, TRAINED), prompts)
    assert got == want
    assert s.drafts > 0 and s.accepted_tokens == s.draft_tokens  # 100 %
    # every step of a sequence that still needed k + 1 tokens emitted k + 1
    assert dec.emitted[0] == [5, 5]


def test_ngram_lookup_against_brute_force():
    """NgramIndex (incremental, one dict probe per size) against the definition: the longest
    suffix n-gram (min..max) that occurred earlier; its earliest occurrence; the up to k tokens
    after it."""
    def brute(tokens, n_min, n_max, k):
        for n in range(n_max, n_min - 1, -1):
            if n >= len(tokens):
                continue
            suffix = tokens[-n:]
            for i in range(len(tokens) - n):  # occurrences that end before the suffix does
                if tokens[i:i + n] == suffix:
                    return tokens[i + n:i + n + k]
        return []

    rng = random.Random(0)
    for trial in range(200):
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        index = NgramIndex(n_min, n_max)
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 6))]
        for _ in range(30):  # grow the sequence as decoding does: 1 .. 4 tokens at a time
            k = rng.randint(1, 5)
            assert index.propose(tokens, k) == brute(tokens, n_min, n_max, k), (tokens, n_min, n_max, k)
            tokens += [rng.randrange(4) for _ in range(rng.randint(1, 4))]


# ---- bugs that must show --------------------------------------------------------------------------

def test_injected_verifier_bug_changes_the_output(monkeypatch):
    """A verifier that accepts one draft token the target did not pick: the output is no longer
    the target's (what the harness's lossless check compares)."""
    prompts = heldout_prompts([150, 97, 211], seed=4)
    want, *_ = baseline(prompts)
    good = speculative.accept_length

    def accept_one_more(draft, greedy):
        return min(good(draft, greedy) + 1, len(draft))
    monkeypatch.setattr(speculative, "accept_length", accept_one_more)
    got, *_ = run_batch(spec_options("ngram", 4), prompts)
    assert got != want


@pytest.mark.parametrize("bug", [False, True])
def test_injected_verifier_bug_fails_the_workloads_lossless_check(bug, monkeypatch):
    """The same injected bug (a draft token the target did not pick, accepted) in the real engine,
    measured as workload=speculative measures it - serve() in a closed loop, the row completed
    against the run without speculation (finalize_row) -: the row is `failed`, naming the request,
    the first differing position and both tokens; without the bug the same points pass."""
    from harness.core.presets import load_preset
    from workloads.base import Point, RunContext
    from workloads.speculative import Speculative, SpeculativeConfig

    cfg = SpeculativeConfig(methods=["ngram"], num_speculative_tokens=[4], batch_sizes=[2], contents=["code"],
                            prompt_len=96, output_len=24, min_requests=4, rounds=1)
    ctx = RunContext(shape=load_preset("tiny-trained"), dtype="float32", device="cpu", model_path=str(TRAINED),
                     max_model_len=wl_len(cfg), memory_sample_hz=0)
    wl = Speculative()
    rows = []
    for point in wl.plan(cfg):
        if bug and point.params["method"] != "none":
            good = speculative.accept_length
            monkeypatch.setattr(speculative, "accept_length", lambda d, g: min(good(d, g) + 1, len(d)))
        engine = ReferenceEngine()
        engine.load(ModelSpec(path=str(TRAINED), name="tiny-trained", dtype="float32", max_model_len=ctx.max_model_len,
                              max_batch_size=2), wl.engine_overrides(point, engine.capabilities()))
        try:
            fields = wl.run_point(engine, point, ctx, cfg)
        finally:
            engine.close()
        rows.append({"engine": "reference", "workload": "speculative", "status": "ok", "error": None,
                     "point": point.params, "point_key": Point("speculative", point.params).key, **fields})
        wl.finalize_row(rows[-1], rows[:-1])
    base, row = rows
    assert base["lossless"] == "baseline" and row["spec_drafts"] > 0 and row["spec_accepted_tokens"] > 0
    if not bug:
        assert row["status"] == "ok" and row["lossless"] == "pass", row.get("lossless_detail")
        assert row["lossless_requests"] == 4 and row["lossless_tokens"] == 4 * 24
        return
    assert row["status"] == "failed" and row["lossless"] == "fail"
    m = row["lossless_mismatch"]
    exp, got = base["request_output_ids"][m["request"]], row["request_output_ids"][m["request"]]
    assert exp[:m["position"]] == got[:m["position"]] and (m["expected"], m["got"]) == (exp[m["position"]],
                                                                                      got[m["position"]])
    assert m["expected"] != m["got"]
    assert row["error"].startswith("lossless check failed") and f"request {m['request']}" in row["error"]
    assert f"token {m['position']}" in row["error"]


def wl_len(cfg) -> int:
    from workloads.speculative import Speculative
    return Speculative().max_model_len(cfg)


def test_rejected_slots_are_given_back(half_draft):
    """Many rejections (the half draft at k = 4, blocks of 4 slots). After every step each
    sequence holds the blocks of its computed tokens and no more, as without speculation: the
    target's and the draft's slots of rejected tokens (and of room not drafted into) went back.
    At the end of decode() the blocks in use equal those of a run without speculation; none
    after release()."""
    prompts = heldout_prompts(LENGTHS, seed=9)
    engine = ReferenceEngine()
    engine.load(spec_of(batch=1), spec_options("draft", 4, half_draft, block_size=4))
    core = engine.core
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", p, 100))
    for _ in range(16):
        core.step()
        for seq in core.scheduler.running:
            assert len(seq.block_table) == -(-seq.num_computed // 4)
            assert len(seq.spec.block_table) == -(-seq.spec.num_computed // 4)  # the draft's
        assert engine.blocks.num_used == sum(len(s.block_table) for s in core.scheduler.running)
    s = engine.spec_decode_stats()
    assert s.draft_tokens - s.accepted_tokens > 16  # many rejected tokens
    engine.release()
    assert engine.blocks.num_used == 0 and core.speculator.proposer.blocks.num_used == 0
    engine.close()

    _, _, used_plain, _ = baseline(prompts, block_size=4)
    _, _, used, _ = run_batch(spec_options("draft", 4, half_draft, block_size=4), prompts)
    assert used == used_plain


def test_the_prefix_cache_never_serves_rejected_kv(half_draft):
    """After speculating with rejections (block size 4: rejected tokens land in blocks that fill
    later), a prompt that is a finished sequence hits the prefix cache on its blocks, and its
    next tokens are those of an engine without a prefix cache."""
    prompts = heldout_prompts([150, 97], seed=6)
    engine = ReferenceEngine()
    engine.load(spec_of(), spec_options("draft", 4, half_draft, block_size=4))
    pre = engine.prefill(prompts)
    dec = engine.decode(40)
    full = [p + [f] + [dec.tokens[i][b] for i in range(40)] for b, (p, f) in enumerate(zip(prompts, pre.first_tokens))]
    s = engine.spec_decode_stats()
    assert s.draft_tokens > s.accepted_tokens
    engine.release()
    hits = engine.kv_cache_info().prefix_cache_hits
    pre2 = engine.prefill(full)
    dec2 = engine.decode(8)
    assert engine.kv_cache_info().prefix_cache_hits - hits >= sum(len(f) // 4 - 1 for f in full)
    got = [[f] + [dec2.tokens[i][b] for i in range(8)] for b, f in enumerate(pre2.first_tokens)]
    engine.close()
    want, *_ = baseline(full, steps=8, block_size=4, prefix_caching=False)
    assert got == want


# ---- bad input --------------------------------------------------------------------------------------

def bad_draft(tmp_path, **change) -> Path:
    d = tmp_path / "draft"
    d.mkdir()
    cfg = json.loads((TRAINED / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    shutil.copy(TRAINED / "tokenizer.json", d / "tokenizer.json")
    return d


def problems_of(options, model_path=""):
    return ReferenceEngine.check_options(options, ModelSpec(path=model_path, name="tiny-trained"))


def test_bad_speculative_options_are_named(tmp_path, tiny_ckpt):
    opt = "engine_options.reference"
    cases = [
        ({"speculative_method": "ngram", "num_speculative_tokens": 0}, f"{opt}.num_speculative_tokens"),
        ({"speculative_method": "draft", "draft_model": str(tmp_path / "nowhere")},
         f"{opt}.draft_model={tmp_path / 'nowhere'}: not a checkpoint directory"),
        ({"speculative_method": "draft"}, f"{opt}.draft_model: speculative_method=draft needs a draft checkpoint"),
        ({"speculative_method": "draft", "draft_model": str(bad_draft(tmp_path, vocab_size=512))},
         "its vocabulary has 512 tokens, the target's 4096"),
        ({"speculative_method": "eagle"}, f"{opt}.speculative_method=eagle: the reference engine has no EAGLE heads"),
        ({"speculative_method": "mtp"}, f"{opt}.speculative_method=mtp: the reference engine has no MTP heads"),
        ({"speculative_method": "ngram", "kv_cache": "none"}, "with kv_cache=none there is none"),
        ({"speculative_method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3},
         f"{opt}.prompt_lookup_min=5 exceeds prompt_lookup_max=3"),
    ]
    for options, expected in cases:
        problems = problems_of(options)
        assert len(problems) == 1 and expected in problems[0], (options, problems)
    # another tokenizer with the same vocabulary size (the random `tiny` preset's): seen where the
    # target's directory is on disk (plan time with model=local; always at load)
    options = {"speculative_method": "draft", "draft_model": str(tiny_ckpt)}
    problems = problems_of(options, str(TRAINED))
    assert len(problems) == 1 and "its tokenizer (tokenizer.json) differs from the target's" in problems[0], problems
    with pytest.raises(ValueError, match="differs from the target's"):
        ReferenceEngine().load(spec_of(), options)
    assert problems_of({"speculative_method": "draft", "draft_model": str(TRAINED)}, str(TRAINED)) == []


def test_capabilities_name_the_methods():
    assert ReferenceEngine.capabilities({}).speculative_methods == ("ngram", "draft")
    assert ReferenceEngine.capabilities({"kv_cache": "none"}).speculative_methods == ()


def test_cli_exit_2_naming_the_field(tmp_path):
    problems = check_jobs(["engines=[reference]", "model=tiny-trained",
                           "engine_options.reference.speculative_method=ngram",
                           "engine_options.reference.num_speculative_tokens=0"])
    assert any("engine_options.reference.num_speculative_tokens" in p for p in problems), problems
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "harness.cli", "engines=[reference]", "model=tiny-trained",
                        "engine_options.reference.speculative_method=draft",
                        f"engine_options.reference.draft_model={tmp_path / 'nowhere'}", f"hydra.run.dir={out}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "engine_options.reference.draft_model" in r.stderr and "Traceback" not in r.stderr
    assert not (out / "results.jsonl").exists()


def test_decode_logits_refused_while_speculating():
    engine = ReferenceEngine()
    engine.load(spec_of(), spec_options("ngram", 2))
    engine.prefill(heldout_prompts([40]))
    with pytest.raises(ValueError, match="speculative_method=none for logits"):
        engine.decode(3, return_logits=True)
    engine.close()


def test_block_manager_shrink_frees_only_the_tail():
    bm = BlockManager(8, 4, prefix_caching=True)

    class Seq:
        block_table: list = []
    seq = Seq()
    seq.block_table = []
    assert bm.grow(seq, 13)  # 4 blocks
    bm.shrink(seq, 5)  # 2 blocks hold 5 slots
    assert len(seq.block_table) == 2 and bm.num_used == 2
    bm.shrink(seq, 8)
    assert len(seq.block_table) == 2
    bm.free_sequence(seq)
    assert bm.num_used == 0
