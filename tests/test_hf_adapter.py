"""The transformers adapter: step-by-step prefill/decode equals transformers' own generate()."""

import pytest
import torch

from adapters.base import ModelSpec, Request, now_ns
from adapters.hf import HFEngine

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [100 + i for i in range(12)], [300, 301, 302, 303, 304]]
STEPS = 24


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    e = HFEngine()
    e.load(ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="float32"), {})
    yield e
    e.close()


def _generate_reference(path, prompts, n):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[:, width:].tolist()


def _ours(engine, prompts, n):
    pre = engine.prefill(prompts)
    dec = engine.decode(n - 1)
    engine.release()
    return [[pre.first_tokens[b]] + [dec.tokens[s][b] for s in range(n - 1)] for b in range(len(prompts))], pre, dec


def test_greedy_tokens_equal_generate_unequal_lengths(engine, tiny_ckpt):
    ours, pre, dec = _ours(engine, PROMPTS, STEPS)
    assert ours == _generate_reference(tiny_ckpt, PROMPTS, STEPS)
    assert pre.latency_s > 0 and len(dec.steps) == STEPS - 1
    assert all(s.latency_s > 0 and s.num_tokens == len(PROMPTS) for s in dec.steps)


def test_padding_does_not_change_a_sequence(engine):
    alone, _, _ = _ours(engine, [PROMPTS[1]], 8)
    batched, _, _ = _ours(engine, PROMPTS, 8)
    assert alone[0] == batched[1]


def test_no_cache_mode_gives_the_same_tokens(tiny_ckpt, engine):
    e = HFEngine()
    e.load(ModelSpec(path=str(tiny_ckpt), name="tiny", dtype="float32"), {"kv_cache": "none"})
    try:
        nocache, _, _ = _ours(e, PROMPTS, 10)
        assert e.kv_cache_info().pool_bytes == 0
    finally:
        e.close()
    cached, _, _ = _ours(engine, PROMPTS, 10)
    assert nocache == cached


def test_logits_returned_on_request(engine):
    pre = engine.prefill(PROMPTS[:2], return_logits=True)
    dec = engine.decode(2, return_logits=True)
    engine.release()
    assert pre.logits.shape == (2, 4096) and len(dec.logits) == 2
    assert pre.logits.argmax(-1).tolist() == pre.first_tokens


def test_kv_cache_info_counts_padding(engine):
    engine.prefill(PROMPTS)
    engine.decode(3)
    info = engine.kv_cache_info()
    engine.release()
    width = max(map(len, PROMPTS))
    # cache holds prompt + 3 decoded tokens' K/V per row, left-padded to the longest prompt
    assert info.slots_allocated == len(PROMPTS) * (width + 3)
    assert info.tokens_stored == sum(map(len, PROMPTS)) + 3 * len(PROMPTS)
    assert info.bytes_per_token == 2 * 4 * 4 * 32 * 4  # fp32, 4 layers, 4 KV heads, head_dim 32
    assert info.pool_bytes == info.slots_allocated * info.bytes_per_token


def test_serve_emits_every_token_after_arrival(engine):
    reqs = [Request("a", PROMPTS[0], 4, 0.0), Request("b", PROMPTS[1], 2, 0.0), Request("c", PROMPTS[2], 3, 0.05)]
    t0 = now_ns()
    events = list(engine.serve(reqs, t0))
    by = {r.request_id: [e for e in events if e.request_id == r.request_id] for r in reqs}
    assert [len(by[r.request_id]) for r in reqs] == [4, 2, 3]
    for r in reqs:
        ev = by[r.request_id]
        assert [e.index for e in ev] == list(range(r.max_new_tokens))
        assert ev[-1].finished and not any(e.finished for e in ev[:-1])
        assert ev[0].time_ns >= t0 + r.arrival_s * 1e9
        assert all(a.time_ns <= b.time_ns for a, b in zip(ev, ev[1:]))


def test_check_options():
    spec = ModelSpec(path="x", name="tiny")
    assert HFEngine.check_options({"kv_cache": "on"}, spec) == []
    probs = HFEngine.check_options({"kv_cache": "maybe", "colour": 1, "max_batch_size": 0}, spec)
    assert len(probs) == 3 and all(p.startswith("engine_options.hf.") for p in probs)
