"""api=chat for endpoints: /v1/chat/completions with the conversation's messages, against the
STRICT PROTOCOL FAKE of vLLM (tests/fake_servers_strict.py: it renders the template it was given
with --chat-template, refuses chat without one as vLLM does, and counts the rendered words) and
against the real infer-bench-serve (the reference engine). The client's prompt count is the
tokenizer's count of the chat-templated prompt; the server's usage must say the same."""

from __future__ import annotations

import pytest

from adapters.base import ModelSpec, Request, TokenEvent, now_ns
from adapters.endpoint.config import separator_template
from fake_servers import children, wait_children_gone
from harness.core.presets import load_preset
from test_endpoint import preset_engine
from test_endpoint_kinds import faked
from workloads.base import Point, RunContext
from workloads.conversation import Conversation, ConversationConfig


@pytest.fixture(scope="module", autouse=True)
def no_leftovers():
    before = children()
    yield
    assert not wait_children_gone(before), "a server outlived the module"


def ctx_for(ckpt) -> RunContext:
    shape = load_preset("tiny")
    return RunContext(shape=shape, dtype="float32", device="cpu", model_path=str(ckpt), max_model_len=256,
                      memory_sample_hz=0, token_low=4, token_high=900)


CFG = ConversationConfig(sessions=2, turns=3, user_tokens=20, output_tokens=3, warmup_sessions=0)


def conversation(eng, ckpt, cfg: ConversationConfig = CFG) -> dict:
    eng.begin_point()
    row = Conversation().run_point(eng, Point("conversation", {"prefix_caching": True, "sessions": 2}),
                                   ctx_for(ckpt), cfg)
    row.update({k: v for k, v in eng.end_point().items() if k not in row})
    return row


@pytest.fixture(scope="module")
def fake_vllm(tiny_ckpt, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("chat")
    eng = faked("vllm-serve", api="chat", chat_separator=" ", env={"VLLM_SERVER_DEV_MODE": "1"})()
    eng.load(ModelSpec(str(tiny_ckpt), "tiny", "float32", "cpu", 256, run_dir=str(run_dir)),
             {"prefix_caching": True, "block_size": 32})
    yield eng
    eng.close()


def test_chat_over_the_vllm_fake_counts_the_templated_prompt(fake_vllm, tiny_ckpt):
    eng = fake_vllm
    assert any(a.startswith("--chat-template=") for a in eng.server.argv)
    assert "--enable-prompt-tokens-details" in eng.server.argv
    row = conversation(eng, tiny_ckpt)
    assert row["completed"] == 6 and not row["failed_requests"]
    assert row["input_token_count_mismatches"] is None
    assert row["input_tokens_server"] == row["input_tokens_client"] > 0
    # turn 3 of a session: user, the server's reply, user, its reply, user, joined by " "
    turn3 = [r for r in row["turn_requests"] if r["turn"] == 3]
    assert turn3 and all(r["prompt_tokens"] == 3 * 20 + 2 * 3 for r in turn3)  # words joined by " "
    # usage's cached tokens (the fake's prefix cache, blocks of 32) reach the turn rows
    t = {x["turn"]: x for x in row["turns"]}
    assert t[1]["hit_rate"] == 0 and t[3]["hit_rate"] == pytest.approx(t[3]["reusable_share"]) == 32 / 66


def test_chat_messages_carry_the_servers_replies(fake_vllm, tiny_ckpt):
    eng = fake_vllm
    eng.begin_point()
    msgs = [{"role": "user", "ids": [5, 6]}, {"role": "assistant", "ids": [1000, 1001]},
            {"role": "user", "ids": [7]}]
    ev = list(eng.serve([Request("c", [5, 6, 1000, 1001, 7], 2, messages=msgs)], now_ns()))
    eng.end_point()
    assert [e.token_id for e in ev if isinstance(e, TokenEvent)] == [1000, 1001]
    body, n = eng.bodies.payload([5, 6, 1000, 1001, 7], 2, msgs)
    assert body["messages"] == [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w1000 w1001"},
                                {"role": "user", "content": "w7"}]
    assert n == 5 and "prompt" not in body and body["return_token_ids"] is True


def test_vllm_fake_refuses_chat_without_a_template(tiny_ckpt, tmp_path):
    """The real server's refusal (imitated by the fake) when no template reached it: what the
    plan-time check (test below) keeps from happening."""
    import httpx
    eng = faked("vllm-serve")()
    eng.load(ModelSpec(str(tiny_ckpt), "tiny", "float32", "cpu", 256, run_dir=str(tmp_path)), {})
    try:
        assert not any(a.startswith("--chat-template") for a in eng.server.argv)
        r = httpx.post(eng.server.base + "/chat/completions", json={"model": eng.model_name, "max_tokens": 2,
                                                            "messages": [{"role": "user", "content": "w5"}]})
        assert r.status_code == 400 and "chat template" in r.text
    finally:
        eng.close()


def test_separator_template_joins_contents(tiny_ckpt):
    from transformers import AutoTokenizer

    from adapters.chat import template_ids
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    msgs = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w9"}]
    assert template_ids(tok, msgs, separator_template(" ")) == [5, 6, 9]


def test_api_chat_without_template_or_separator_is_exit_2_naming_the_field():
    from harness.cli import compose_job
    from harness.config import build_plan
    from harness.core.errors import UserError
    with pytest.raises(UserError) as e:
        build_plan(compose_job(["engines=[infer-bench-serve]", "workload=conversation",
                                "endpoints.infer-bench-serve.api=chat"]))
    msg = [p for p in e.value.problems if p.startswith("endpoints.infer-bench-serve.api=chat")]
    assert msg and "chat_template=FILE" in msg[0] and "chat_separator" in msg[0], e.value.problems
    # with a separator the plan is fine
    build_plan(compose_job(["engines=[infer-bench-serve]", "workload=conversation",
                            "endpoints.infer-bench-serve.api=chat", "endpoints.infer-bench-serve.chat_separator=' '"]))


def test_infer_bench_serve_chat_counts_and_caches(tiny_ckpt, tmp_path):
    eng = preset_engine("ibs-chat", api="chat", chat_separator=" ")()
    eng.load(ModelSpec(str(tiny_ckpt), "tiny", "float32", "cpu", 256, run_dir=str(tmp_path)), {})
    try:
        assert any(a.startswith("chat_template=") for a in eng.server.argv)
        row = conversation(eng, tiny_ckpt)
    finally:
        eng.close()
    assert row["completed"] == 6 and not row["failed_requests"]
    assert row["input_token_count_mismatches"] is None
    assert row["input_tokens_server"] == row["input_tokens_client"] == sum(
        r["prompt_tokens"] for r in row["turn_requests"])
    t = {x["turn"]: x for x in row["turns"]}
    # the reference engine behind it reports its cached tokens in usage; reusable in blocks of 16
    assert t[3]["reusable_share"] > 0.4 and t[3]["hit_rate"] == pytest.approx(t[3]["reusable_share"])
