"""Agentic traces replayed as they were (docs/conversation.md, "Agentic traces"): the chat format read
whole (list-of-parts content, assistant tool_calls, tool messages, the developer role, media parts,
tools, timestamps), each reply one request with its history as logged, per turn kind metrics, and
bad input named by its line. The in-process cases run the conversation workload against the FAKE
reply engine of tests/test_conversation.py (a deterministic stand-in, not an inference engine) with
the shipped tiny-trained tokenizer and template; the chat API cases against the STRICT PROTOCOL FAKE
of vLLM (tests/fake_servers_strict.py); the real engines (the reference engine in-process and behind
infer-bench-serve) replay the shipped trace in tests/test_agentic_engines.py."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from adapters.base import Capabilities, ModelSpec
from adapters.chat import call_text, template_ids, wire
from fake_servers import children, wait_children_gone
from harness.checkpoint import SHIPPED_DIR
from harness.core.errors import UserError
from harness.core.paths import REPO_ROOT
from harness.core.presets import load_preset
from test_conversation import FakeReplyEngine, run
from test_endpoint_kinds import faked
from workloads.base import Point, RunContext
from workloads.conversation import Conversation, ConversationConfig, kind_rows, recorded_gaps
from workloads.datasets import parse_chat, read_chats, read_dataset

TT = SHIPPED_DIR / "tiny-trained"
TEMPLATE = REPO_ROOT / "workloads" / "traces" / "chat-tools.jinja"
TRACE = REPO_ROOT / "workloads" / "traces" / "agentic.jsonl"

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
# The file: four conversations as OpenAI-style logs carry them
FOUR = [
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is a list comprehension?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A compact way to build a list."}]},
                  {"role": "user", "content": "Show one."},
                  {"role": "assistant", "content": "[x * x for x in range(5)]"}]},
    {"messages": [{"role": "user", "content": "What's the weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [CALL]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 18, \"sky\": \"cloudy\"}"},
                  {"role": "assistant", "content": "18 degrees and cloudy."}], "tools": [WEATHER]},
    {"messages": [{"role": "developer", "content": "Answer in one sentence."},
                  {"role": "user", "content": "Why is the sky blue?"},
                  {"role": "assistant", "content": "Short wavelengths scatter more."}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, IMAGE]},
                  {"role": "assistant", "content": "A cat on a sofa."}]},
]


def write(tmp_path: Path, lines: list, name: str = "four.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TT)


@pytest.fixture
def tctx() -> RunContext:
    shape = load_preset("tiny-trained")
    return RunContext(shape=shape, dtype="float32", device="cpu", model_path=str(TT), max_model_len=4096,
                      memory_sample_hz=0, token_low=4, token_high=shape.vocab_size)


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def sent(eng: FakeReplyEngine, rid: str) -> list[dict]:
    """The messages of a request as the chat API carries them."""
    return wire(eng.requests[rid].messages, lambda i: "")


# ---- the four conversations, in-process (the template's rendering) --------------------------------

def test_four_conversations_replay_every_tool_round_trip_in_order_as_logged(tmp_path, tctx, tok):
    eng = FakeReplyEngine()
    row = run(ConversationConfig(sessions=8, dataset=str(write(tmp_path, FOUR)), chat_template=str(TEMPLATE),
                                 warmup_sessions=0), tctx, eng)
    # the picture's conversation is not sent (an in-process engine takes no image), and said so
    assert row["sessions"] == 3 and row["dataset_skipped"] == {"turn: non-text part the engine does not take": 1}
    assert sorted(eng.prompts) == ["s0t1", "s0t2", "s1t1", "s1t2", "s2t1"]
    template = TEMPLATE.read_text()
    # the tool round trip: the call as logged, then its result, in order; the request's tools rendered too
    weather = FOUR[1]["messages"]
    assert sent(eng, "s1t1") == weather[:1] and eng.requests["s1t1"].tools == [WEATHER]
    assert sent(eng, "s1t2") == weather[:3]
    assert eng.prompts["s1t2"] == template_ids(tok, weather[:3], template, [WEATHER])
    assert "get_weather" in tok.decode(eng.prompts["s1t1"])  # the tools are in the prompt
    # a tool-call turn's length is the call's tokens; the next one's the recorded answer's
    caps = {r["request_id"]: (r["output_tokens"], r["kind"]) for r in row["turn_requests"]}
    assert caps["s1t1"] == (len(ids(tok, call_text(CALL))), "user")
    assert caps["s1t2"] == (len(ids(tok, "18 degrees and cloudy.")), "tool")
    # developer is sent as system; content given as parts is sent as logged, rendered as its text
    assert sent(eng, "s2t1")[0] == {"role": "system", "content": "Answer in one sentence."}
    assert sent(eng, "s0t1") == FOUR[0]["messages"][:1]
    assert eng.prompts["s0t1"] == template_ids(tok, [{"role": "user", "content": "What is a list comprehension?"}],
                                               template)
    # the engine's own reply takes a text reply's place (replies=engine), never a tool call's
    assert sent(eng, "s0t2")[1] == {"role": "assistant", "content": ""} and sent(eng, "s0t2")[2] == weather[0] | {
        "content": "Show one."}
    assert [k["kind"] for k in row["turn_kinds"]] == ["user", "tool"] and row["tool_turns"] == 1
    assert "chat template (workload.chat_template=" in row["prompt_template"]


def test_recorded_replies_are_sent_as_logged(tmp_path, tctx):
    eng = FakeReplyEngine()
    run(ConversationConfig(sessions=8, dataset=str(write(tmp_path, FOUR)), chat_template=str(TEMPLATE),
                           replies="recorded", warmup_sessions=0), tctx, eng)
    assert sent(eng, "s0t2") == FOUR[0]["messages"][:3]


def test_an_in_process_engine_needs_a_template_for_tool_calls(tmp_path, tctx):
    with pytest.raises(UserError, match="workload.chat_template=FILE"):
        run(ConversationConfig(sessions=8, dataset=str(write(tmp_path, FOUR)), warmup_sessions=0), tctx,
            FakeReplyEngine())


# ---- over the chat API (the strict fake of vLLM) --------------------------------------------------

# The four conversations in the test checkpoints' words (the fake counts words), the same shapes
WORDS = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "w10 w11"}]},
                       {"role": "assistant", "content": [{"type": "text", "text": "w50 w51"}]},
                       {"role": "user", "content": "w12"}, {"role": "assistant", "content": "w52 w53 w54"}]},
         {"messages": [{"role": "user", "content": "w20 w21"},
                       {"role": "assistant", "content": None, "tool_calls": [CALL]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "w30 w31 w32"},
                       {"role": "assistant", "content": "w60 w61"}], "tools": [WEATHER]},
         {"messages": [{"role": "developer", "content": "w40"}, {"role": "user", "content": "w41 w42"},
                       {"role": "assistant", "content": "w70"}]},
         {"messages": [{"role": "user", "content": [{"type": "text", "text": "w80"}, IMAGE]},
                       {"role": "assistant", "content": "w90 w91"}]}]
# a word-level template: each message's text, the calls' names, the tools' names (one word each)
WORD_TEMPLATE = ("{% for t in tools or [] %}{{ t.function.name }} {% endfor %}{% for m in messages %}{{ m.content }} "
                 "{% for c in m.tool_calls or [] %}{{ c.function.name }} {% endfor %}{% endfor %}")


@pytest.fixture(scope="module", autouse=True)
def no_leftovers():
    before = children()
    yield
    assert not wait_children_gone(before), "a server outlived the module"


def chat_replay(eng, ckpt, tmp_path, **cfg) -> dict:
    shape = load_preset("tiny")
    ctx = RunContext(shape=shape, dtype="float32", device="cpu", model_path=str(ckpt), max_model_len=256,
                     memory_sample_hz=0, token_low=4, token_high=900)
    eng.begin_point()
    row = Conversation().run_point(eng, Point("conversation", {"prefix_caching": True, "sessions": 8}), ctx,
                                   ConversationConfig(sessions=8, dataset=str(write(tmp_path, WORDS)),
                                                      warmup_sessions=0, **cfg))
    row.update({k: v for k, v in eng.end_point().items() if k not in row})
    return row


def test_over_the_chat_api_the_messages_and_tools_go_as_logged(tiny_ckpt, tmp_path):
    tpl = tmp_path / "words.jinja"
    tpl.write_text(WORD_TEMPLATE)
    eng = faked("vllm-serve", api="chat", chat_template=str(tpl), tool_call_parser="hermes", content_parts=["image_url"],
                env={"VLLM_SERVER_DEV_MODE": "1"})()
    eng.load(ModelSpec(str(tiny_ckpt), "tiny", "float32", "cpu", 256, run_dir=str(tmp_path)),
             {"prefix_caching": True, "block_size": 32})
    try:
        assert eng.server.argv[-2:] == ["--enable-auto-tool-choice", "--tool-call-parser=hermes"]
        row = chat_replay(eng, tiny_ckpt, tmp_path)
        bodies = {tuple(json.dumps(m, sort_keys=True) for m in b["messages"]): b for b in eng.server.get(eng.server.root + "/fake/chat_seen").json()}
    finally:
        eng.close()
    assert row["completed"] == 6 and not row["failed_requests"] and not row["dataset_skipped"]
    # the client counted what the server rendered, but for the image, whose tokens only the server knows
    assert row["input_token_count_mismatches"] == [{"request_id": "s3t1", "server": 2, "client": 1}]
    logged = [[m if m["role"] != "developer" else {**m, "role": "system"} for m in c["messages"]] for c in WORDS]

    def body(msgs):
        return bodies[tuple(json.dumps(m, sort_keys=True) for m in msgs)]
    # each reply one request, its history as logged: the parts, the call, the result, the image, developer as system
    assert body(logged[1][:3])["tools"] == [WEATHER] and "tool_choice" not in body(logged[1][:3])
    assert body(logged[1][:1])["tools"] == [WEATHER]
    assert body(logged[3][:1])["messages"][0]["content"][1] == IMAGE  # the image part as logged
    assert body(logged[2][:2])["messages"][0] == {"role": "system", "content": "w40"}
    assert "tools" not in body(logged[2][:2])
    t = {k["kind"]: k for k in row["turn_kinds"]}
    assert t["tool"]["requests"] == 1 and t["user"]["requests"] == 5


def test_a_server_that_takes_text_alone_is_not_sent_the_image(tiny_ckpt, tmp_path):
    """Without content_parts the picture's turn is skipped and counted; without tool_call_parser
    vLLM refuses a request with tools ("auto" tool choice): the session ends with its words."""
    tpl = tmp_path / "words.jinja"
    tpl.write_text(WORD_TEMPLATE)
    eng = faked("vllm-serve", api="chat", chat_template=str(tpl), env={"VLLM_SERVER_DEV_MODE": "1"})()
    eng.load(ModelSpec(str(tiny_ckpt), "tiny", "float32", "cpu", 256, run_dir=str(tmp_path)), {})
    try:
        row = chat_replay(eng, tiny_ckpt, tmp_path)
        seen = eng.server.get(eng.server.root + "/fake/chat_seen").json()
    finally:
        eng.close()
    assert row["dataset_skipped"] == {"turn: non-text part the engine does not take": 1}
    assert not any(isinstance(m.get("content"), list) and IMAGE in m["content"] for b in seen for m in b["messages"])
    assert "enable-auto-tool-choice" in json.dumps(row["session_end_reasons"])


def test_the_fields_that_need_the_chat_api_are_refused_without_it():
    from adapters.endpoint import check_endpoint
    from test_endpoint_kinds import preset
    raw = preset("vllm-serve")
    _, problems = check_endpoint("vllm-serve", {**raw, "tool_call_parser": "hermes", "content_parts": ["image_url"]})
    assert any("apply to api=chat only" in p for p in problems)
    _, problems = check_endpoint("vllm-serve", {**raw, "api": "chat", "content_parts": ["hologram"]})
    assert any("hologram are not parts" in p for p in problems)


# ---- reading: bad input, skips, timestamps, serving ---------------------------------------------------

@pytest.mark.parametrize("messages,where,says", [
    ([{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "nope", "content": "r"},
      {"role": "assistant", "content": "a"}], "line 2 message 1", "answers tool_call_id 'nope'"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}],
     "line 2 message 1", "malformed tool_calls[0]: \"arguments\" must be a JSON string"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": {"id": "c"}}],
     "line 2 message 1", "\"tool_calls\" must be a list"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "user", "content": "again"}, {"role": "assistant", "content": "a"}],
     "line 2 message 2", "'call_1' of message 1 have no tool message"),
    ([{"role": "narrator", "content": "x"}, {"role": "ipython", "content": "y"}], "line 2",
     "none of its 2 messages can be read (roles ipython, narrator)"),
])
def test_bad_input_names_the_line_and_the_fix(tmp_path, messages, where, says):
    p = write(tmp_path, [FOUR[0], {"messages": messages}], "bad.jsonl")
    with pytest.raises(UserError) as e:
        read_chats(p, view="replay")
    assert any(f"{p} {where}" in m and says in m for m in e.value.problems), e.value.problems


def test_a_dataset_replay_gets_the_models_positions_beside_parity():
    """A dataset's lengths are known only once tokenised: the run's max_model_len is the model's
    positions, not parity's prompt length (the trace's later turns were cut at 2,080 tokens)."""
    from harness.cli import compose_job
    from harness.config import build_plan
    plan = build_plan(compose_job(["engines=[reference]", "model=tiny-trained", "workload=conversation",
                                   f"workload.dataset={TRACE}", f"workload.chat_template={TEMPLATE}"]))
    assert any(w.workload.name == "parity" for w in plan.workloads)
    assert plan.max_model_len == load_preset("tiny-trained").max_position_embeddings


def test_bad_input_exits_2_before_anything_runs(tmp_path):
    from harness.cli import compose_job
    from harness.config import build_plan
    p = write(tmp_path, [{"messages": [{"role": "user", "content": "q"},
                                       {"role": "tool", "tool_call_id": "x", "content": "r"}]}], "bad.jsonl")
    with pytest.raises(UserError) as e:
        build_plan(compose_job(["engines=[reference]", "workload=conversation", f"workload.dataset={p}"]))
    assert any(f"{p} line 1 message 1" in m for m in e.value.problems), e.value.problems


def test_an_unknown_role_is_counted_not_fatal():
    skipped: Counter = Counter()
    chat = parse_chat({"messages": [{"role": "user", "content": "q"}, {"role": "function", "content": "f"},
                                    {"role": "assistant", "content": "a"}]}, "messages", "here", skipped, [])
    assert chat is not None and len(chat.replies) == 1 and skipped == {"message: unknown role": 1}


def test_recorded_think_time_from_timestamps(tmp_path, tctx):
    conv = {"messages": [{"role": "user", "content": "q", "timestamp": 100.0},
                         {"role": "assistant", "content": None, "tool_calls": [CALL], "timestamp": 100.5},
                         {"role": "tool", "tool_call_id": "call_1", "content": "r", "timestamp": "1970-01-01T00:01:40.8Z"},
                         {"role": "assistant", "content": "a", "timestamp": 101.0}], "tools": [WEATHER]}
    chat = read_chats(write(tmp_path, [conv]), view="replay").chats[0]
    assert recorded_gaps(chat, 2) == [pytest.approx(0.3), 0.0]  # the tool ran 0.3 s
    row = run(ConversationConfig(sessions=1, dataset=str(write(tmp_path, [conv])), chat_template=str(TEMPLATE),
                                 warmup_sessions=0), tctx, FakeReplyEngine())
    later = next(r for r in row["turn_requests"] if r["turn"] == 2)
    assert row["think_time"] == "recorded" and row["duration_s"] >= 0.3 and later["ttft_s"] < 0.25


def test_serving_does_not_send_a_tool_conversation_reshaped(tmp_path):
    entries = read_dataset(write(tmp_path, FOUR))
    assert len(entries) == 2  # the parts conversation and the developer's: text turns alone
    assert entries.skipped == {"conversation: tool calls or non-text parts": 2}
    assert entries[1].history == [("system", "Answer in one sentence.")]


def test_kind_rows_split_user_and_tool_turns():
    reqs = [{"turn": 1, "kind": "user", "ok": True, "prompt_tokens": 100, "new_tokens": 100, "growth_tokens": 100,
             "output_tokens": 20, "reusable_tokens": 0, "cached_tokens": 0, "ttft_s": 0.2},
            {"turn": 2, "kind": "tool", "ok": True, "prompt_tokens": 200, "new_tokens": 40, "growth_tokens": 100,
             "output_tokens": 10, "reusable_tokens": 160, "cached_tokens": 144, "ttft_s": 0.1},
            {"turn": 3, "kind": "tool", "ok": True, "prompt_tokens": 300, "new_tokens": 50, "growth_tokens": 100,
             "output_tokens": 10, "reusable_tokens": 240, "cached_tokens": 240, "ttft_s": 0.3}]
    user, tool = kind_rows(reqs)
    assert (user["kind"], user["requests"], user["growth_tokens_mean"]) == ("user", 1, None)  # a first turn grows nothing
    assert tool["reusable_share"] == pytest.approx(400 / 500) and tool["hit_rate"] == pytest.approx(384 / 500)
    assert tool["growth_tokens_mean"] == 100 and tool["ttft_s"] == pytest.approx(0.2)


def test_the_shipped_trace_reads_whole_and_fits_the_model(tok):
    chats = read_chats(TRACE, view="replay")
    assert len(chats.chats) == 6 and not chats.skipped
    kinds = Counter(r.kind for c in chats.chats for r in c.replies)
    assert kinds["tool"] > 2 * kinds["user"] > 0
    assert all(c.tools and any(len(m.get("tool_calls") or []) > 1 for m in c.messages) for c in chats.chats)
    assert all(t is not None for c in chats.chats for t in c.times)
    longest = max(len(template_ids(tok, c.messages, TEMPLATE.read_text(), c.tools, generation_prompt=False))
                  for c in chats.chats)
    assert longest < load_preset("tiny-trained").max_position_embeddings


def test_sessions_use_the_engines_chat_api_and_parts(tmp_path, tctx):
    """An engine with a chat API that takes images gets the picture's conversation; the workload
    renders nothing it would not send."""
    caps = Capabilities(chat_api=True, content_parts=("image_url",))
    wl = Conversation()
    sessions = wl.sessions(ConversationConfig(sessions=8, dataset=str(write(tmp_path, FOUR))), tctx, "k", caps)
    assert len(sessions) == 4 and wl.dataset_fields["dataset_skipped"] == {}


def test_reusable_counts_what_a_request_in_flight_had_computed():
    """Two sessions sharing a 16-token system turn, the second handed out while the first decodes:
    its reusable share holds the shared blocks, which the first one's prefill had computed by then
    (an engine reuses them: the reference engine reported so at the trace's first turns)."""
    from adapters.base import TokenEvent
    from workloads.base import Collector
    from workloads.conversation import ConversationSource, Session
    system = list(range(100, 116))
    a = Session(0, [list(range(200, 210))], [4], [0.0], start_s=0.0, system=system)
    b = Session(1, [list(range(300, 310))], [4], [0.0], start_s=0.002, system=system)
    c = Collector([], 0)
    src = ConversationSource([a, b], 0, c, [], None, True, block_size=4)
    c.source = src
    assert [r.request_id for r in src.due(0)] == ["s0t1"]
    for k in range(3):
        c.feed(TokenEvent("s0t1", k, 500 + k, 1_000 + k))
    assert [r.request_id for r in src.due(2_000_000)] == ["s1t1"]  # s0t1 has 3 of its 4 tokens
    c.feed(TokenEvent("s0t1", 3, 503, 2_000_001, finished=True))
    for k in range(4):
        c.feed(TokenEvent("s1t1", k, 600 + k, 3_000_000 + k, finished=k == 3))
    reusable = src.reusable({t.request_id: t for t in c.traces()})
    assert reusable == {"s0t1": 0, "s1t1": 16}  # the system turn's four whole blocks
