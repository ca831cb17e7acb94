"""The shipped agentic trace (workloads/traces/agentic.jsonl) replayed on real engines: the reference
engine in-process (prompts rendered by the shipped chat template, tools included) and behind
infer-bench-serve's chat API (tools, tool calls and tool messages sent as logged). Each turn's hit
rate must equal its reusable share, per turn index and per turn kind; vLLM's chat API replays it in
tests/test_endpoint_vllm.py."""

from __future__ import annotations

import pytest

from adapters.base import ModelSpec
from adapters.reference.engine import ReferenceEngine
from fake_servers import children, wait_children_gone
from harness.checkpoint import SHIPPED_DIR
from harness.core.paths import REPO_ROOT
from harness.core.presets import load_preset
from test_endpoint import preset_engine
from workloads.base import Point, RunContext
from workloads.conversation import Conversation, ConversationConfig

TT = SHIPPED_DIR / "tiny-trained"
TEMPLATE = REPO_ROOT / "workloads" / "traces" / "chat-tools.jinja"
TRACE = REPO_ROOT / "workloads" / "traces" / "agentic.jsonl"
# two sessions of the trace, started as recorded (7.5 s apart: the second one's first prompt shares the system
# turn and the tools with the first one's, finished by then), without think time (seconds, not minutes)
CFG = ConversationConfig(sessions=2, dataset=str(TRACE), chat_template=str(TEMPLATE), think_time="none",
                         arrival="recorded", warmup_sessions=0)


def replay(eng, cfg: ConversationConfig = CFG) -> dict:
    shape = load_preset("tiny-trained")
    ctx = RunContext(shape=shape, dtype="float32", device="cpu", model_path=str(TT), max_model_len=4096,
                     memory_sample_hz=0, token_low=4, token_high=shape.vocab_size)
    eng.begin_point()
    row = Conversation().run_point(eng, Point("conversation", {"prefix_caching": True, "sessions": 2}), ctx, cfg)
    row.update({k: v for k, v in eng.end_point().items() if k not in row})
    return row


def check_hits(row: dict) -> None:
    """Every tool round trip replayed, and the engine reused all the history allowed: hit rate =
    reusable share for every turn index and both kinds (the trace's histories fit the pool)."""
    assert row["completed"] == row["turns_planned"] == 14 and not row["failed_requests"], row.get("session_end_reasons")
    for t in row["turns"]:
        assert t["hit_rate"] == pytest.approx(t["reusable_share"]), t
    kinds = {k["kind"]: k for k in row["turn_kinds"]}
    assert set(kinds) == {"user", "tool"} and kinds["tool"]["requests"] == 11
    assert kinds["tool"]["hit_rate"] == pytest.approx(kinds["tool"]["reusable_share"])
    assert kinds["tool"]["reusable_share"] > 0.6  # a tool result's turn: most of its prompt is history
    assert kinds["user"]["hit_rate"] == pytest.approx(kinds["user"]["reusable_share"])
    assert row["tool_turns"] == 11


@pytest.mark.slow
def test_reference_engine_replays_the_trace_with_its_template():
    eng = ReferenceEngine()
    eng.load(ModelSpec(str(TT), "tiny-trained", "float32", "cpu", 4096, threads=1), {"prefix_caching": True})
    try:
        row = replay(eng)
    finally:
        eng.close()
    check_hits(row)
    assert row["prompt_template"].startswith("chat template (workload.chat_template=")


def replay_served(eng, tmp_path, options: dict) -> dict:
    """The trace through a launched server (the endpoint engine `eng`), checked (check_hits) and
    counted as the server counted it; no server left behind."""
    before = children()
    try:
        eng.load(ModelSpec(str(TT), "tiny-trained", "float32", "cpu", 4096, run_dir=str(tmp_path)), options)
        row = replay(eng)
    finally:
        eng.close()
    assert not wait_children_gone(before)
    check_hits(row)
    # the server's prompt ids (return_token_ids) are the client's rendering of the same messages and tools
    assert row["input_token_count_mismatches"] is None and row["input_tokens_server"] == row["input_tokens_client"]
    assert row["prompt_template"].startswith("the server's chat template")
    return row


@pytest.mark.slow
def test_infer_bench_serve_replays_the_trace_over_its_chat_api(tmp_path):
    replay_served(preset_engine("ibs-agentic", api="chat", chat_template=str(TEMPLATE))(), tmp_path, {})
