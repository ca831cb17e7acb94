"""The reference engine's interface pieces: teacher-forced score() against transformers' own
forward pass, equal-resource threads, the online API a server drives (add_request / step /
has_work / abort), and prefill()'s max_new_tokens keyword."""

from __future__ import annotations

import pytest
import torch

from adapters.base import ModelSpec, Request, now_ns
from adapters.reference.config import EngineConfig
from adapters.reference.engine import ReferenceEngine
from adapters.reference.llm_engine import LLMEngine
from harness.core.kvcalc import bytes_per_token
from harness.core.presets import load_preset

MAX_LEN = 128


def make_prompts(lengths, seed=0, vocab=4096):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def spec(tiny_ckpt) -> ModelSpec:
    return ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="float32", max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_ckpt):
    """log_softmax of transformers' logits for every position of a sequence (one forward pass)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()

    def run(seq: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([seq])).logits[0].float().log_softmax(-1)
    return run


def check_scores(scores, sequences, start, top_k, oracle, tol=1e-4):
    for res, seq, s0 in zip(scores, sequences, start):
        n = len(seq) - s0
        assert len(res.top_ids) == len(res.top_logprobs) == len(res.target_logprobs) == n
        lp = oracle(seq)  # lp[p - 1] is the distribution of the token at p
        for j, p in enumerate(range(s0, len(seq))):
            want = lp[p - 1]
            assert abs(res.target_logprobs[j] - want[seq[p]].item()) < tol, (p, res.target_logprobs[j])
            assert len(res.top_ids[j]) == top_k
            assert res.top_logprobs[j] == sorted(res.top_logprobs[j], reverse=True)
            top = want.topk(top_k)
            assert torch.allclose(torch.tensor(res.top_logprobs[j]), top.values, atol=tol)
            # ids agree wherever the oracle's top values are not (near-)tied
            for i, (a, b) in enumerate(zip(res.top_ids[j], top.indices.tolist())):
                if a != b:
                    assert abs(want[a].item() - want[b].item()) < tol, (p, i)


@pytest.mark.parametrize("options", [
    {},  # paged, default block size
    {"block_size": 4, "max_num_batched_tokens": 9},  # chunked: every scored position crosses chunks
    {"kv_layout": "contiguous"},
    {"kv_cache": "none"},
])
def test_score_matches_transformers(spec, hf_logprobs, options):
    seqs = make_prompts((12, 40, 33), seed=1)
    start = [1, 17, 33]  # the whole sequence; a tail; nothing (start == len)
    engine = ReferenceEngine()
    engine.load(spec, options)
    scores = engine.score(seqs, start, top_k=5)
    assert scores[2].target_logprobs == [] and scores[2].top_ids == []
    check_scores(scores, seqs, start, 5, hf_logprobs)
    assert engine.blocks is None or engine.blocks.num_used == 0  # every block back
    engine.close()


def test_score_through_the_prefix_cache_and_a_tight_pool(spec, hf_logprobs):
    """The cache may supply blocks before the first scored position (and a KV bug there would
    show up in the scores); in a pool too small for the batch, chunked sequences take turns and
    reuse each other's blocks."""
    base = make_prompts((60,), seed=2)[0]
    seqs = [base[:50] + [9, 8, 7], base[:44] + [3] * 6, base]
    engine = ReferenceEngine()
    engine.load(ModelSpec(spec.path, "tiny", "float32", max_model_len=64), {"block_size": 4})
    engine.prefill([base[:48]]), engine.release()  # cached: the first 12 blocks
    scores = engine.score(seqs, [45, 40, 30], top_k=3)
    assert engine.kv_cache_info().prefix_cache_hits >= 3 * 7  # blocks before position 29, each
    check_scores(scores, seqs, [45, 40, 30], 3, hf_logprobs)
    engine.close()
    seqs = make_prompts((50, 60, 55), seed=3)  # ~42 blocks of 4, in chunks of 8: 24 blocks cannot hold them
    bpt = bytes_per_token(load_preset("tiny"), "fp32")
    engine = ReferenceEngine()
    engine.load(ModelSpec(spec.path, "tiny", "float32", max_model_len=64),
                {"block_size": 4, "kv_cache_bytes": 24 * 4 * bpt, "max_num_batched_tokens": 8})
    scores = engine.score(seqs, [2, 30, 54], top_k=3)
    assert engine.kv_cache_info().extra["prefix_cache_evictions"] > 0  # blocks were reused
    check_scores(scores, seqs, [2, 30, 54], 3, hf_logprobs)
    engine.close()


def test_score_capability_and_bad_input(spec):
    assert ReferenceEngine.capabilities().scores
    engine = ReferenceEngine()
    engine.load(spec, {})
    for args, match in ((([[1, 2, 3]], [0], 2), "start\\[0\\]=0"), (([[1, 2, 3]], [4], 2), "start\\[0\\]=4"),
                        (([[1, 2, 3]], [1, 2], 2), "2 start positions"), (([[1, 2, 3]], [1], 0), "top_k=0")):
        with pytest.raises(ValueError, match=match):
            engine.score(*args)
    engine.close()


def test_threads_follow_the_run_unless_the_user_set_them(spec):
    before = torch.get_num_threads()
    try:
        engine = ReferenceEngine()
        info = engine.load(ModelSpec(spec.path, "tiny", "float32", max_model_len=MAX_LEN, threads=1), {})
        assert info.compute_threads == 1 == torch.get_num_threads()
        engine.close()
        engine = ReferenceEngine()
        info = engine.load(ModelSpec(spec.path, "tiny", "float32", max_model_len=MAX_LEN, threads=1),
                           {"num_threads": 2})
        assert info.compute_threads == 2 == torch.get_num_threads()
        engine.close()
    finally:
        torch.set_num_threads(before)


def test_prefill_accepts_max_new_tokens(spec):
    engine = ReferenceEngine()
    engine.load(spec, {})
    prompts = make_prompts((5, 9), seed=3)
    a = engine.prefill(prompts, max_new_tokens=4).first_tokens
    b = engine.prefill(prompts).first_tokens
    assert a == b
    engine.close()


def test_online_api_matches_serve(spec):
    """A server's loop (add_request / step / has_work) gives the tokens serve() gives; requests
    may join between steps; finished requests free their blocks the step they finish."""
    prompts = make_prompts((12, 30, 9), seed=4)
    outs = (5, 3, 6)
    engine = ReferenceEngine()
    engine.load(spec, {"block_size": 4})
    served = sorted((e.request_id, e.index, e.token_id)
                    for e in engine.serve([Request(f"r{i}", p, o) for i, (p, o) in enumerate(zip(prompts, outs))],
                                          now_ns()))
    assert not engine.has_work()
    events = []
    engine.add_request(Request("r0", prompts[0], outs[0]))
    t0 = now_ns()
    events += engine.step()
    engine.add_request(Request("r1", prompts[1], outs[1], arrival_s=1e6))  # arrival_s is ignored
    engine.add_request(Request("r2", prompts[2], outs[2]))
    while engine.has_work():
        events += engine.step()
    assert sorted((e.request_id, e.index, e.token_id) for e in events) == served
    assert all(e.time_ns >= t0 for e in events)
    for rid in ("r0", "r1", "r2"):
        mine = [e for e in events if e.request_id == rid]
        assert [e.finished for e in mine] == [False] * (len(mine) - 1) + [True]
    assert engine.blocks.num_used == 0 and engine.step() == []
    engine.close()


def test_abort_frees_blocks_and_others_continue(spec):
    prompts = make_prompts((20, 20), seed=5)
    engine = ReferenceEngine()
    engine.load(spec, {"block_size": 4, "prefix_caching": False})
    engine.add_request(Request("keep", prompts[0], 6))
    engine.add_request(Request("drop", prompts[1], 50))
    engine.step()
    used = engine.blocks.num_used
    engine.abort("drop")
    assert engine.blocks.num_used < used
    engine.abort("drop"), engine.abort("never-seen")  # no-ops
    events = []
    while engine.has_work():
        events += engine.step()
    assert {e.request_id for e in events} == {"keep"} and events[-1].finished
    assert engine.blocks.num_used == 0
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request(Request("bad", prompts[0], 0))
    engine.add_request(Request("dup", prompts[0], 2))
    with pytest.raises(ValueError, match="already live"):
        engine.add_request(Request("dup", prompts[0], 2))
    engine.release()
    assert not engine.has_work() and engine.blocks.num_used == 0
    engine.close()


def test_the_core_alone_serves_and_scores_as_the_adapter(spec):
    """LLMEngine, without the harness's interface (as infer-bench-serve drives it): the same tokens
    as the adapter's serve(), the same scores, and every block back after close."""
    prompts = make_prompts((12, 30), seed=6)
    requests = [Request(f"r{i}", p, 4) for i, p in enumerate(prompts)]
    adapter = ReferenceEngine()
    adapter.load(spec, {"block_size": 4})
    want = sorted((e.request_id, e.index, e.token_id) for e in adapter.serve(requests, now_ns()))
    want_scores = adapter.score([prompts[0]], [3], 4)
    adapter.close()
    core = LLMEngine(spec, EngineConfig(block_size=4))
    for r in requests:
        core.add_request(r)
    events = []
    while core.has_work():
        events += core.step()
    assert sorted((e.request_id, e.index, e.token_id) for e in events) == want
    assert core.blocks.num_used == 0
    assert core.score([prompts[0]], [3], 4) == want_scores
    core.add_request(Request("left", prompts[1], 8))
    core.step()
    core.close()
    assert core.model is None and core.pool is None
