"""Speculative decoding in the transformers adapter (transformers' assisted generation), on the
shipped tiny-trained preset with held-out code as prompts: greedy outputs equal to the adapter's
plain decode token for token (marker `slow`: an engine per method), counters consistent with the tokens each step emitted, batch 1
only, and the option checks (a draft with another vocabulary refused in one line)."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch

from adapters.base import ModelSpec, Request, now_ns
from adapters.hf import HFEngine, _CountedCandidates
from adapters.speculative import SpecCounter
from harness.checkpoint import shipped_checkpoint
from harness.core.presets import load_preset
from tests_support import noisy_draft

K = 4
N = 32  # output tokens per request: the first (prefill) + N - 1 decoded


@pytest.fixture(scope="module")
def trained():
    path = shipped_checkpoint(load_preset("tiny-trained"))
    assert path is not None, "the shipped tiny-trained checkpoint does not match its preset"
    return path


@pytest.fixture(scope="module")
def prompts(trained):
    held = np.load(trained / "heldout.npy")
    return [held[1000 + 700 * i: 1160 + 700 * i].tolist() for i in range(2)]


def _load(path, options):
    e = HFEngine()
    e.load_info = e.load(ModelSpec(path=str(path), name="tiny-trained", dtype="float32"), options)
    return e


def _generate(engine, prompt, n):
    pre = engine.prefill([prompt])
    dec = engine.decode(n - 1)
    engine.release()
    return pre.first_tokens + [row[0] for row in dec.tokens], dec


@pytest.fixture(scope="module")
def plain(trained, prompts):
    e = _load(trained, {})
    out = [_generate(e, p, N)[0] for p in prompts]
    assert e.spec_decode_stats() is None  # not speculating: nothing to say
    e.close()
    return out


METHODS = {
    "ngram-2-4": {"speculative_method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
                  "prompt_lookup_max": 4},
    "ngram-1-3": {"speculative_method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3},
    "draft-self": {"speculative_method": "draft", "num_speculative_tokens": K},
    "draft-noisy": {"speculative_method": "draft", "num_speculative_tokens": K},
}


@pytest.fixture(scope="module", params=list(METHODS))
def speculating(request, trained, tmp_path_factory):
    opts = dict(METHODS[request.param])
    if request.param == "draft-self":
        opts["draft_model"] = str(trained)  # the target as its own draft: every draft token is accepted
    elif request.param == "draft-noisy":  # a draft that the target overrules now and then
        opts["draft_model"] = str(noisy_draft(trained, tmp_path_factory.mktemp("draft") / "noisy"))
    e = _load(trained, opts)
    e.method = request.param
    yield e
    e.close()


@pytest.mark.slow
def test_outputs_equal_plain_decoding_and_counters_match_the_tokens(speculating, prompts, plain):
    before = speculating.spec_decode_stats()
    assert before.drafts == 0 and before.source == "derived"
    steps = 0
    for prompt, want in zip(prompts, plain):
        got, dec = _generate(speculating, prompt, N)
        assert got == want, f"{speculating.method}: speculation changed the output"
        assert sum(e[0] for e in dec.emitted) == N - 1 == len(dec.tokens)
        assert [s.num_tokens for s in dec.steps] == [e[0] for e in dec.emitted]
        assert all(1 <= e[0] <= K + 1 for e in dec.emitted)
        assert all(s.end_ns >= s.start_ns for s in dec.steps)
        assert all(a.end_ns <= b.start_ns for a, b in zip(dec.steps, dec.steps[1:]))
        steps += len(dec.steps)
    st = speculating.spec_decode_stats()
    # every step emits its accepted draft tokens plus the target's own: emitted = accepted + 1
    assert st.accepted_tokens == len(prompts) * (N - 1) - steps
    assert st.drafts <= steps and st.draft_tokens <= K * st.drafts
    assert len(st.accepted_per_pos) == K and sum(st.accepted_per_pos) == st.accepted_tokens
    assert all(a >= b for a, b in zip(st.accepted_per_pos, st.accepted_per_pos[1:]))
    assert st.draft_time_s > 0 and st.verify_time_s > 0
    if speculating.method == "draft-self":
        # the draft is the target: every draft token accepted; every step drafts but a request's last
        # when one token is left (transformers drafts no more than the tokens still asked for)
        assert st.accepted_tokens == st.draft_tokens and steps - len(prompts) <= st.drafts <= steps
        assert speculating.load_info.details["speculative"]["num_assistant_tokens_schedule"] == "constant"
    else:
        assert 0 < st.accepted_tokens < st.draft_tokens  # some drafts accepted, some overruled


@pytest.mark.slow
def test_decode_in_two_calls_continues_the_same_sequence(speculating, prompts, plain):
    pre = speculating.prefill([prompts[0]])
    first = speculating.decode(7)
    rest = speculating.decode(N - 8)
    info = speculating.kv_cache_info()
    speculating.release()
    got = pre.first_tokens + [r[0] for r in first.tokens] + [r[0] for r in rest.tokens]
    assert got == plain[0]
    assert info.tokens_stored == len(prompts[0]) + N - 1  # every token but the newest is cached


@pytest.mark.slow
def test_serve_takes_one_request_at_a_time_and_stamps_a_steps_tokens_together(speculating, prompts, plain):
    reqs = [Request(f"r{i}", p, N, 0.0) for i, p in enumerate(prompts)]
    events = list(speculating.serve(reqs, now_ns()))
    for r, want in zip(reqs, plain):
        ev = [e for e in events if e.request_id == r.request_id]
        assert [e.token_id for e in ev] == want and [e.index for e in ev] == list(range(N))
        assert ev[-1].finished and not any(e.finished for e in ev[:-1])
    first_of_second = next(i for i, e in enumerate(events) if e.request_id == "r1")
    assert all(e.request_id == "r0" for e in events[:first_of_second])  # batch 1: one request, then the next
    if speculating.method == "draft-self":  # K + 1 tokens per step share its stamp
        stamps = [e.time_ns for e in events if e.request_id == "r0"][1:]
        assert len(set(stamps)) < len(stamps)


@pytest.mark.slow
def test_batches_over_one_are_refused_with_transformers_reason(speculating, prompts):
    caps = HFEngine.capabilities({})
    assert caps.speculative_max_batch == 1 and set(caps.speculative_methods) == {"ngram", "draft"}
    with pytest.raises(ValueError, match="batch 1 only.*assisted generate is only supported for batch_size = 1"):
        speculating.prefill(prompts[:2])


def _reference_lookup(seq, k, lo, hi):
    """The longest n-gram (lo <= n <= hi) ending the sequence that occurs earlier with a
    continuation, its earliest occurrence's next (up to) k tokens - vLLM's n-gram proposer's rule,
    written out plainly."""
    for n in range(min(hi, len(seq) - 1), lo - 1, -1):
        for i in range(len(seq) - n):
            if seq[i:i + n] == seq[-n:]:
                return seq[i + n: i + n + k]
    return []


@pytest.mark.parametrize("lo,hi", [(1, 2), (2, 4), (3, 3)])
def test_prompt_lookup_with_its_min_matches_vllms_rule(lo, hi):
    """transformers' PromptLookupCandidateGenerator (down to 1-token matches) wrapped with the
    adapter's prompt_lookup_min filter proposes what vLLM's n-gram rule proposes."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
    rng = random.Random(0)
    inner = PromptLookupCandidateGenerator(num_output_tokens=K, max_matching_ngram_size=hi, max_length=10_000)
    wrapped = _CountedCandidates(inner, SpecCounter(), lambda: None, min_ngram=lo)
    differ_from_plain = 0
    for _ in range(300):
        seq = [rng.randrange(4) for _ in range(rng.randrange(2, 30))]
        ids = torch.tensor([seq])
        got = wrapped.get_candidates(ids)[0][0, len(seq):].tolist()
        assert got == _reference_lookup(seq, K, lo, hi), seq
        differ_from_plain += got != inner.get_candidates(ids)[0][0, len(seq):].tolist()
    assert (differ_from_plain > 0) == (lo > 1)  # the filter acts exactly when min > 1


# ---- option checks ---------------------------------------------------------------------------
def _problems(trained, **opts):
    return HFEngine.check_options(opts, ModelSpec(path=str(trained), name="tiny-trained"))


def test_speculative_options_are_checked(trained, tmp_path):
    assert _problems(trained, speculative_method="draft", num_speculative_tokens=2, draft_model=str(trained)) == []
    assert _problems(trained, speculative_method="ngram", num_speculative_tokens=2) == []
    (p,) = _problems(trained, speculative_method="ngram")
    assert p.startswith("engine_options.hf.num_speculative_tokens:")
    (p,) = _problems(trained, speculative_method="draft", num_speculative_tokens=2)
    assert p.startswith("engine_options.hf.draft_model:")
    (p,) = _problems(trained, speculative_method="draft", num_speculative_tokens=2, draft_model=str(tmp_path / "no"))
    assert p.startswith("engine_options.hf.draft_model=") and "no such checkpoint directory" in p
    (p,) = _problems(trained, speculative_method="ngram", num_speculative_tokens=2, prompt_lookup_min=3,
                     prompt_lookup_max=2)
    assert "prompt_lookup_min=3" in p and "prompt_lookup_max=2" in p
    (p,) = _problems(trained, speculative_method="ngram", num_speculative_tokens=2, kv_cache="none")
    assert p.startswith("engine_options.hf.kv_cache=none")
    (p,) = _problems(trained, speculative_method="eagle", num_speculative_tokens=2)
    assert p.startswith("engine_options.hf.speculative_method")  # not one of its choices
    assert _problems(trained, speculative_method="ngram", num_speculative_tokens=0)  # k >= 1


def test_a_draft_with_another_vocabulary_is_refused_in_one_line(trained, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(trained, draft)
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] + 64}))
    problems = _problems(trained, speculative_method="draft", num_speculative_tokens=2, draft_model=str(draft))
    assert len(problems) == 1 and "\n" not in problems[0]
    assert problems[0].startswith(f"engine_options.hf.draft_model={draft}:")
    assert f"{cfg['vocab_size'] + 64} tokens, the target's {cfg['vocab_size']}" in problems[0]
    # same size, other ids: two tokens swapped in tokenizer.json
    (draft / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    (p,) = _problems(trained, speculative_method="draft", num_speculative_tokens=2, draft_model=str(draft))
    assert "tokenizer.json maps tokens to other ids" in p
    with pytest.raises(ValueError, match="draft_model"):  # load() refuses it too, before loading anything
        HFEngine().load(ModelSpec(path=str(trained), name="tiny-trained"),
                        {"speculative_method": "draft", "num_speculative_tokens": 2, "draft_model": str(draft)})
